"""The gateway's Kafka producer process (gateway.producer_process) on a real broker: its pipe,
its acknowledgements, what a waiting request gets when the process dies, and the gateway
starting another one."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from gateway.producer_process import ProducerExited, ProducerProcess, _frame, _unframe
from ipdp.wire import split_container
from producer.gateway_client import GatewayClient
from tests.gateway.conftest import running_gateway
from tests.gateway.test_gateway import D, known, records
from tests.pipeline import create, read_records


def test_a_frame_carries_key_headers_and_value_unchanged():
    headers = [("study", b"s-1"), ("credentials", bytes(range(256)) * 3), ("empty", b"")]
    frame = _frame(7, b"k" * 16, b"v" * 5000, headers)
    size = int.from_bytes(frame[:4], "little")
    assert size == len(frame) - 4
    assert _unframe(frame[4:]) == (7, b"k" * 16, headers, b"v" * 5000)


def _children_running(module: str) -> list[int]:
    """Pids of this process's children whose command line runs ``module``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if ppid == os.getpid() and module.encode() in argv:
            found.append(int(entry))
    return found


def test_the_process_acknowledges_what_kafka_took_and_refuses_everything_once_gone(
        kafka_settings, topics):
    async def run() -> None:
        process = await ProducerProcess.start(kafka_settings, topics.records, {"linger_ms": 0},
                                              timeout_s=60)
        sent = [process.send(b"%016d" % i, b"value-%d" % i, [("study", b"pp")])
                for i in range(20)]
        await asyncio.wait_for(asyncio.gather(*sent), 30)  # every one acknowledged
        os.kill(process._transport.get_pid(), signal.SIGKILL)
        assert await asyncio.wait_for(process.exited, 30) == -signal.SIGKILL
        with pytest.raises(ProducerExited):
            process.send(b"k", b"after", [])
        await process.close(5)

    asyncio.run(run())
    got = read_records(kafka_settings, topics.records, expected=20, timeout_s=10)
    assert sorted(m.value for m in got) == sorted(b"value-%d" % i for i in range(20))
    assert all(dict(m.headers)["study"] == b"pp" for m in got)


def test_a_process_that_cannot_connect_exits_and_says_so(topics):
    from ipdp.embedded.children import free_port
    from ipdp.settings import KafkaSettings

    nobody = KafkaSettings(bootstrap=f"127.0.0.1:{free_port()}")

    async def run() -> None:
        with pytest.raises(ProducerExited, match="exited with code 3"):
            await ProducerProcess.start(nobody, topics.records,
                                        {"bootstrap_timeout_ms": 1000},
                                        timeout_s=60)

    asyncio.run(run())


def test_the_gateway_starts_another_producer_when_its_process_dies(kafka_settings,
                                                                   redis_settings, topics):
    study = create(kafka_settings, redis_settings, topics, study_id="pp-restart", d=D, n=1000,
                   epsilon=1.0, delta=0.01)
    before, after = records(study, 2, seed=11)
    with running_gateway(kafka_settings, topics, kafka_timeout_s=1.0) as url, \
            GatewayClient(url) as c:
        known(url, study.study_id)
        assert c.post_records(study.study_id, before).status == 202
        (child,) = _children_running("gateway.producer_process")
        os.kill(child, signal.SIGKILL)
        deadline = time.monotonic() + 60
        # First a new process (so the gateway has seen the old one exit), then readiness: read
        # in the other order, a /readyz answered before the exit was noticed passes the check.
        while not [p for p in _children_running("gateway.producer_process") if p != child]:
            assert time.monotonic() < deadline, "no new producer process within 60 s"
            time.sleep(0.2)
        while c.request("GET", "/readyz").status != 200:  # connected, failure older than 1 s
            assert time.monotonic() < deadline, "the new producer did not connect within 60 s"
            time.sleep(0.2)
        assert c.post_records(study.study_id, after).status == 202
    got = read_records(kafka_settings, topics.records, expected=2, timeout_s=10)
    assert sorted(r for m in got for r in split_container(m.value)) == sorted([before, after])


def test_a_stopped_gateway_leaves_no_producer_process_and_no_shutdown_error(
        kafka_settings, topics, capfd):
    with running_gateway(kafka_settings, topics):
        assert len(_children_running("gateway.producer_process")) == 1
    deadline = time.monotonic() + 15
    while _children_running("gateway.producer_process"):
        assert time.monotonic() < deadline, "the producer process outlived its gateway"
        time.sleep(0.1)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "shutdown failed" not in err, err
