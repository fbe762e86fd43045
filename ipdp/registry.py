"""The study store: Redis is the service's source of truth, the compacted studies topic its
public mirror (which devices read; see producer/studies.py).

Redis layout (ipdp.state): ``ipdp:{<id>}:study`` holds ``json``, ``status`` (open/closed),
``created_ms`` and ``envelope`` (the studies-topic value last published, signed or not);
``ipdp:study-hash`` maps the 16-byte wire hash to the id. The studies topic
(``TopicSettings.studies``, cleanup.policy=compact) carries one message per change, key = study
id, value = the format-2 envelope of ipdp.study; the last value per key is the current
definition. Contributors read the topic, so they need no Redis credentials.

Readers that pin study-owner keys (the aggregator, the trainer) load a study *from its stored
envelope*, verified: a study whose signature does not verify raises :class:`SignatureError` and
is never used; one that cannot be read raises :class:`MalformedValue`. Readers that pin none
read the same envelope's study text unverified: the text carries the noise the study was created
with, which a later calibration rule must not change (ipdp.study; ``json`` is only the fallback
of an entry without an envelope). The ``status`` field stays authoritative for open/closed in Redis (the aggregator
closes a study at max_rounds without the owner's key); the envelope's signed status is what
devices see.

A study's parameters never change once created: :func:`create_study` refuses a different
definition under an existing id, and is a no-op (apart from re-publishing the current state, so
a lost topic can be repaired) when the parameters are identical.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import redis
from pydantic import ValidationError

from ipdp.errors import ConfigurationError, SignatureError, StudyExists, UnknownStudy
from ipdp.kafka_io import send_and_wait
from ipdp.settings import TopicSettings
from ipdp.signing import SigningKey, TrustedKeys
from ipdp.state import STUDY_HASHES, StudyKeys
from ipdp.study import Study, StudyStatus, parse_study_message, study_message
from ipdp.topic_values import invalid_fields, load_json_object

if TYPE_CHECKING:
    from kafka import KafkaProducer

log = logging.getLogger(__name__)

__all__ = [
    "close_study",
    "create_study",
    "envelope_signer",
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
    """Same parameters; the noise is the calibration's (or, read from a text, the text's)."""
    return a.model_dump(exclude={"noise"}) == b.model_dump(exclude={"noise"})


def _stored(study_id: str, raw_json: bytes, envelope: bytes | None) -> Study:
    """The study as stored: its envelope's text, which carries the noise devices add, or its
    JSON when it has no envelope. Signatures are checked by the callers that pin keys; a stored
    study that cannot be read raises :class:`MalformedValue`."""
    if envelope is not None:
        return parse_study_message(envelope)[0]
    try:
        return Study.model_validate_json(raw_json)
    except ValidationError as exc:
        raise invalid_fields(f"stored study {study_id!r}", exc) from None


def _publish(producer: KafkaProducer, topics: TopicSettings, study_id: str, envelope: bytes,
             timeout_s: float = 30.0) -> None:
    send_and_wait(producer, topics.studies, study_id.encode("utf-8"), envelope, timeout_s)


def envelope_signer(envelope: bytes | None) -> str:
    """Key id of a stored envelope ("" when unsigned or absent)."""
    if envelope is None:
        return ""
    return str(load_json_object(envelope, "stored envelope").get("key_id", ""))


def register_study(r: redis.Redis, study: Study, signing_key: SigningKey | None = None,
                   ) -> tuple[Study, StudyStatus, bool]:
    """Store ``study`` in Redis unless an identical one is there: (stored study, status, created).

    The stored envelope is signed with ``signing_key`` (if given). For an identical study that
    exists, a given key re-signs its current status. Raises :class:`StudyExists` if the id is
    taken by different parameters, or its wire hash by another id.
    """
    key = StudyKeys(study.study_id).study
    with r.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(key)
                existing, envelope = pipe.hmget(key, ["json", "envelope"])
                if existing is not None:
                    old = _stored(study.study_id, existing, envelope)
                    pipe.reset()
                    if not _same(old, study):
                        raise StudyExists(
                            f"study {study.study_id!r} already exists with different parameters"
                            " (a study is immutable: choose a new id)")
                    status = StudyStatus(_text(r.hget(key, "status")) or StudyStatus.OPEN)
                    if signing_key is not None or r.hget(key, "envelope") is None:
                        r.hset(key, "envelope", study_message(old, status, signing_key))
                    _claim_hash(r, old)  # repairs a registration interrupted before it
                    return old, status, False
                _claim_hash(r, study)
                pipe.multi()
                pipe.hset(key, mapping={
                    "json": study.to_json(), "status": StudyStatus.OPEN.value,
                    "created_ms": int(time.time() * 1000),
                    "envelope": study_message(study, StudyStatus.OPEN, signing_key)})
                pipe.execute()
                return study, StudyStatus.OPEN, True
            except redis.WatchError:
                continue


def _claim_hash(r: redis.Redis, study: Study) -> None:
    """Map the study's wire hash to its id, unless another id holds it (StudyExists).

    The registry hash is in no study's slot, so this is its own command: before the study's
    definition is stored, a record under the hash finds no study (unknown_study); a crash in
    between leaves a hash without a study, which registering the study again completes.
    """
    if not r.hsetnx(STUDY_HASHES, study.hash, study.study_id):
        owner = _text(r.hget(STUDY_HASHES, study.hash))
        if owner != study.study_id:
            raise StudyExists(f"study {study.study_id!r} has the same wire hash as {owner!r}")


def create_study(r: redis.Redis, producer: KafkaProducer, topics: TopicSettings,
                 study: Study, signing_key: SigningKey | None = None) -> bool:
    """Register ``study`` in Redis and publish its envelope (signed with ``signing_key``, if
    given) on the studies topic.

    Returns True when the study was created, False when an identical study already existed (its
    current envelope is re-published, which a compacted topic absorbs). Raises
    :class:`StudyExists` as :func:`register_study` does.
    """
    if signing_key is None:
        log.warning("study %s is created UNSIGNED: devices and aggregators that pin study keys "
                    "refuse it, and anyone who can write the studies topic can redefine it for "
                    "devices that do not (docs/security.md)", study.study_id)
    _, _, created = register_study(r, study, signing_key)
    _publish(producer, topics, study.study_id, r.hget(StudyKeys(study.study_id).study, "envelope"))
    return created


def load_study(r: redis.Redis, study_id: str,
               trusted: TrustedKeys | None = None) -> tuple[Study, StudyStatus] | None:
    """(study, status) from Redis, or None if unknown.

    With ``trusted`` keys the study comes from its stored envelope, verified; raises
    :class:`SignatureError` when that signature does not verify, :class:`MalformedValue` when
    the stored study cannot be read.
    """
    raw = r.hmget(StudyKeys(study_id).study, ["json", "status", "envelope"])
    if raw[0] is None:
        return None
    status = StudyStatus(_text(raw[1]) or StudyStatus.OPEN)
    if not trusted:
        return _stored(study_id, raw[0], raw[2]), status
    if raw[2] is None:
        raise SignatureError(f"study {study_id!r} has no signed envelope in Redis (no signature)")
    study, _ = parse_study_message(raw[2], trusted)
    if study.study_id != study_id or not _same(study, Study.model_validate_json(raw[0])):
        raise SignatureError(f"study {study_id!r}: the signed envelope is another study's "
                             "(its signature covers different parameters)")
    return study, status


def study_by_hash(r: redis.Redis, h: bytes,
                  trusted: TrustedKeys | None = None) -> tuple[Study, StudyStatus] | None:
    """(study, status) for a 16-byte wire hash, or None if no study has it (``trusted`` as in
    :func:`load_study`)."""
    study_id = _text(r.hget(STUDY_HASHES, bytes(h)))
    return None if study_id is None else load_study(r, study_id, trusted)


def close_study(r: redis.Redis, producer: KafkaProducer, topics: TopicSettings,
                study_id: str, signing_key: SigningKey | None = None) -> Study:
    """Mark the study closed in Redis and publish the closed state; returns the study.

    A signed study's closed state must be signed too (devices that pin the key would refuse an
    unsigned one), so closing it needs ``signing_key``: without it, ConfigurationError and
    nothing changes. Closing an already closed study re-publishes the closed state. Raises
    :class:`UnknownStudy`.
    """
    key = StudyKeys(study_id).study
    with r.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(key)
                raw, envelope = pipe.hmget(key, ["json", "envelope"])
                if raw is None:
                    pipe.reset()
                    raise UnknownStudy(f"unknown study {study_id!r}")
                signer = envelope_signer(envelope)
                if signer and signing_key is None:
                    pipe.reset()
                    raise ConfigurationError(
                        f"study {study_id!r} is signed by key {signer}: closing it needs that "
                        "signing key (--signing-key or IPDP_STUDY_SIGNING_KEY)")
                study = _stored(study_id, raw, envelope)
                closed = study_message(study, StudyStatus.CLOSED, signing_key)
                pipe.multi()
                pipe.hset(key, mapping={"status": StudyStatus.CLOSED.value, "envelope": closed})
                pipe.execute()
                break
            except redis.WatchError:
                continue
    _publish(producer, topics, study_id, closed)
    return study


def list_studies(r: redis.Redis) -> list[tuple[Study, StudyStatus]]:
    """Every registered study with its status, sorted by id."""
    ids = sorted({_text(v) for v in r.hvals(STUDY_HASHES)})
    out = []
    for study_id in ids:
        got = load_study(r, study_id)
        if got is not None:
            out.append(got)
    return out


def rounds_published(r: redis.Redis, study_id: str) -> int:
    """How many rounds of the study have a published model."""
    return int(r.hlen(StudyKeys(study_id).published))
