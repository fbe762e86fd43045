"""Hostile input: every bad record goes to the dead-letter topic with its reason, is counted,
never touches the statistics and never stops the aggregator."""

from __future__ import annotations

import struct
import threading
import time
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka import TopicPartition

from aggregator.batch import Message
from aggregator.fold import Folder
from aggregator.service import Aggregator
from aggregator.settings import AggregatorSettings
from ipdp import state
from ipdp.calibration import record_norm_bounds
from ipdp.dead_letters import DeadLetter, read_dead_letters
from ipdp.kafka_io import kafka_consumer, kafka_producer
from ipdp.losses import prepare
from ipdp.metrics import EVERY_METRIC
from ipdp.redis_io import redis_client
from ipdp.study import Study
from ipdp.wire import (
    RECORD_ID_BYTES,
    RejectReason,
    decode_record,
    encode_batch,
    encode_container,
    encode_record,
    study_hash,
)
from producer.contributor import new_record_ids
from tests.pipeline import GROUP_JOIN_TIMEOUT_S, create, total_stats, wait_for

WINDOW_S = 3600
SKEW_S = 60
MAX_BYTES = 4096
ATOL = 1e-9


def now_ms() -> int:
    return int(time.time() * 1000)


def honest(study, k: int, seed: int, created_ms: int | None = None):
    """k honest records of `study`: (wire values, q̃, p̃)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(k, study.d))
    x /= np.maximum(1.0, np.linalg.norm(x, axis=1, keepdims=True))
    y = np.clip(x @ np.linspace(-0.5, 0.5, study.d), -1, 1)
    q, p = prepare(study.loss, x, y, study.calibration, rng)
    created = np.full(k, now_ms() if created_ms is None else created_ms, dtype=np.int64)
    return encode_batch(study.hash, new_record_ids(k), created, q, p), q, p


def one(study, q, p, *, created_ms: int | None = None, sh: bytes | None = None) -> bytes:
    """One record with the given (q̃, p̃), a fresh id, now as its creation time."""
    return encode_record(sh or study.hash, new_record_ids(1)[0].tobytes(),
                         now_ms() if created_ms is None else created_ms, q, p)


def hostile_values(study, closed_study) -> list[tuple[RejectReason, bytes | None]]:
    """One or more messages for every reason a record is refused, with the reason expected."""
    d = study.d
    good, q, p = honest(study, 3, seed=99)
    bounds = record_norm_bounds(study.calibration)
    max_q, max_p = bounds.q_high, bounds.p_high
    e1 = np.eye(d)[0]
    nan_q = q[0].copy()
    nan_q[1] = np.nan
    inf_p = p[0].copy()
    inf_p[0] = -np.inf
    v3 = bytearray(good[0])
    v3[0] = 3
    v2 = bytearray(good[0])  # a version-1 record relabelled 2: a container that does not split
    v2[0] = 2
    reserved = bytearray(good[1])
    reserved[2] = 7
    small = one(study, q[0][:d - 1], p[0][:d - 1])  # a well-formed record of dimension d − 1
    big_d = (MAX_BYTES - 48) // 16 + 1
    return [
        (RejectReason.UNDECODABLE, b"\x01garbage that is no record at all"),
        (RejectReason.UNDECODABLE, good[2][:-8]),  # truncated
        (RejectReason.UNDECODABLE, b""),
        (RejectReason.UNDECODABLE, None),  # a tombstone
        (RejectReason.UNDECODABLE, bytes(reserved)),
        (RejectReason.UNSUPPORTED_VERSION, bytes(v3)),
        (RejectReason.UNDECODABLE, bytes(v2)),
        (RejectReason.UNSUPPORTED_VERSION, b"\x07" + bytes(10)),
        (RejectReason.WRONG_DIMENSION, small),
        (RejectReason.NON_FINITE, one(study, nan_q, p[0])),
        (RejectReason.NON_FINITE, one(study, q[0], inf_p)),
        (RejectReason.NORM_OUT_OF_BOUNDS, one(study, e1 * max_q * 1.001, p[0])),
        (RejectReason.NORM_OUT_OF_BOUNDS, one(study, q[0], -e1 * max_p * 1.001)),
        # Less noise than any honest device adds: a record sent without its noise.
        (RejectReason.NORM_OUT_OF_BOUNDS, one(study, e1 * bounds.q_low * 0.999, p[0])),
        (RejectReason.NORM_OUT_OF_BOUNDS, one(study, q[0], e1 * bounds.p_low * 0.999)),
        (RejectReason.UNKNOWN_STUDY, one(study, q[0], p[0], sh=study_hash("no-such-study"))),
        (RejectReason.CLOSED_STUDY, one(closed_study, q[0][:closed_study.d],
                                        p[0][:closed_study.d])),
        (RejectReason.STALE, one(study, q[0], p[0],
                                 created_ms=now_ms() - (WINDOW_S + 600) * 1000)),
        (RejectReason.FUTURE, one(study, q[0], p[0], created_ms=now_ms() + (SKEW_S + 600) * 1000)),
        (RejectReason.OVERSIZED, one(study, np.zeros(big_d), np.zeros(big_d))),
    ]


def make_folder(redis_settings, clock=time.time, **kw) -> Folder:
    kw = {"replay_window_s": WINDOW_S, "max_future_skew_s": SKEW_S, "max_message_bytes": MAX_BYTES,
          **kw}
    return Folder(redis_client(redis_settings), group=f"g-{uuid.uuid4().hex[:8]}", topic="t",
                  clock=clock, **kw)


@pytest.fixture
def studies(kafka_settings, redis_settings, topics):
    """An open study under test and a closed one."""
    study = create(kafka_settings, redis_settings, topics, study_id="hostile", d=4, n=10**5,
                   epsilon=1.0, delta=0.01)
    closed = create(kafka_settings, redis_settings, topics, study_id="closed", d=3, n=10**5,
                    epsilon=1.0, delta=0.01)
    producer = kafka_producer(kafka_settings)
    try:
        state.close_study(redis_client(redis_settings), producer, topics, "closed")
    finally:
        producer.close()
    return study, closed


# --------------------------------------------------------------------------- fold level


def test_every_hostile_record_is_rejected_with_its_reason_and_leaves_the_statistics_alone(
        redis_settings, studies):
    study, closed = studies
    hostile = hostile_values(study, closed)
    good, q, p = honest(study, 20, seed=1)
    # Honest and hostile records interleaved in one batch, over two partitions.
    values = [v for pair in zip(good, [v for _, v in hostile], strict=False) for v in pair]
    values += good[len(hostile):]
    msgs = [Message(i % 2, i // 2, v) for i, v in enumerate(values)]
    sent = []
    folder = make_folder(redis_settings)
    result = folder.fold(msgs, sent.extend)
    expected = {(m.partition, m.offset): reason for m, (reason, _) in
                zip(msgs[1::2], hostile, strict=False)}
    got = {(x.message.partition, x.message.offset): x.reason for x in result.rejected}
    assert got == expected
    assert [(x.message, x.reason) for x in sent] == [(x.message, x.reason)
                                                    for x in result.rejected]
    assert result.folded == {"hostile": 20}
    r = redis_client(redis_settings)
    counts = state.rejected_counts(r, folder.group, folder.topic)
    assert counts == {reason.value: sum(1 for x, _ in hostile if x is reason)
                      for reason in {x for x, _ in hostile}}
    a, b, count = total_stats(redis_settings, study)
    assert count == 20
    np.testing.assert_allclose(a, q.T @ q, rtol=0, atol=ATOL)
    np.testing.assert_allclose(b, p.sum(axis=0), rtol=0, atol=ATOL)
    assert not r.exists(state.StudyKeys("closed").open)


def test_replayed_record_is_rejected_in_the_same_batch_and_in_a_later_one(
        redis_settings, studies):
    study, _ = studies
    good, q, _ = honest(study, 3, seed=2)
    folder = make_folder(redis_settings)
    first = folder.fold([Message(0, 0, good[0]), Message(1, 0, good[1]), Message(0, 1, good[0])])
    assert first.folded == {"hostile": 2}
    assert [(x.message.offset, x.reason) for x in first.rejected] == [(1, RejectReason.REPLAYED)]
    later = folder.fold([Message(0, 2, good[2]), Message(1, 1, good[1])])
    assert later.folded == {"hostile": 1}
    assert [(x.message.partition, x.reason) for x in later.rejected] == [
        (1, RejectReason.REPLAYED)]
    a, _, count = total_stats(redis_settings, study)
    assert count == 3
    np.testing.assert_allclose(a, q.T @ q, rtol=0, atol=ATOL)


def test_replay_ids_expire_after_the_window_and_are_the_only_thing_kept(redis_settings, studies):
    study, _ = studies
    clock = [1_000_000.0]
    folder = make_folder(redis_settings, clock=lambda: clock[0], replay_window_s=10,
                         max_future_skew_s=2)
    t0 = int(clock[0] * 1000)
    old, _, _ = honest(study, 1, seed=3, created_ms=t0)
    r = redis_client(redis_settings)
    index = state.StudyKeys(study.study_id).replay
    assert folder.fold([Message(0, 0, old[0])]).folded == {"hostile": 1}
    old_id = old[0][RECORD_ID_BYTES]
    (end,) = [int(k) for k in r.hkeys(index)]  # one bucket of 1 s (window / 24, at least 1 s)
    assert t0 < end <= t0 + 1000
    # Only the first 8 bytes of the id, in the bucket of its fold time.
    assert r.lrange(state.StudyKeys(study.study_id).replay_bucket(end), 0, -1) == [old_id[:8]]

    clock[0] += 5  # inside the window: a replay is caught by its id
    replay = folder.fold([Message(0, 1, old[0])])
    assert [x.reason for x in replay.rejected] == [RejectReason.REPLAYED]

    clock[0] += 9  # past window + skew + a span: the bucket is dropped whole at the next fold...
    new, _, _ = honest(study, 1, seed=4, created_ms=int(clock[0] * 1000))
    assert folder.fold([Message(0, 2, new[0])]).folded == {"hostile": 1}
    assert not r.exists(state.StudyKeys(study.study_id).replay_bucket(end))
    (later,) = [int(k) for k in r.hkeys(index)]
    assert r.lrange(state.StudyKeys(study.study_id).replay_bucket(later), 0, -1) == [new[0][24:32]]
    # ...and the replay is still refused: it is too old to be accepted at all.
    late = folder.fold([Message(0, 3, old[0])])
    assert [x.reason for x in late.rejected] == [RejectReason.STALE]
    assert total_stats(redis_settings, study)[2] == 2


# --------------------------------------------------------------------------- fuzz


MUTATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.integers(0, 200), st.integers(0, 255)),
        st.tuples(st.just("cut"), st.integers(0, 200)),
        st.tuples(st.just("grow"), st.binary(min_size=1, max_size=40)),
        st.tuples(st.just("float"), st.integers(0, 7),
                  st.sampled_from([np.nan, np.inf, -np.inf, 1e300, -0.0, 5e-324])),
    ),
    max_size=3,
)


def _mutate(value: bytes, ops) -> bytes:
    buf = bytearray(value)
    for op in ops:
        if op[0] == "set" and op[1] < len(buf):
            buf[op[1]] = op[2]
        elif op[0] == "cut":
            del buf[op[1]:]
        elif op[0] == "grow":
            buf += op[1]
        elif op[0] == "float" and 48 + 8 * op[1] + 8 <= len(buf):
            buf[48 + 8 * op[1]:56 + 8 * op[1]] = struct.pack("<d", op[2])
    return bytes(buf)


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(batch=st.lists(MUTATIONS, min_size=1, max_size=8), seed=st.integers(0, 2**32 - 1))
def test_fuzzed_records_are_each_folded_or_rejected_exactly_once(redis_settings, studies, batch,
                                                                 seed):
    study, _ = studies
    values, _, _ = honest(study, len(batch), seed=seed)
    msgs = [Message(i % 3, i, _mutate(v, ops)) for i, (v, ops) in enumerate(zip(values, batch))]
    before = total_stats(redis_settings, study)
    result = make_folder(redis_settings).fold(msgs)
    rejected = [(x.message.partition, x.message.offset) for x in result.rejected]
    assert len(set(rejected)) == len(rejected)
    assert len(rejected) + sum(result.folded.values()) == len(msgs)
    kept = [m for m in msgs if (m.partition, m.offset) not in set(rejected)]
    records = [decode_record(m.value) for m in kept]
    assert all(rec.study_hash == study.hash for rec in records)
    a, b, count = total_stats(redis_settings, study)
    assert count == before[2] + len(kept)
    q = np.array([rec.q for rec in records]).reshape(-1, study.d)
    p = np.array([rec.p for rec in records]).reshape(-1, study.d)
    np.testing.assert_allclose(a - before[0], q.T @ q, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(b - before[1], p.sum(axis=0), rtol=1e-9, atol=1e-9)


# --------------------------------------------------------------------------- through Kafka


def _dead_letters(kafka, topic: str, expect: int, timeout_s: float = 30.0) -> list[DeadLetter]:
    """The refused records on the dead-letter topic, once ``expect`` of them are there."""
    consumer = kafka_consumer(kafka, group_id=None)
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        out: list[DeadLetter] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < expect and time.monotonic() < deadline:
            for msgs in consumer.poll(timeout_ms=300).values():
                out += [x for m in msgs for x in read_dead_letters(m.value, m.headers)]
        # Anything beyond what we expect would be a duplicate: give it a moment to show up.
        for msgs in consumer.poll(timeout_ms=1000).values():
            out += [x for m in msgs for x in read_dead_letters(m.value, m.headers)]
        return out
    finally:
        consumer.close()


def _dead_lettered(reason: str) -> float:
    return EVERY_METRIC.get_sample_value("ipdp_records_dead_lettered_total", {"reason": reason}) or 0


@pytest.mark.slow
def test_a_mix_of_hostile_and_honest_records_dead_letters_each_bad_one_once(
        kafka_settings, redis_settings, topics, studies):
    study, closed = studies
    hostile = hostile_values(study, closed)
    good, q, p = honest(study, 200, seed=5)
    producer = kafka_producer(kafka_settings)
    expected: dict[tuple[int, int], tuple[RejectReason, bytes]] = {}

    def send(value, key):
        return producer.send(topics.records, key=key, value=value)

    # Wave 1: honest records with the hostile ones, and one honest record sent twice in a row
    # (same key, same partition; the fold-level test pins the same-batch and later-batch cases).
    futures = [send(v, v[RECORD_ID_BYTES]) for v in good[:150]]
    bad = [(reason, value, send(value, b"bad-%d" % i)) for i, (reason, value) in
           enumerate(hostile)]
    twin = send(good[0], good[0][RECORD_ID_BYTES])
    producer.flush()
    for reason, value, f in bad:
        m = f.get(timeout=30)
        expected[(m.partition, m.offset)] = (reason, value or b"")
    m = twin.get(timeout=30)
    expected[(m.partition, m.offset)] = (RejectReason.REPLAYED, good[0])
    assert all(f.get(timeout=30) for f in futures)
    before = {reason.value: _dead_lettered(reason.value) for reason in RejectReason}

    agg = Aggregator(kafka_settings, redis_settings, topics,
                     AggregatorSettings(group=f"agg-{topics.records}", replay_window_s=WINDOW_S,
                                        max_future_skew_s=SKEW_S, max_message_bytes=MAX_BYTES))
    worker = threading.Thread(target=agg.run, daemon=True)
    worker.start()
    r = redis_client(redis_settings)
    try:
        wait_for(lambda: total_stats(redis_settings, study)[2] == 150, GROUP_JOIN_TIMEOUT_S,
                 "150 honest records folded")
        # Wave 2, after wave 1 is folded: the rest, and a replay from an earlier batch.
        futures = [send(v, v[RECORD_ID_BYTES]) for v in good[150:]]
        replay = send(good[7], good[7][RECORD_ID_BYTES])
        producer.flush()
        m = replay.get(timeout=30)
        expected[(m.partition, m.offset)] = (RejectReason.REPLAYED, good[7])
        wait_for(lambda: total_stats(redis_settings, study)[2] == 200, 30,
                 "200 honest records folded")
        wait_for(lambda: sum(state.rejected_counts(r, f"agg-{topics.records}", topics.records).values()) == len(expected), 30,
                 "every rejection counted")
        assert worker.is_alive()
    finally:
        agg.stop_event.set()
        worker.join(timeout=30)
        producer.close()

    letters = _dead_letters(kafka_settings, topics.dead_letter, len(expected))
    got = {}
    for m in letters:
        assert m.topic == topics.records and m.detail
        assert (m.partition, m.offset) not in got, f"{m.source} dead-lettered twice"
        got[(m.partition, m.offset)] = (RejectReason(m.reason), m.value)
    oversized = [k for k, (reason, _) in expected.items() if reason is RejectReason.OVERSIZED]
    for k in oversized:  # the DLQ does not carry what the aggregator refused to read
        expected[k] = (RejectReason.OVERSIZED, b"")
    assert got == expected

    by_reason: dict[str, int] = {}
    for reason, _ in expected.values():
        by_reason[reason.value] = by_reason.get(reason.value, 0) + 1
    assert state.rejected_counts(r, f"agg-{topics.records}", topics.records) == by_reason
    assert {reason: _dead_lettered(reason) - before[reason] for reason in by_reason} == by_reason
    a, b, count = total_stats(redis_settings, study)
    assert count == 200
    np.testing.assert_allclose(a, q.T @ q, rtol=0, atol=ATOL)
    np.testing.assert_allclose(b, p.sum(axis=0), rtol=0, atol=ATOL)
    assert int(r.hget(state.StudyKeys(study.study_id).counts, "folded")) == 200


def test_a_record_dated_ahead_of_the_aggregator_clock_cannot_be_replayed_after_the_window(
        redis_settings, studies):
    """Its id must outlive `window` from its creation time, not only from the fold time."""
    study, _ = studies
    clock = [2_000_000.0]
    folder = make_folder(redis_settings, clock=lambda: clock[0], replay_window_s=10,
                         max_future_skew_s=5)
    t0 = int(clock[0] * 1000)
    ahead, _, _ = honest(study, 1, seed=6, created_ms=t0 + 4000)  # a device clock 4 s fast
    assert folder.fold([Message(0, 0, ahead[0])]).folded == {"hostile": 1}
    clock[0] += 11  # a later fold trims the ids older than the window
    other, _, _ = honest(study, 1, seed=7, created_ms=int(clock[0] * 1000))
    assert folder.fold([Message(0, 1, other[0])]).folded == {"hostile": 1}
    clock[0] += 1  # t0 + 12 s: created t0 + 4 s is still inside the window
    replay = folder.fold([Message(0, 2, ahead[0])])
    assert [x.reason for x in replay.rejected] == [RejectReason.REPLAYED]
    assert total_stats(redis_settings, study)[2] == 2


# --------------------------------------------------------------------------- containers


def test_a_container_folds_its_good_records_once_and_dead_letters_each_bad_one(
        redis_settings, studies):
    study, _ = studies
    good, q, p = honest(study, 6, seed=7)
    max_q = record_norm_bounds(study.calibration).q_high
    big = one(study, np.eye(study.d)[0] * max_q * 1.001, p[0])
    stale = one(study, q[0], p[0], created_ms=now_ms() - (WINDOW_S + 600) * 1000)
    nan_q = q[1].copy()
    nan_q[0] = np.nan
    records = [good[0], big, good[1], good[0], stale, one(study, nan_q, p[1]), good[2]]
    malformed = encode_container(good[3:5])[:-1]  # count no longer divides the length
    msgs = [Message(0, 0, encode_container(records)), Message(0, 1, malformed),
            Message(1, 0, good[5])]
    sent = []
    folder = make_folder(redis_settings)
    result = folder.fold(msgs, sent.extend)
    assert result.folded == {"hostile": 4}
    got = sorted((x.source, x.reason) for x in sent)
    assert got == sorted([("0:0#1", RejectReason.NORM_OUT_OF_BOUNDS),
                          ("0:0#3", RejectReason.REPLAYED),
                          ("0:0#4", RejectReason.STALE),
                          ("0:0#5", RejectReason.NON_FINITE),
                          ("0:1", RejectReason.UNDECODABLE)])
    by_source = {x.source: x.message.value for x in sent}
    assert by_source["0:0#1"] == big  # the bad record's own bytes, not the whole container
    # Re-reading the same offsets folds nothing twice (exactly once per Kafka offset).
    again = folder.fold(msgs)
    assert again.folded == {} and again.skipped == 3
    # A record of that container replayed inside a later container is refused.
    later = folder.fold([Message(0, 2, encode_container([good[4], good[2]]))])
    assert later.folded == {"hostile": 1}
    assert [(x.source, x.reason) for x in later.rejected] == [("0:2#1", RejectReason.REPLAYED)]
    keep = [0, 1, 2, 4, 5]
    a, b, count = total_stats(redis_settings, study)
    assert count == 5
    np.testing.assert_allclose(a, q[keep].T @ q[keep], rtol=0, atol=ATOL)
    np.testing.assert_allclose(b, p[keep].sum(axis=0), rtol=0, atol=ATOL)


def test_dead_letters_of_a_container_name_the_record_inside_it(kafka_settings, redis_settings,
                                                               topics, studies):
    study, _ = studies
    good, q, _ = honest(study, 2, seed=8)
    max_q = record_norm_bounds(study.calibration).q_high
    big = one(study, np.eye(study.d)[0] * max_q * 1.001, q[0] * 0)
    producer = kafka_producer(kafka_settings)
    producer.send(topics.records, value=encode_container([good[0], big, good[1]]),
                  partition=0).get(timeout=30)
    producer.close()
    agg = Aggregator(kafka_settings, redis_settings, topics,
                     AggregatorSettings(group=f"agg-{uuid.uuid4().hex[:8]}",
                                        replay_window_s=WINDOW_S, max_future_skew_s=SKEW_S,
                                        max_message_bytes=MAX_BYTES))
    totals = agg.run(idle_exit_s=3)
    assert totals["folded"] == 2 and totals["rejected"] == 1
    dlq = kafka_consumer(kafka_settings, group_id=None)
    dlq.assign([TopicPartition(topics.dead_letter, p)
                for p in dlq.partitions_for_topic(topics.dead_letter)])
    dlq.seek_to_beginning()
    got = []
    deadline = time.monotonic() + 30
    while not got and time.monotonic() < deadline:
        for recs in dlq.poll(timeout_ms=500).values():
            got += recs
    dlq.close()
    (message,) = got
    (m,) = read_dead_letters(message.value, message.headers)
    assert m.reason == "norm_out_of_bounds"
    assert f"{m.topic}:{m.source}" == f"{topics.records}:0:0#1"
    assert m.value == big


def test_a_container_longer_than_the_message_size_limit_is_dead_lettered_as_oversized(
        redis_settings, studies):
    study, _ = studies
    good, _, _ = honest(study, 2, seed=8)
    record = len(good[0])
    # Every record inside is small and valid; together they pass the limit.
    filler, _, _ = honest(study, MAX_BYTES // record + 1, seed=9)
    container = encode_container(filler)
    assert len(container) > MAX_BYTES
    sent = []
    folder = make_folder(redis_settings)
    result = folder.fold([Message(0, 0, container), Message(0, 1, encode_container(good))],
                         sent.extend)
    assert [(x.source, x.reason) for x in sent] == [("0:0", RejectReason.OVERSIZED)]
    assert result.folded == {study.study_id: 2}
    assert total_stats(redis_settings, study)[2] == 2
    assert state.rejected_counts(redis_client(redis_settings), folder.group, folder.topic) == {
        "oversized": 1}


def test_an_unknown_study_hash_is_remembered_and_a_study_created_later_is_found_within_the_ttl(
        redis_settings):
    ttl_s = 1.0
    study = Study(study_id=f"late-{uuid.uuid4().hex[:6]}", d=3, n=10**5, epsilon=1.0,
                  delta=0.01)
    values, _, _ = honest(study, 3, seed=10)
    folder = make_folder(redis_settings, unknown_study_ttl_s=ttl_s)
    first = folder.fold([Message(0, 0, values[0])])
    assert [x.reason for x in first.rejected] == [RejectReason.UNKNOWN_STUDY]
    state.register_study(redis_client(redis_settings), study)
    created = time.monotonic()
    # Still remembered as unknown: no lookup per record while the TTL runs.
    cached = folder.fold([Message(0, 1, values[1])])
    if time.monotonic() - created < ttl_s:
        assert [x.reason for x in cached.rejected] == [RejectReason.UNKNOWN_STUDY]
    time.sleep(max(0.0, ttl_s - (time.monotonic() - created)))
    found = folder.fold([Message(0, 2, values[2])])
    assert found.folded == {study.study_id: 1} and found.rejected == []


def test_a_record_perturbed_under_other_parameters_than_its_named_study_is_study_mismatch(
        redis_settings):
    """docs/wire-format.md: a hash that names no study, from a device whose ``study`` header
    names a registered one, is study_mismatch (unknown_study when the header names none)."""
    registered = Study(study_id=f"mm-{uuid.uuid4().hex[:6]}", d=3, n=10**5, epsilon=1.0,
                       delta=0.01)
    state.register_study(redis_client(redis_settings), registered)
    # The device's own parameters, never registered.
    other = Study(study_id=registered.study_id, d=3, n=10**5, epsilon=2.0, delta=0.01)
    assert other.hash != registered.hash
    values, _, _ = honest(other, 2, seed=41)
    result = make_folder(redis_settings).fold([
        Message(0, 0, values[0], registered.study_id), Message(0, 1, values[1], "no-such-study")])
    assert [(x.message.offset, x.reason) for x in result.rejected] == [
        (0, RejectReason.STUDY_MISMATCH), (1, RejectReason.UNKNOWN_STUDY)]
    assert registered.study_id in result.rejected[0].detail


def test_records_of_a_study_signed_by_a_key_the_aggregator_does_not_pin_are_untrusted(
        redis_settings, tmp_path):
    """docs/security.md, "Signed studies": with study keys pinned, a study another key signed is
    refused (untrusted_study) and none of its records fold."""
    from ipdp.signing import TrustedKeys, generate_key_files

    owner, stranger = (generate_key_files(tmp_path / name) for name in ("owner", "stranger"))
    study = Study(study_id=f"pin-{uuid.uuid4().hex[:6]}", d=3, n=10**5, epsilon=1.0, delta=0.01)
    state.register_study(redis_client(redis_settings), study, stranger)
    values, _, _ = honest(study, 1, seed=42)
    folder = make_folder(redis_settings, trusted=TrustedKeys([owner.private.public_key()]))
    result = folder.fold([Message(0, 0, values[0])])
    assert result.folded == {}
    assert [x.reason for x in result.rejected] == [RejectReason.UNTRUSTED_STUDY]
