"""Which log an offset belongs to: no silent skip when Kafka loses or replaces a partition's log.

Redis's offsets are positions in one particular log. A topic that is deleted and recreated, or a
memory-only broker that restarts, starts again at offset 0 under the same name, and a stored
offset of 40 would then mean "skip the first 40 new records". So every partition's offset is kept
with the identity of its log — Kafka's topic id (KIP-516, Kafka ≥ 2.8; tansu has one too) — and
an assigned partition whose log has another identity, or whose log ends below the stored offset,
is paused: nothing of it is folded until an operator says where to resume
(`ipdp aggregator resume`, :func:`resume_partition`). One log line and a metric say so.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis
from kafka import TopicPartition
from kafka.errors import KafkaError, OffsetOutOfRangeError

from ipdp import metrics, state
from ipdp.errors import BackendUnavailable, ConfigurationError
from ipdp.kafka_io import kafka_admin, kafka_consumer
from ipdp.settings import KafkaSettings

log = logging.getLogger(__name__)

#: The all-zero UUID is Kafka's "no topic id" (a broker older than 2.8).
NO_TOPIC_ID = "00000000-0000-0000-0000-000000000000"
#: Why a partition is paused (the ``reason`` of a Pause and of ipdp_partition_pauses_total).
PAUSE_REASONS = ("log_replaced", "log_truncated", "offset_out_of_range")
PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Pause:
    """Why one partition is not folded."""

    partition: int
    reason: str
    """`log_replaced` | `log_truncated` | `offset_out_of_range`."""
    detail: str
    since: tuple[str | None, int | None] = (None, None)
    """Redis's (log id, offset) of the partition when it was paused; a resume changes them."""


def topic_id(kafka: KafkaSettings, topic: str) -> str | None:
    """The broker's current id of `topic` (a fresh Metadata request), or None without one."""
    admin = kafka_admin(kafka)
    try:
        described = admin.describe_topics([topic])
    finally:
        admin.close()
    for t in described:
        found = t.get("topic_id")
        if t["name"] == topic and found is not None and str(found) != NO_TOPIC_ID:
            return str(found)
    return None


def log_behind(kafka: KafkaSettings, topic: str, offsets: dict[int, int]) -> dict[int, int]:
    """partition → end offset, for the partitions whose log ends below the offset given.

    With ``kafka.end_offsets_exact`` false (the embedded tansu broker, whose ListOffsets answers
    the last batch's base offset + 1, below the true end after a multi-record batch) a log end
    below the offset is confirmed by fetching the record just before it, so that the broker's
    answer alone pauses nothing.
    """
    wanted = {p: o for p, o in offsets.items() if o > 0}
    if not wanted:
        return {}
    consumer = kafka_consumer(kafka, group_id=None, auto_offset_reset="none")
    try:
        tps = {p: TopicPartition(topic, p) for p in wanted}
        ends = consumer.end_offsets(list(tps.values()))
        behind = {p: ends[tp] for p, tp in tps.items() if ends[tp] < wanted[p]}
        if not kafka.end_offsets_exact:
            for p in list(behind):
                if _record_exists(consumer, tps[p], wanted[p] - 1):
                    del behind[p]
        return behind
    finally:
        consumer.close()


def _record_exists(consumer, tp: TopicPartition, offset: int) -> bool:
    consumer.assign([tp])
    consumer.seek(tp, offset)
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            got = consumer.poll(timeout_ms=200).get(tp, [])
        except OffsetOutOfRangeError:
            return False
        if any(m.offset >= offset for m in got):
            return True
    return False


