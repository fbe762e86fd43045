"""Exactly once under failure: SIGKILLed aggregators and trainers, Redis and broker outages.

Real broker, real Redis; the processes that get killed are real `ipdp ... run` subprocesses.
Every check is against a clean fold of the exact rows produced (tests.pipeline.contribute
returns them), never against the service's own view of what it did.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from aggregator.batch import Message
from aggregator.service import Aggregator
from aggregator.settings import AggregatorSettings
from bench.soak import closed_rounds
from ipdp import state
from ipdp.embedded import EmbeddedRuntime
from ipdp.kafka_io import ensure_topics, kafka_consumer
from ipdp.metrics import EVERY_METRIC
from ipdp.model_message import model_key
from ipdp.redis_io import redis_client
from ipdp.settings import KafkaSettings, RedisSettings, TopicSettings
from ipdp.subscriber import ModelSubscriber
from ipdp.wire import RECORD_ID_BYTES
from tests.aggregator.test_hostile_input import honest, make_folder
from tests.pipeline import GROUP_JOIN_TIMEOUT_S, contribute, create, total_stats, wait_for
from tests.proc_services import REPO, service_env, start, stop
from trainer.service import _STORE_MODEL_LUA, Trainer
from trainer.settings import TrainerSettings
from trainer.solver import solve_constrained

KILLS = 24
ATOL = 1e-9


# --------------------------------------------------------------------------- helpers


def folded(r, study_id: str) -> int:
    return int(r.hget(state.StudyKeys(study_id).counts, "folded") or 0)


def assert_clean_fold(redis_settings, study, q: np.ndarray, p: np.ndarray) -> None:
    """Open + closed statistics in Redis equal one fold of exactly (q, p)."""
    a, b, count = total_stats(redis_settings, study)
    assert count == len(q)
    np.testing.assert_allclose(a, q.T @ q, rtol=0, atol=ATOL)
    np.testing.assert_allclose(b, p.sum(axis=0), rtol=0, atol=ATOL)


def sample(name: str, **labels: str) -> float:
    return EVERY_METRIC.get_sample_value(name, labels) or 0.0


class Feeder:
    """Produces seeded chunks of records in a thread until stopped; keeps the exact rows."""

    def __init__(self, study, kafka, topics, chunk: int, pause_s: float, seed: int):
        self.args = (study, kafka, topics)
        self.chunk, self.pause_s, self.seed = chunk, pause_s, seed
        self.rows: list[tuple[np.ndarray, np.ndarray]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self.stop.is_set():
            self.rows.append(contribute(*self.args, self.chunk, seed=self.seed + 10 * i))
            i += 1
            self.stop.wait(self.pause_s)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=60)

    def all_rows(self) -> tuple[np.ndarray, np.ndarray]:
        return np.concatenate([q for q, _ in self.rows]), np.concatenate([p for _, p in self.rows])


class AggregatorThread:
    """One in-process aggregator whose thread must survive whatever the test does to backends."""

    def __init__(self, kafka, redis_settings, topics, **settings):
        settings.setdefault("group", f"agg-{topics.records}")
        self.agg = Aggregator(kafka, redis_settings, topics, AggregatorSettings(**settings))
        self.thread = threading.Thread(target=self.agg.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.agg.stop_event.set()
        self.thread.join(timeout=30)


# --------------------------------------------------------------------------- aggregator kills


@pytest.mark.slow
def test_aggregator_sigkilled_at_random_moments_folds_every_record_exactly_once(
        runtime, kafka_settings, redis_settings, topics, tmp_path):
    study = create(kafka_settings, redis_settings, topics, study_id="kills", d=4, n=200,
                   epsilon=1.0, delta=0.01, delta_in=0.5)
    r = redis_client(redis_settings)
    # A killed member's partitions go to the restarted one once its 1.5 s session expires.
    env = service_env(runtime, topics, IPDP_AGGREGATOR_GROUP=f"agg-{topics.records}",
                      IPDP_AGGREGATOR_SESSION_TIMEOUT_MS="1500", IPDP_AGGREGATOR_MAX_BATCH="40")
    rng = random.Random(20240601)
    kills_while_folding = 0
    with Feeder(study, kafka_settings, topics, chunk=40, pause_s=0.2, seed=1000) as feeder:
        child = start(["aggregator", "run"], env, tmp_path, "aggregator")
        try:
            for kill in range(KILLS):
                before = folded(r, study.study_id)
                if kill % 2:
                    # Anywhere: start-up, group join, seek, mid-fold.
                    time.sleep(rng.uniform(0.2, 3.0))
                else:
                    # Once it is folding, so that half the kills land in the fold loop.
                    wait_for(lambda b=before: folded(r, study.study_id) > b,
                             GROUP_JOIN_TIMEOUT_S, "the restarted aggregator to fold")
                    time.sleep(rng.uniform(0.0, 0.5))
                kills_while_folding += folded(r, study.study_id) > before
                child.check_alive()
                child.proc.kill()
                child.proc.wait()
                child = start(["aggregator", "run"], env, tmp_path, "aggregator")
            feeder.stop.set()
            feeder.thread.join(timeout=60)
            q, p = feeder.all_rows()
            wait_for(lambda: folded(r, study.study_id) == len(q), GROUP_JOIN_TIMEOUT_S,
                     f"{len(q)} records folded")
            child.check_alive()
        finally:
            stop(child)
    assert kills_while_folding >= KILLS // 2

    # Exactly once: the statistics are one clean fold of every record produced, nothing was
    # rejected (a refold would show up as a replay), and every closed round holds exactly n.
    assert folded(r, study.study_id) == len(q)
    assert state.rejected_counts(r, f"agg-{topics.records}", topics.records) == {}
    assert_clean_fold(redis_settings, study, q, p)
    rounds = closed_rounds(r, study)
    assert sorted(rounds) == list(range(1, len(q) // study.n + 1))
    assert all(count == study.n for _, _, count in rounds.values())
    assert r.hmget(state.StudyKeys(study.study_id).open, ["round", "count"]) == [
        str(len(q) // study.n + 1).encode(), str(len(q) % study.n).encode()]

    # Each published model is the solve of exactly its closed round.
    trainer = Trainer(kafka_settings, redis_settings, topics, TrainerSettings(block_ms=200))
    trainer.run(idle_exit_s=2.0)
    models = list(ModelSubscriber(kafka_settings, topics, study_id=study.study_id))
    assert sorted(m.round for m in models) == sorted(rounds)
    for m in models:
        a, b, _ = rounds[m.round]
        assert m.n == study.n
        expected = solve_constrained(a + study.calibration.delta_in * np.eye(study.d), b,
                                     study.eta).w
        np.testing.assert_allclose(m.weights, expected, rtol=0, atol=ATOL)


def test_a_stale_batch_never_moves_the_offsets_back(redis_settings, kafka_settings, topics):
    """A zombie folding a batch the next owner already folded must not rewind the offsets."""
    study = create(kafka_settings, redis_settings, topics, study_id="zombie", d=3, n=10**5,
                   epsilon=1.0, delta=0.01)
    values, q, p = honest(study, 30, seed=5)
    msgs = [Message(0, i, v) for i, v in enumerate(values)]
    folder = make_folder(redis_settings)
    folder.fold(msgs[:10])
    folder.fold(msgs[10:20])
    stale = folder.fold(msgs[5:10])
    assert stale.skipped == 5 and not stale.folded
    assert folder.committed_offsets() == {0: 20}
    result = folder.fold(msgs[20:])
    assert result.reseek == {} and result.folded == {"zombie": 10}
    assert state.rejected_counts(redis_client(redis_settings), folder.group, folder.topic) == {}
    assert_clean_fold(redis_settings, study, q, p)


def test_a_discarded_batch_re_reads_every_partition_it_held(redis_settings, kafka_settings,
                                                             topics):
    """A batch that starts past Redis's offset on one partition is re-read on all of them."""
    study = create(kafka_settings, redis_settings, topics, study_id="reseek", d=3, n=10**5,
                   epsilon=1.0, delta=0.01)
    values, _, _ = honest(study, 8, seed=6)
    folder = make_folder(redis_settings)
    folder.fold([Message(0, 0, values[0]), Message(1, 0, values[1])])
    result = folder.fold([Message(0, 3, values[2]), Message(1, 1, values[3]),
                          Message(2, 0, values[4])])
    assert result.reseek == {0: 1, 1: 1, 2: 0}
    assert not result.folded
    assert folder.committed_offsets() == {0: 1, 1: 1}


