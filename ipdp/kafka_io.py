"""Kafka clients built from settings, topic creation, and reading assigned partitions to the end.

All Kafka clients start from :meth:`KafkaSettings.client_kwargs`, so SASL/TLS settings pass
through unchanged; keyword overrides win over the defaults below.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient

from ipdp.errors import BackendUnavailable
from ipdp.settings import KafkaSettings, TopicSettings

log = logging.getLogger(__name__)

__all__ = [
    "CONSUMER_DEFAULTS",
    "PRODUCER_DEFAULTS",
    "assign_all",
    "ensure_topics",
    "kafka_admin",
    "kafka_consumer",
    "kafka_producer",
    "read_to_end",
    "send_and_wait",
]

MiB = 1 << 20

PRODUCER_DEFAULTS: dict[str, Any] = {
    "acks": "all",
    "linger_ms": 5,
    "batch_size": 1 * MiB,
    "max_request_size": 4 * MiB,
    # Bounded by delivery_timeout_ms, like the Java client (kafka-python's default is inf).
    "retries": 2_147_483_647,
    "delivery_timeout_ms": 120_000,
    "retry_backoff_ms": 100,
    "request_timeout_ms": 30_000,
}

CONSUMER_DEFAULTS: dict[str, Any] = {
    "enable_auto_commit": False,
    "auto_offset_reset": "earliest",
    # Fast group joins: ~3 s to a first assignment instead of ~23 s with kafka-python defaults.
    "session_timeout_ms": 6_000,
    "heartbeat_interval_ms": 500,
    "max_poll_records": 5_000,
    "max_poll_interval_ms": 300_000,
    "fetch_min_bytes": 1,
    "fetch_max_wait_ms": 250,
    "fetch_max_bytes": 32 * MiB,
    "max_partition_fetch_bytes": 4 * MiB,  # at least the producer's max_request_size
}


def kafka_producer(s: KafkaSettings, **overrides: Any) -> KafkaProducer:
    """A producer with :data:`PRODUCER_DEFAULTS` (acks=all, idempotent, 1 MiB batches)."""
    return KafkaProducer(**{**s.client_kwargs(), **PRODUCER_DEFAULTS, **overrides})


def kafka_consumer(s: KafkaSettings, *topics: str, **overrides: Any) -> KafkaConsumer:
    """A consumer with :data:`CONSUMER_DEFAULTS` (manual commits, earliest, fast group joins).

    Pass ``group_id=...`` for a consumer group; topics may be given positionally or subscribed
    later. It carries ``ipdp_end_offsets_exact`` (``KafkaSettings.end_offsets_exact``) for
    :func:`read_to_end`.
    """
    consumer = KafkaConsumer(*topics, **{**s.client_kwargs(), **CONSUMER_DEFAULTS, **overrides})
    consumer.ipdp_end_offsets_exact = s.end_offsets_exact
    return consumer


def kafka_admin(s: KafkaSettings, **overrides: Any) -> KafkaAdminClient:
    """An admin client (topic creation, describe_configs, groups)."""
    return KafkaAdminClient(**{**s.client_kwargs(), "request_timeout_ms": 30_000, **overrides})


def send_and_wait(producer: KafkaProducer, topic: str, key: bytes, value: bytes,
                  timeout_s: float = 30.0) -> None:
    """Produce one message and wait until Kafka acknowledged it (raises the delivery error)."""
    producer.send(topic, key=key, value=value).get(timeout=timeout_s)


def assign_all(consumer: KafkaConsumer, topic: str, timeout_s: float,
               label: str = "topic") -> list[TopicPartition]:
    """Assign every partition of ``topic`` (no consumer group) once the broker reports them.

    Raises TimeoutError ("{label} '{topic}' not found on the broker") if the topic has no
    partitions after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        partitions = consumer.partitions_for_topic(topic)
        if partitions:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{label} {topic!r} not found on the broker")
        time.sleep(0.1)
    tps = [TopicPartition(topic, p) for p in sorted(partitions)]
    consumer.assign(tps)
    return tps


