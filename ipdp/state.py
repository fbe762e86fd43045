"""What ipdp keeps in Redis, the only state it keeps: the key layout, the statistics, and the
study store. No key ever holds a record or any part of one.

Every key a transaction touches shares one hash slot, so ipdp runs on Redis Cluster as on one
Redis: a study's keys carry the hash tag ``{id}``, an aggregator group's bookkeeping the tag
``{group:topic}`` (the part in braces is literal; ``<id>`` below is a placeholder).

| key | type | holds |
|---|---|---|
| `ipdp:{<id>}:study` | hash | `json` (the Study), `status` (open/closed), `hash` (its 16-byte wire hash), `created_ms`, `envelope` |
| `ipdp:{<id>}:open` | hash | the open round: `round`, `count`, `A` (d×d f8), `b` (d f8); of a two-server study `round`, `count`, `sum` (L u8, mod 2⁶⁴), `checksum` (32 bytes) |
| `ipdp:{<id>}:closed:<round>` | hash | a closed round's `A`, `b`, `count`, `closed_ms` until its model is published; of a two-server study `sum`, `count`, `checksum`, `closed_ms`, `mode` (`two-server`); once solved, `model` (the model's JSON, sent again as is after a crash) |
| `ipdp:{<id>}:helper-pending` | hash | a two-server study's journal: job id → JSON {round: [id hex, …]}, the helper commit a fold owes |
| `ipdp:{<id>}:unannounced` | set | closed rounds not yet on `ipdp:rounds` (written in the closing fold) |
| `ipdp:{<id>}:published` | hash | round → publication time (ms) |
| `ipdp:{<id>}:offsets:<group>:<topic>` | hash | `<partition>:<epoch>` → next offset whose records of this study are unfolded |
| `ipdp:{<id>}:replay` | hash | replay buckets: bucket end (fold time, ms) → blobs appended to it |
| `ipdp:{<id>}:replay:<end>` | list | one blob per fold: the first 8 bytes of each record id it folded |
| `ipdp:{<id>}:seen` | zset | legacy replay set (16-byte id → fold time), only read until it has expired |
| `ipdp:{<id>}:counts` | hash | `folded`, `rounds_closed`, `rejected:<reason>` (refusals that read the study's state) |
| `ipdp:{<group>:<topic>}:offsets` | hash | `<partition>` → next offset to read; `<partition>:epoch` → its epoch |
| `ipdp:{<group>:<topic>}:log-ids` | hash | partition → id of the Kafka log its offset belongs to (aggregator/logs.py) |
| `ipdp:{<group>:<topic>}:rejected` | hash | reason → count of refusals decided before any study state is read |
| `ipdp:study-hash` | hash | 16-byte study hash → study id (the registry; never in a fold's transaction) |
| `ipdp:rounds` | stream | one entry per closed round: `study`, `round` (the trainer's queue; written after the fold) |

Statistics are stored as raw little-endian float64 bytes: A as d·d values (row-major), b as d.

**The study store.** Redis is the service's source of truth for studies, the compacted studies
topic its public mirror (which devices read; see producer/studies.py): ``ipdp:{<id>}:study``
holds ``json``, ``status`` (open/closed), ``created_ms`` and ``envelope`` (the studies-topic
value last published, signed or not); ``ipdp:study-hash`` maps the 16-byte wire hash to the id.
The studies topic (``TopicSettings.studies``, cleanup.policy=compact) carries one message per
change, key = study id, value = the format-2 envelope of ipdp.study; the last value per key is
the current definition. Contributors read the topic, so they need no Redis credentials.

Readers that pin study-owner keys (the aggregator, the trainer) load a study *from its stored
envelope*, verified: a study whose signature does not verify raises :class:`SignatureError` and
is never used; one that cannot be read raises :class:`MalformedValue`. Readers that pin none
read the same envelope's study text unverified: the text carries the noise the study was created
with, which a later calibration rule must not change (ipdp.study; ``json`` is only the fallback
of an entry without an envelope). The ``status`` field stays authoritative for open/closed in
Redis (the aggregator closes a study at max_rounds without the owner's key); the envelope's
signed status is what devices see.

A study's parameters never change once created: :func:`create_study` refuses a different
definition under an existing id, and is a no-op (apart from re-publishing the current state, so
a lost topic can be repaired) when the parameters are identical. A study that never folded a
record can be deleted (:func:`delete_study`: its keys, its registry entry, a tombstone on the
topic), after which its id is free. The fold reads the stored ``hash`` with the status, so an
aggregator that still holds the deleted study's definition refuses its records even once the id
names another study.
"""

from __future__ import annotations

import logging
import re
import time
from typing import TYPE_CHECKING

import numpy as np
import redis
from pydantic import ValidationError

from ipdp.errors import (
    ConfigurationError,
    SignatureError,
    StudyExists,
    StudyInUse,
    UnknownStudy,
)
from ipdp.settings import TopicSettings
from ipdp.signing import SigningKey, TrustedKeys, warn_once
from ipdp.study import Study, StudyStatus, parse_study_message, study_message
from ipdp.topic_values import invalid_fields, load_json_object

