"""The device SDK through a real gateway: `Contributor.connect(study, via=URL)` takes the same
calls as straight to Kafka, raises the same errors for the same refusals, verifies a signed study
as the gateway relays it, sends its credential, and sends a 429 again after its Retry-After."""

from __future__ import annotations

import numpy as np
import pytest

from ipdp import state
from ipdp.credentials import issue_credential, token_text
from ipdp.errors import RecordRefused, SignatureError, StudyClosed, UnknownStudy
from ipdp.kafka_io import kafka_producer
from ipdp.redis_io import redis_client
from ipdp.signing import generate_key_files
from ipdp.study import Study
from ipdp.subscriber import ModelSubscriber
from producer.contributor import Contributor, now_ms
from producer.gateway_client import GatewayClient
from tests.gateway.conftest import running_gateway
from tests.gateway.test_gateway import known
from tests.pipeline import create, services, wait_for

PARAMS = {"d": 3, "n": 100, "epsilon": 1.0, "delta": 0.01, "delta_in": 0.5}
X, Y = np.array([0.3, -0.2, 0.5]), 0.4


def test_devices_through_the_gateway_and_straight_to_kafka_fill_one_round_with_the_same_calls(
        kafka_settings, redis_settings, topics):
    study = create(kafka_settings, redis_settings, topics, study_id="sdk-both", **PARAMS)
    with running_gateway(kafka_settings, topics) as url:
        known(url, study.study_id)
        # Half the round's devices each way; one Contributor plays each half (a simulator).
        half = study.n // 2
        ids = []
        for way in ({"via": url}, {"kafka": kafka_settings, "topics": topics}):
            with Contributor.connect(study.study_id, records_per_device=half, **way) as device:
                for i in range(half):
                    ids.append(device.submit(X * (i + 1) / half, Y))
                device.flush()
                assert (device.delivered, device.failed) == (half, 0)
    assert len(set(ids)) == study.n
    with services(kafka_settings, redis_settings, topics):
        def models():
            return list(ModelSubscriber(kafka_settings, topics, study_id=study.study_id))

        wait_for(lambda: len(models()) == 1, 60, "the round's model")
    assert [(m.round, m.n) for m in models()] == [(1, study.n)]


def test_the_gateway_path_raises_what_the_kafka_path_raises_for_the_same_refusal(
        kafka_settings, redis_settings, topics):
    study = create(kafka_settings, redis_settings, topics, study_id="sdk-refused", **PARAMS)
    with running_gateway(kafka_settings, topics) as url:
        known(url, study.study_id)
        for connect in ({"via": url}, {"kafka": kafka_settings, "topics": topics}):
            with pytest.raises(UnknownStudy):
                Contributor.connect("sdk-nobody", timeout_s=5, **connect)
        device = Contributor.connect(study.study_id, via=url)
        producer = kafka_producer(kafka_settings)
        try:
            state.close_study(redis_client(redis_settings), producer, topics, study.study_id)
        finally:
            producer.close()
        with GatewayClient(url) as client:
            wait_for(lambda: client.study(study.study_id)[1].value == "closed", 15,
                     "the gateway to see the study closed")
        device.submit(X, Y)
        with pytest.raises(StudyClosed, match="409 closed_study"):
            device.flush()
        assert (device.delivered, device.failed) == (0, 1)
        device.close()  # the failure was raised once; closing does not raise it again
        for connect in ({"via": url}, {"kafka": kafka_settings, "topics": topics}):
            with pytest.raises(StudyClosed):
                Contributor.connect(study.study_id, timeout_s=5, **connect)


def test_a_record_the_gateway_refuses_raises_record_refused_with_its_reason_and_status(
        kafka_settings, redis_settings, topics):
    study = create(kafka_settings, redis_settings, topics, study_id="sdk-413", **PARAMS)
    # A body limit below one record: the refusal is final (413), never sent again.
    with running_gateway(kafka_settings, topics, max_body_bytes=64) as url:
        known(url, study.study_id)
        device = Contributor.connect(study.study_id, via=url)
        device.submit(X, Y)
        with pytest.raises(RecordRefused) as refused:
            device.flush()
        assert (refused.value.reason, refused.value.status) == ("too_large", 413)
        assert device.transport.retried == 0
        device.close()


def test_a_device_pinning_the_owner_key_uses_the_signed_study_the_gateway_relays_and_no_other(
        kafka_settings, redis_settings, topics, tmp_path):
    owner = generate_key_files(tmp_path / "owner")
    stranger = generate_key_files(tmp_path / "stranger")
    study = Study(study_id="sdk-signed", **PARAMS)
    producer = kafka_producer(kafka_settings)
    try:
        state.create_study(redis_client(redis_settings), producer, topics, study, owner)
    finally:
        producer.close()
    with running_gateway(kafka_settings, topics) as url:
        known(url, study.study_id)
        with Contributor.connect(study.study_id, via=url,
                                 trusted_keys=[owner.public_b64]) as device:
            assert device.study == study
            device.submit(X, Y)
        assert device.delivered == 1
        with pytest.raises(SignatureError):
            Contributor.connect(study.study_id, via=url, trusted_keys=[stranger.public_b64])


def test_a_device_sends_its_credential_through_the_gateway(
        kafka_settings, redis_settings, env_topics, tmp_path, monkeypatch):
    topics = env_topics
    issuer = generate_key_files(tmp_path / "issuer")
    monkeypatch.setenv("IPDP_TRUSTED_CREDENTIAL_KEYS", issuer.public_b64)
    study = create(kafka_settings, redis_settings, topics, study_id="sdk-cred",
                   require_credentials=True, records_per_device=2, **PARAMS)
    t = now_ms()
    credential = token_text(issue_credential(issuer, study.hash, t, t + 600_000))
    with running_gateway(kafka_settings, topics) as url:
        known(url, study.study_id)
        with Contributor.connect(study.study_id, via=url, credential=credential) as device:
            device.submit_many([X, -X], [Y, -Y])  # its two slots
        assert device.delivered == 2
        anonymous = Contributor.connect(study.study_id, via=url)
        anonymous.submit(X, Y)
        with pytest.raises(RecordRefused) as refused:
            anonymous.flush()
        assert (refused.value.reason, refused.value.status) == ("credential_missing", 401)
        anonymous.close()


def test_a_device_limited_by_the_gateway_sends_its_records_again_after_retry_after(
        kafka_settings, redis_settings, topics):
    study = create(kafka_settings, redis_settings, topics, study_id="sdk-429", **PARAMS)
    # Not a relay: one request at once, then two per second, for this address.
    with running_gateway(kafka_settings, topics, relay_addresses="", rate_limit_per_s=2.0,
                         rate_limit_burst=1) as url:
        known(url, study.study_id)
        with Contributor.connect(study.study_id, via=url, records_per_device=4) as device:
            for _ in range(4):
                device.submit(X, Y)
        assert (device.delivered, device.failed) == (4, 0)
        assert device.transport.rate_limited > 0
        assert device.transport.retried > 0
