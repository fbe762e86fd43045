"""Every check on a polled batch that does not depend on Redis state, vectorised per study.

Decode (ipdp.wire) → known study → dimension → norm bounds → time window. What passes is grouped
per study as arrays, in (partition, offset) order, for the fold; what fails becomes a
:class:`Rejection` with its reason, for the dead-letter topic.

The study hash binds every parameter a device used (ipdp.study), so a record perturbed under
anything but a registered study's exact calibration matches no study: ``study_mismatch`` when the
record's ``study`` header names a registered study (the device was handed other parameters under
that id), ``unknown_study`` otherwise. The lookup refuses (raises MalformedRecord) a study whose
signature does not verify: ``untrusted_study``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ipdp.calibration import record_norm_bounds
from ipdp.study import Study
from ipdp.wire import MalformedRecord, RecordBatch, RejectReason, decode_batch


@dataclass(frozen=True)
class Message:
    """The parts of a Kafka record the fold needs; ``study_id`` is the device's ``study`` header."""

    partition: int
    offset: int
    value: bytes | None
    study_id: str | None = None


def header_study(headers) -> str | None:
    """The ``study`` header of a Kafka record (producer.contributor.study_headers), if any."""
    for name, value in headers or ():
        if name == "study" and value is not None:
            return bytes(value).decode("utf-8", "replace")
    return None


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
    """Stateless checks for one aggregator.

    ``lookup`` maps a 16-byte wire hash to its study (None: no such study; raises MalformedRecord
    to refuse it); ``registered`` says whether a study id exists.
    """

    def __init__(self, lookup: Callable[[bytes], Study | None],
                 registered: Callable[[str], bool], *, replay_window_s: int,
                 max_future_skew_s: int, max_message_bytes: int) -> None:
        self.lookup = lookup
        self.registered = registered
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
                try:
                    study = self.lookup(bytes(key))
                except MalformedRecord as exc:
                    rejects += [Rejection(messages[i], exc.reason, exc.detail)
                                for i in rows.index]
                    continue
                if study is None:
                    rejects += self._unmatched([messages[i] for i in rows.index], bytes(key))
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

    def _unmatched(self, msgs: list[Message], key: bytes) -> list[Rejection]:
        registered = {sid: self.registered(sid) for sid in {m.study_id for m in msgs} if sid}
        return [
            Rejection(m, RejectReason.STUDY_MISMATCH,
                      f"hash {key.hex()} is not study {m.study_id}'s: the record was perturbed "
                      "under other parameters than the registered ones")
            if registered.get(m.study_id) else
            Rejection(m, RejectReason.UNKNOWN_STUDY, f"no study has hash {key.hex()}")
            for m in msgs]

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
