"""The HTTP load generator sends a rate-limited record again after the gateway's Retry-After,
through a gateway that treats its address as one device's (not a relay), so it meets 429s."""

from __future__ import annotations

import numpy as np

from ipdp.metrics import EVERY_METRIC
from producer.datasets import synthetic_batches
from producer.loadgen import run_loadgen_http
from producer.retry import RetryPolicy
from tests.gateway.conftest import running_gateway
from tests.gateway.test_gateway import known
from tests.pipeline import create


def rate_limited() -> float:
    return EVERY_METRIC.get_sample_value("ipdp_gateway_refusals_total",
                                         {"reason": "rate_limited"}) or 0.0


def test_loadgen_sends_each_rate_limited_record_again_until_it_is_accepted(
        kafka_settings, redis_settings, topics):
    n = 30
    study = create(kafka_settings, redis_settings, topics, study_id="loadgen-429", d=3, n=1000,
                   epsilon=1.0, delta=0.01)
    _, batches = synthetic_batches(n, study.d, study.loss, n, seed=5)
    # 20 requests a second after a burst of 5: most of the 30 first tries meet a 429.
    with running_gateway(kafka_settings, topics, rate_limit_per_s=20.0, rate_limit_burst=5,
                         relay_addresses=None) as url:
        known(url, study.study_id)
        before = rate_limited()
        result = run_loadgen_http(study, url, batches, total=n, connections=8, progress=False,
                                  rng=np.random.default_rng(1),
                                  retry=RetryPolicy(max_attempts=20, max_wait_s=2.0))
        refused = rate_limited() - before
    assert refused > 0, "the gateway never refused: the test would not show a retry"
    # sent counts 202s, each an acks=all acknowledgement of Kafka.
    assert (result.sent, result.errors, result.refused) == (n, 0, {})
