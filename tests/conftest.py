"""Shared fixtures for the integration tests: one embedded broker + Redis per test session.

* ``runtime``        session-scoped, started :class:`~ipdp.embedded.EmbeddedRuntime` (default
                     topics created). Skips the test if no tansu / redis-server binary exists.
* ``kafka_settings`` its :class:`~ipdp.settings.KafkaSettings`.
* ``topics``         a :class:`~ipdp.settings.TopicSettings` with names unique to the test
                     (uuid suffix), already created on the broker.
* ``redis_settings`` / ``redis_url``  the session Redis, FLUSHALLed before the test.
* ``fresh_redis``    a private, started :class:`~ipdp.embedded.EmbeddedRedis` (restart tests).
* ``env_topics``     ``topics``, with the IPDP_* environment of the CLI pointing at it, the
                     broker and Redis (and no trusted or signing keys from the caller's shell).

Every session runs with TMPDIR (and :data:`tempfile.tempdir`) set to a directory of its own, so
what the code under test and its child processes create in "the temporary directory" can be
told apart from other runs' files; the session fails if it leaves an ``ipdp-*`` entry there.

Any test using one of these fixtures is marked ``integration`` automatically
(``pytest -m "not integration"`` runs the rest).
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ipdp.errors import IpdpError
from ipdp.settings import KafkaSettings, RedisSettings, TopicSettings

SERVER_FIXTURES = frozenset(
    {"runtime", "kafka_settings", "topics", "redis_settings", "redis_url", "fresh_redis",
     "env_topics"}
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def collect_leaks() -> Iterator[None]:
    """After each test, collect its garbage, so that a file, socket or transport it left open
    fails that test (a ResourceWarning is an error) and not a later one."""
    yield
    gc.collect()


def _require_binaries(broker: bool = True) -> None:
    from ipdp.embedded import find_redis_server, find_tansu

    try:
        find_redis_server()
        if broker:
            find_tansu()
    except IpdpError as exc:
        # In CI a missing server is a broken set-up, never a reason to report a green run.
        if os.environ.get("CI"):
            pytest.fail(f"integration servers unavailable: {exc}")
        pytest.skip(f"integration servers unavailable: {exc}")


@pytest.fixture(scope="session", autouse=True)
def temp_dir_left_clean(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point TMPDIR at a directory of this session's own; after the session, fail if the code
    under test left ``ipdp-*`` entries in it (servers' data directories, runtimes)."""
    tmp_path_factory.getbasetemp()  # pytest's own temp dirs stay where pytest keeps them
    own = Path(tempfile.mkdtemp(prefix="pytest-tmpdir-"))
    previous_env, previous_tempdir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = str(own)
    tempfile.tempdir = str(own)
    try:
        yield own
    finally:
        tempfile.tempdir = previous_tempdir
        if previous_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = previous_env
        left = sorted(entry.name for entry in own.glob("ipdp-*"))
        shutil.rmtree(own, ignore_errors=True)
    if left:
        pytest.fail(f"the test run left {len(left)} entr{'y' if len(left) == 1 else 'ies'} in "
                    f"the temporary directory: {', '.join(left)}", pytrace=False)


@pytest.fixture(scope="session")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """One broker + Redis for the whole session, in a pytest temp dir (logs kept on failure)."""
    from ipdp.embedded import EmbeddedRuntime

    _require_binaries()
    rt = EmbeddedRuntime(tmp_path_factory.mktemp("ipdp-runtime"))
    rt.start()
    try:
        yield rt
    finally:
        rt.stop()


@pytest.fixture
def kafka_settings(runtime) -> KafkaSettings:
    return runtime.kafka_settings()


@pytest.fixture
def topics(runtime) -> TopicSettings:
    """Topic names unique to this test, created (records with 4 partitions)."""
    from ipdp.kafka_io import ensure_topics

    suffix = uuid.uuid4().hex[:12]
    t = TopicSettings(
        records=f"ipdp.records.{suffix}",
        models=f"ipdp.models.{suffix}",
        dead_letter=f"ipdp.dead-letter.{suffix}",
        studies=f"ipdp.studies.{suffix}",
        records_partitions=4,
        replication_factor=1,
    )
    ensure_topics(runtime.kafka_settings(), t)
    return t


@pytest.fixture
def redis_settings(runtime) -> Iterator[RedisSettings]:
    """The session Redis, emptied (FLUSHALL) before the test."""
    from ipdp.redis_io import redis_client

    s = runtime.redis_settings()
    client = redis_client(s)
    try:
        client.flushall()
    finally:
        client.close()
    yield s


@pytest.fixture
def redis_url(redis_settings: RedisSettings) -> str:
    return redis_settings.url


@pytest.fixture
def fresh_redis(tmp_path) -> Iterator:
    """A private redis-server (AOF, appendfsync always) in tmp_path, stopped afterwards."""
    from ipdp.embedded import EmbeddedRedis

    _require_binaries(broker=False)
    with EmbeddedRedis(data_dir=tmp_path / "redis") as r:
        yield r


@pytest.fixture
def env_topics(topics, kafka_settings, redis_settings, monkeypatch):
    """Point the env-driven CLI settings at this test's topics, broker and Redis."""
    for name, value in topics.model_dump().items():
        monkeypatch.setenv(f"IPDP_TOPIC_{name.upper()}", str(value))
    monkeypatch.setenv("IPDP_KAFKA_BOOTSTRAP", kafka_settings.bootstrap)
    monkeypatch.setenv("IPDP_REDIS_URL", redis_settings.url)
    for name in ("IPDP_TRUSTED_STUDY_KEYS", "IPDP_TRUSTED_MODEL_KEYS", "IPDP_STUDY_SIGNING_KEY",
                 "IPDP_TRUSTED_CREDENTIAL_KEYS"):
        monkeypatch.delenv(name, raising=False)
    return topics
