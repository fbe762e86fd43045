"""Studies: their definitions in Redis (the service's source of truth) and on the compacted topic.

Redis layout (ipdp.state): ``ipdp:study:{id}`` holds ``json``, ``status`` (open/closed) and
``created_ms``; ``ipdp:study-hash`` maps the 16-byte wire hash to the id. The studies topic
(``TopicSettings.studies``, cleanup.policy=compact) carries one message per change, key = study
id, value = ``{"study": {...}, "status": "open" | "closed"}``; the last value per key is the
current definition. Contributors read the topic, so they need no Redis credentials.

A study's parameters never change once created: :func:`create_study` refuses a different
definition under an existing id, and is a no-op (apart from re-publishing the current state, so
a lost topic can be repaired) when the parameters are identical.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

import redis
from pydantic import ValidationError

from ipdp.settings import KafkaSettings, TopicSettings
from ipdp.state import STUDY_HASHES, published_key, study_key
from ipdp.study import Study

if TYPE_CHECKING:
    from kafka import KafkaProducer

log = logging.getLogger(__name__)

OPEN = "open"
CLOSED = "closed"
STATUSES = (OPEN, CLOSED)

__all__ = [
    "CLOSED",
    "OPEN",
    "StudyExists",
    "UnknownStudy",
    "close_study",
    "create_study",
    "list_studies",
    "load_study",
    "read_studies_topic",
    "rounds_published",
    "study_by_hash",
    "study_message",
]


class StudyExists(ValueError):
    """The id is taken by a study with different parameters."""


class UnknownStudy(LookupError):
    """No study with this id (or hash)."""


def _text(v: bytes | str | None) -> str | None:
    if v is None:
        return None
    return v.decode("utf-8") if isinstance(v, bytes | bytearray) else str(v)


def _same(a: Study, b: Study) -> bool:
    return a.model_dump() == b.model_dump()


def study_message(study: Study, status: str) -> bytes:
    """The studies-topic value: ``{"study": {...}, "status": ...}`` as UTF-8 JSON."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    return json.dumps({"study": study.model_dump(mode="json"), "status": status},
                      sort_keys=True, separators=(",", ":")).encode("utf-8")


def _publish(producer: KafkaProducer, topics: TopicSettings, study: Study, status: str,
             timeout_s: float = 30.0) -> None:
    fut = producer.send(topics.studies, key=study.study_id.encode("utf-8"),
                        value=study_message(study, status))
    producer.flush(timeout=timeout_s)
    fut.get(timeout=timeout_s)  # raise the delivery error, if any


def register_study(r: redis.Redis, study: Study) -> tuple[Study, str, bool]:
    """Store ``study`` in Redis unless an identical one is there: (stored study, status, created).

    Raises :class:`StudyExists` if the id is taken by different parameters, or its wire hash by
    another id.
    """
    key = study_key(study.study_id)
    with r.pipeline() as pipe:
        while True:
            try:
                pipe.watch(key, STUDY_HASHES)
                existing = pipe.hget(key, "json")
                if existing is not None:
                    old = Study.model_validate_json(existing)
                    pipe.reset()
                    if not _same(old, study):
                        raise StudyExists(
                            f"study {study.study_id!r} already exists with different parameters"
                            " (a study is immutable: choose a new id)")
                    return old, _text(r.hget(key, "status")) or OPEN, False
                owner = _text(pipe.hget(STUDY_HASHES, study.hash))
                if owner is not None and owner != study.study_id:
                    pipe.reset()
                    raise StudyExists(
                        f"study {study.study_id!r} has the same wire hash as {owner!r}")
                pipe.multi()
                pipe.hset(key, mapping={"json": study.to_json(), "status": OPEN,
                                        "created_ms": int(time.time() * 1000)})
                pipe.hset(STUDY_HASHES, study.hash, study.study_id)
                pipe.execute()
                return study, OPEN, True
            except redis.WatchError:
                continue


def create_study(r: redis.Redis, producer: KafkaProducer, topics: TopicSettings,
                 study: Study) -> bool:
    """Register ``study`` in Redis and publish it on the studies topic.

    Returns True when the study was created, False when an identical study already existed (its
    current state is re-published, which a compacted topic absorbs). Raises :class:`StudyExists`
    as :func:`register_study` does.
    """
    stored, status, created = register_study(r, study)
    _publish(producer, topics, stored, status)
    return created


