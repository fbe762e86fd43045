"""A two-server study through the device SDK's two transports: straight to Kafka its records are
version 3 (the leader's share in clear, the helper's sealed, ipdp.two_server_wire), which the
leader's aggregator folds only with the token its helper expects
(tests/aggregator/test_two_server_fold.py folds them); through the gateway they reach the records
topic as sent, and a record the gateway's checks refuse is answered with its reason
(docs/architecture.md, "The gateway")."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from aggregator.batch import Message
from aggregator.fold import Folder
from ipdp.credentials import issue_credential, token_text
from ipdp.errors import ConfigurationError
from ipdp.fixed_point import combine
from ipdp.redis_io import redis_client
from ipdp.sealing import HelperKey, open_share
from ipdp.signing import generate_key_files
from ipdp.study import Study
from ipdp.two_server_wire import TwoServerLayout, decode_two_server_batch, two_server_record_size
from ipdp.wire import header_study, split_container
from producer.contributor import Contributor, perturb_records
from producer.gateway_client import GatewayClient
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


def test_through_the_gateway_a_devices_records_reach_the_topic_as_sent_and_bad_ones_are_refused(
        study, kafka_settings, redis_settings, topics, tmp_path, monkeypatch):
    issuer = generate_key_files(tmp_path / "issuer")
    monkeypatch.setenv("IPDP_TRUSTED_CREDENTIAL_KEYS", issuer.public_b64)
    vouched = create(kafka_settings, redis_settings, topics, study_id="two-sdk-credentials",
                     d=D, n=1000, epsilon=1.0, delta=0.01, require_credentials=True,
                     records_per_device=2, two_server=study.two_server.model_dump(
                         include={"helper_id", "helper_url", "helper_key"}))
    issued = time.time_ns() // 1_000_000
    credential = token_text(issue_credential(issuer, vouched.hash, issued, issued + 600_000))
    x = np.array([[0.3, -0.2, 0.5, 0.1], [0.0, 0.4, -0.4, 0.2], [0.6, 0.0, 0.0, -0.6]])
    y = np.array([0.4, -0.1, 0.9])
    with running_gateway(kafka_settings, topics) as url:
        known(url, study.study_id)
        known(url, vouched.study_id)
        # Three devices' records, one POST each, as Contributor.submit sends them.
        with Contributor.connect(study.study_id, via=url, records_per_device=3) as device:
            assert device.study == study
            ids, sent = device.encode_many(x, y)
            device.transport.send(device.study, ids, sent, None)
            device.flush()
            assert device.delivered == 3
        # A study that requires credentials: the records' ids are the credential's slots.
        with Contributor.connect(vouched.study_id, via=url, credential=credential) as holder:
            slots, vouched_sent = holder.encode_many(x[:2], y[:2])
            holder.transport.send(holder.study, slots, vouched_sent, holder.credential)
            holder.flush()
            assert holder.delivered == 2
        proof = TwoServerLayout(D).proof_length.start
        one_server = Study(study_id="one", d=D, n=1000, epsilon=1.0, delta=0.01)
        bad = {
            "a proof": (sent[0][:proof] + (64).to_bytes(4, "little"), None),
            "another study's hash": (vouched_sent[0], None),
            "a version-1 record": (perturb_records(one_server, x[:1], y[:1],
                                                   np.random.default_rng(3))[1][0], None),
            "no credential": (vouched_sent[0], vouched.study_id),
        }
        with GatewayClient(url) as client:
            answers = {name: client.post_records(to or study.study_id, body)
                       for name, (body, to) in bad.items()}
            as_json = client.post_records(study.study_id, b'{"records": []}',
                                          content_type="application/json")
        # Kafka holds exactly the accepted records, byte for byte, and none of the refused.
        on_topic = read_records(kafka_settings, topics.records, expected=6, timeout_s=2)
    assert {name: (a.status, a.error) for name, a in answers.items()} == {
        "a proof": (400, "undecodable"),
        "another study's hash": (400, "study_mismatch"),
        "a version-1 record": (400, "unsupported_version"),
        "no credential": (401, "credential_missing"),
    }
    assert answers["a proof"].body["detail"] == (
        "record 0: a validity proof is not accepted yet (proof length ≠ 0)")
    assert "two-server study: it takes version 3" in answers["a version-1 record"].body["detail"]
    assert (as_json.status, as_json.error) == (415, "unsupported_media_type")
    held = {header_study(m.headers): [] for m in on_topic}
    for m in on_topic:
        held[header_study(m.headers)] += split_container(m.value)
    assert {name: sorted(records) for name, records in held.items()} == {
        study.study_id: sorted(sent), vouched.study_id: sorted(vouched_sent)}
    assert all(len(r) == two_server_record_size(D) for r in sent + vouched_sent)
