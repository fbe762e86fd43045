"""The gateway on a real broker: 202 only after Kafka holds the records, in one container; every
refusal a 4xx with its reason; Kafka down → 503."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
from starlette.responses import JSONResponse

from gateway.refusals import Refusal
from ipdp import state
from ipdp.embedded import EmbeddedRuntime
from ipdp.kafka_io import kafka_producer
from ipdp.redis_io import redis_client
from ipdp.settings import RecordWindowSettings
from ipdp.studies_topic import read_study_entries
from ipdp.study import Study
from ipdp.wire import (
    CREATED_MS_BYTES,
    RECORD_ID_BYTES,
    STUDY_HASH_BYTES,
    VALUES_OFFSET,
    RejectReason,
    encode_record,
    record_size,
    split_container,
    study_hash,
)
from producer.contributor import now_ms, perturb_records
from producer.gateway_client import GatewayClient
from tests.gateway.conftest import running_gateway
from tests.pipeline import create, read_records, wait_for

D = 3


def records(study, k: int, d: int = D, seed: int = 0) -> list[bytes]:
    """k records created now and perturbed as a device does, of ``study`` (a Study: its wire
    hash), or under a hash no study has (a str); with another ``d`` than the study's, records
    of a d-dimensional study under the study's hash."""
    rng = np.random.default_rng(seed)
    h = study_hash(study) if isinstance(study, str) else study.hash
    device_study = study if isinstance(study, Study) and study.d == d else Study(
        study_id="shape", d=d, n=1000, epsilon=1.0, delta=0.01)
    x = rng.normal(size=(k, d)) / np.sqrt(d)
    values = perturb_records(device_study, x, np.clip(x[:, 0], -1, 1), rng)[1]
    return [v[:STUDY_HASH_BYTES.start] + h + v[STUDY_HASH_BYTES.stop:] for v in values]


def known(url: str, study_id: str) -> None:
    with GatewayClient(url) as c:
        wait_for(lambda: c.study(study_id) is not None, 15, f"the gateway to know {study_id}")


@pytest.fixture
def study(kafka_settings, redis_settings, topics):
    return create(kafka_settings, redis_settings, topics, study_id="gw-1", d=D, n=1000,
                  epsilon=1.0, delta=0.01)


def test_one_record_and_a_batch_are_acknowledged_as_one_container_each(
        study, gateway_url, kafka_settings, topics):
    known(gateway_url, study.study_id)
    one, batch = records(study, 1), records(study, 50, seed=1)
    with GatewayClient(gateway_url) as c:
        a = c.post_records(study.study_id, one[0])
        b = c.post_records(study.study_id, b"".join(batch))
    assert (a.status, a.body) == (202, {"accepted": 1})
    assert (b.status, b.body) == (202, {"accepted": 50})
    # 202 came after acks=all: the messages are already on the topic.
    got = read_records(kafka_settings, topics.records, expected=2, timeout_s=10)
    assert len(got) == 2
    by_key = {m.key: m.value for m in got}
    assert split_container(by_key[one[0][RECORD_ID_BYTES]]) == one
    assert split_container(by_key[batch[0][RECORD_ID_BYTES]]) == batch


def test_json_records_are_encoded_exactly_as_the_binary_form(
        study, gateway_url, kafka_settings, topics):
    known(gateway_url, study.study_id)
    rid, q, p, created = uuid.uuid4().bytes, [0.5, -1.25, 0.125], [1.0, -0.0, 2.5], now_ms()
    body = json.dumps({"records": [{"record_id": rid.hex(), "created_ms": created,
                                    "q": q, "p": p}]}).encode()
    with GatewayClient(gateway_url) as c:
        answer = c.post_records(study.study_id, body, "application/json")
    assert (answer.status, answer.body) == (202, {"accepted": 1})
    (msg,) = read_records(kafka_settings, topics.records, expected=1, timeout_s=10)
    assert split_container(msg.value) == [
        encode_record(study.hash, rid, created, q, p)]


