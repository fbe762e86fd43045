"""`ipdp aggregator run`: poll a batch → decode → validate → fold → commit stats + offsets.

One process is one member of the consumer group; partitions are its shards. Offsets live in
Redis next to the statistics (aggregator/fold.py), so on every assignment the consumer seeks to
Redis's offsets, not Kafka's. Kafka commits are made too, but only so lag tools see progress.

The next poll overlaps the current fold (one fold thread; the consumer stays on the loop's
thread). That is safe because the fold, not the consumer, decides what counts: it drops what
Redis's offsets already cover and refuses a batch that starts past them. A batch polled while
the fold before it asked for a re-seek is not folded: its partitions are rewound instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import redis
from kafka import ConsumerRebalanceListener, TopicPartition
from kafka.errors import KafkaError, OffsetOutOfRangeError

from aggregator import fetch
from aggregator.batch import Polled, Refused
from aggregator.fold import Folder, FoldResult
from aggregator.logs import PAUSE_REASONS, LogGuard, Pause
from aggregator.settings import AggregatorSettings
from aggregator.two_server import HelperLink, HelperUnavailable
from ipdp import metrics, state
from ipdp.dead_letters import dead_letter_headers, encode_dead_letters
from ipdp.kafka_io import kafka_consumer, kafka_producer
from ipdp.process import Backoff, install_signal_handlers, pause_after_failure
from ipdp.redis_io import check_redis, redis_client
from ipdp.settings import (
    KafkaSettings,
    LeaderTokenSettings,
    MetricsSettings,
    RedisSettings,
    TopicSettings,
    TrustSettings,
)
from ipdp.wire import DEAD_LETTER_REASONS, RejectReason

log = logging.getLogger(__name__)

LAG_REFRESH_S = 5.0
LAG_TIMEOUT_MS = 2_000
DEAD_LETTER_TIMEOUT_S = 30.0
REDIS_TRANSIENT = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


def _secret(value) -> str | None:
    return value.get_secret_value() if value is not None else None


class _SeekToRedisOffsets(ConsumerRebalanceListener):
    """On every assignment, continue from the offsets stored with the statistics."""

    def __init__(self, service: Aggregator) -> None:
        self.service = service

    def on_partitions_revoked(self, revoked) -> None:
        log.info("partitions revoked: %s", sorted(tp.partition for tp in revoked))
        for tp in revoked:  # its new owner reports the lag now; a stale value would double it
            metrics.CONSUMER_LAG.remove(str(tp.partition))
        self.service.logs.release([tp.partition for tp in revoked])

    def on_partitions_assigned(self, assigned) -> None:
        self.service.seek_to_committed(assigned)


class Aggregator:
    """A consumer-group member folding the records topic into Redis."""

    def __init__(
        self,
        kafka: KafkaSettings,
        redis_settings: RedisSettings,
        topics: TopicSettings,
        settings: AggregatorSettings,
        trust: TrustSettings | None = None,
    ) -> None:
        self.kafka, self.topics, self.settings = kafka, topics, settings
        self.redis = redis_client(redis_settings)
        check_redis(self.redis)
        trust = trust or TrustSettings()
        trusted = trust.study_keys()
        if trusted:
            log.info("aggregator: studies must be signed by one of keys %s", trusted.ids)
        else:
            log.warning("aggregator: no trusted study key (IPDP_TRUSTED_STUDY_KEYS) — UNSIGNED "
                        "studies are accepted; anyone who can write Redis defines what is folded "
                        "(docs/security.md)")
        leader = LeaderTokenSettings()
        self.folder = Folder(
            self.redis, group=settings.group, topic=topics.records, trusted=trusted,
            replay_window_s=settings.replay_window_s,
            max_future_skew_s=settings.max_future_skew_s,
            max_message_bytes=settings.max_message_bytes,
            unknown_study_ttl_s=settings.unknown_study_ttl_s,
            credential_keys=trust.credential_keys(),
            helpers=HelperLink(_secret(leader.leader_token), ca_file=leader.ca_file,
                               timeout_s=settings.helper_timeout_s,
                               retry_s=settings.helper_retry_s),
        )
        state.upgrade_layout(self.redis, settings.group, topics.records)
        announced = self.folder.announce_pending()
        if announced:
            log.warning("announced %d closed rounds a crash had left off the trainer's stream",
                        announced)
        owed = self.folder.resend_pending(every_study=True)
        if owed:
            log.warning("%d helper commits a crash left owing could not be sent yet; sending "
                        "them again every loop", owed)
        self.logs = LogGuard(self.redis, kafka, group=settings.group, topic=topics.records)
        self.producer = kafka_producer(kafka)
        # No automatic reset: a vanished offset must pause its partition, never jump in the log.
        self.consumer = kafka_consumer(
            kafka, group_id=settings.group, max_poll_records=settings.max_batch,
            auto_offset_reset="none",
            session_timeout_ms=settings.session_timeout_ms,
            max_partition_fetch_bytes=max(settings.max_message_bytes * 4, 1 << 20),
        )
        if settings.columnar_fetch:  # polls return Polled chunks, not one object per record
            fetch.install(self.consumer)
        self.consumer.subscribe([topics.records], listener=_SeekToRedisOffsets(self))
        self.stop_event = threading.Event()
        self._folding = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fold")
        self._pending: Future | None = None
        self.totals = {"folded": 0, "rejected": 0, "rounds_closed": 0}
        self._lag_at = 0.0

    def seek_to_committed(self, assigned) -> None:
        """Seek each assigned partition to the next offset Redis says is unfolded (its log's
        start if none), and pause those whose log is not the one that offset belongs to."""
        if self._pending is not None:  # let the fold in flight land first: it moves them
            wait([self._pending])
        committed = self._with_retry(self.folder.committed_offsets)
        for tp in assigned:
            if tp.partition in committed:
                self.consumer.seek(tp, committed[tp.partition])
            else:
                self.consumer.seek_to_beginning(tp)
        log.info("assigned partitions %s; resuming from Redis offsets %s",
                 sorted(tp.partition for tp in assigned),
                 {tp.partition: committed.get(tp.partition) for tp in assigned})
        self._pause(self._with_retry(
            lambda: self.logs.check(sorted(tp.partition for tp in assigned))))

    def _pause(self, pauses: list[Pause]) -> None:
        if pauses:
            self.consumer.pause(*(TopicPartition(self.topics.records, x.partition)
                                  for x in pauses))
        for x in pauses:
            self.logs.pause(x)

    def _resume_released(self) -> None:
        """Resume the paused partitions an operator has pointed at the current log."""
        ready = self._with_retry(self.logs.resumable)
        committed = self._with_retry(self.folder.committed_offsets)
        for p in ready:
            tp = TopicPartition(self.topics.records, p)
            self.consumer.seek(tp, committed[p])
            self.consumer.resume(tp)
            log.warning("topic %s partition %d resumed by the operator at offset %d",
                        self.topics.records, p, committed[p])

    def _from_verified_log(self, messages: Polled) -> Polled:
        """Drop a batch fetched from another log than the one checked at assignment.

        The client learns a recreated topic's new id from its metadata, possibly before the
        rebalance that re-checks it; until then every assigned partition is paused.
        """
        seen = fetch.topic_id_seen(self.consumer, self.topics.records)
        if seen is not None and self.logs.verified_id is not None \
                and seen != self.logs.verified_id:
            self._pause(self._with_retry(lambda: self.logs.replaced(
                sorted(tp.partition for tp in self.consumer.assignment()), seen)))
            return messages.take(np.zeros(0, np.int64))
        if not self.logs.paused:
            return messages
        keep = ~np.isin(messages.partition, np.fromiter(self.logs.paused, np.int64))
        return messages.take(np.flatnonzero(keep))

    def run(self, *, idle_exit_s: float | None = None) -> dict[str, int]:
        """Fold until stopped (SIGTERM/SIGINT or stop_event); returns the totals folded here."""
        backoff = Backoff(self.settings.retry_initial_s, self.settings.retry_max_s)
        idle_since = time.monotonic()
        try:
            while not self.stop_event.is_set():
                try:
                    polled = self.consumer.poll(timeout_ms=self.settings.poll_timeout_ms,
                                                max_records=self.settings.max_batch)
                except OffsetOutOfRangeError as exc:
                    offsets = exc.args[0] if exc.args and isinstance(exc.args[0], dict) else {}
                    self._pause(self._with_retry(lambda o=offsets: self.logs.out_of_range(
                        {tp.partition: offset for tp, offset in o.items()})))
                    continue
                except KafkaError as exc:
                    pause_after_failure(backoff, self.stop_event, "kafka", "poll", exc)
                    continue
                backoff.reset()
                batch = fetch.batch_of(polled) if polled else None
                if self._pending is not None:
                    reseeked = self._finish()
                    if reseeked and batch is not None:
                        self._rewind(batch, reseeked)
                        continue
                if batch is None:
                    # Nothing is in flight: the loop thread may use the fold's helper clients.
                    self._with_retry(self.folder.resend_pending)
                    self._refresh_lag()
                    if not self.consumer.assignment():
                        idle_since = time.monotonic()  # joining the group is not idleness
                    elif idle_exit_s is not None and time.monotonic() - idle_since > idle_exit_s:
                        break
                    continue
                idle_since = time.monotonic()
                partitions, counts = np.unique(batch.partition, return_counts=True)
                for partition, k in zip(partitions.tolist(), counts.tolist(), strict=True):
                    metrics.RECORDS_CONSUMED.labels(str(partition)).inc(k)
                # The log check talks to the consumer, so it runs here, not on the fold thread.
                batch = self._from_verified_log(batch)
                if len(batch):
                    self._pending = self._folding.submit(self._fold, batch)
                self._refresh_lag()
            if self._pending is not None:
                self._finish()
        finally:
            self._folding.shutdown(wait=True)
        self.close()
        return self.totals

    def _fold(self, messages: Polled) -> FoldResult:
        """On the fold thread: send again the helper commits the journals owe, then fold one
        batch, retrying until Redis (and a two-server study's helper) lets it through."""
        started = time.perf_counter()
        self._with_retry(self.folder.resend_pending)
        result = self._with_retry(self.folder.fold, messages, self._dead_letter,
                                  before_retry=self._announce_left_rounds)
        metrics.FOLD_SECONDS.observe(time.perf_counter() - started)
        metrics.FOLD_BATCH_RECORDS.observe(len(messages))
        if result.conflicts:
            metrics.FOLD_CONFLICTS.inc(result.conflicts)
        return result

    def _announce_left_rounds(self) -> None:
        """A Redis failure can strike after a study's transaction committed (its reply lost, or
        the announcement that follows it): the retried fold then finds its batch folded and
        closes nothing, so the rounds that transaction closed are announced here."""
        announced = self.folder.announce_pending()
        if announced:
            log.warning("announced %d closed rounds a Redis failure had left off the trainer's "
                        "stream", announced)

    def _finish(self) -> dict[int, int]:
        """On the loop's thread: wait for the fold in flight, then seek, account and commit to
        Kafka; returns the re-seeks the fold asked for."""
        pending, self._pending = self._pending, None
        result: FoldResult = pending.result()
        assigned = self.consumer.assignment()
        for partition, offset in result.reseek.items():
            tp = TopicPartition(self.topics.records, partition)
            if tp in assigned:  # a partition revoked meanwhile is its new owner's to seek
                self.consumer.seek(tp, offset)
        if result.reseek:
            return result.reseek
        self._account(result)
        try:
            self.consumer.commit_async()
        except KafkaError as exc:  # Kafka's commit is informational; Redis holds the truth
            metrics.BACKEND_ERRORS.labels("kafka", "commit").inc()
            log.debug("kafka commit failed: %s", exc)
        return {}

    def _rewind(self, batch: Polled, reseeked: dict[int, int]) -> None:
        """Drop a batch polled before a re-seek: its other partitions go back to its start."""
        assigned = self.consumer.assignment()
        partitions, first = np.unique(batch.partition, return_index=True)
        for partition, offset in zip(partitions.tolist(), batch.offset[first].tolist(),
                                     strict=True):
            tp = TopicPartition(self.topics.records, partition)
            if partition not in reseeked and tp in assigned:
                self.consumer.seek(tp, offset)

    def _account(self, result: FoldResult) -> None:
        for sid, k in result.folded.items():
            metrics.RECORDS_FOLDED.labels(sid).inc(k)
            self.totals["folded"] += k
        for reason, k in result.refused.counts().items():
            metrics.RECORDS_DEAD_LETTERED.labels(reason.value).inc(k)
        refused = result.refused
        for c, (reason, detail) in enumerate(refused.causes):
            if reason == RejectReason.HELPER_REFUSED:
                metrics.HELPER_RECORDS_REFUSED.labels(detail).inc(int((refused.cause == c).sum()))
        self.totals["rejected"] += len(result.refused)
        for sid, _round in result.closed_rounds:
            metrics.ROUNDS_CLOSED.labels(sid).inc()
            log.info("study %s: round %d closed", sid, _round)
        self.totals["rounds_closed"] += len(result.closed_rounds)
        for sid, (_round, count, n) in result.open_rounds.items():
            metrics.ROUND_RECORDS.labels(sid).set(count)
            metrics.ROUND_TARGET.labels(sid).set(n)
            metrics.ROUND_PROGRESS.labels(sid).set(count / n)

    def _dead_letter(self, refused: Refused) -> None:
        """Send refused records with their reasons, in dead-letter containers
        (ipdp.dead_letters); delivered (or raising) before the fold commits."""
        r = refused.records
        headers = dead_letter_headers(self.topics.records)
        futures = [self.producer.send(self.topics.dead_letter, key=key, value=value,
                                      headers=headers)
                   for key, value in encode_dead_letters(
                       r.partition, r.offset, r.index, refused.cause,
                       [(reason.value, detail) for reason, detail in refused.causes], r.values,
                       max_bytes=self.settings.max_message_bytes)]
        self.producer.flush(timeout=DEAD_LETTER_TIMEOUT_S)
        for f in futures:  # a failed delivery raises here, so the fold does not commit without it
            f.get(timeout=0)
        log.info("dead-lettered %d records in %d messages (%s)", len(refused), len(futures),
                 ", ".join(sorted(reason.value for reason in refused.counts())))

    def _with_retry(self, fn: Callable, *args, before_retry: Callable[[], None] | None = None):
        """Run `fn(*args)` until Redis and the dead-letter producer let it through. A failed try
        may still have committed (a transaction whose reply was lost); a retry never redoes it,
        as each transaction checks the offsets it moves. `before_retry`, if given, runs before
        each retry, inside the same retry loop."""
        backoff = Backoff(self.settings.retry_initial_s, self.settings.retry_max_s)
        failed = False
        while True:
            try:
                if failed and before_retry is not None:
                    before_retry()
                return fn(*args)
            except REDIS_TRANSIENT as exc:
                failed = True
                if self.stop_event.is_set():
                    raise
                pause_after_failure(backoff, self.stop_event, "redis", "fold", exc)
            except KafkaError as exc:
                failed = True
                if self.stop_event.is_set():
                    raise
                pause_after_failure(backoff, self.stop_event, "kafka", "dead_letter", exc)
            except HelperUnavailable as exc:  # at prepare: nothing of the study was written
                failed = True
                if self.stop_event.is_set():
                    raise
                pause_after_failure(backoff, self.stop_event, "helper", "prepare", exc)

    def _refresh_lag(self) -> None:
        if time.monotonic() - self._lag_at < LAG_REFRESH_S:
            return
        self._lag_at = time.monotonic()
        if self.logs.paused:
            self._resume_released()
        assigned = self.consumer.assignment()
        if not assigned:
            return
        try:
            # Bounded: polling hides an unreachable broker, so this is also its health probe.
            ends = self.consumer.end_offsets(list(assigned), timeout_ms=LAG_TIMEOUT_MS)
            positions = {tp: self.consumer.position(tp, timeout_ms=LAG_TIMEOUT_MS)
                         for tp in assigned}
        except KafkaError as exc:
            metrics.BACKEND_ERRORS.labels("kafka", "end_offsets").inc()
            metrics.BACKEND_RETRIES.labels("kafka").inc()
            log.warning("kafka end_offsets failed (%s); still polling", exc)
            return
        for tp, position in positions.items():
            if position is not None:  # None until a fetch position is known
                metrics.CONSUMER_LAG.labels(str(tp.partition)).set(
                    max(0, ends.get(tp, 0) - position))

    def close(self) -> None:
        """Leave the group and close clients (Redis's too: a connection left to the garbage
        collector can be finalised after its socket, which then warns of a leak)."""
        for close in (self.consumer.close, self.producer.close, self.folder.helpers.close,
                      self.redis.close):
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - closing must not mask the exit reason
                log.debug("close failed: %s", exc)


def cmd_run(args) -> int:
    """Entry point of `ipdp aggregator run`."""
    kafka, redis_settings, topics = KafkaSettings(), RedisSettings(), TopicSettings()
    settings = AggregatorSettings()
    metrics.serve(MetricsSettings(), "aggregator")
    metrics.start_at_zero(metrics.RECORDS_DEAD_LETTERED,
                          *((reason.value,) for reason in DEAD_LETTER_REASONS))
    metrics.start_at_zero(metrics.PARTITION_PAUSES, *((reason,) for reason in PAUSE_REASONS))
    metrics.start_studies_reader_at_zero("aggregator", topic_values=False)
    metrics.start_backends_at_zero(("kafka", "poll"), ("kafka", "commit"), ("kafka", "end_offsets"),
                                   ("kafka", "dead_letter"), ("redis", "fold"),
                                   ("helper", "prepare"), ("helper", "commit"))
    metrics.start_at_zero(metrics.HELPER_CALLS, *((call, outcome) for call in ("prepare", "commit")
                                                  for outcome in ("ok", "refused", "unavailable")))
    agg = Aggregator(kafka, redis_settings, topics, settings)
    install_signal_handlers(agg.stop_event)
    log.info("aggregator: group %s, topic %s", settings.group, topics.records)
    totals = agg.run(idle_exit_s=args.idle_exit)
    log.info("aggregator stopped: %s", totals)
    return 0