# --------------------------------------------------------------------------- trainer kills


def _close_one_round(redis_settings, study, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Fold exactly n records straight into Redis (round 1 closes); returns its (A, b)."""
    values, q, p = honest(study, study.n, seed=seed)
    make_folder(redis_settings).fold([Message(0, i, v) for i, v in enumerate(values)])
    return q.T @ q, p.sum(axis=0)


def _raw_models(kafka, topics) -> list[tuple[bytes, bytes]]:
    """Every (key, value) on the models topic, repeats included.

    tansu answers end_offsets with the last batch's base offset + 1; the trainer sends each
    model in a batch of its own, so here that is the end of the topic.
    """
    from kafka import TopicPartition

    consumer = kafka_consumer(kafka, group_id=None)
    try:
        tp = TopicPartition(topics.models, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        end = consumer.end_offsets([tp])[tp]
        out = []
        while consumer.position(tp) < end:
            for msgs in consumer.poll(timeout_ms=500).values():
                out += [(m.key, m.value) for m in msgs if m.offset < end]
        return out
    finally:
        consumer.close()


def _run_trainer(runtime, topics, tmp_path, fault: str | None = None) -> int:
    """The real trainer, or (fault = before|after) tests/trainer/faulty_trainer.py."""
    env = service_env(runtime, topics, IPDP_TRAINER_BLOCK_MS="200")
    if fault is None:
        child = start(["trainer", "run", "--idle-exit", "2"], env, tmp_path, "trainer")
    else:
        child = start([fault], env, tmp_path, "trainer", module="tests.trainer.faulty_trainer")
    try:
        return child.proc.wait(timeout=60)
    finally:
        stop(child)


@pytest.mark.parametrize("fault", ["before", "after"])
def test_trainer_killed_around_publishing_still_publishes_the_round_once_per_key(
        runtime, kafka_settings, redis_settings, topics, tmp_path, fault):
    study = create(kafka_settings, redis_settings, topics, study_id="crash", d=3, n=200,
                   epsilon=1.0, delta=0.01, delta_in=0.5)
    a, b = _close_one_round(redis_settings, study, seed=7)
    r = redis_client(redis_settings)
    group = TrainerSettings().group

    assert _run_trainer(runtime, topics, tmp_path, fault) == 137
    log = (tmp_path / "trainer.log").read_text()
    assert "fault injection" in log and "Traceback" not in log
    published_before_ack = 1 if fault == "after" else 0
    assert len(_raw_models(kafka_settings, topics)) == published_before_ack
    assert r.exists(state.StudyKeys(study.study_id).closed(1))  # the round is not lost...
    assert r.xpending(state.ROUNDS_STREAM, group)["pending"] == 1  # ...nor acknowledged

    assert _run_trainer(runtime, topics, tmp_path) == 0
    raw = _raw_models(kafka_settings, topics)
    assert len(raw) == published_before_ack + 1
    assert set(raw) == {raw[0]}  # a repeat is the stored model again, byte for byte
    assert raw[0][0] == model_key(study.study_id, 1)
    sub = ModelSubscriber(kafka_settings, topics, study_id=study.study_id)
    (model,) = list(sub)
    assert sub.duplicates_dropped == published_before_ack
    assert (model.round, model.n) == (1, study.n)
    expected = solve_constrained(a + 0.5 * np.eye(study.d), b, study.eta).w
    np.testing.assert_allclose(model.weights, expected, rtol=0, atol=ATOL)
    assert not r.exists(state.StudyKeys(study.study_id).closed(1))
    assert r.xpending(state.ROUNDS_STREAM, group)["pending"] == 0
    assert r.hexists(state.StudyKeys(study.study_id).published, "1")


def test_the_first_model_stored_for_a_round_is_kept_and_none_is_stored_once_it_is_gone(
        redis_settings):
    r = redis_client(redis_settings)
    closed = state.StudyKeys("store-model").closed(1)
    r.delete(closed)
    # Another trainer published the round and deleted it: nothing is stored, no hash made.
    assert r.eval(_STORE_MODEL_LUA, 1, closed, "late") is None
    assert not r.exists(closed)
    r.hset(closed, mapping={"count": 3, "closed_ms": 1})
    assert r.eval(_STORE_MODEL_LUA, 1, closed, "first") == b"first"
    assert r.eval(_STORE_MODEL_LUA, 1, closed, "second") == b"first"  # two trainers agree
    r.delete(closed)


# --------------------------------------------------------------------------- backend outages


@pytest.mark.slow
def test_redis_killed_mid_load_loses_no_acknowledged_fold_and_the_aggregator_resumes(
        kafka_settings, topics, fresh_redis):
    rs = fresh_redis.settings()
    study = create(kafka_settings, rs, topics, study_id="redis-crash", d=4, n=250,
                   epsilon=1.0, delta=0.01)
    r = redis_client(rs)
    offsets_key = state.offsets_key(f"agg-{topics.records}", topics.records)
    errors = sample("ipdp_backend_errors_total", backend="redis", operation="fold")
    with AggregatorThread(kafka_settings, rs, topics, max_batch=30,
                          retry_max_s=1.0) as agg, \
            Feeder(study, kafka_settings, topics, chunk=50, pause_s=0.1, seed=2000) as feeder:
        wait_for(lambda: folded(r, study.study_id) > 300, GROUP_JOIN_TIMEOUT_S, "folding")
        # What Redis acknowledged just before it dies (one MULTI: offsets and counts agree).
        with r.pipeline() as pipe:
            acked_offsets, acked_folded = pipe.hgetall(offsets_key).hget(
                state.StudyKeys(study.study_id).counts, "folded").execute()
        os.killpg(fresh_redis.pid, signal.SIGKILL)  # a crash: no shutdown, no final fsync
        fresh_redis.proc.wait()
        time.sleep(3.0)  # an outage: every fold attempt fails meanwhile
        fresh_redis.restart()  # same port, same AOF
        with r.pipeline() as pipe:
            offsets, now_folded = pipe.hgetall(offsets_key).hget(
                state.StudyKeys(study.study_id).counts, "folded").execute()
        assert int(now_folded) >= int(acked_folded)
        assert all(int(offsets[k]) >= int(v) for k, v in acked_offsets.items())
        time.sleep(1.0)
        feeder.stop.set()
        feeder.thread.join(timeout=60)
        q, p = feeder.all_rows()
        wait_for(lambda: folded(r, study.study_id) == len(q), GROUP_JOIN_TIMEOUT_S,
                 f"{len(q)} records folded")
        assert agg.thread.is_alive()
    assert sample("ipdp_backend_errors_total", backend="redis", operation="fold") > errors
    assert state.rejected_counts(r, f"agg-{topics.records}", topics.records) == {}
    assert_clean_fold(rs, study, q, p)


@pytest.mark.slow
def test_broker_frozen_mid_load_the_aggregator_waits_reports_and_folds_exactly_once(
        runtime, kafka_settings, redis_settings, topics):
    """SIGSTOP/SIGCONT: a stall with every connection open and nothing answering."""
    study = create(kafka_settings, redis_settings, topics, study_id="frozen", d=3, n=10**5,
                   epsilon=1.0, delta=0.01)
    r = redis_client(redis_settings)
    q1, p1 = contribute(study, kafka_settings, topics, 300, seed=31)
    errors = sample("ipdp_backend_errors_total", backend="kafka", operation="end_offsets")
    with AggregatorThread(kafka_settings, redis_settings, topics) as agg:
        wait_for(lambda: folded(r, study.study_id) == 300, GROUP_JOIN_TIMEOUT_S, "300 folded")
        os.kill(runtime.broker.pid, signal.SIGSTOP)
        try:
            time.sleep(10.0)
        finally:
            os.kill(runtime.broker.pid, signal.SIGCONT)
        q2, p2 = contribute(study, kafka_settings, topics, 300, seed=32)
        wait_for(lambda: folded(r, study.study_id) == 600, GROUP_JOIN_TIMEOUT_S, "600 folded")
        assert agg.thread.is_alive()
    assert sample("ipdp_backend_errors_total", backend="kafka", operation="end_offsets") > errors
    assert_clean_fold(redis_settings, study, np.concatenate([q1, q2]), np.concatenate([p1, p2]))


@pytest.mark.slow
def test_broker_restarted_under_load_the_new_log_is_paused_not_skipped_then_folded_once(
        tmp_path, monkeypatch, caplog):
    """A private runtime: its memory-storage broker loses every topic and record on restart.

    The recreated topic starts again at offset 0 with a new topic id while Redis holds the old
    log's offsets. Nothing of the new log may be skipped silently: every partition is reported
    paused (one log line each, the metrics), folds nothing, and after `ipdp aggregator resume
    --from-beginning` every record of the new log is folded exactly once.
    """
    from ipdp.cli.main import main as ipdp_main

    rt = EmbeddedRuntime(tmp_path / "rt")
    rt.start()
    try:
        kafka, rs = rt.kafka_settings(), rt.redis_settings()
        topics = TopicSettings(records=f"ipdp.records.{uuid.uuid4().hex[:8]}")
        ensure_topics(kafka, topics)
        study = create(kafka, rs, topics, study_id="restart", d=3, n=10**5, epsilon=1.0,
                       delta=0.01)
        r = redis_client(rs)
        group = f"agg-{topics.records}"
        pauses = sum(sample("ipdp_partition_pauses_total", reason=why)
                     for why in ("log_replaced", "offset_out_of_range", "log_truncated"))
        with AggregatorThread(kafka, rs, topics, group=group) as agg:
            with Feeder(study, kafka, topics, chunk=40, pause_s=0.05, seed=4100) as before:
                wait_for(lambda: folded(r, study.study_id) >= 200, GROUP_JOIN_TIMEOUT_S,
                         "folding under load")
            q1, p1 = before.all_rows()
            wait_for(lambda: folded(r, study.study_id) == len(q1), GROUP_JOIN_TIMEOUT_S,
                     f"{len(q1)} folded")
            old_ids = r.hgetall(state.log_ids_key(group, topics.records))
            assert len(old_ids) == topics.records_partitions
            rt.broker.stop()
            time.sleep(2.0)
            rt.restart_broker()
            ensure_topics(kafka, topics)
            with Feeder(study, kafka, topics, chunk=40, pause_s=0.05, seed=4200) as after:
                wait_for(lambda: sample("ipdp_partitions_paused") == topics.records_partitions,
                         GROUP_JOIN_TIMEOUT_S * 2, "every partition reported paused")
                time.sleep(1.0)
            q2, p2 = after.all_rows()
            time.sleep(3.0)  # the aggregator is up and holds the partitions: it folds nothing
            assert folded(r, study.study_id) == len(q1)
            assert agg.thread.is_alive()
            paused_lines = [rec.getMessage() for rec in caplog.records
                            if "PAUSED" in rec.getMessage()]
            assert {line.split(" partition ")[1].split()[0] for line in paused_lines} == {
                str(p) for p in range(topics.records_partitions)}
            assert all("ipdp aggregator resume" in line for line in paused_lines)

            for name, value in {**rt.env(), "IPDP_AGGREGATOR_GROUP": group,
                                "IPDP_TOPIC_RECORDS": topics.records}.items():
                monkeypatch.setenv(name, value)
            for partition in range(topics.records_partitions):
                assert ipdp_main(["aggregator", "resume", "--partition", str(partition),
                                  "--from-beginning"]) == 0
            wait_for(lambda: folded(r, study.study_id) == len(q1) + len(q2),
                     GROUP_JOIN_TIMEOUT_S, f"{len(q1) + len(q2)} folded")
            assert sample("ipdp_partitions_paused") == 0
            assert r.hgetall(state.log_ids_key(group, topics.records)).keys() == old_ids.keys()
            assert set(r.hgetall(state.log_ids_key(group, topics.records)).values()).isdisjoint(
                old_ids.values())
        assert sum(sample("ipdp_partition_pauses_total", reason=why)
                   for why in ("log_replaced", "offset_out_of_range", "log_truncated")) \
            >= pauses + topics.records_partitions
        assert state.rejected_counts(r, f"agg-{topics.records}", topics.records) == {}
        assert_clean_fold(rs, study, np.concatenate([q1, q2]), np.concatenate([p1, p2]))
    finally:
        rt.stop()


def produce_rows(study, kafka, topics, k: int, seed: int):
    """Send k honest records; returns their (q̃, p̃) and where each landed (partition, offset).

    Positions come from the produce acknowledgements: tansu's ListOffsets answers the last
    batch's base offset + 1, not the log end, so end_offsets cannot be trusted here.
    """
    from ipdp.kafka_io import kafka_producer

    values, q, p = honest(study, k, seed)
    producer = kafka_producer(kafka)
    try:
        futures = [producer.send(topics.records, key=v[RECORD_ID_BYTES], value=v) for v in values]
        producer.flush()
        where = [(m.partition, m.offset) for m in (f.get(timeout=30) for f in futures)]
    finally:
        producer.close()
    return q, p, where


class ExportedRuntime:
    """An `ipdp up` child process seen through the export lines it wrote to its env file."""

    def __init__(self, env_file) -> None:
        self.exported = dict(line.removeprefix("export ").split("=", 1)
                             for line in env_file.read_text().splitlines())

    def env(self) -> dict[str, str]:
        return self.exported

    def kafka_settings(self) -> KafkaSettings:
        return KafkaSettings(bootstrap=self.exported["IPDP_KAFKA_BOOTSTRAP"],
                             security_protocol="PLAINTEXT", sasl_mechanism=None,
                             sasl_username=None, sasl_password=None, ssl_cafile=None,
                             ssl_certfile=None, ssl_keyfile=None,
                             end_offsets_exact=self.exported["IPDP_KAFKA_END_OFFSETS_EXACT"]
                             == "true")

    def redis_settings(self) -> RedisSettings:
        return RedisSettings(url=self.exported["IPDP_REDIS_URL"], username=None, password=None)


@pytest.mark.slow
def test_ipdp_up_restarts_a_sigkilled_redis_under_load_and_folds_every_acknowledged_record_once(
        tmp_path):
    env_file, out, err = tmp_path / "ipdp.env", tmp_path / "up.out", tmp_path / "up.err"
    with open(out, "wb") as o, open(err, "wb") as e:
        up = subprocess.Popen([sys.executable, "-m", "ipdp.cli", "up", "--dir", str(tmp_path / "rt"),
                               "--env-file", str(env_file)], cwd=REPO, stdin=subprocess.DEVNULL,
                              stdout=o, stderr=e, start_new_session=True)
    aggregator = None
    try:
        wait_for(env_file.exists, 60, "ipdp up's env file")
        rt = ExportedRuntime(env_file)
        ks, rs, topics = rt.kafka_settings(), rt.redis_settings(), TopicSettings()
        broker_pid, redis_pid = (int(re.search(rf"^# {what} .* pid (\d+)$", out.read_text(),
                                               re.MULTILINE)[1]) for what in ("kafka", "redis"))
        study = create(ks, rs, topics, study_id="up-redis-crash", d=4, n=200, epsilon=1.0,
                       delta=0.01, delta_in=0.5)
        r = redis_client(rs)
        env = service_env(rt, topics, IPDP_AGGREGATOR_GROUP="agg-up",
                          IPDP_AGGREGATOR_MAX_BATCH="30", IPDP_TRAINER_BLOCK_MS="200")
        aggregator = start(["aggregator", "run"], env, tmp_path, "aggregator")
        with Feeder(study, ks, topics, chunk=50, pause_s=0.1, seed=4000) as feeder:
            wait_for(lambda: folded(r, study.study_id) > 300, GROUP_JOIN_TIMEOUT_S, "folding")
            os.kill(redis_pid, signal.SIGKILL)  # a crash under load: no shutdown, no final fsync
            wait_for(lambda: "restarted it" in err.read_text(), 30, "ipdp up to restart redis")
            time.sleep(1.0)  # records keep arriving while the aggregator reconnects
        q, p = feeder.all_rows()
        top_up = -len(q) % study.n  # complete the last round
        if top_up:
            tq, tp = contribute(study, ks, topics, top_up, seed=5000)
            q, p = np.concatenate([q, tq]), np.concatenate([p, tp])
        wait_for(lambda: folded(r, study.study_id) == len(q), GROUP_JOIN_TIMEOUT_S,
                 f"{len(q)} acknowledged records folded")
        aggregator.check_alive()
        assert up.poll() is None, err.read_text()  # the broker and its log were never stopped
        assert f"pid {broker_pid}" in out.read_text() and _pid_alive(broker_pid)
        # No record refused, none seen twice.
        assert state.rejected_counts(r, "agg-up", topics.records) == {}
        assert_clean_fold(rs, study, q, p)  # every acknowledged record folded exactly once
        rounds = len(q) // study.n
        assert sorted(closed_rounds(r, study)) == list(range(1, rounds + 1))
        trainer = start(["trainer", "run", "--idle-exit", "3"], env, tmp_path, "trainer")
        assert trainer.proc.wait(timeout=120) == 0, trainer.log_tail()
        models = list(ModelSubscriber(ks, topics, study_id=study.study_id))
        assert sorted((m.round, m.n) for m in models) == [(i, study.n)
                                                          for i in range(1, rounds + 1)]
    finally:
        if aggregator is not None:
            stop(aggregator)
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0, err.read_text()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