class LogGuard:
    """Checks assigned partitions against the log identities stored in Redis; pauses mismatches.

    ``paused`` maps partition → :class:`Pause` for the partitions this process holds paused.
    """

    def __init__(self, r: redis.Redis, kafka: KafkaSettings, *, group: str, topic: str) -> None:
        self.r, self.kafka, self.topic = r, kafka, topic
        self.ids_key = state.log_ids_key(group, topic)
        self.offsets_key = state.offsets_key(group, topic)
        self.paused: dict[int, Pause] = {}
        self.verified_id: str | None = None
        """The topic id the last check saw; a fold from another log is refused."""

    def snapshot(self) -> tuple[dict[int, str], dict[int, int]]:
        """Redis's (partition → log id, partition → offset)."""
        with self.r.pipeline(transaction=False) as pipe:
            ids_raw, offsets_raw = pipe.hgetall(self.ids_key).hgetall(self.offsets_key).execute()
        return ({int(k): v.decode() for k, v in ids_raw.items()},
                {int(k): int(v) for k, v in offsets_raw.items() if b":" not in k})

    def check(self, partitions: list[int]) -> list[Pause]:
        """Pauses for `partitions`; records the current log id of those that pass and had none."""
        if not partitions:
            return []
        current = topic_id(self.kafka, self.topic)
        stored, committed = self.snapshot()
        pauses: dict[int, Pause] = {}
        for p in partitions:
            if current is not None and p in stored and stored[p] != current:
                pauses[p] = Pause(p, "log_replaced",
                                  f"its log is now topic id {current}, but Redis's offset "
                                  f"{committed.get(p)} belongs to topic id {stored[p]}",
                                  (stored.get(p), committed.get(p)))
        for p, end in log_behind(self.kafka, self.topic, {
                p: committed[p] for p in partitions if p in committed and p not in pauses}).items():
            pauses[p] = Pause(p, "log_truncated",
                              f"its log ends at offset {end}, below Redis's offset {committed[p]}",
                              (stored.get(p), committed.get(p)))
        adopt = [p for p in partitions if current is not None and p not in pauses
                 and p not in stored]
        if adopt:
            if any(p in committed for p in adopt):
                log.warning("topic %s: offsets of partitions %s predate log identities; "
                            "recording topic id %s for them", self.topic, adopt, current)
            for p in adopt:
                self.r.hsetnx(self.ids_key, str(p), current)
        self.verified_id = current
        return [pauses[p] for p in sorted(pauses)]

    def out_of_range(self, partitions: dict[int, int]) -> list[Pause]:
        """Pauses for partitions whose fetch offset the broker no longer has."""
        stored, committed = self.snapshot()
        return [Pause(p, "offset_out_of_range",
                      f"Kafka has no offset {offset} in its log (truncated, expired or replaced)",
                      (stored.get(p), committed.get(p)))
                for p, offset in sorted(partitions.items())]

    def replaced(self, partitions: list[int], seen: str) -> list[Pause]:
        """Pauses for partitions whose topic id changed under us to `seen`."""
        stored, committed = self.snapshot()
        return [Pause(p, "log_replaced", f"its log became topic id {seen} while assigned "
                      f"(checked: {self.verified_id})", (stored.get(p), committed.get(p)))
                for p in partitions]

    def resumable(self) -> list[int]:
        """Paused partitions an operator has resumed since (Redis's id or offset changed) and
        whose log now matches; the caller seeks them to Redis's offset and resumes them."""
        if not self.paused:
            return []
        stored, committed = self.snapshot()
        touched = [p for p, x in self.paused.items()
                   if (stored.get(p), committed.get(p)) != x.since]
        still = {x.partition: x for x in self.check(touched)}
        for p, x in still.items():  # resumed to a place that does not match either: report it
            self.paused.pop(p)
            self.pause(x)
        ready = [p for p in touched if p not in still]
        self.release(ready)
        return ready

    def pause(self, pause: Pause) -> None:
        """Hold `pause.partition` (the caller pauses the consumer): one log line, the metrics."""
        if pause.partition in self.paused:
            return
        self.paused[pause.partition] = pause
        metrics.PARTITION_PAUSES.labels(pause.reason).inc()
        metrics.PARTITIONS_PAUSED.set(len(self.paused))
        log.error("topic %s partition %d PAUSED, nothing of it is folded: %s. Resume explicitly "
                  "with `ipdp aggregator resume --partition %d --from-offset O` (or "
                  "--from-beginning) once you know where its unfolded records start",
                  self.topic, pause.partition, pause.detail, pause.partition)

    def release(self, partitions: list[int]) -> None:
        """Forget pauses of partitions this process no longer holds (revoked or resumed)."""
        for p in partitions:
            self.paused.pop(p, None)
        metrics.PARTITIONS_PAUSED.set(len(self.paused))


