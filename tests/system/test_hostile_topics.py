"""The hostile studies-topic and models-topic values of tests/hostile.py, replayed against the
real parts: a running gateway keeps serving, a gateway started afterwards becomes ready, a
device's `ipdp loadgen` exits 0, `ipdp models` shows the valid model, and the aggregator keeps
folding past a stored study it cannot read (docs/security.md)."""

from __future__ import annotations

import json
import threading
import time
import uuid

import numpy as np

from aggregator.service import Aggregator
from aggregator.settings import AggregatorSettings
from ipdp import state
from ipdp.cli.main import main
from ipdp.kafka_io import kafka_producer
from ipdp.metrics import EVERY_METRIC
from ipdp.redis_io import redis_client
from ipdp.signing import generate_key_files
from ipdp.state import create_study
from ipdp.study import Study, signed_bytes
from ipdp.wire import encode_record
from producer.contributor import Contributor
from producer.gateway_client import GatewayClient
from tests.gateway.conftest import running_gateway
from tests.hostile import HOSTILE_STUDY_VALUES, PARAMS, bad_signature
from tests.ipdp.test_study_store_and_subscriber import _model
from tests.pipeline import total_stats, wait_for


def _malformed(topic: str, reader: str) -> float:
    return sum(EVERY_METRIC.get_sample_value("ipdp_topic_values_malformed_total",
                                         {"topic": topic, "reader": reader, "reason": reason})
               or 0.0 for reason in {r for _, _, r in HOSTILE_STUDY_VALUES})


def _send(kafka_settings, topic: str, pairs) -> None:
    producer = kafka_producer(kafka_settings)
    try:
        for key, value in pairs:
            producer.send(topic, key=key, value=value).get(timeout=30)
    finally:
        producer.close()


def _hostile(owner) -> list[tuple[bytes, bytes]]:
    return [(f"evil-{name}".encode(), value(owner)) for name, value, _ in HOSTILE_STUDY_VALUES]


def _create(kafka_settings, redis_settings, topics, study: Study, key) -> None:
    producer = kafka_producer(kafka_settings)
    try:
        create_study(redis_client(redis_settings), producer, topics, study, key)
    finally:
        producer.close()


def _served(url: str, study_id: str) -> bool:
    with GatewayClient(url) as c:
        return c.request("GET", f"/studies/{study_id}").status == 200


def test_gateways_and_devices_keep_going_past_every_hostile_study_value(
        kafka_settings, redis_settings, env_topics, tmp_path, monkeypatch, capsys):
    topics = env_topics
    owner = generate_key_files(tmp_path / "owner")
    pub = f"{tmp_path / 'owner'}.pub"
    monkeypatch.setenv("IPDP_TRUSTED_STUDY_KEYS", pub)
    _create(kafka_settings, redis_settings, topics, Study(study_id="before", **PARAMS), owner)
    before = _malformed("studies", "gateway")
    with running_gateway(kafka_settings, topics) as url:
        wait_for(lambda: _served(url, "before"), 15, "the gateway to serve 'before'")
        late = Study(study_id="late", **PARAMS)
        forged = json.dumps({"format": 2, "study": late.canonical_text, "status": "open",
                             "key_id": owner.key_id, "signature": bad_signature()}).encode()
        _send(kafka_settings, topics.studies, [*_hostile(owner), (b"late", forged)])
        _create(kafka_settings, redis_settings, topics, late, owner)
        wait_for(lambda: _served(url, "late"), 15, "the running gateway to serve 'late'")
        assert _served(url, "before")
        with GatewayClient(url) as c:
            assert c.request("GET", "/readyz").status == 200
        # running_gateway waits for /readyz: a gateway started after the values becomes ready.
        with running_gateway(kafka_settings, topics) as fresh:
            assert _served(fresh, "before") and _served(fresh, "late")
            assert not _served(fresh, "evil-deep_nesting")
    # With keys pinned, the unsigned value is refused for its signature before its text is read.
    pinned_malformed = len(HOSTILE_STUDY_VALUES) - 1
    assert _malformed("studies", "gateway") - before == 2 * pinned_malformed

    device_before = _malformed("studies", "device")
    assert main(["loadgen", "--study", "late", "--devices", "5", "--no-progress",
                 "--trust", pub]) == 0
    monkeypatch.delenv("IPDP_TRUSTED_STUDY_KEYS")
    assert main(["loadgen", "--study", "before", "--devices", "5", "--no-progress"]) == 0
    assert _malformed("studies", "device") - device_before == \
        pinned_malformed + len(HOSTILE_STUDY_VALUES)
    assert "Traceback" not in capsys.readouterr().err


