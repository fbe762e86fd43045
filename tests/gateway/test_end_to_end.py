"""Devices over HTTP, end to end: n records through the gateway → aggregator → trainer → exactly
one model of exactly n records; a load generator whose records are refused says so; and one the
gateway's per-address limit holds back sends again until every record is in, and says why."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np

from ipdp import state
from ipdp.redis_io import redis_client
from ipdp.subscriber import ModelSubscriber
from producer.datasets import synthetic_batches
from producer.loadgen import run_loadgen_http
from tests.gateway.conftest import running_gateway
from tests.pipeline import create, services, wait_for


def test_n_records_through_the_gateway_give_exactly_one_model_of_n(
        kafka_settings, redis_settings, topics):
    n = 2000
    study = create(kafka_settings, redis_settings, topics, study_id="gw-e2e", d=4, n=n,
                   epsilon=1.0, delta=0.01)
    _, batches = synthetic_batches(n, study.d, study.loss, 500, seed=7)
    with running_gateway(kafka_settings, topics) as url, \
            services(kafka_settings, redis_settings, topics):
        # The defaults: one record per request (each device its own), many connections.
        result = run_loadgen_http(study, url, batches, total=n, progress=False,
                                  rng=np.random.default_rng(3))
        assert (result.sent, result.errors) == (n, 0)

        def models():
            return list(ModelSubscriber(kafka_settings, topics, study_id=study.study_id,
                                        from_beginning=True))

        wait_for(lambda: len(models()) >= 1, 90, "the round's model")
    got = models()
    assert [(m.round, m.n) for m in got] == [(1, n)]
    counts = redis_client(redis_settings).hgetall(state.StudyKeys(study.study_id).counts)
    assert int(counts[b"folded"]) == n


def test_loadgen_exits_non_zero_with_the_reasons_when_records_are_finally_refused(
        kafka_settings, redis_settings, topics):
    study = create(kafka_settings, redis_settings, topics, study_id="gw-refused", d=4, n=2000,
                   epsilon=1.0, delta=0.01)
    # A body limit below one record: every request is refused 413, which no retry changes.
    with running_gateway(kafka_settings, topics, max_body_bytes=64) as url:
        run = subprocess.run(
            [sys.executable, "-m", "ipdp.cli", "loadgen", "--via", url, "--study",
             study.study_id, "--devices", "5", "--no-progress"],
            check=False, capture_output=True, text=True, timeout=300,
            env={k: v for k, v in os.environ.items() if not k.startswith("IPDP_")})
    assert run.returncode == 1, run.stdout + run.stderr
    assert "records sent  0\n" in run.stdout
    assert "errors        5\n" in run.stdout
    assert re.search(r"^ +5  too_large$", run.stdout, re.MULTILINE), run.stdout
    assert "Traceback" not in run.stderr


def test_loadgen_held_back_by_the_per_address_limit_delivers_every_record_and_says_why_once(
        kafka_settings, redis_settings, topics):
    devices = 60
    study = create(kafka_settings, redis_settings, topics, study_id="gw-limited", d=4, n=2000,
                   epsilon=1.0, delta=0.01)
    # Not a relay: the default limits of one address (a burst, then a steady rate) apply.
    with running_gateway(kafka_settings, topics, relay_addresses=None) as url:
        run = subprocess.run(
            [sys.executable, "-m", "ipdp.cli", "loadgen", "--via", url, "--study",
             study.study_id, "--devices", str(devices), "--connections", "8"],
            check=False, capture_output=True, text=True, timeout=300,
            env={k: v for k, v in os.environ.items() if not k.startswith("IPDP_")})
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"records sent  {devices}\n" in run.stdout
    assert "errors        0\n" in run.stdout
    retried = re.search(r"^retried +(\d+) request", run.stdout, re.MULTILINE)
    assert retried and int(retried.group(1)) > 0, run.stdout
    assert re.search(r"^rate limited +[1-9]\d* answer", run.stdout, re.MULTILINE), run.stdout
    # Live: the progress bar's postfix counts refused records and requests sent again.
    assert re.search(r"refused=0, retried=[1-9]", run.stderr), run.stderr
    assert run.stderr.count("answers 429 rate_limited") == 1, run.stderr
    assert "IPDP_GATEWAY_RELAY_ADDRESSES" in run.stderr
    assert "Traceback" not in run.stderr
