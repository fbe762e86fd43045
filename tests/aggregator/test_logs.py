"""Offsets belong to one log: a log that ends below them pauses its partition, and a resume
never moves an offset back within the same log (that would fold records twice)."""

from __future__ import annotations

import pytest

from aggregator.logs import LogGuard, resume_partition, topic_id
from ipdp import state
from ipdp.errors import ConfigurationError
from ipdp.redis_io import redis_client
from tests.pipeline import create
from tests.system.test_failures import produce_rows

GROUP = "g-logs"


def test_a_log_ending_below_the_offset_pauses_and_a_resume_back_into_folded_records_is_refused(
        kafka_settings, redis_settings, topics):
    study = create(kafka_settings, redis_settings, topics, study_id="logs", d=3, n=10**5,
                   epsilon=1.0, delta=0.01)
    _, _, where = produce_rows(study, kafka_settings, topics, 60, seed=3)
    ends = {}
    for partition, offset in where:
        ends[partition] = max(ends.get(partition, 0), offset + 1)
    r = redis_client(redis_settings)
    offsets_key = state.offsets_key(GROUP, topics.records)
    r.hset(offsets_key, mapping={str(p): e for p, e in ends.items()})
    guard = LogGuard(r, kafka_settings, group=GROUP, topic=topics.records)
    partitions = list(range(topics.records_partitions))

    # Multi-record batches: tansu's ListOffsets answers below the true end; that pauses nothing.
    assert guard.check(partitions) == []
    current = topic_id(kafka_settings, topics.records)
    assert current is not None
    assert r.hgetall(state.log_ids_key(GROUP, topics.records)) == {
        str(p).encode(): current.encode() for p in partitions}

    p0 = min(ends)
    with pytest.raises(ConfigurationError, match="fold them twice"):
        resume_partition(r, kafka_settings, group=GROUP, topic=topics.records, partition=p0,
                         from_offset=0)
    assert int(r.hget(offsets_key, str(p0))) == ends[p0]

    r.hset(offsets_key, str(p0), ends[p0] + 1000)  # the log lost its tail
    (pause,) = guard.check(partitions)
    assert (pause.partition, pause.reason) == (p0, "log_truncated")
    assert resume_partition(r, kafka_settings, group=GROUP, topic=topics.records, partition=p0,
                            from_offset=ends[p0]) == (ends[p0], current)
    assert guard.check(partitions) == []
