"""The study store: Redis is the service's source of truth, the compacted studies topic its
public mirror (which devices read; see producer/studies.py).

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

import logging
import time
from typing import TYPE_CHECKING

import redis

from ipdp.errors import StudyExists, UnknownStudy
from ipdp.kafka_io import send_and_wait
from ipdp.settings import TopicSettings
from ipdp.state import STUDY_HASHES, published_key, study_key
from ipdp.study import Study, StudyStatus, study_message

if TYPE_CHECKING:
    from kafka import KafkaProducer

log = logging.getLogger(__name__)

__all__ = [
    "close_study",
    "create_study",
    "list_studies",
    "load_study",
    "register_study",
    "rounds_published",
    "study_by_hash",
]


def _text(v: bytes | str | None) -> str | None:
    if v is None:
        return None
    return v.decode("utf-8") if isinstance(v, bytes | bytearray) else str(v)


def _same(a: Study, b: Study) -> bool:
    return a.model_dump() == b.model_dump()


def _publish(producer: KafkaProducer, topics: TopicSettings, study: Study, status: StudyStatus,
             timeout_s: float = 30.0) -> None:
    send_and_wait(producer, topics.studies, study.study_id.encode("utf-8"),
                  study_message(study, status), timeout_s)


def register_study(r: redis.Redis, study: Study) -> tuple[Study, StudyStatus, bool]:
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
                    return old, StudyStatus(_text(r.hget(key, "status")) or StudyStatus.OPEN), False
                owner = _text(pipe.hget(STUDY_HASHES, study.hash))
                if owner is not None and owner != study.study_id:
                    pipe.reset()
                    raise StudyExists(
                        f"study {study.study_id!r} has the same wire hash as {owner!r}")
                pipe.multi()
                pipe.hset(key, mapping={"json": study.to_json(), "status": StudyStatus.OPEN.value,
                                        "created_ms": int(time.time() * 1000)})
                pipe.hset(STUDY_HASHES, study.hash, study.study_id)
                pipe.execute()
                return study, StudyStatus.OPEN, True
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


def _load_key(r: redis.Redis, study_id: str) -> tuple[Study, StudyStatus] | None:
    raw = r.hmget(study_key(study_id), ["json", "status"])
    if raw[0] is None:
        return None
    return Study.model_validate_json(raw[0]), StudyStatus(_text(raw[1]) or StudyStatus.OPEN)


def load_study(r: redis.Redis, study_id: str) -> tuple[Study, StudyStatus] | None:
    """(study, status) from Redis, or None if unknown."""
    return _load_key(r, study_id)


def study_by_hash(r: redis.Redis, h: bytes) -> tuple[Study, StudyStatus] | None:
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
                pipe.hset(key, "status", StudyStatus.CLOSED.value)
                pipe.execute()
                break
            except redis.WatchError:
                continue
    study = Study.model_validate_json(raw)
    _publish(producer, topics, study, StudyStatus.CLOSED)
    return study


def list_studies(r: redis.Redis) -> list[tuple[Study, StudyStatus]]:
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