#: After the end offsets are reached, one poll this long must come back empty before stopping.
QUIET_MS = 300
#: Stop short of the reported end offsets if nothing arrives for this long (never with Kafka).
STALL_S = 5.0


def read_to_end(consumer, tps, *, timeout_s: float | None = None, quiet_ms: int = QUIET_MS,
                poll_ms: int = 200, stop: threading.Event | None = None) -> Iterator:
    """Yield every record of the assigned partitions ``tps`` from the current positions to the end.

    Stops once every position has reached the end offsets taken at the start. Unless the
    consumer says its brokers' end offsets are exact (``ipdp_end_offsets_exact``, set by
    :func:`kafka_consumer` from ``KafkaSettings.end_offsets_exact``), a poll of ``quiet_ms``
    must then return nothing too: the embedded tansu broker's ListOffsets(latest) answers the
    last batch's base offset + 1, not the last offset + 1, so after a multi-record batch
    ``end_offsets`` stops short of records that fetches do return. Raises TimeoutError after
    ``timeout_s`` (None: no limit).
    """
    if getattr(consumer, "ipdp_end_offsets_exact", False):
        quiet_ms = 0
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    end = consumer.end_offsets(tps)
    last_data = time.monotonic()
    while stop is None or not stop.is_set():
        caught_up = all(consumer.position(tp) >= end[tp] for tp in tps)
        if caught_up and not quiet_ms:
            return
        batch = consumer.poll(timeout_ms=quiet_ms if caught_up else poll_ms)
        now = time.monotonic()
        if batch:
            last_data = now
            for msgs in batch.values():
                yield from msgs
        elif caught_up:
            return
        elif now - last_data > STALL_S:
            log.warning("no records for %.0fs short of the end offsets %s; stopping", STALL_S,
                        {f"{tp.topic}[{tp.partition}]": end[tp] for tp in tps})
            return
        if deadline is not None and now > deadline:
            raise TimeoutError(f"could not read {sorted({tp.topic for tp in tps})} to the end "
                               f"within {timeout_s}s")


def ensure_topics(kafka: KafkaSettings, topics: TopicSettings) -> None:
    """Create the four ipdp topics if missing. Idempotent.

    ``records`` gets ``topics.records_partitions`` partitions; ``models`` and ``dead_letter``
    one; ``studies`` one with ``cleanup.policy=compact`` (latest study definition per key).
    """
    from kafka.errors import TopicAlreadyExistsError, for_code

    rf = topics.replication_factor
    wanted: dict[str, dict] = {
        topics.records: {"num_partitions": topics.records_partitions, "replication_factor": rf},
        topics.models: {"num_partitions": 1, "replication_factor": rf},
        topics.dead_letter: {"num_partitions": 1, "replication_factor": rf},
        topics.studies: {
            "num_partitions": 1,
            "replication_factor": rf,
            "configs": {"cleanup.policy": "compact"},
        },
    }
    admin = kafka_admin(kafka)
    try:
        existing = set(admin.list_topics())
        missing = {name: spec for name, spec in wanted.items() if name not in existing}
        if missing:
            result = admin.create_topics(missing, raise_errors=False)
            errors = []
            for t in result.get("topics", []):
                err = for_code(t["error_code"])
                if t["error_code"] == 0 or err is TopicAlreadyExistsError:
                    continue
                errors.append(f"{t['name']}: {err.__name__} {t.get('error_message') or ''}")
            if errors:
                raise BackendUnavailable("Could not create Kafka topics: " + "; ".join(errors))
            admin.wait_for_topics(list(missing), timeout_ms=15000)
        described = admin.describe_topics([topics.records])
        for t in described:
            have = len(t.get("partitions") or [])
            if t["name"] == topics.records and have and have != topics.records_partitions:
                log.warning(
                    "topic %s has %d partitions, settings ask for %d (left unchanged)",
                    topics.records,
                    have,
                    topics.records_partitions,
                )
    finally:
        admin.close()
