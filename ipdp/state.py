"""Redis key layout: the only state ipdp keeps. No key ever holds a record or any part of one.

| key | type | holds |
|---|---|---|
| `ipdp:study:{id}` | hash | `json` (the Study), `status` (open/closed), `created_ms` |
| `ipdp:study-hash` | hash | 16-byte study hash → study id (for decoding records) |
| `ipdp:open:{id}` | hash | the open round: `round`, `count`, `A` (d×d f8), `b` (d f8) |
| `ipdp:closed:{id}:{round}` | hash | a closed round's `A`, `b`, `count`, `closed_ms` until its model is published |
| `ipdp:published:{id}` | hash | round → publication time (ms) |
| `ipdp:rounds` | stream | one entry per closed round: `study`, `round` (the trainer's queue) |
| `ipdp:offsets:{group}:{topic}` | hash | partition → next offset to fold (written with the statistics) |
| `ipdp:log-ids:{group}:{topic}` | hash | partition → id of the Kafka log its offset belongs to (aggregator/logs.py) |
| `ipdp:replay:{id}` | hash | replay buckets: bucket end (fold time, ms) → blobs appended to it |
| `ipdp:replay:{id}:{end}` | list | one blob per fold: the first 8 bytes of each record id it folded |
| `ipdp:seen:{id}` | zset | legacy replay set (16-byte id → fold time), only read until it has expired |
| `ipdp:counts:{id}` | hash | `accepted`, `folded`, `rounds_closed` |
| `ipdp:rejected` | hash | reason → count, over all studies (unknown studies have no id) |

Statistics are stored as raw little-endian float64 bytes: A as d·d values (row-major), b as d.
"""

from __future__ import annotations

import numpy as np

PREFIX = "ipdp"
ROUNDS_STREAM = f"{PREFIX}:rounds"
STUDY_HASHES = f"{PREFIX}:study-hash"
REJECTED = f"{PREFIX}:rejected"


def study_key(study_id: str) -> str:
    """Study definition and status."""
    return f"{PREFIX}:study:{study_id}"


def open_key(study_id: str) -> str:
    """The open round's running statistics."""
    return f"{PREFIX}:open:{study_id}"


def closed_key(study_id: str, round_no: int) -> str:
    """A closed round's statistics, kept until its model is published."""
    return f"{PREFIX}:closed:{study_id}:{round_no}"


def published_key(study_id: str) -> str:
    """Which rounds have a published model."""
    return f"{PREFIX}:published:{study_id}"


def offsets_key(group: str, topic: str) -> str:
    """Next offset to fold per partition, written atomically with the statistics."""
    return f"{PREFIX}:offsets:{group}:{topic}"


def log_ids_key(group: str, topic: str) -> str:
    """Per partition, the topic id of the log the stored offset is a position in."""
    return f"{PREFIX}:log-ids:{group}:{topic}"


def seen_key(study_id: str) -> str:
    """The replay set of earlier versions (a sorted set): read until its ids expire, never written."""
    return f"{PREFIX}:seen:{study_id}"


def replay_key(study_id: str) -> str:
    """The study's replay buckets: bucket end time (ms) → number of blobs appended to it."""
    return f"{PREFIX}:replay:{study_id}"


def replay_bucket_key(study_id: str, end_ms: int) -> str:
    """One replay bucket: the truncated ids folded before ``end_ms``, one blob per fold."""
    return f"{PREFIX}:replay:{study_id}:{end_ms}"


def counts_key(study_id: str) -> str:
    """Per-study counters kept exactly (updated in the fold transaction)."""
    return f"{PREFIX}:counts:{study_id}"


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