if TYPE_CHECKING:
    from kafka import KafkaProducer

log = logging.getLogger(__name__)

PREFIX = "ipdp"
ROUNDS_STREAM = f"{PREFIX}:rounds"
STUDY_HASHES = f"{PREFIX}:study-hash"
REJECTED_FIELD = "rejected:"
"""Prefix of a study's counts field holding the refusals of one reason."""


class StudyKeys:
    """Every Redis key of one study, named once: the hash tag ``{<id>}`` puts them all in one
    slot, so one transaction may touch any of them (the table above says what each holds)."""

    def __init__(self, study_id: str) -> None:
        self.study_id = study_id
        self._tag = f"{PREFIX}:{{{study_id}}}"
        self.study = f"{self._tag}:study"
        """Study definition and status."""
        self.open = f"{self._tag}:open"
        """The open round's running statistics."""
        self.unannounced = f"{self._tag}:unannounced"
        """Closed rounds whose entry on ROUNDS_STREAM is not written yet."""
        self.published = f"{self._tag}:published"
        """Which rounds have a published model."""
        self.replay = f"{self._tag}:replay"
        """The replay buckets: bucket end time (ms) → number of blobs appended to it."""
        self.seen = f"{self._tag}:seen"
        """The replay set of earlier versions (a sorted set): read until its ids expire."""
        self.counts = f"{self._tag}:counts"
        """Per-study counters kept exactly (updated in the fold transaction)."""
        self.helper_pending = f"{self._tag}:helper-pending"
        """A two-server study's journal: job id → the helper commit a fold still owes."""

    def closed(self, round_no: int) -> str:
        """A closed round's statistics, kept until its model is published."""
        return f"{self._tag}:closed:{round_no}"

    def offsets(self, group: str, topic: str) -> str:
        """Per partition (and epoch), the offset below which this study's records are folded
        by ``group`` reading ``topic``."""
        return f"{self._tag}:offsets:{group}:{topic}"

    def replay_bucket(self, end_ms: int) -> str:
        """One replay bucket: the truncated ids folded before ``end_ms``, one blob per fold."""
        return f"{self._tag}:replay:{end_ms}"


def offsets_key(group: str, topic: str) -> str:
    """Next offset to read per partition, and each partition's epoch (moved by a resume)."""
    return f"{PREFIX}:{{{group}:{topic}}}:offsets"


def log_ids_key(group: str, topic: str) -> str:
    """Per partition, the topic id of the log the stored offset is a position in."""
    return f"{PREFIX}:{{{group}:{topic}}}:log-ids"


def rejected_key(group: str, topic: str) -> str:
    """Refusals decided before any study's state is read, by reason."""
    return f"{PREFIX}:{{{group}:{topic}}}:rejected"


def rejected_counts(r: redis.Redis, group: str, topic: str) -> dict[str, int]:
    """Every refusal by reason: the group's, plus those each registered study counted."""
    totals = {k.decode(): int(v) for k, v in r.hgetall(rejected_key(group, topic)).items()}
    for sid in sorted({v.decode() for v in r.hvals(STUDY_HASHES)}):
        for k, v in r.hgetall(StudyKeys(sid).counts).items():
            name = k.decode()
            if name.startswith(REJECTED_FIELD):
                reason = name[len(REJECTED_FIELD):]
                totals[reason] = totals.get(reason, 0) + int(v)
    return totals


def pack_stats(a: np.ndarray, b: np.ndarray) -> tuple[bytes, bytes]:
    """A (d×d) and b (d) as little-endian float64 bytes."""
    return np.ascontiguousarray(a, dtype="<f8").tobytes(), np.ascontiguousarray(b, "<f8").tobytes()


