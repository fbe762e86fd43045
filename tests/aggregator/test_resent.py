"""Re-sent records on the real broker and Redis: each is dead-lettered with its reason, in
dead-letter containers, and counted exactly once, even when the aggregator dies after the dead
letters are delivered and before the commit that counts them."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import uuid

import numpy as np
import pytest
from kafka import TopicPartition

from aggregator.service import Aggregator
from aggregator.settings import AggregatorSettings
from ipdp import state
from ipdp.dead_letters import read_dead_letters
from ipdp.kafka_io import kafka_consumer, kafka_producer
from ipdp.redis_io import redis_client
from ipdp.wire import RejectReason, encode_container, study_headers
from tests.aggregator.test_hostile_input import _dead_lettered, honest
from tests.pipeline import create, total_stats

PER_CONTAINER = 100
CONTAINERS = 3


class Crash(Exception):
    """Stands for the process dying at that point: nothing after it runs."""


def _send(kafka_settings, topics, study, containers: list[list[bytes]], plain: list[bytes]
          ) -> dict[tuple[int, int, int | None], bytes]:
    """Produce gateway-like containers and plain records; source → the record's bytes."""
    producer = kafka_producer(kafka_settings)
    sent = {}
    try:
        for c, records in enumerate(containers):
            m = producer.send(topics.records, value=encode_container(records),
                              headers=study_headers(study.study_id),
                              partition=c % 2).get(timeout=30)
            sent.update(((m.partition, m.offset, i), r) for i, r in enumerate(records))
        for value in plain:
            m = producer.send(topics.records, value=value, headers=study_headers(study.study_id),
                              partition=1).get(timeout=30)
            sent[(m.partition, m.offset, None)] = value
    finally:
        producer.close()
    return sent


def _aggregator(kafka_settings, redis_settings, topics) -> Aggregator:
    return Aggregator(kafka_settings, redis_settings, topics,
                      AggregatorSettings(group=f"agg-{topics.records}"))


def _all_dead_letters(kafka_settings, topic: str) -> tuple[list, int]:
    """Every refused record on the dead-letter topic, and how many Kafka messages held them."""
    consumer = kafka_consumer(kafka_settings, group_id=None)
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        letters, messages = [], 0
        while got := consumer.poll(timeout_ms=2000):
            for msgs in got.values():
                messages += len(msgs)
                letters += [x for m in msgs for x in read_dead_letters(m.value, m.headers)]
        return letters, messages
    finally:
        consumer.close()


@pytest.mark.slow
def test_a_resent_batch_is_dead_lettered_per_record_and_counted_once_across_a_crash(
        kafka_settings, redis_settings, env_topics):
    topics = env_topics
    study = create(kafka_settings, redis_settings, topics, study_id=f"resent-{uuid.uuid4().hex[:6]}",
                   d=4, n=10**5, epsilon=1.0, delta=0.01)
    values, _, _ = honest(study, PER_CONTAINER * CONTAINERS + 20, seed=61)
    containers = [values[i * PER_CONTAINER:(i + 1) * PER_CONTAINER] for i in range(CONTAINERS)]
    plain = values[PER_CONTAINER * CONTAINERS:]
    _send(kafka_settings, topics, study, containers, plain)
    _aggregator(kafka_settings, redis_settings, topics).run(idle_exit_s=3)
    r = redis_client(redis_settings)
    folded = total_stats(redis_settings, study)
    assert folded[2] == len(values)

    # The same records again, as the same containers and plain messages.
    resent = _send(kafka_settings, topics, study, containers, plain)
    before = _dead_lettered(RejectReason.REPLAYED.value)
    dying = _aggregator(kafka_settings, redis_settings, topics)
    deliver = dying._dead_letter

    def deliver_then_die(refused):
        deliver(refused)
        raise Crash

    dying._dead_letter = deliver_then_die
    with pytest.raises(Crash):
        dying.run(idle_exit_s=3)
    dying.close()
    assert state.rejected_counts(r, f"agg-{topics.records}", topics.records) == {}

    totals = _aggregator(kafka_settings, redis_settings, topics).run(idle_exit_s=3)
    assert totals["rejected"] == len(resent)

    # Counted once: in Redis, and in the metrics of the aggregator that committed.
    assert state.rejected_counts(r, f"agg-{topics.records}", topics.records) == {
        "replayed": len(resent)}
    assert _dead_lettered(RejectReason.REPLAYED.value) - before == len(resent)
    # The statistics are those of the first fold.
    a, b, count = total_stats(redis_settings, study)
    assert count == len(values)
    np.testing.assert_array_equal(a, folded[0])
    np.testing.assert_array_equal(b, folded[1])

    # Dead-lettered per record, with its reason and its own bytes: once by the aggregator that
    # died after delivering them, once by the one that committed (at least once, by design).
    letters, messages = _all_dead_letters(kafka_settings, topics.dead_letter)
    by_source: dict[tuple[int, int, int | None], list] = {}
    for x in letters:
        assert x.topic == topics.records
        by_source.setdefault((x.partition, x.offset, x.index), []).append(x)
    assert by_source.keys() == resent.keys()
    for source, copies in by_source.items():
        assert len(copies) == 2
        assert all(x.reason == "replayed" and "replay window" in x.detail for x in copies)
        assert all(x.value == resent[source] for x in copies)
    # In containers: a few Kafka messages, not one per refused record.
    assert messages * 10 < len(letters)

    # What an operator reads with `ipdp dead-letters`: the same refused records.
    done = subprocess.run([sys.executable, "-m", "ipdp.cli", "dead-letters", "--reason",
                           "replayed", "--json"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out, err = done.stdout, done.stderr
    shown = [json.loads(line) for line in out.splitlines()]
    assert sorted((x["partition"], x["offset"], x["index"]) for x in shown) == sorted(
        (x.partition, x.offset, x.index) for x in letters)
    assert all(base64.b64decode(x["value"]) == resent[(x["partition"], x["offset"], x["index"])]
               for x in shown)
    assert f"{len(letters)} refused record(s) in {messages} message(s): replayed " \
        f"{len(letters)}" in err