def test_ipdp_models_shows_the_valid_model_past_hostile_values(kafka_settings, env_topics,
                                                                tmp_path, capsys):
    topics = env_topics
    good = _model(Study(study_id="m1", **PARAMS), 1)
    values = _hostile(generate_key_files(tmp_path / "owner"))
    _send(kafka_settings, topics.models,
          [*values, (b"m1:0", b'{"version": 1e999}'), (good.key, good.model_dump_json().encode())])
    before = EVERY_METRIC.get_sample_value("ipdp_topic_values_malformed_total",
                                       {"topic": "models", "reader": "subscriber",
                                        "reason": "too_deep"}) or 0.0
    assert main(["models"]) == 0
    out, err = capsys.readouterr()
    assert out.count("m1  round 1") == 1 and "Traceback" not in err
    assert EVERY_METRIC.get_sample_value("ipdp_topic_values_malformed_total",
                                     {"topic": "models", "reader": "subscriber",
                                      "reason": "too_deep"}) == before + 1


def test_the_aggregator_keeps_folding_past_hostile_values_and_an_unreadable_stored_study(
        kafka_settings, redis_settings, env_topics, tmp_path):
    topics = env_topics
    owner = generate_key_files(tmp_path / "owner")
    good = Study(study_id="good", **PARAMS)
    _create(kafka_settings, redis_settings, topics, good, owner)
    _send(kafka_settings, topics.studies, _hostile(owner))
    # A study stored with ε = 1e-308 (it crashed the aggregator's study lookup before).
    r = redis_client(redis_settings)
    evil_hash = uuid.uuid4().bytes
    fields = json.loads(good.to_json()) | {"study_id": "evil"}
    text = json.dumps(fields).replace('"epsilon": 1.0', '"epsilon": 1e-308')
    assert "1e-308" in text
    r.hset(state.StudyKeys("evil").study, mapping={"json": text, "status": "open",
                                             "envelope": signed_bytes("open", text)})
    r.hset(state.STUDY_HASHES, evil_hash, "evil")
    now = int(time.time() * 1000)
    rng = np.random.default_rng(0)
    _send(kafka_settings, topics.records,
          [(None, encode_record(evil_hash, uuid.uuid4().bytes, now, rng.normal(size=4) * 0.1,
                                rng.normal(size=4) * 0.1)) for _ in range(10)])
    producer = kafka_producer(kafka_settings)
    try:
        c = Contributor(good, producer, topics.records, records_per_device=20)
        c.submit_many([[0.1, 0.2, 0.0, 0.0]] * 20, [0.5] * 20)
        c.flush()
    finally:
        producer.close()
    agg = Aggregator(kafka_settings, redis_settings, topics,
                     AggregatorSettings(group=f"agg-{topics.records}"))
    worker = threading.Thread(target=agg.run, daemon=True)
    worker.start()
    try:
        wait_for(lambda: total_stats(redis_settings, good)[2] == 20, 60,
                 "the good study's records folded")
        wait_for(lambda: state.rejected_counts(r, f"agg-{topics.records}", topics.records).get(
            "untrusted_study", 0) == 10, 30,
                 "the unreadable study's records dead-lettered")
        assert worker.is_alive()
    finally:
        agg.stop_event.set()
        worker.join(timeout=30)