def unpack_stats(a_raw: bytes | None, b_raw: bytes | None, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of pack_stats; missing fields are zero statistics."""
    if not a_raw:
        return np.zeros((d, d)), np.zeros(d)
    a = np.frombuffer(a_raw, dtype="<f8").reshape(d, d).copy()
    b = np.frombuffer(b_raw, dtype="<f8").copy()
    return a, b


# The study store (module docstring).


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


def _publish(producer: KafkaProducer, topics: TopicSettings, study_id: str, envelope: bytes | None,
             timeout_s: float = 30.0) -> None:
    # Imported here: reading studies from Redis (`ipdp study list`) needs no Kafka client.
    from ipdp.kafka_io import send_and_wait

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
                    "json": study.to_json(), "status": StudyStatus.OPEN.value, "hash": study.hash,
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
    :class:`StudyExists` as :func:`register_study` does, before warning that it is unsigned.
    """
    _, _, created = register_study(r, study, signing_key)
    if signing_key is None:
        warn_once(log, ("unsigned studies",),
                  "study %s is created UNSIGNED: devices and aggregators that pin study keys "
                  "refuse it, and anyone who can write the studies topic can redefine it for "
                  "devices that do not. Sign studies: `ipdp keys generate --out owner`, then "
                  "--signing-key owner.key (docs/security.md)", study.study_id)
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


#: Remove KEYS[1]'s field ARGV[1] if it still holds ARGV[2]: the registry's entry of a deleted
#: study, unless a study registered since holds it.
_HDEL_IF_LUA = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""


def delete_study(r: redis.Redis, producer: KafkaProducer, topics: TopicSettings,
                 study_id: str) -> Study:
    """Remove a study that never folded a record: its Redis keys and wire hash, then a tombstone
    on the compacted studies topic, so devices, gateways and aggregators forget it and the id
    can be used again. Returns the deleted study.

    Raises :class:`UnknownStudy`, or :class:`StudyInUse` once a record was folded or a model
    published: those rounds' guarantees and models name the study, which must stay as it was.
    The check and the removal are one transaction on the study's keys, which every fold
    watches, so a fold either sees the study gone (and refuses its records, unknown_study) or
    counts before the check. Records still on their way are refused the same way.
    """
    keys = StudyKeys(study_id)
    with r.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(keys.study, keys.open, keys.counts, keys.published)
                raw, envelope = pipe.hmget(keys.study, ["json", "envelope"])
                if raw is None:
                    pipe.reset()
                    raise UnknownStudy(f"unknown study {study_id!r}")
                folded = int(pipe.hget(keys.counts, "folded") or 0)
                published = int(pipe.hlen(keys.published))
                if folded or published or pipe.exists(keys.open):
                    pipe.reset()
                    raise StudyInUse(
                        f"study {study_id!r} has folded {folded} record(s) and published "
                        f"{published} model(s): it can no longer be deleted, only closed "
                        f"(`ipdp study close {study_id}`)")
                study = _stored(study_id, raw, envelope)
                pipe.multi()
                pipe.delete(keys.study, keys.open, keys.counts, keys.unannounced,
                            keys.published, keys.replay, keys.seen)
                pipe.execute()
                break
            except redis.WatchError:
                continue
    r.eval(_HDEL_IF_LUA, 1, STUDY_HASHES, study.hash, study_id)
    # What else carries the study's tag (an aggregator group's offsets for it, replay buckets).
    leftovers = list(r.scan_iter(match=f"{PREFIX}:{{{study_id}}}:*", count=1000))
    if leftovers:
        r.delete(*leftovers)
    _publish(producer, topics, study_id, None)
    return study


def rounds_published(r: redis.Redis, study_id: str) -> int:
    """How many rounds of the study have a published model."""
    return int(r.hlen(StudyKeys(study_id).published))


#: Key names of the layout before hash tags (one Redis only), and what each became.
_LEGACY_STUDY = re.compile(
    rb"^ipdp:(study|open|published|replay|seen|counts):([A-Za-z0-9][A-Za-z0-9._-]{0,63})"
    rb"(?::(\d+))?$|^ipdp:closed:([A-Za-z0-9][A-Za-z0-9._-]{0,63}):(\d+)$")


def _legacy_target(key: bytes) -> str | None:
    m = _LEGACY_STUDY.match(key)
    if m is None:
        return None
    if m.group(4) is not None:
        return StudyKeys(m.group(4).decode()).closed(int(m.group(5)))
    kind, sid, end = m.group(1).decode(), m.group(2).decode(), m.group(3)
    if end is not None:
        return StudyKeys(sid).replay_bucket(int(end)) if kind == "replay" else None
    return f"{PREFIX}:{{{sid}}}:{kind}"


def upgrade_layout(r: redis.Redis, group: str | None = None, topic: str | None = None) -> int:
    """Rename the keys of the layout before hash tags (which existed on one Redis only) to this
    layout, in one MULTI; returns how many were renamed. Idempotent, and safe to run from
    several processes at once: a key another process renamed first is skipped.

    The aggregators' offsets hash (``ipdp:offsets:<group>:<topic>``, partition → next offset)
    becomes the group's offsets hash at epoch 0 (no study offsets: the old fold committed every
    study with its offsets, so nothing is half-folded); ``ipdp:rejected`` becomes the group's.
    """
    if isinstance(r, redis.RedisCluster):
        return 0  # the old layout could not run on a cluster: nothing to upgrade
    renames: dict[str, str] = {}
    for key in r.scan_iter(match=f"{PREFIX}:[a-z]*", count=1000):
        target = _legacy_target(key)
        if target is not None:
            renames[key.decode()] = target
    if group is not None and topic is not None:
        for old, new in ((f"{PREFIX}:offsets:{group}:{topic}", offsets_key(group, topic)),
                         (f"{PREFIX}:log-ids:{group}:{topic}", log_ids_key(group, topic)),
                         (f"{PREFIX}:rejected", rejected_key(group, topic))):
            if r.exists(old):
                renames[old] = new
    if not renames:
        return 0
    with r.pipeline(transaction=True) as pipe:
        for old, new in renames.items():
            pipe.renamenx(old, new)
        done = pipe.execute(raise_on_error=False)
    moved = sum(1 for x in done if x is True or x == 1)
    kept = [old for old, x in zip(renames, done, strict=True) if x == 0]
    if kept:
        log.warning("upgrade: %d keys of the old layout were kept because their new name "
                    "exists already (first: %s)", len(kept), kept[0])
    log.warning("upgrade: renamed %d Redis keys to the hash-tagged layout", moved)
    return moved
