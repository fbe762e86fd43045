"""Devices over HTTP, end to end: n records through the gateway → aggregator → trainer → exactly
one model of exactly n records."""

from __future__ import annotations

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
