"""A study that requires credentials folds only records with a valid credential, each slot once,
whoever sends them straight to Kafka; every other record is dead-lettered with its reason."""

from __future__ import annotations

import os
import time

import numpy as np

from aggregator.settings import AggregatorSettings
from ipdp import state
from ipdp.credentials import (
    credential_id,
    credentials_header,
    issue_batch,
    issue_credential,
    slot_record_ids,
    token_text,
)
from ipdp.kafka_io import kafka_producer
from ipdp.redis_io import redis_client
from ipdp.signing import generate_key_files
from ipdp.wire import encode_batch, encode_container, encode_record, study_headers
from producer.contributor import Contributor
from tests.aggregator.test_hostile_input import _dead_lettered, _dead_letters
from tests.pipeline import create, services, total_stats, wait_for
from tests.system.test_cli import ipdp

PARAMS = {"d": 4, "n": 1_000, "epsilon": 1.0, "delta": 0.01}
X, Y = [0.1, 0.2, 0.0, 0.0], 0.5
REASONS = ("credential_missing", "credential_invalid", "credential_untrusted",
           "credential_expired", "credential_wrong_study", "credential_bad_slot",
           "credential_reused")


def _rejected(r, topics) -> dict[str, int]:
    """Refusals by reason of the aggregator the tests run (tests.pipeline.services' group)."""
    return state.rejected_counts(r, f"agg-{topics.records}", topics.records)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def test_only_records_with_a_valid_unused_credential_slot_are_folded(
        kafka_settings, redis_settings, env_topics, tmp_path, monkeypatch):
    topics = env_topics
    issuer = generate_key_files(tmp_path / "issuer")
    stranger = generate_key_files(tmp_path / "stranger")
    monkeypatch.setenv("IPDP_TRUSTED_CREDENTIAL_KEYS", f"{tmp_path / 'issuer'}.pub")
    study = create(kafka_settings, redis_settings, topics, study_id="c1",
                   require_credentials=True, records_per_device=2, **PARAMS)
    other = create(kafka_settings, redis_settings, topics, study_id="c2",
                   require_credentials=True, **PARAMS)
    t = now_ms()
    window_ms = AggregatorSettings().replay_window_s * 1000
    # Two devices with a signature each, two of one batch (version 2).
    valid = [*(issue_credential(issuer, study.hash, t, t + 600_000) for _ in range(2)),
             *issue_batch(issuer, study.hash, t, t + 600_000, 2)]
    producer = kafka_producer(kafka_settings)

    def send(credential=None, k: int = 1) -> None:
        c = Contributor(study, producer, topics.records, credential=credential,
                        records_per_device=k if credential is None else None)
        c.submit_many([X] * k, [Y] * k)
        c.flush()

    for token in valid[:3]:  # three devices, both slots each; the text form as a device keeps it
        send(token_text(token), 2)
    # A fourth device's two slots in one container, as the gateway sends them.
    ids = slot_record_ids(credential_id(valid[3]), 2)
    q = np.full((2, 4), 0.1)
    values = encode_batch(study.hash, ids, np.full(2, t), q, q)
    producer.send(topics.records, value=encode_container(values),
                  headers=[*study_headers("c1"), credentials_header([(valid[3], 2)])]).get(30)
    expired = issue_batch(issuer, study.hash, t - 20_000, t - 10_000, 2)[1]
    for token in (expired, issue_credential(issuer, other.hash, t, t + 600_000),
                  issue_batch(stranger, study.hash, t, t + 600_000, 3)[0],
                  issue_credential(issuer, study.hash, t, t + window_ms + 1)):
        send(token)
    send(None)  # no credential at all
    # A valid credential with a record id that is none of its slots.
    producer.send(topics.records, value=encode_record(study.hash, os.urandom(16), t, X, X),
                  headers=[*study_headers("c1"), credentials_header([(valid[0], 1)])]).get(30)
    before = {reason: _dead_lettered(reason) for reason in REASONS}
    r = redis_client(redis_settings)
    with services(kafka_settings, redis_settings, topics, trainer=False):
        wait_for(lambda: int(r.hget(state.StudyKeys("c1").counts, "folded") or 0) == 8
                 and sum(_rejected(r, topics).values()) == 6, 60,
                 "the valid records folded and the bad ones dead-lettered")
    # A device that restarts and sends slot 0 again, to a restarted aggregator.
    send(token_text(valid[0]))
    with services(kafka_settings, redis_settings, topics, trainer=False):
        wait_for(lambda: _rejected(r, topics).get("credential_reused", 0) == 1, 60,
                 "the reused slot dead-lettered")
    producer.close()

    assert total_stats(redis_settings, study)[2] == 8
    assert int(r.hget(state.StudyKeys("c1").counts, "folded")) == 8
    expected = {"credential_expired": 1, "credential_wrong_study": 1, "credential_untrusted": 1,
                "credential_invalid": 1, "credential_missing": 1, "credential_bad_slot": 1,
                "credential_reused": 1}
    assert _rejected(r, topics) == expected
    assert {reason: _dead_lettered(reason) - before[reason] for reason in REASONS} == expected
    letters = _dead_letters(kafka_settings, topics.dead_letter, 7)
    got = sorted(m.reason for m in letters)
    assert got == sorted(expected)
    details = {m.reason: m.detail for m in letters}
    assert "replay window" in details["credential_invalid"]


def test_loadgen_devices_with_issued_credentials_fold_once_each(
        kafka_settings, redis_settings, env_topics, tmp_path, monkeypatch):
    topics = env_topics
    generate_key_files(tmp_path / "issuer")
    monkeypatch.setenv("IPDP_TRUSTED_CREDENTIAL_KEYS", f"{tmp_path / 'issuer'}.pub")
    made = ipdp("study", "create", "--study-id", "c3", "--d", "4", "--n", "1000", "--epsilon",
                "1", "--delta", "0.01", "--require-credentials")
    assert made.returncode == 0, made.stderr
    issued = ipdp("credentials", "issue", "c3", "--key", str(tmp_path / "issuer.key"),
                  "--count", "30", "--valid-for", "3600")
    assert issued.returncode == 0, issued.stderr
    (tmp_path / "devices.txt").write_text(issued.stdout)
    loadgen = ["loadgen", "--study", "c3", "--devices", "30", "--no-progress",
               "--credentials", str(tmp_path / "devices.txt")]
    first = ipdp(*loadgen)
    assert first.returncode == 0, first.stderr
    assert ipdp(*loadgen).returncode == 0  # the same devices again: every slot reused
    short = ipdp("loadgen", "--study", "c3", "--devices", "31", "--no-progress",
                 "--credentials", str(tmp_path / "devices.txt"))
    assert short.returncode == 2 and "one per device" in short.stderr
    r = redis_client(redis_settings)
    with services(kafka_settings, redis_settings, topics, trainer=False):
        wait_for(lambda: int(r.hget(state.StudyKeys("c3").counts, "folded") or 0) == 30
                 and _rejected(r, topics).get("credential_reused", 0) == 30, 60,
                 "30 records folded and 30 reused slots dead-lettered")
    assert _rejected(r, topics) == \
        {"credential_reused": 30}
