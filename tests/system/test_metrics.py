"""Prometheus metrics of the real processes: counters move by exactly what went through them.

The aggregator and trainer run as `python -m ipdp.cli ROLE run` children with IPDP_METRICS_PORT
on free ports (as in compose/); the test scrapes their /metrics over HTTP.
"""

from __future__ import annotations

import os
import signal

import numpy as np

from ipdp.kafka_io import kafka_producer
from ipdp.losses import prepare
from ipdp.wire import DEAD_LETTER_REASONS, encode_record, study_hash
from producer.contributor import now_ms
from tests import proc_services as ps
from tests.pipeline import GROUP_JOIN_TIMEOUT_S, contribute, create, wait_for

N = 200
GOOD = 250  # one closed round of N, 50 records in the open round


def _bad_records(study) -> tuple[list[tuple[bytes, bytes]], bytes, dict[str, int]]:
    """(key, value) pairs of bad records, one good record sent twice, and the reasons expected."""
    d = study.d
    zeros = np.zeros(d)

    def rec(sh: bytes, q, p) -> tuple[bytes, bytes]:
        rid = os.urandom(16)
        return rid, encode_record(sh, rid, now_ms(), q, p)

    bad = [(os.urandom(16), b"\x01not a record"), (os.urandom(16), b"")]
    bad += [rec(study_hash("no-such-study"), zeros, zeros) for _ in range(3)]
    bad.append(rec(study.hash, np.zeros(d + 1), np.zeros(d + 1)))
    bad.append(rec(study.hash, np.full(d, np.nan), zeros))
    bad.append(rec(study.hash, np.full(d, 1e9), zeros))
    # A good record is perturbed as a device does: the norm check refuses one with no noise.
    q, p = prepare("squared", np.zeros((1, d)), np.zeros(1), study.calibration,
                   np.random.default_rng(3))
    twice_key, twice_value = rec(study.hash, q[0], p[0])
    bad.append((twice_key, twice_value))  # the replay (its first copy is a good record)
    expected = {"undecodable": 2, "unknown_study": 3, "wrong_dimension": 1, "non_finite": 1,
                "norm_out_of_bounds": 1, "replayed": 1}
    return bad, twice_value, expected


def test_counters_histograms_and_gauges_move_by_exactly_what_went_through(
        runtime, kafka_settings, redis_settings, topics, tmp_path):
    study = create(kafka_settings, redis_settings, topics, study_id="metrics", d=4, n=N,
                   epsilon=1.0, delta=0.01)
    bad, twice_value, expected = _bad_records(study)
    contribute(study, kafka_settings, topics, GOOD - 1, seed=11)
    producer = kafka_producer(kafka_settings)
    twice_key = bad[-1][0]
    producer.send(topics.records, key=twice_key, value=twice_value)  # good, then replayed
    for key, value in bad:
        producer.send(topics.records, key=key, value=value)
    producer.flush()
    producer.close()
    sent = GOOD + len(bad)
    dead = sum(expected.values())
    assert len(bad) == dead

    with ps.pipeline(runtime, topics, tmp_path, group=f"agg-{topics.records}") as children:
        agg, trainer = children["aggregator"], children["trainer"]

        def settled() -> bool:
            agg.check_alive()
            trainer.check_alive()
            a, t = agg.scrape(), trainer.scrape()
            lags = [ps.value(a, "ipdp_consumer_lag_records", partition=str(p))
                    for p in range(topics.records_partitions)]
            have_lag = all(("ipdp_consumer_lag_records", (("partition", str(p)),)) in a
                           for p in range(topics.records_partitions))
            return (ps.value(a, "ipdp_records_folded_total", study="metrics") == GOOD
                    and ps.total(a, "ipdp_records_dead_lettered_total") == dead
                    and ps.value(t, "ipdp_models_published_total", study="metrics") == 1
                    and have_lag and lags == [0.0] * topics.records_partitions)

        wait_for(settled, GROUP_JOIN_TIMEOUT_S + 30, "aggregator and trainer metrics to settle")
        a, t = agg.scrape(), trainer.scrape()

    # Aggregator: every record consumed once, each good one folded once, each bad one
    # dead-lettered once under its reason.
    assert ps.total(a, "ipdp_records_consumed_total") == sent
    assert ps.value(a, "ipdp_records_folded_total", study="metrics") == GOOD
    reasons = {dict(labels)["reason"]: v for (name, labels), v in a.items()
               if name == "ipdp_records_dead_lettered_total"}
    # Every reason's series exists from the start, at 0 until a record is dead-lettered for it.
    assert set(reasons) == {reason.value for reason in DEAD_LETTER_REASONS}
    assert {reason: v for reason, v in reasons.items() if v} == expected
    assert ps.value(a, "ipdp_rounds_closed_total", study="metrics") == 1
    assert ps.value(a, "ipdp_round_records", study="metrics") == GOOD - N
    assert ps.value(a, "ipdp_round_target_records", study="metrics") == N
    assert ps.value(a, "ipdp_round_progress_ratio", study="metrics") == (GOOD - N) / N
    # One histogram observation per atomic fold; the batches add up to every record consumed.
    folds = ps.value(a, "ipdp_fold_seconds_count")
    assert folds >= 1
    assert ps.value(a, "ipdp_fold_batch_records_count") == folds
    assert ps.value(a, "ipdp_fold_batch_records_sum") == sent
    assert ps.value(a, "ipdp_fold_seconds_bucket", le="+Inf") == folds
    assert ps.value(a, "ipdp_fold_seconds_sum") > 0
    assert ps.total(a, "ipdp_backend_errors_total") == 0
    assert ps.total(a, "ipdp_models_published_total") == 0  # the trainer's, not exported here

    # Trainer: one closed round, one model, one solve.
    assert ps.value(t, "ipdp_models_published_total", study="metrics") == 1
    assert ps.value(t, "ipdp_solve_seconds_count") == 1
    assert ps.value(t, "ipdp_round_to_model_seconds_count") == 1
    assert ps.total(t, "ipdp_rounds_refused_total") == 0
    assert ps.total(t, "ipdp_records_folded_total") == 0


def test_the_load_generator_serves_its_metrics_while_it_runs(
        runtime, kafka_settings, redis_settings, topics, tmp_path):
    create(kafka_settings, redis_settings, topics, study_id="loadgen-metrics", d=4, n=N,
           epsilon=1.0, delta=0.01)
    env = ps.service_env(runtime, topics)
    # Slow enough to be running when scraped; stopped with SIGINT (it flushes and exits).
    child = ps.start(["loadgen", "--study", "loadgen-metrics", "--devices", "1000000",
                      "--rate", "200", "--batch", "100", "--no-progress"],
                     env, tmp_path, "loadgen")
    try:
        ps.wait_metrics_up(child)

        def sent() -> float:
            child.check_alive()
            return ps.value(child.scrape(), "ipdp_loadgen_records_sent_total",
                            study="loadgen-metrics")

        wait_for(lambda: sent() > 0, 60, "the load generator to count records sent")
        samples = child.scrape()
        assert ps.value(samples, "ipdp_loadgen_send_errors_total", study="loadgen-metrics") == 0
        assert ps.total(samples, "ipdp_records_folded_total") == 0
    finally:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGINT)
        ps.stop(child)
