"""Device → Kafka → statistics in Redis → model at exactly n, on the real broker and Redis."""

from __future__ import annotations

import numpy as np
import pytest

from aggregator.settings import AggregatorSettings
from ipdp import state
from ipdp.redis_io import redis_client
from tests.pipeline import GROUP_JOIN_TIMEOUT_S, contribute, create, services, total_stats, wait_for
from trainer.solver import solve_constrained


def _models(kafka, topics, study_id):
    from ipdp.subscriber import ModelSubscriber

    return list(ModelSubscriber(kafka, topics, study_id=study_id, from_beginning=True))


@pytest.mark.parametrize("columnar_fetch", [True, False], ids=["columnar", "library_parser"])
def test_one_round_publishes_the_direct_solve_of_exactly_the_produced_records(
        kafka_settings, redis_settings, topics, columnar_fetch):
    """Either parser hands the fold the same batches (IPDP_AGGREGATOR_COLUMNAR_FETCH)."""
    study = create(kafka_settings, redis_settings, topics, study_id="one-round", d=5, n=300,
                   epsilon=1.0, delta=0.01, delta_in=0.5)
    q, p = contribute(study, kafka_settings, topics, study.n, seed=1)
    agg_settings = AggregatorSettings(group=f"agg-{topics.records}",
                                      columnar_fetch=columnar_fetch)
    with services(kafka_settings, redis_settings, topics, agg_settings=agg_settings):
        wait_for(lambda: len(_models(kafka_settings, topics, study.study_id)) == 1,
                 GROUP_JOIN_TIMEOUT_S, "the round's model")
    (model,) = _models(kafka_settings, topics, study.study_id)
    expected = solve_constrained(q.T @ q + 0.5 * np.eye(5), p.sum(axis=0), study.eta).w
    np.testing.assert_allclose(model.weights, expected, rtol=0, atol=1e-9)
    assert (model.study_id, model.round, model.n, model.d) == ("one-round", 1, 300, 5)
    assert model.privacy.sigma_u2 == study.calibration.sigma_u2
    assert model.privacy.mode == "rigorous"
    r = redis_client(redis_settings)
    # Published rounds leave no statistics behind; the open round is empty.
    assert not r.exists(state.StudyKeys(study.study_id).closed(1))
    assert r.hmget(state.StudyKeys(study.study_id).open, ["round", "count"]) == [b"2", b"0"]


def test_two_and_a_half_rounds_give_two_models_of_exactly_n_and_keep_the_rest_open(
        kafka_settings, redis_settings, topics):
    study = create(kafka_settings, redis_settings, topics, study_id="rounds", d=4, n=400,
                   epsilon=1.0, delta=0.01)
    contribute(study, kafka_settings, topics, 1000, seed=2)
    with services(kafka_settings, redis_settings, topics):
        wait_for(lambda: len(_models(kafka_settings, topics, study.study_id)) == 2,
                 GROUP_JOIN_TIMEOUT_S, "two models")
        wait_for(lambda: redis_client(redis_settings).hget(
            state.StudyKeys(study.study_id).open, "count") == b"200", 30, "200 records in round 3")
    models = _models(kafka_settings, topics, study.study_id)
    assert sorted(m.round for m in models) == [1, 2]
    assert all(m.n == 400 for m in models)
    r = redis_client(redis_settings)
    assert r.hget(state.StudyKeys(study.study_id).open, "round") == b"3"
    assert r.hget(state.StudyKeys(study.study_id).counts, "folded") == b"1000"
    assert r.hget(state.StudyKeys(study.study_id).counts, "rounds_closed") == b"2"
    # What stayed open is exactly the 200 records no model used (rounds are order-dependent
    # across partitions, so compare the total).
    a_open, _, count = total_stats(redis_settings, study)
    assert count == 200
    assert np.linalg.norm(a_open) > 0


