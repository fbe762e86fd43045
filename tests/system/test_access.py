"""Access: Redis AUTH (password and ACL user) and Kafka SASL/TLS settings reach every client."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import ClassVar

import pytest
from pydantic import SecretStr

from aggregator.service import Aggregator
from aggregator.settings import AggregatorSettings
from ipdp import kafka_io, state
from ipdp.cli import main as cli
from ipdp.errors import IpdpError, RedisAuthError
from ipdp.redis_io import check_redis, redis_client
from ipdp.settings import RedisSettings, TopicSettings
from tests.pipeline import GROUP_JOIN_TIMEOUT_S, contribute, create, wait_for

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "default-user-secret"
ACL_USER, ACL_PASSWORD = "ipdp-service", "acl-user-secret"


@pytest.fixture
def auth_redis(tmp_path):
    """A private redis-server that requires a password, with an extra ACL user."""
    from ipdp.embedded import EmbeddedRedis, find_redis_server

    try:
        find_redis_server()
    except IpdpError as exc:
        pytest.skip(str(exc))
    server = EmbeddedRedis(data_dir=tmp_path / "redis", password=PASSWORD)
    server.start()
    admin = redis_client(server.settings())
    admin.execute_command("ACL", "SETUSER", ACL_USER, "on", f">{ACL_PASSWORD}", "~*", "&*",
                          "+@all")
    admin.close()
    try:
        yield server
    finally:
        server.stop()


def _settings(server, username: str | None, password: str | None) -> RedisSettings:
    return RedisSettings(url=server.url, username=username,
                         password=SecretStr(password) if password is not None else None)


@pytest.mark.parametrize("username,password", [(None, PASSWORD), (ACL_USER, ACL_PASSWORD)],
                         ids=["password", "acl-user"])
def test_the_aggregator_folds_with_the_right_credentials(
        kafka_settings, topics, auth_redis, username, password):
    rs = _settings(auth_redis, username, password)
    study = create(kafka_settings, rs, topics, study_id="auth", d=3, n=10**5, epsilon=1.0,
                   delta=0.01)
    contribute(study, kafka_settings, topics, 100, seed=1)
    agg = Aggregator(kafka_settings, rs, topics,
                     AggregatorSettings(group=f"agg-{topics.records}"))
    worker = threading.Thread(target=agg.run, daemon=True)
    worker.start()
    try:
        r = redis_client(rs)
        wait_for(lambda: r.hget(state.StudyKeys("auth").counts, "folded") == b"100",
                 GROUP_JOIN_TIMEOUT_S, "100 records folded")
    finally:
        agg.stop_event.set()
        worker.join(timeout=30)


@pytest.mark.parametrize("username,password,who", [
    (None, "wrong", "user default"),
    (None, None, "user default"),
    (ACL_USER, "wrong", f"user {ACL_USER}"),
    ("nobody", ACL_PASSWORD, "user nobody"),
], ids=["wrong-password", "no-password", "wrong-acl-password", "unknown-acl-user"])
def test_wrong_credentials_are_a_clear_error(kafka_settings, topics, auth_redis, username,
                                             password, who):
    rs = _settings(auth_redis, username, password)
    with pytest.raises(RedisAuthError,
                       match=f"Redis authentication failed for {who} at 127.0.0.1:"):
        check_redis(redis_client(rs))
    with pytest.raises(RedisAuthError, match="Redis authentication failed"):
        Aggregator(kafka_settings, rs, topics, AggregatorSettings())


@pytest.mark.parametrize("argv", [["aggregator", "run"], ["trainer", "run"], ["study", "list"]])
def test_a_command_with_a_wrong_password_exits_with_the_message_and_no_traceback(
        runtime, auth_redis, argv):
    env = {"PATH": "/usr/bin:/bin", **runtime.env(), "IPDP_REDIS_URL": auth_redis.url,
           "IPDP_REDIS_PASSWORD": "wrong"}
    done = subprocess.run([sys.executable, "-m", "ipdp.cli", *argv], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert "Redis authentication failed for user default" in done.stderr
    assert "Traceback" not in done.stderr


# --------------------------------------------------------------------------- kafka settings


SASL_ENV = {
    "IPDP_KAFKA_BOOTSTRAP": "broker-a:9093,broker-b:9093",
    "IPDP_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
    "IPDP_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
    "IPDP_KAFKA_SASL_USERNAME": "ipdp",
    "IPDP_KAFKA_SASL_PASSWORD": "kafka-secret",
    "IPDP_KAFKA_SSL_CAFILE": "/etc/ipdp/ca.pem",
    "IPDP_KAFKA_SSL_CERTFILE": "/etc/ipdp/client.pem",
    "IPDP_KAFKA_SSL_KEYFILE": "/etc/ipdp/client.key",
}
EXPECTED_KAFKA = {
    "bootstrap_servers": ["broker-a:9093", "broker-b:9093"],
    "security_protocol": "SASL_SSL",
    "sasl_mechanism": "SCRAM-SHA-512",
    "sasl_plain_username": "ipdp",
    "sasl_plain_password": "kafka-secret",
    "ssl_cafile": "/etc/ipdp/ca.pem",
    "ssl_certfile": "/etc/ipdp/client.pem",
    "ssl_keyfile": "/etc/ipdp/client.key",
}


class _Metadata:
    partition, offset, topic = 0, 0, "t"


class _Future:
    def get(self, timeout=None):
        return _Metadata()

    def add_callback(self, fn, *args, **kwargs):
        fn(*args, _Metadata(), **kwargs)
        return self

    def add_errback(self, fn, *args, **kwargs):
        return self


class _FakeKafka:
    """Stands in for kafka-python's producer, consumer and admin client; records how it was
    built."""

    built: ClassVar[list[tuple[str, dict]]] = []

    def __init__(self, *topics, **kwargs):
        self.built.append((type(self).__name__, kwargs))

    def send(self, *args, **kwargs):
        return _Future()

    def partitions_for(self, topic):
        return {0}

    def partitions_for_topic(self, topic):
        return {0}

    def poll(self, *args, **kwargs):
        return {}

    def end_offsets(self, tps, timeout_ms=None):
        return dict.fromkeys(tps, 0)

    def position(self, tp, timeout_ms=None):
        return 0

    def assignment(self):
        from kafka import TopicPartition

        return {TopicPartition("ipdp.records", 0)}  # joined: `--idle-exit` counts from here

    def flush(self, timeout=None):
        pass

    def close(self, timeout=None):
        pass

    def subscribe(self, *args, **kwargs):
        pass

    def assign(self, *args):
        pass

    def seek_to_beginning(self, *args):
        pass


class FakeProducer(_FakeKafka):
    pass


class FakeConsumer(_FakeKafka):
    pass


class FakeAdmin(_FakeKafka):
    """The admin client a command builds to check that Kafka answers before it runs."""


def test_every_command_builds_its_kafka_clients_from_the_sasl_and_tls_settings(
        auth_redis, monkeypatch, capsys):
    """Each command runs to completion against fakes; every client it built got the settings,
    and every command reached the password-protected Redis as the ACL user from the env."""
    monkeypatch.setattr(kafka_io, "KafkaProducer", FakeProducer)
    monkeypatch.setattr(kafka_io, "KafkaConsumer", FakeConsumer)
    monkeypatch.setattr(kafka_io, "KafkaAdminClient", FakeAdmin)
    for name in TopicSettings.model_fields:
        monkeypatch.delenv(f"IPDP_TOPIC_{name.upper()}", raising=False)
    # The fake consumer has no kafka-python fetcher for the columnar fetch to replace.
    for key, value in {**SASL_ENV, "IPDP_REDIS_URL": auth_redis.url,
                       "IPDP_REDIS_USERNAME": ACL_USER, "IPDP_REDIS_PASSWORD": ACL_PASSWORD,
                       "IPDP_AGGREGATOR_COLUMNAR_FETCH": "false"}.items():
        monkeypatch.setenv(key, value)
    study = ["--study-id", "sasl", "--n", "1000", "--d", "3", "--epsilon", "1", "--delta", "0.01"]
    # Every command first checks that Kafka answers, with an admin client (FakeAdmin).
    commands = {
        "study create": (["study", "create", *study], {"FakeAdmin", "FakeProducer"}),
        "aggregator run": (["aggregator", "run", "--idle-exit", "0.2"],
                           {"FakeAdmin", "FakeProducer", "FakeConsumer"}),
        "trainer run": (["trainer", "run", "--idle-exit", "0.2"], {"FakeAdmin", "FakeProducer"}),
        "loadgen": (["loadgen", "--study", "sasl", "--devices", "3", "--no-progress",
                     "--redis-url", auth_redis.url], {"FakeAdmin", "FakeProducer", "FakeConsumer"}),
        "models": (["models"], {"FakeAdmin", "FakeConsumer"}),
        "study close": (["study", "close", "sasl"], {"FakeAdmin", "FakeProducer"}),
    }
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for name, (argv, kinds) in commands.items():
            _FakeKafka.built.clear()
            assert cli.main(argv) == 0, (name, capsys.readouterr().err)
            assert {kind for kind, _ in _FakeKafka.built} == kinds, name
            for kind, kwargs in _FakeKafka.built:
                assert {k: kwargs.get(k) for k in EXPECTED_KAFKA} == EXPECTED_KAFKA, (name, kind)
    finally:  # the run commands install their own SIGINT/SIGTERM handlers
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    r = redis_client(_settings(auth_redis, ACL_USER, ACL_PASSWORD))
    assert r.hget(state.StudyKeys("sasl").study, "status") == b"closed"
