"""A two-server study through the device SDK's two transports: straight to Kafka its records are
version 3 (the leader's share in clear, the helper's sealed, ipdp.two_server_wire), which the
leader's aggregator folds only with the token its helper expects
(tests/aggregator/test_two_server_fold.py folds them), and its gateway refuses as `undecodable`
(a body that is not a whole number of the study's version-1 records)."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from aggregator.batch import Message
from aggregator.fold import Folder
from ipdp.errors import ConfigurationError, RecordRefused
from ipdp.fixed_point import combine
from ipdp.redis_io import redis_client
from ipdp.sealing import HelperKey, open_share
from ipdp.two_server_wire import decode_two_server_batch, two_server_record_size
from producer.contributor import Contributor
from tests.gateway.conftest import running_gateway
from tests.gateway.test_gateway import known
from tests.pipeline import create, read_records

HELPER = HelperKey(X25519PrivateKey.from_private_bytes(bytes(range(7, 39))))
D = 4


@pytest.fixture
def study(kafka_settings, redis_settings, topics):
    return create(kafka_settings, redis_settings, topics, study_id="two-sdk", d=D, n=1000,
                  epsilon=1.0, delta=0.01,
                  two_server={"helper_id": "helper-a", "helper_url": "https://helper.example.org",
                              "helper_key": HELPER.public_b64})


def test_straight_to_kafka_a_devices_records_are_version_3_and_need_the_helpers_token(
        study, kafka_settings, redis_settings, topics):
    x = np.array([[0.3, -0.2, 0.5, 0.1], [0.0, 0.4, -0.4, 0.2], [0.6, 0.0, 0.0, -0.6]])
    with Contributor.connect(study.study_id, kafka_settings, topics,
                             records_per_device=3) as device:
        ids = device.submit_many(x, np.array([0.4, -0.1, 0.9]))
        device.flush()
    got = read_records(kafka_settings, topics.records, 3)
    values = [m.value for m in got]
    assert {len(v) for v in values} == {two_server_record_size(D)}
    batch, rejects = decode_two_server_batch(values, D)
    assert rejects == [] and sorted(map(bytes, batch.record_id)) == sorted(map(bytes, ids))
    helper = np.stack([np.frombuffer(open_share(HELPER.private, s, h.tobytes()), "<u8")
                       for s, h in zip(batch.sealed, batch.header, strict=True)])
    plain = combine(batch.leader, helper)
    # q̃₀² of each record, decoded: the square of a clipped example plus its noise, positive.
    assert (plain[:, 0].view(np.int64) > 0).all()
    assert not np.array_equal(batch.leader, plain)

    folder = Folder(redis_client(redis_settings), group=f"g-{uuid.uuid4().hex[:8]}", topic="t",
                    clock=time.time, replay_window_s=3600, max_future_skew_s=60,
                    max_message_bytes=1 << 20)
    with pytest.raises(ConfigurationError, match="IPDP_HELPER_LEADER_TOKEN"):
        folder.fold([Message(0, i, v) for i, v in enumerate(values)], lambda _: None)


def test_through_the_gateway_a_two_server_record_is_refused_by_its_length(
        study, kafka_settings, topics):
    with running_gateway(kafka_settings, topics) as url:
        known(url, study.study_id)
        device = Contributor.connect(study.study_id, via=url)
        assert device.study == study
        device.submit(np.array([0.3, -0.2, 0.5, 0.1]), 0.4)
        with pytest.raises(RecordRefused) as refused:
            device.flush()
        assert (refused.value.reason, refused.value.status) == ("undecodable", 400)
        assert "not a multiple of the record size" in str(refused.value)
        device.close()


def test_the_load_generator_sends_a_two_server_studys_devices_as_version_3_records(
        study, kafka_settings, topics):
    from producer.loadgen import run_loadgen

    rng = np.random.default_rng(11)
    x = rng.normal(size=(250, D)) / 4
    res = run_loadgen(study, kafka_settings, topics, x, np.clip(x.sum(axis=1), -1, 1),
                      batch=100, progress=False, rng=np.random.default_rng(12))
    assert res.sent == 250
    values = [m.value for m in read_records(kafka_settings, topics.records, 250)]
    batch, rejects = decode_two_server_batch(values, D)
    assert rejects == [] and len(batch) == 250
    helper = np.stack([np.frombuffer(open_share(HELPER.private, s, h.tobytes()), "<u8")
                       for s, h in zip(batch.sealed, batch.header, strict=True)])
    assert (combine(batch.leader, helper)[:, 0].view(np.int64) >= 0).all()  # q̃₀² ≥ 0
