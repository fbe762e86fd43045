"""Helpers for the pipeline integration tests: services in threads, and seeded contributions."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from aggregator.service import Aggregator
from aggregator.settings import AggregatorSettings
from ipdp import state
from ipdp.kafka_io import kafka_producer
from ipdp.losses import prepare
from ipdp.redis_io import redis_client
from ipdp.settings import KafkaSettings, RedisSettings, TopicSettings
from ipdp.study import Study
from producer.contributor import Contributor
from trainer.service import Trainer
from trainer.settings import TrainerSettings

GROUP_JOIN_TIMEOUT_S = 60.0


def wait_for(cond: Callable[[], bool], timeout: float, what: str, every: float = 0.1) -> None:
    """Poll `cond` until true; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def create(kafka: KafkaSettings, redis_settings: RedisSettings, topics: TopicSettings,
           **params) -> Study:
    """Register a study in Redis and on the studies topic."""
    study = Study(**params)
    producer = kafka_producer(kafka)
    try:
        state.create_study(redis_client(redis_settings), producer, topics, study)
    finally:
        producer.close()
    return study


def contribute(study: Study, kafka: KafkaSettings, topics: TopicSettings, k: int,
               seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Send k seeded synthetic records; returns the exact (q̃, p̃) that went on the wire."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(k, study.d))
    x /= np.maximum(1.0, np.linalg.norm(x, axis=1, keepdims=True))
    w = np.linspace(-0.5, 0.5, study.d)
    y = np.clip(x @ w + 0.05 * rng.normal(size=k), -1, 1)
    if study.loss == "logistic":
        y = np.where(y >= 0, 1.0, -1.0)
    producer = kafka_producer(kafka)
    # k simulated devices: one Contributor whose limit is all of them (a simulator, not a device).
    c = Contributor(study, producer, topics.records, noise=np.random.default_rng(seed + 1),
                    records_per_device=k)
    for start in range(0, k, 5000):
        c.submit_many(x[start:start + 5000], y[start:start + 5000])
    c.flush()
    producer.close()
    # The contributor's noise is the only randomness: replaying its seed gives the exact rows.
    return prepare(study.loss, x, y, study.calibration, np.random.default_rng(seed + 1))


def read_records(kafka: KafkaSettings, topic: str, expected: int, timeout_s: float = 20.0):
    """Every record of `topic` from the beginning, until `expected` arrived or the time is up.

    Reads by count, not by end offsets: tansu's end offsets can stop short of the last record.
    """
    from kafka import TopicPartition

    from ipdp.kafka_io import kafka_consumer

    consumer = kafka_consumer(kafka, group_id=None)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        out = []
        deadline = time.monotonic() + timeout_s
        while len(out) < expected and time.monotonic() < deadline:
            for msgs in consumer.poll(timeout_ms=200).values():
                out.extend(msgs)
        return out
    finally:
        consumer.close()


@contextmanager
def services(kafka: KafkaSettings, redis_settings: RedisSettings, topics: TopicSettings, *,
             aggregators: int = 1, trainer: bool = True,
             agg_settings: AggregatorSettings | None = None) -> Iterator[list[Aggregator]]:
    """Run aggregator(s) and a trainer in threads until the block ends."""
    agg_settings = agg_settings or AggregatorSettings(group=f"agg-{topics.records}")
    aggs = [Aggregator(kafka, redis_settings, topics, agg_settings) for _ in range(aggregators)]
    workers = [threading.Thread(target=a.run, daemon=True) for a in aggs]
    tr = None
    if trainer:
        tr = Trainer(kafka, redis_settings, topics, TrainerSettings(block_ms=200))
        workers.append(threading.Thread(target=tr.run, daemon=True))
    for w in workers:
        w.start()
    try:
        yield aggs
    finally:
        for a in aggs:
            a.stop_event.set()
        if tr is not None:
            tr.stop_event.set()
        for w in workers:
            w.join(timeout=30)


def total_stats(redis_settings: RedisSettings, study: Study) -> tuple[np.ndarray, np.ndarray, int]:
    """Σ over the open and all unpublished closed rounds of (A, b, count)."""
    r = redis_client(redis_settings)
    a, b, count = np.zeros((study.d, study.d)), np.zeros(study.d), 0
    keys = [state.StudyKeys(study.study_id).open] + [
        k.decode() for k in r.scan_iter(match=state.StudyKeys(study.study_id).closed(0)[:-1] + "*")]
    for key in keys:
        raw = r.hmget(key, ["A", "b", "count"])
        if raw[0] is None:
            continue
        ka, kb = state.unpack_stats(raw[0], raw[1], study.d)
        a, b, count = a + ka, b + kb, count + int(raw[2])
    return a, b, count