def test_a_request_above_the_message_size_is_split_into_several_containers(
        study, kafka_settings, topics):
    size = 8 + 10 * record_size(D)
    with running_gateway(kafka_settings, topics, max_message_bytes=size) as url:
        known(url, study.study_id)
        batch = records(study, 25)
        with GatewayClient(url) as c:
            answer = c.post_records(study.study_id, b"".join(batch))
    assert (answer.status, answer.body) == (202, {"accepted": 25})
    got = read_records(kafka_settings, topics.records, expected=3, timeout_s=10)
    assert sorted(len(split_container(m.value)) for m in got) == [5, 10, 10]
    assert sorted(r for m in got for r in split_container(m.value)) == sorted(batch)


def scaled(record: bytes, q_scale: float, p_scale: float) -> bytes:
    """The record with q̃ and p̃ multiplied by the given factors."""
    values = np.frombuffer(record, "<f8", offset=VALUES_OFFSET).copy()
    d = len(values) // 2
    values[:d] *= q_scale
    values[d:] *= p_scale
    return record[:VALUES_OFFSET] + values.tobytes()


def created_at(record: bytes, ms: int) -> bytes:
    return (record[:CREATED_MS_BYTES.start] + ms.to_bytes(8, "little", signed=True)
            + record[CREATED_MS_BYTES.stop:])


def json_body(**fields) -> bytes:
    """One JSON record of a d = 3 study, honest but for ``fields``."""
    record = {"record_id": "ab" * 16, "created_ms": now_ms(), "q": [0.5, -0.25, 0.125],
              "p": [1.0, -0.5, 0.25]}
    return json.dumps({"records": [{**record, **fields}]}).encode()


#: The aggregator's defaults (IPDP_AGGREGATOR_REPLAY_WINDOW_S, …_MAX_FUTURE_SKEW_S).
WINDOW = RecordWindowSettings().window()


def _bad(study: Study) -> dict[str, tuple[bytes, str, int, str]]:
    good = records(study, 3)
    nan = bytearray(good[1])
    nan[VALUES_OFFSET:VALUES_OFFSET + 8] = np.float64("nan").tobytes()
    version = bytearray(good[0])
    version[0] = 9
    return {
        "undecodable": (b"".join(good)[:-5], "application/octet-stream", 400, "undecodable"),
        "empty": (b"", "application/octet-stream", 400, "undecodable"),
        "wrong_dimension": (records(study, 2, d=D + 1)[0], "application/octet-stream", 400,
                            "wrong_dimension"),
        "non_finite": (good[0] + bytes(nan), "application/octet-stream", 400, "non_finite"),
        "unsupported_version": (bytes(version), "application/octet-stream", 400,
                                "unsupported_version"),
        "study_mismatch": (records("another-study", 1)[0], "application/octet-stream", 400,
                           "study_mismatch"),
        "json_schema": (b'{"records": [{"record_id": "xyz"}]}', "application/json", 400,
                        "undecodable"),
        "json_wrong_dimension": (json.dumps({"records": [{
            "record_id": "00" * 16, "created_ms": 0, "q": [1.0], "p": [1.0]}]}).encode(),
            "application/json", 400, "wrong_dimension"),
        "json_non_finite": (b'{"records": [{"record_id": "' + b"ab" * 16 + b'", "created_ms": 0,'
                            b' "q": [NaN, 1, 2], "p": [1, 2, 3]}]}', "application/json", 400,
                            "non_finite"),
        "q_norm_above": (scaled(good[0], 100.0, 1.0), "application/octet-stream", 400,
                         "norm_out_of_bounds"),
        "p_without_noise": (good[0] + scaled(good[1], 1.0, 0.0), "application/octet-stream",
                            400, "norm_out_of_bounds"),
        "stale": (created_at(good[0], now_ms() - WINDOW.replay_window_ms - 60_000),
                  "application/octet-stream", 400, "stale"),
        "future": (created_at(good[0], now_ms() + WINDOW.max_future_skew_ms + 60_000),
                   "application/octet-stream", 400, "future"),
        "json_norm": (json_body(q=[3.0, 0.0, 0.0]), "application/json", 400,
                      "norm_out_of_bounds"),
        "json_stale": (json_body(created_ms=0), "application/json", 400, "stale"),
        "json_q_string": (json_body(q=["0.5", -0.25, 0.125]), "application/json", 400,
                          "undecodable"),
        "json_q_boolean": (json_body(q=[True, -0.25, 0.125]), "application/json", 400,
                           "undecodable"),
        "json_created_ms_string": (json_body(created_ms=str(now_ms())), "application/json",
                                   400, "undecodable"),
        "duplicate_record": (good[0] + good[1] + good[0], "application/octet-stream", 400,
                             "duplicate_record"),
        "json_duplicate_record": (json.dumps({"records": [json.loads(json_body())["records"][0]] * 2})
                                  .encode(), "application/json", 400, "duplicate_record"),
        "media_type": (good[0], "text/plain", 415, "unsupported_media_type"),
        "too_large": (b"".join(records(study, 20)), "application/octet-stream", 413,
                      "too_large"),
    }