def _load_key(r: redis.Redis, study_id: str) -> tuple[Study, str] | None:
    raw = r.hmget(study_key(study_id), ["json", "status"])
    if raw[0] is None:
        return None
    return Study.model_validate_json(raw[0]), _text(raw[1]) or OPEN


def load_study(r: redis.Redis, study_id: str) -> tuple[Study, str] | None:
    """(study, status) from Redis, or None if unknown."""
    return _load_key(r, study_id)


def study_by_hash(r: redis.Redis, h: bytes) -> tuple[Study, str] | None:
    """(study, status) for a 16-byte wire hash, or None if no study has it."""
    study_id = _text(r.hget(STUDY_HASHES, bytes(h)))
    return None if study_id is None else _load_key(r, study_id)


def close_study(r: redis.Redis, producer: KafkaProducer, topics: TopicSettings,
                study_id: str) -> Study:
    """Mark the study closed in Redis and publish the closed state; returns the study.

    Closing an already closed study re-publishes the closed state. Raises :class:`UnknownStudy`.
    """
    key = study_key(study_id)
    with r.pipeline() as pipe:
        while True:
            try:
                pipe.watch(key)
                raw = pipe.hget(key, "json")
                if raw is None:
                    pipe.reset()
                    raise UnknownStudy(f"unknown study {study_id!r}")
                pipe.multi()
                pipe.hset(key, "status", CLOSED)
                pipe.execute()
                break
            except redis.WatchError:
                continue
    study = Study.model_validate_json(raw)
    _publish(producer, topics, study, CLOSED)
    return study


def list_studies(r: redis.Redis) -> list[tuple[Study, str]]:
    """Every registered study with its status, sorted by id."""
    ids = sorted({_text(v) for v in r.hvals(STUDY_HASHES)})
    out = []
    for study_id in ids:
        got = _load_key(r, study_id)
        if got is not None:
            out.append(got)
    return out


def rounds_published(r: redis.Redis, study_id: str) -> int:
    """How many rounds of the study have a published model."""
    return int(r.hlen(published_key(study_id)))


def parse_study_message(value: bytes) -> tuple[Study, str]:
    """Inverse of :func:`study_message`; raises ValueError on a malformed value."""
    try:
        obj = json.loads(value)
        status = obj["status"]
        study = Study.model_validate(obj["study"])
    except (ValueError, KeyError, TypeError, ValidationError) as exc:
        raise ValueError(f"malformed studies-topic message: {exc}") from None
    if status not in STATUSES:
        raise ValueError(f"malformed studies-topic message: status {status!r}")
    return study, status


def read_studies_topic(kafka: KafkaSettings, topics: TopicSettings,
                       timeout_s: float = 10) -> dict[str, tuple[Study, str]]:
    """Replay the compacted studies topic: {id: (study, status)}, the last value per key winning.

    Assigns every partition (no consumer group), seeks to the beginning and reads to the end
    (ipdp.subscriber.read_to_end). A tombstone (null value) removes the key. Raises TimeoutError if
    the topic cannot be found or read within ``timeout_s``.
    """
    from kafka import TopicPartition

    from ipdp.clients import kafka_consumer
    from ipdp.subscriber import read_to_end

    deadline = time.monotonic() + timeout_s
    consumer = kafka_consumer(kafka, group_id=None, enable_auto_commit=False,
                              bootstrap_timeout_ms=max(1000, int(timeout_s * 1000)))
    try:
        partitions = None
        while True:
            partitions = consumer.partitions_for_topic(topics.studies)
            if partitions or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if not partitions:
            raise TimeoutError(f"studies topic {topics.studies!r} not found on the broker")
        tps = [TopicPartition(topics.studies, p) for p in sorted(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        out: dict[str, tuple[Study, str]] = {}
        for m in read_to_end(consumer, tps, timeout_s=max(0.1, deadline - time.monotonic())):
            if m.key is None:
                continue
            sid = m.key.decode("utf-8", "replace")
            if m.value is None:
                out.pop(sid, None)
                continue
            try:
                out[sid] = parse_study_message(m.value)
            except ValueError as exc:
                log.warning("skipping studies-topic offset %d: %s", m.offset, exc)
        return out
    finally:
        consumer.close()
