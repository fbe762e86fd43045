"""Redis key layout: the only state ipdp keeps. No key ever holds a record or any part of one.

Every key a transaction touches shares one hash slot, so ipdp runs on Redis Cluster as on one
Redis: a study's keys carry the hash tag ``{id}``, an aggregator group's bookkeeping the tag
``{group:topic}`` (the part in braces is literal; ``<id>`` below is a placeholder).

| key | type | holds |
|---|---|---|
| `ipdp:{<id>}:study` | hash | `json` (the Study), `status` (open/closed), `created_ms`, `envelope` |
| `ipdp:{<id>}:open` | hash | the open round: `round`, `count`, `A` (d×d f8), `b` (d f8) |
| `ipdp:{<id>}:closed:<round>` | hash | a closed round's `A`, `b`, `count`, `closed_ms` until its model is published |
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
"""

from __future__ import annotations

import logging
import re

import numpy as np
import redis

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
