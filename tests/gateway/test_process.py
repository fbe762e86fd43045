"""`ipdp gateway` as an operator runs it: a real process, configured by IPDP_* variables, that
serves until SIGTERM and then exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ipdp.embedded.children import free_port
from producer.gateway_client import GatewayClient
from tests.gateway.test_gateway import records
from tests.pipeline import create, read_records


@pytest.mark.parametrize("workers", [1, 2])
def test_ipdp_gateway_process_accepts_records_and_stops_cleanly_on_sigterm(
        runtime, kafka_settings, redis_settings, topics, tmp_path, workers):
    study = create(kafka_settings, redis_settings, topics, study_id=f"gw-proc-{workers}", d=3,
                   n=1000, epsilon=1.0, delta=0.01)
    port = free_port()
    env = {**os.environ, **runtime.env(), "IPDP_TOPIC_RECORDS": topics.records,
           "IPDP_TOPIC_STUDIES": topics.studies, "IPDP_GATEWAY_HOST": "127.0.0.1"}
    log = open(tmp_path / "gateway.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "ipdp.cli", "gateway", "--port", str(port),
                             "--workers", str(workers)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        with GatewayClient(f"http://127.0.0.1:{port}") as c:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, (tmp_path / "gateway.log").read_text()
                try:
                    if c.study(study.study_id) is not None:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "gateway did not come up within 60 s"
                time.sleep(0.2)
            answer = c.post_records(study.study_id, b"".join(records(study, 5)))
        assert (answer.status, answer.body) == (202, {"accepted": 5})
        assert len(read_records(kafka_settings, topics.records, expected=1, timeout_s=10)) == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        log.close()
    assert code == 0, (tmp_path / "gateway.log").read_text()


def test_a_gateway_worker_settles_its_heap_and_an_embedded_app_leaves_the_collector_alone():
    # In a fresh interpreter, as an `ipdp gateway` worker is: what lives after the imports is
    # frozen out of the collector's sight and the youngest generation is collected less often.
    code = ("import gc\n"
            "from gateway.app import create_app, worker_app\n"
            "from gateway.heap import GC_YOUNG_THRESHOLD, settle_heap\n"
            "assert worker_app().ingest.owns_process\n"
            "assert not create_app().ingest.owns_process\n"
            "before = gc.get_threshold()\n"
            "settle_heap()\n"
            "print(gc.get_freeze_count(), before[0], *gc.get_threshold(), GC_YOUNG_THRESHOLD)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    frozen, young_before, young, middle, oldest, wanted = map(int, out)
    assert frozen > 10_000  # numpy, pydantic, starlette, kafka-python: tens of thousands
    assert young_before == 700 and young == wanted > young_before
    assert (middle, oldest) == (10, 10)


def _children(pid: int) -> set[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True,
                         check=False).stdout
    return {int(p) for p in out.split()}


def _running(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_gateway_killed_without_warning_leaves_no_worker_serving(runtime, topics, tmp_path):
    """granian's workers are processes of their own; SIGKILL of the main process (which can
    stop nothing) still stops them, as each asked Linux to tell it when its parent dies."""
    port = free_port()
    env = {**os.environ, **runtime.env(), "IPDP_TOPIC_RECORDS": topics.records,
           "IPDP_TOPIC_STUDIES": topics.studies, "IPDP_GATEWAY_HOST": "127.0.0.1"}
    with open(tmp_path / "gateway.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ipdp.cli", "gateway", "--port",
                                 str(port), "--workers", "2"], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        with GatewayClient(f"http://127.0.0.1:{port}") as c:
            c.wait_ready(60, "/healthz", alive=lambda: proc.poll() is None)
        workers = _children(proc.pid)
        assert workers, "granian forked no worker"
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 30
        while any(_running(w) for w in workers):
            if time.monotonic() > deadline:
                left = [w for w in workers if _running(w)]
                for w in left:
                    os.kill(w, signal.SIGKILL)
                pytest.fail(f"workers {left} of {sorted(workers)} outlived the killed gateway "
                            f"by 30 s; its log:\n{(tmp_path / 'gateway.log').read_text()}")
            time.sleep(0.2)