def resume_partition(r: redis.Redis, kafka: KafkaSettings, *, group: str, topic: str,
                     partition: int, from_offset: int | None) -> tuple[int, str | None]:
    """Point `partition`'s stored offset at the current log: (offset, topic id) it now holds.

    ``from_offset=None`` means the beginning of the current log. Going below the stored offset
    of the same, untruncated log is refused: those records are folded already. Another log, or
    a lower offset, starts a new epoch of the partition, so that no study's offsets of the old
    log (aggregator/fold.py) skip a record of the new one.
    """
    tp = TopicPartition(topic, partition)
    current = topic_id(kafka, topic)
    consumer = kafka_consumer(kafka, group_id=None)
    try:
        if partition not in (consumer.partitions_for_topic(topic) or set()):
            raise ConfigurationError(f"topic {topic} has no partition {partition}")
        offset = (consumer.beginning_offsets([tp])[tp] if from_offset is None else from_offset)
    except KafkaError as exc:
        raise BackendUnavailable(f"Kafka: {exc}") from exc
    finally:
        consumer.close()
    if offset < 0:
        raise ConfigurationError(f"--from-offset must be ≥ 0, got {offset}")
    ids_key, offsets_key = state.log_ids_key(group, topic), state.offsets_key(group, topic)
    with r.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(ids_key, offsets_key)
                stored_id = pipe.hget(ids_key, str(partition))
                stored_offset = pipe.hget(offsets_key, str(partition))
                same_log = stored_id is None or current is None or stored_id.decode() == current
                if (same_log and stored_offset is not None and offset < int(stored_offset)
                        and not log_behind(kafka, topic, {partition: int(stored_offset)})):
                    raise ConfigurationError(
                        f"partition {partition} of {topic}: records below offset "
                        f"{int(stored_offset)} of this log are folded already; resuming at "
                        f"{offset} would fold them twice")
                moved_back = stored_offset is not None and offset < int(stored_offset)
                pipe.multi()
                pipe.hset(offsets_key, str(partition), offset)
                if not same_log or moved_back:
                    # Offsets of the old log: every study's offsets of this partition retire.
                    pipe.hincrby(offsets_key, f"{partition}:epoch", 1)
                if current is not None:
                    pipe.hset(ids_key, str(partition), current)
                pipe.execute()
                return offset, current
            except redis.WatchError:
                continue


def cmd_resume(args) -> int:
    """Entry point of `ipdp aggregator resume --partition P (--from-offset O | --from-beginning)`.

    A running aggregator holding the partition notices within seconds and resumes it there.
    """
    from aggregator.settings import AggregatorSettings
    from ipdp.redis_io import check_redis, redis_client
    from ipdp.settings import RedisSettings, TopicSettings

    kafka, topics, group = KafkaSettings(), TopicSettings(), AggregatorSettings().group
    r = redis_client(RedisSettings())
    check_redis(r)
    offset, tid = resume_partition(r, kafka, group=group, topic=topics.records,
                                   partition=args.partition,
                                   from_offset=None if args.from_beginning else args.from_offset)
    print(f"group {group}, topic {topics.records} partition {args.partition}: folding resumes "
          f"at offset {offset} of log {tid or '(no topic id)'}")
    return 0
