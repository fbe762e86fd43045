"""Every check on a polled batch that does not depend on Redis state, vectorised per study.

Decode (ipdp.wire) → known study → dimension → norm bounds → time window. What passes is grouped
per study as arrays, in (partition, offset) order, for the fold; what fails becomes a
:class:`Rejection` with its reason, for the dead-letter topic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ipdp.calibration import record_norm_bounds
from ipdp.study import Study
from ipdp.wire import RecordBatch, RejectReason, decode_batch


@dataclass(frozen=True)
class Message:
    """The parts of a Kafka record the fold needs."""

    partition: int
    offset: int
    value: bytes | None


@dataclass(frozen=True)
class Rejection:
    """A message that will not be folded, and why."""

    message: Message
    reason: RejectReason
    detail: str


@dataclass
class ValidRows:
    """Rows that passed every stateless check, for one study, in (partition, offset) order."""

    study: Study
    messages: list[Message]
    record_id: np.ndarray
    q: np.ndarray
    p: np.ndarray


class Validator:
    """Stateless checks for one aggregator; ``lookup`` maps a 16-byte wire hash to its study."""

    def __init__(self, lookup: Callable[[bytes], Study | None], *, replay_window_s: int,
                 max_future_skew_s: int, max_message_bytes: int) -> None:
        self.lookup = lookup
        self.window_ms = replay_window_s * 1000
        self.skew_ms = max_future_skew_s * 1000
        self.max_message_bytes = max_message_bytes

    def validate(self, messages: Sequence[Message], now_ms: int):
        """Every check that does not depend on Redis state, vectorised per study."""
        rejects: list[Rejection] = []
        batches, bad = decode_batch([m.value for m in messages], self.max_message_bytes)
        rejects += [Rejection(messages[i], err.reason, err.detail) for i, err in bad]
        valid: dict[str, ValidRows] = {}
        for batch in batches:
            keys = batch.study_hash.view("V16").ravel()
            for key in np.unique(keys):
                rows = batch.take(np.flatnonzero(keys == key))
                study = self.lookup(bytes(key))
                if study is None:
                    rejects += [Rejection(messages[i], RejectReason.UNKNOWN_STUDY,
                                          f"no study has hash {bytes(key).hex()}")
                                for i in rows.index]
                    continue
                rows = self._check_rows(study, rows, messages, now_ms, rejects)
                if len(rows) == 0:
                    continue
                v = valid.get(study.study_id)
                msgs = [messages[i] for i in rows.index]
                if v is None:
                    valid[study.study_id] = ValidRows(study, msgs, rows.record_id, rows.q, rows.p)
                else:
                    v.messages += msgs
                    v.record_id = np.concatenate([v.record_id, rows.record_id])
                    v.q = np.concatenate([v.q, rows.q])
                    v.p = np.concatenate([v.p, rows.p])
        for v in valid.values():
            order = sorted(range(len(v.messages)),
                           key=lambda i: (v.messages[i].partition, v.messages[i].offset))
            if order != list(range(len(order))):
                v.messages = [v.messages[i] for i in order]
                v.record_id = v.record_id[order]
                v.q, v.p = v.q[order], v.p[order]
        rejects.sort(key=lambda x: (x.message.partition, x.message.offset))
        return rejects, list(valid.values())

    def _check_rows(self, study: Study, rows: RecordBatch, messages, now_ms,
                    rejects) -> RecordBatch:
        """Dimension, norm bounds and the time window; returns the rows that pass."""
        if rows.d != study.d:
            rejects += [Rejection(messages[i], RejectReason.WRONG_DIMENSION,
                                  f"record has d={rows.d}, study {study.study_id} has d={study.d}")
                        for i in rows.index]
            return rows.take(np.zeros(len(rows), bool))
        max_q, max_p = record_norm_bounds(study.calibration)
        norm_q = np.linalg.norm(rows.q, axis=1)
        norm_p = np.linalg.norm(rows.p, axis=1)
        checks = [
            (norm_q > max_q, RejectReason.NORM_OUT_OF_BOUNDS, f"‖q̃‖ exceeds {max_q:.4g}"),
            (norm_p > max_p, RejectReason.NORM_OUT_OF_BOUNDS, f"‖p̃‖ exceeds {max_p:.4g}"),
            (rows.created_ms < now_ms - self.window_ms, RejectReason.STALE,
             "created before the replay window"),
            (rows.created_ms > now_ms + self.skew_ms, RejectReason.FUTURE,
             "created too far in the future"),
        ]
        ok = np.ones(len(rows), bool)
        for bad, reason, detail in checks:
            hit = bad & ok
            rejects += [Rejection(messages[i], reason, detail) for i in rows.index[hit]]
            ok &= ~bad
        return rows.take(ok)