def test_two_aggregators_in_one_group_fold_the_same_statistics_as_one(
        kafka_settings, redis_settings, topics, runtime):
    from aggregator.settings import AggregatorSettings
    from ipdp.kafka_io import ensure_topics

    params = {"d": 6, "n": 100_000, "epsilon": 1.0, "delta": 0.01}
    single = create(kafka_settings, redis_settings, topics, study_id="single", **params)
    q, _ = contribute(single, kafka_settings, topics, 4000, seed=3)
    with services(kafka_settings, redis_settings, topics, trainer=False):
        wait_for(lambda: total_stats(redis_settings, single)[2] == 4000,
                 GROUP_JOIN_TIMEOUT_S, "one aggregator to fold 4000 records")

    pair_topics = topics.model_copy(update={"records": topics.records + ".pair"})
    ensure_topics(kafka_settings, pair_topics)
    pair = create(kafka_settings, redis_settings, pair_topics, study_id="pair", **params)
    contribute(pair, kafka_settings, pair_topics, 4000, seed=3)
    settings = AggregatorSettings(group="agg-pair", max_batch=100)
    with services(kafka_settings, redis_settings, pair_topics, aggregators=2, trainer=False,
                  agg_settings=settings) as aggs:
        wait_for(lambda: total_stats(redis_settings, pair)[2] == 4000,
                 GROUP_JOIN_TIMEOUT_S * 2, "two aggregators to fold 4000 records")
        assignments = [len(a.consumer.assignment()) for a in aggs]
    a1, b1, _ = total_stats(redis_settings, single)
    a2, b2, _ = total_stats(redis_settings, pair)
    np.testing.assert_allclose(a2, a1, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(b2, b1, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(a1, q.T @ q, rtol=1e-12, atol=1e-12)
    assert sum(assignments) == 4


def test_redis_holds_only_statistics_and_bookkeeping_whose_size_does_not_grow_with_n(
        kafka_settings, redis_settings, topics):
    r = redis_client(redis_settings)
    sizes = {}
    rows = {}
    for n in (500, 2000):
        study = create(kafka_settings, redis_settings, topics, study_id=f"size-{n}", d=8,
                       n=n * 10, epsilon=1.0, delta=0.01)
        rows[n] = contribute(study, kafka_settings, topics, n, seed=n)
    with services(kafka_settings, redis_settings, topics, trainer=False):
        wait_for(lambda: all(
            r.hget(state.StudyKeys(f"size-{n}").counts, "folded") == str(n).encode()
            for n in (500, 2000)), GROUP_JOIN_TIMEOUT_S, "both studies folded")
    for n in (500, 2000):
        key = state.StudyKeys(f"size-{n}").open
        sizes[n] = (sorted(r.hkeys(key)), r.hstrlen(key, "A") + r.hstrlen(key, "b"),
                    r.memory_usage(key))
    # Same fields, and A and b are exactly (d² + d) float64s at n and at 4n.
    assert sizes[500][:2] == sizes[2000][:2] == ([b"A", b"b", b"count", b"round"], 72 * 8)
    # Redis's own accounting may move by one allocator size class with the count's digits;
    # 1,500 more records of 8 + 8 floats each would add 192,000 bytes.
    assert abs(sizes[500][2] - sizes[2000][2]) <= 64
    offsets = r.hgetall(state.offsets_key(f"agg-{topics.records}", topics.records))
    assert len(offsets) == 4  # one entry per partition, whatever n is
    # No value anywhere holds a record's q̃ or p̃ bytes (record ids are kept, by design).
    needles = {row.tobytes()[:16] for q, p in rows.values() for row in (*q[:50], *p[:50])}
    for key in r.scan_iter():
        kind = r.type(key)
        blobs = []
        if kind == b"hash":
            blobs = list(r.hgetall(key).values())
        elif kind == b"string":
            blobs = [r.get(key)]
        elif kind == b"zset":
            blobs = [m for m, _ in r.zrange(key, 0, -1, withscores=True)]
            assert all(len(m) == 16 for m in blobs), key
        elif kind == b"list":  # replay buckets: packed 8-byte id prefixes
            blobs = r.lrange(key, 0, -1)
            assert all(len(m) % 8 == 0 for m in blobs), key
        for blob in blobs:
            assert not any(needle in blob for needle in needles), key


def test_a_budget_for_exactly_two_rounds_closes_the_study_before_the_third(
        kafka_settings, redis_settings, topics):
    """(ε, δ) = (1, 0.01) per round, budget (2, 0.05): two rounds compose to ε ≈ 1.94, a
    third would need ≈ 2.95 (tests/ipdp/test_accounting.py checks both against the theorem)."""
    from ipdp.accounting import composed_epsilon
    from ipdp.study import StudyStatus

    study = create(kafka_settings, redis_settings, topics, study_id="budget", d=3, n=200,
                   epsilon=1.0, delta=0.01, delta_in=0.5, budget_epsilon=2.0, budget_delta=0.05)
    contribute(study, kafka_settings, topics, 3 * study.n, seed=9)
    r = redis_client(redis_settings)
    with services(kafka_settings, redis_settings, topics):
        wait_for(lambda: len(_models(kafka_settings, topics, study.study_id)) == 2,
                 GROUP_JOIN_TIMEOUT_S, "two models")
        wait_for(lambda: state.rejected_counts(r, f"agg-{topics.records}", topics.records).get("closed_study", 0) == study.n, 30,
                 "the third round's records dead-lettered")
    models = sorted(_models(kafka_settings, topics, study.study_id), key=lambda m: m.round)
    assert [m.round for m in models] == [1, 2]
    status = r.hget(state.StudyKeys(study.study_id).study, "status")
    assert status == StudyStatus.CLOSED.value.encode()
    assert r.hget(state.StudyKeys(study.study_id).counts, "folded") == str(2 * study.n).encode()
    # Each round enters as the deployed mechanism's (ε, δ), the study's: the norm check's share
    # is taken out of δ.
    per_round_delta = study.calibration.delta
    assert per_round_delta == 0.01
    for m in models:
        assert (m.privacy.rounds_composed, m.privacy.composed_delta) == (m.round, 0.05)
        assert m.privacy.composed_epsilon == composed_epsilon(1.0, per_round_delta, m.round,
                                                             0.05) <= 2.0
        assert "Kairouz" in m.privacy.composition and "one device" in m.privacy.unit
    assert composed_epsilon(1.0, per_round_delta, 3, 0.05) > 2.0
