"""Broker + Redis + topics for ``ipdp up``, ``ipdp demo``, the tests and the benchmarks.

This package is the ``[embedded]`` extra: only the CLI, the tests and the benchmarks import it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Self

from ipdp.embedded.children import register, unregister
from ipdp.embedded.servers import EmbeddedBroker, EmbeddedRedis
from ipdp.kafka_io import ensure_topics
from ipdp.settings import KafkaSettings, RedisSettings, TopicSettings

__all__ = ["EmbeddedRuntime"]


class EmbeddedRuntime:
    """Broker + Redis + topics, in ``directory`` (a fresh temp dir unless given one).

    >>> with EmbeddedRuntime() as rt:
    ...     produce(rt.kafka_settings()); r = redis_client(rt.redis_settings())
    """

    owns_children = True

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
            register(self)
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
            unregister(self)

    def restart_broker(self) -> None:
        """Restart the broker on the same port and re-create the topics (memory storage loses
        them)."""
        self.broker.restart()
        if self.create_topics:
            ensure_topics(self.kafka_settings(), self.topics)

    def restart_redis(self) -> None:
        """Restart Redis on the same port; the AOF brings every acknowledged write back."""
        self.redis.restart()

    def revive_redis(self) -> int | None:
        """If redis-server has exited, start it again on its port and data directory, leaving
        the broker (whose memory-only log holds the records not yet folded) untouched; returns
        the exit status of the server that died, None if it was running."""
        with self._lock:
            if not self._started or self.redis.running:
                return None
            status = self.redis.proc.returncode
            self.redis.restart()
            return status

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

    def kafka_settings(self) -> KafkaSettings:
        return self.broker.settings()

    def redis_settings(self) -> RedisSettings:
        return self.redis.settings()

    def env(self) -> dict[str, str]:
        """The ``IPDP_*`` variables other commands read to reach this runtime."""
        env = {
            "IPDP_KAFKA_BOOTSTRAP": self.broker.bootstrap,
            "IPDP_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT",
            "IPDP_KAFKA_END_OFFSETS_EXACT": "false",  # tansu's ListOffsets (KafkaSettings)
            "IPDP_REDIS_URL": self.redis.url,
        }
        if self.redis.password:
            env["IPDP_REDIS_PASSWORD"] = self.redis.password
        for name, info in TopicSettings.model_fields.items():
            value = getattr(self.topics, name)
            if value != info.default:
                env[f"IPDP_TOPIC_{name.upper()}"] = str(value)
        return env