def test_every_bad_request_gets_its_4xx_and_reason_and_nothing_reaches_kafka(
        study, kafka_settings, redis_settings, topics):
    producer = kafka_producer(kafka_settings)
    closed = create(kafka_settings, redis_settings, topics, study_id="gw-closed", d=D, n=1000,
                    epsilon=1.0, delta=0.01)
    state.close_study(redis_client(redis_settings), producer, topics, closed.study_id)
    producer.close()
    with running_gateway(kafka_settings, topics, max_body_bytes=10 * record_size(D)) as url:
        known(url, study.study_id)
        known(url, closed.study_id)
        with GatewayClient(url) as c:
            seen = {}
            for name, (body, ctype, _, _) in _bad(study).items():
                answer = c.post_records(study.study_id, body, ctype)
                seen[name] = (answer.status, answer.error, sorted(answer.body))
            unknown = c.post_records("no-such-study", records("no-such-study", 1)[0])
            shut = c.post_records(closed.study_id, records(closed, 1)[0])
            missing = c.request("GET", "/studies/no-such-study")
            nowhere = c.request("GET", "/nowhere")
    assert seen == {name: (status, reason, ["detail", "error"])
                    for name, (_, _, status, reason) in _bad(study).items()}
    assert (unknown.status, unknown.error) == (404, "unknown_study")
    assert (shut.status, shut.error) == (409, "closed_study")
    assert (missing.status, missing.error) == (404, "unknown_study")
    assert (nowhere.status, nowhere.error) == (404, "not_found")
    assert read_records(kafka_settings, topics.records, expected=1, timeout_s=2) == []


def test_the_json_form_takes_numbers_only_and_names_the_field_it_refuses(study, gateway_url):
    known(gateway_url, study.study_id)
    with GatewayClient(gateway_url) as c:
        details = {field: c.post_records(study.study_id, json_body(**{field: value}),
                                         "application/json").body["detail"]
                   for field, value in (("q", ["0.01", 0.0, 0.0]), ("p", [1.0, True, 0.5]),
                                        ("created_ms", str(now_ms())),
                                        ("created_ms", float(now_ms())))}
        integers = c.post_records(study.study_id, json_body(q=[1, 0, 0]), "application/json")
    assert details["q"].startswith("records.0.q.0: ")
    assert details["p"].startswith("records.0.p.1: ")
    assert details["created_ms"].startswith("records.0.created_ms: ")
    assert (integers.status, integers.body) == (202, {"accepted": 1})  # a JSON integer is a number


def test_a_client_over_its_rate_gets_429_with_retry_after(study, kafka_settings, topics):
    with running_gateway(kafka_settings, topics, rate_limit_per_s=0.5,
                         rate_limit_burst=2, relay_addresses=None) as url:
        known(url, study.study_id)
        with GatewayClient(url) as c:
            answers = [c.post_records(study.study_id, r) for r in records(study, 3)]
    assert [(a.status, a.error) for a in answers] == [
        (202, None), (202, None), (429, "rate_limited")]


