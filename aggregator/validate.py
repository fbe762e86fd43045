"""Every check on a polled batch that does not depend on Redis state, vectorised per study.

A poll arrives as one :class:`~aggregator.batch.Polled`: partitions, offsets and values as the
fetch gathered them. Containers (wire version 2) are split into their records (one row each,
with its position in the container) → decode (ipdp.wire) → (the Folder looks the studies up) →
known study → dimension → norm bounds → time window → credential. What passes is grouped per
study as arrays (:class:`ValidRows`), in (partition, offset, index) order, for the fold; what
fails is refused by row arrays, one reason and detail per group of rows, and becomes one
:class:`~aggregator.batch.Refused` for the dead-letter topic: no check makes a Python object per
record it refuses.

The study hash binds every parameter a device used (ipdp.study), so a record perturbed under
anything but a registered study's exact calibration matches no study: ``study_mismatch`` when the
record's ``study`` header names a registered study (the device was handed other parameters under
that id), ``unknown_study`` otherwise. The lookup resolves a study whose signature does not
verify to a MalformedRecord: ``untrusted_study``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aggregator.batch import Polled, Refused
from aggregator.credentials import CredentialCheck
from aggregator.studies import Resolved
from ipdp.signing import TrustedKeys
from ipdp.study import Study
from ipdp.wire import (
    CONTAINER_VERSION,
    MalformedRecord,
    RecordBatch,
    RecordWindow,
    RejectReason,
    decode_batch,
    split_container,
    squared_norms,
)

__all__ = ["Decoded", "ValidRows", "Validator", "split_containers"]

#: Rows refused for one reason and detail: (rows of the Polled, reason, detail).
RefusedRows = tuple[np.ndarray, RejectReason, str]


def split_containers(polled: Polled, max_message_bytes: int) -> tuple[Polled, Refused]:
    """One row per record: every version-2 value is replaced by its records (index 0..k-1);
    a container longer than ``max_message_bytes`` is refused whole as oversized (as a single
    record that long is), one that does not split as undecodable."""
    values = polled.values
    try:
        lengths = np.fromiter(map(len, values), np.int64, len(values))
        joined = np.frombuffer(b"".join(values), np.uint8)
        starts = np.cumsum(lengths) - lengths
        firsts = np.where(lengths > 0, joined[np.minimum(starts, max(len(joined) - 1, 0))], 0) \
            if len(joined) else np.zeros(len(values), np.uint8)
    except TypeError:  # a tombstone (None) or an odd type: the decoder rejects it
        firsts = None
    if firsts is not None and len(firsts) == len(values):
        containers = np.flatnonzero(firsts == CONTAINER_VERSION)
    else:
        containers = np.array([i for i, v in enumerate(values)
                               if isinstance(v, bytes | bytearray | memoryview) and len(v)
                               and v[0] == CONTAINER_VERSION], np.int64)
    if len(containers) == 0:
        return polled, Refused.none()
    refused: list[Refused] = []
    parts, offs, idx, vals = [], [], [], []
    heads = None if polled.headers is None else []
    last = 0
    for c in containers.tolist():
        parts.append(polled.partition[last:c])
        offs.append(polled.offset[last:c])
        idx.append(polled.index[last:c])
        vals += values[last:c]
        if heads is not None:
            heads += polled.headers[last:c]
        last = c + 1
        if len(values[c]) > max_message_bytes:
            refused.append(Refused.of(
                polled, [c], RejectReason.OVERSIZED,
                f"container of {len(values[c])} bytes exceeds {max_message_bytes}"))
            continue
        records = split_container(values[c])
        if records is None:
            refused.append(Refused.of(polled, [c], RejectReason.UNDECODABLE,
                                      "malformed container: count, length or reserved bytes "
                                      "do not add up"))
            continue
        k = len(records)
        parts.append(np.full(k, polled.partition[c]))
        offs.append(np.full(k, polled.offset[c]))
        idx.append(np.arange(k, dtype=np.int64))
        vals += records
        if heads is not None:
            heads += [polled.headers[c]] * k
    parts.append(polled.partition[last:])
    offs.append(polled.offset[last:])
    idx.append(polled.index[last:])
    vals += values[last:]
    if heads is not None:
        heads += polled.headers[last:]
    return (Polled(np.concatenate(parts), np.concatenate(offs), vals, np.concatenate(idx), heads),
            Refused.join(refused))


@dataclass
class ValidRows:
    """Rows that passed every stateless check, for one study, in (partition, offset) order;
    ``row`` points into the Polled the validator was given."""

    study: Study
    row: np.ndarray
    record_id: np.ndarray
    q: np.ndarray
    p: np.ndarray

    def take(self, keep: np.ndarray) -> ValidRows:
        """The rows where (or at the positions) ``keep``."""
        return ValidRows(self.study, self.row[keep], self.record_id[keep], self.q[keep],
                         self.p[keep])


@dataclass(frozen=True)
class Decoded:
    """A batch's records decoded (one RecordBatch per dimension), the rows that did not decode,
    and the distinct 16-byte study hashes the records carry."""

    batches: list[RecordBatch]
    undecoded: list[tuple[int, RejectReason, str]]
    study_hashes: list[bytes]


class Validator:
    """Every check on a batch that does not read Redis. The Folder looks the studies up first
    (:meth:`decode` says which hashes), so :meth:`validate` is a pure function of the rows, the
    studies and the clock."""

    def __init__(self, *, replay_window_s: int, max_future_skew_s: int,
                 max_message_bytes: int, credentials: CredentialCheck | None = None) -> None:
        self.credentials = credentials or CredentialCheck(
            TrustedKeys(), replay_window_s=replay_window_s, max_future_skew_s=max_future_skew_s)
        self.window = RecordWindow(replay_window_s * 1000, max_future_skew_s * 1000)
        self.max_message_bytes = max_message_bytes

    def decode(self, rows: Polled) -> Decoded:
        """Decode ``rows`` (containers already split), vectorised per dimension."""
        batches, undecoded = decode_batch(rows.values, self.max_message_bytes)
        keys = np.concatenate([b.study_hash for b in batches]).view("V16").ravel() \
            if batches else np.zeros(0, "V16")
        return Decoded(batches, [(i, err.reason, err.detail) for i, err in undecoded],
                       [bytes(k) for k in np.unique(keys)])

    def validate(self, rows: Polled, decoded: Decoded, studies: dict[bytes, Resolved],
                 registered: dict[str, bool], now_ms: int) -> tuple[Refused, list[ValidRows]]:
        """Every stateless check; ``studies`` resolves each of ``decoded.study_hashes``,
        ``registered`` says which ``study`` headers of unmatched rows name a registered study
        (:meth:`unmatched_headers`). Rows are in (partition, offset, index) order."""
        refused: list[RefusedRows] = []
        passed: dict[bytes, ValidRows] = {}  # by study hash: one id may name two (a deleted one)
        for batch in decoded.batches:
            keys = batch.study_hash.view("V16").ravel()
            if (batch.study_hash == batch.study_hash[0]).all():  # one study: skip the sort
                uniq, inverse = keys[:1], None
            else:
                uniq, inverse = np.unique(keys, return_inverse=True)
            for u, key in enumerate(uniq):
                found = studies[bytes(key)]
                part = batch if inverse is None else batch.take(inverse.ravel() == u)
                if isinstance(found, MalformedRecord):
                    refused.append((part.index, found.reason, found.detail))
                elif found is None:
                    refused += self._unmatched(rows, part.index, bytes(key), registered)
                elif found.two_server is not None:  # its rounds are ring sums of shares
                    detail = (f"study {found.study_id} is a two-server study: its records "
                              "are version 3 (aggregator/two_server.py)")
                    refused.append((part.index, RejectReason.UNSUPPORTED_VERSION, detail))
                else:
                    part = self._check_rows(found, part, now_ms, refused)
                    if found.require_credentials and len(part):
                        part = self.credentials.admit(found, part, rows, now_ms, refused)
                    if len(part):
                        # A study has one d and the decoder makes one batch per d, so a study's
                        # rows pass in this batch only, in row order as decode_batch keeps them.
                        passed[bytes(key)] = ValidRows(found, part.index, part.record_id,
                                                       part.q, part.p)
        return (Refused.join([Refused.of_each(rows, decoded.undecoded)]
                             + [Refused.of(rows, *group) for group in refused]).in_order(),
                list(passed.values()))

    @staticmethod
    def unmatched_headers(rows: Polled, decoded: Decoded,
                          studies: dict[bytes, Resolved]) -> set[str]:
        """The ``study`` headers of the rows whose hash names no study (to look up before
        :meth:`validate`)."""
        unknown = [k for k, v in studies.items() if v is None]
        if not unknown:
            return set()
        missing = np.frombuffer(b"".join(unknown), "V16")
        names: set[str] = set()
        for batch in decoded.batches:
            hit = np.isin(batch.study_hash.view("V16").ravel(), missing)
            names.update(x for x in rows.study_headers(batch.index[hit].tolist())
                         if x is not None)
        return names

    @staticmethod
    def _unmatched(rows: Polled, picked: np.ndarray, key: bytes,
                   registered: dict[str, bool]) -> list[RefusedRows]:
        """Rows whose hash matches no study: ``study_mismatch`` if their ``study`` header names a
        registered study (one group per such study), else ``unknown_study``."""
        names = np.array([x if x is not None and registered.get(x) else ""
                          for x in rows.study_headers(picked.tolist())], object)
        out: list[RefusedRows] = []
        for name in sorted(set(names.tolist())):
            where = picked[names == name]
            if name:
                detail = (f"hash {key.hex()} is not study {name}'s: the record was perturbed "
                          "under other parameters than the registered ones")
                out.append((where, RejectReason.STUDY_MISMATCH, detail))
            else:
                out.append((where, RejectReason.UNKNOWN_STUDY, f"no study has hash {key.hex()}"))
        return out

    def _check_rows(self, study: Study, rows: RecordBatch, now_ms: int,
                    refused: list[RefusedRows]) -> RecordBatch:
        """Dimension, norm bounds and the time window; returns the rows that pass."""
        if rows.d != study.d:
            refused.append((rows.index, RejectReason.WRONG_DIMENSION,
                            f"record has d={rows.d}, study {study.study_id} has d={study.d}"))
            return rows.take(np.zeros(len(rows), bool))
        sq_q, sq_p = ((rows.sq_q, rows.sq_p) if rows.sq_q is not None
                      else squared_norms(rows.q, rows.p))
        checks = (study.norm_bounds.failures(sq_q, sq_p)
                  + self.window.failures(rows.created_ms, now_ms))
        ok = np.ones(len(rows), bool)
        for bad, reason, detail in checks:
            hit = bad & ok
            if hit.any():
                refused.append((rows.index[hit], reason, detail))
            ok &= ~bad
        return rows if ok.all() else rows.take(ok)