def test_study_endpoint_serves_the_topic_value_byte_for_byte(study, gateway_url, kafka_settings,
                                                             topics):
    known(gateway_url, study.study_id)
    value = read_study_entries(kafka_settings, topics)[0][study.study_id].value
    with GatewayClient(gateway_url) as c:
        answer = c.request("GET", f"/studies/{study.study_id}")
        health, ready = c.request("GET", "/healthz"), c.request("GET", "/readyz")
        c.post_records(study.study_id, records(study, 4)[0])
        metrics = c.request("GET", "/metrics").raw.decode()
    assert (answer.status, answer.raw) == (200, value)
    assert (health.status, ready.status) == (200, 200)
    assert 'ipdp_gateway_requests_total{route="/studies/{study_id}/records",status="202"}' \
        in metrics
    assert "ipdp_gateway_records_accepted_total" in metrics
    assert "ipdp_gateway_kafka_produce_seconds_bucket" in metrics


def test_kafka_down_gives_503_kafka_unavailable(tmp_path):
    with EmbeddedRuntime(tmp_path / "rt") as rt:
        kafka, topics = rt.kafka_settings(), rt.topics
        study = create(kafka, rt.redis_settings(), topics, study_id="gw-down", d=D, n=1000,
                       epsilon=1.0, delta=0.01)
        with running_gateway(kafka, topics, kafka_timeout_s=2.0) as url:
            known(url, study.study_id)
            with GatewayClient(url) as c:
                assert c.post_records(study.study_id, records(study, 1)[0]).status == 202
                rt.broker.stop()
                answer = c.post_records(study.study_id, records(study, 1)[0])
                ready = c.request("GET", "/readyz")
    assert (answer.status, answer.error) == (503, "kafka_unavailable")
    assert sorted(answer.body) == ["detail", "error"]
    # Kafka refused within the last kafka_timeout_s (2 s): the gateway says it is not ready.
    assert (ready.status, ready.error) == (503, "not_ready")


def test_a_device_verifies_the_study_the_gateway_serves(kafka_settings, redis_settings, topics,
                                                         gateway_url, tmp_path):
    """The gateway relays the owner's signature: the right key verifies, another key refuses,
    and an unsigned study is refused once a key is pinned."""
    from ipdp.errors import SignatureError
    from ipdp.signing import generate_key_files, parse_trusted_keys

    owner = generate_key_files(tmp_path / "owner")
    other = generate_key_files(tmp_path / "other")
    signed = Study(study_id="gw-signed", d=D, n=1000, epsilon=1.0, delta=0.01)
    producer = kafka_producer(kafka_settings)
    try:
        state.create_study(redis_client(redis_settings), producer, topics, signed,
                              signing_key=owner)
    finally:
        producer.close()
    unsigned = create(kafka_settings, redis_settings, topics, study_id="gw-unsigned", d=D,
                      n=1000, epsilon=1.0, delta=0.01)
    known(gateway_url, signed.study_id)
    known(gateway_url, unsigned.study_id)
    with GatewayClient(gateway_url) as c:
        study, _ = c.study(signed.study_id, parse_trusted_keys([f"{tmp_path}/owner.pub"]))
        assert study.hash == signed.hash
        with pytest.raises(SignatureError):
            c.study(signed.study_id, parse_trusted_keys([f"{tmp_path}/other.pub"]))
        with pytest.raises(SignatureError):
            c.study(unsigned.study_id, parse_trusted_keys([f"{tmp_path}/owner.pub"]))
    assert owner.key_id != other.key_id


@pytest.mark.parametrize("detail", ["record 0: names another study than 'é'", "x" * 300,
                                    'a quote " a backslash \\ and U+2028 \u2028'])
def test_a_refusal_answers_what_a_starlette_json_response_would(detail):
    """The refusal's body is rendered once and kept: byte for byte what JSONResponse renders,
    with the same status and headers (asked twice, so the kept body is compared too)."""
    headers = {"WWW-Authenticate": "IPDP-Credential"}
    expected = JSONResponse({"error": "credential_missing", "detail": detail}, status_code=401,
                            headers=headers)
    for _ in range(2):
        got = Refusal(RejectReason.CREDENTIAL_MISSING, detail, headers=headers).response()
        assert (got.status_code, got.body, got.raw_headers) == (
            expected.status_code, expected.body, expected.raw_headers)
