"""The gateway's per-record checks, and the HTTP status of every reason.

The check step of the ingest pipeline (gateway.ingest) asks :func:`why_refused` of a body's
records. The checks are one sequence, :func:`_failures`, whose verdicts come from the one
vocabulary ``ipdp.wire.RejectReason``; it reads its fields from either of two readers of the same
wire fields: numpy columns of k records (one comparison per check over all of them:
:func:`check_records`), or one record's Python scalars (a device's request holds one record, and
for one the numpy calls cost more than the checks). A check added to the sequence is applied to
both.

A study's records are of one version: version 1 (q̃ and p̃ in clear, :class:`_Records`,
:class:`_Record`) for a one-server study, version 3 (the leader's share and the helper's sealed
share, ipdp.two_server_wire; :class:`_TwoServerRecords`, :class:`_TwoServerRecord`) for a
two-server study. A version-3 record's values cannot be read without the helper, so its checks
are those of its header and layout: no finite-value or norm check (docs/architecture.md, "The
gateway").
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from math import hypot, isfinite

import numpy as np

from ipdp.study import Study
from ipdp.two_server_wire import TWO_SERVER_WIRE_VERSION, TwoServerLayout
from ipdp.wire import (
    CREATED_MS_BYTES,
    CREATED_MS_WORD,
    D_BYTES,
    HEAD_D_SHIFT,
    HEAD_RESERVED_MASK,
    HEAD_VERSION_MASK,
    HEAD_WORD,
    HEAD_WORD_BYTES,
    HEADER_SIZE,
    ID_SIZE,
    RECORD_ID_WORDS,
    RESERVED_BYTES,
    STUDY_HASH_BYTES,
    STUDY_HASH_WORDS,
    STUDY_HEAD_BYTES,
    VALUES_OFFSET,
    VALUES_WORD,
    VERSION_BYTE,
    WIRE_VERSION,
    RecordWindow,
    RejectReason,
    record_size,
    squared_norms,
)

__all__ = ["HTTP_STATUS", "RECORD_OK", "check_records", "reason_of", "study_record_size",
           "study_version", "why_refused"]

#: The HTTP status of every reason the gateway answers with (the OpenAPI document lists them
#: from here); a reason the gateway never gives (replayed, credential_reused across requests,
#: …) is absent.
HTTP_STATUS: dict[RejectReason, int] = {
    RejectReason.UNDECODABLE: 400,
    RejectReason.UNSUPPORTED_VERSION: 400,
    RejectReason.WRONG_DIMENSION: 400,
    RejectReason.NON_FINITE: 400,
    RejectReason.STUDY_MISMATCH: 400,
    RejectReason.NORM_OUT_OF_BOUNDS: 400,
    RejectReason.STALE: 400,
    RejectReason.FUTURE: 400,
    RejectReason.DUPLICATE_RECORD: 400,
    RejectReason.BAD_REQUEST: 400,
    RejectReason.UNKNOWN_STUDY: 404,
    RejectReason.NOT_FOUND: 404,
    RejectReason.METHOD_NOT_ALLOWED: 405,
    RejectReason.CREDENTIAL_MISSING: 401,
    RejectReason.CREDENTIAL_INVALID: 401,
    RejectReason.CREDENTIAL_UNTRUSTED: 401,
    RejectReason.CREDENTIAL_EXPIRED: 403,
    RejectReason.CREDENTIAL_WRONG_STUDY: 403,
    RejectReason.CREDENTIAL_BAD_SLOT: 403,
    RejectReason.CREDENTIAL_REUSED: 403,
    RejectReason.CLOSED_STUDY: 409,
    RejectReason.TOO_LARGE: 413,
    RejectReason.UNSUPPORTED_MEDIA_TYPE: 415,
    RejectReason.RATE_LIMITED: 429,
    RejectReason.KAFKA_UNAVAILABLE: 503,
    RejectReason.STUDIES_UNAVAILABLE: 503,
    RejectReason.NOT_READY: 503,
}

#: The verdict of a record that passed every check (reason codes are 1 + the member's position).
RECORD_OK = 0
_REASONS = list(RejectReason)
_CODES = {reason: position + 1 for position, reason in enumerate(_REASONS)}


def reason_of(code: int) -> RejectReason:
    """The reason a non-zero verdict of :func:`check_records` stands for."""
    return _REASONS[code - 1]


def study_version(study: Study) -> int:
    """The wire version of every record of ``study``: 3 for a two-server study, else 1."""
    return WIRE_VERSION if study.two_server is None else TWO_SERVER_WIRE_VERSION


def study_record_size(study: Study) -> int:
    """The bytes of one record of ``study`` (48 + 16·d for version 1; 2,004 at d = 14 for
    version 3)."""
    if study.two_server is None:
        return record_size(study.d)
    return TwoServerLayout(study.d).size


class _Headers:
    """The header fields of k records as numpy columns: ``words`` holds each record's six
    header words (ipdp.wire's word names)."""

    words: np.ndarray

    def other_study(self, study_hash: bytes) -> np.ndarray:
        return (self.words[:, STUDY_HASH_WORDS] != np.frombuffer(study_hash, "<u8")).any(axis=1)

    def repeated_ids(self) -> np.ndarray:
        """Each record whose id an earlier record of the request holds (np.unique keeps each
        id's first occurrence)."""
        if len(self.words) == 1:
            return np.zeros(1, bool)
        ids = np.ascontiguousarray(self.words[:, RECORD_ID_WORDS]).view(f"V{ID_SIZE}").ravel()
        repeated = np.ones(len(ids), bool)
        repeated[np.unique(ids, return_index=True)[1]] = False
        return repeated


class _Records(_Headers):
    """The wire fields of k version-1 records of dimension d, back to back, as numpy columns of
    their little-endian 64-bit words (no copy)."""

    def __init__(self, records: bytes, d: int) -> None:
        self.d = d
        self.words = np.frombuffer(records, "<u8").reshape(-1, record_size(d) // 8)
        self.head = self.words[:, HEAD_WORD]
        self.values = self.words[:, VALUES_WORD:].view("<f8")
        self.created_ms = self.words[:, CREATED_MS_WORD].view("<i8")

    def non_finite(self) -> np.ndarray:
        return ~np.isfinite(self.values).all(axis=1)

    def squared_norms(self) -> tuple[np.ndarray, np.ndarray]:
        return squared_norms(self.values[:, :self.d], self.values[:, self.d:])


class _TwoServerRecords(_Headers):
    """The header fields and proof length of k version-3 records of dimension d, back to back,
    as numpy columns. A version-3 record is not a whole number of words (100 + 16·L bytes), so
    the headers are copied out (48 bytes a record) rather than viewed."""

    def __init__(self, records: bytes, d: int) -> None:
        layout = TwoServerLayout(d)
        raw = np.frombuffer(records, np.uint8).reshape(-1, layout.size)
        self.words = np.ascontiguousarray(raw[:, :HEADER_SIZE]).view("<u8")
        self.head = self.words[:, HEAD_WORD]
        self.created_ms = self.words[:, CREATED_MS_WORD].view("<i8")
        self.proof_length = np.ascontiguousarray(raw[:, layout.proof_length]).view("<u4").ravel()


class _Header:
    """The header fields of one record, as Python scalars."""

    def __init__(self, record: bytes) -> None:
        self.record = record
        self.head = int.from_bytes(record[HEAD_WORD_BYTES], "little")
        self.created_ms = int.from_bytes(record[CREATED_MS_BYTES], "little", signed=True)

    def other_study(self, study_hash: bytes) -> bool:
        return self.record[STUDY_HASH_BYTES] != study_hash

    def repeated_ids(self) -> bool:
        return False


class _Record(_Header):
    """The wire fields of one version-1 record of dimension d, as Python scalars."""

    def __init__(self, record: bytes, d: int) -> None:
        super().__init__(record)
        self.d = d

    def non_finite(self) -> bool:
        return not all(map(isfinite, _values(self.record)))

    def squared_norms(self) -> tuple[float, float]:
        values = np.frombuffer(self.record, "<f8", offset=VALUES_OFFSET).reshape(1, -1)
        sq_q, sq_p = squared_norms(values[:, :self.d], values[:, self.d:])
        return sq_q[0], sq_p[0]


class _TwoServerRecord(_Header):
    """The header fields and proof length of one version-3 record, as Python scalars."""

    def __init__(self, record: bytes, d: int) -> None:
        super().__init__(record)
        self.proof_length = int.from_bytes(record[TwoServerLayout(d).proof_length], "little")


#: A validity proof's length must be 0 until studies require proofs (docs/wire-format.md).
_NO_PROOF_YET = "a validity proof is not accepted yet (proof length ≠ 0)"


def _failures(rows: _Headers | _Header, study: Study, window: RecordWindow,
              now_ms: int) -> Iterator[tuple[object, RejectReason, str | None]]:
    """The checks, in order: ``(where they fail, reason, detail)``, over one record's scalars or
    k records' columns; the detail of a check on the record's header is None (``_DETAIL`` has
    it).

    Version (the study's: 1, or 3 for a two-server study), reserved bytes, the header's d against
    the study's (the three are bits of the head word), for version 1 finite q̃ and p̃ and for
    version 3 a zero proof length, the study hash, then what the aggregator would dead-letter
    (for version 1 ``RecordNormBounds``: norms outside the study's two-sided bounds; for both
    ``RecordWindow``: creation time outside ``window``), then an id an earlier record of the
    request holds (the aggregator would dead-letter the copy as replayed, at a higher cost than
    a fold: it is refused here, before anything is produced). Lazy, so one record stops at its
    first failure.
    """
    one_server = study.two_server is None
    yield (rows.head & HEAD_VERSION_MASK) != study_version(study), \
        RejectReason.UNSUPPORTED_VERSION, None
    yield (rows.head & HEAD_RESERVED_MASK) != 0, RejectReason.UNDECODABLE, None
    yield (rows.head >> HEAD_D_SHIFT) != study.d, RejectReason.WRONG_DIMENSION, None
    if one_server:
        yield rows.non_finite(), RejectReason.NON_FINITE, None
    else:
        yield rows.proof_length != 0, RejectReason.UNDECODABLE, _NO_PROOF_YET
    yield rows.other_study(study.hash), RejectReason.STUDY_MISMATCH, None
    if one_server:
        yield from study.norm_bounds.failures(*rows.squared_norms())
    yield from window.failures(rows.created_ms, now_ms)
    yield rows.repeated_ids(), RejectReason.DUPLICATE_RECORD, None


def _columns(records: bytes, study: Study) -> _Records | _TwoServerRecords:
    """The numpy reader of the study's record version."""
    reader = _Records if study.two_server is None else _TwoServerRecords
    return reader(records, study.d)


def check_records(records: bytes, study: Study, window: RecordWindow, now_ms: int) -> np.ndarray:
    """The verdict of each record of ``records`` (records of the study's version and size, back
    to back) at time ``now_ms``: ``RECORD_OK`` or the code of its first failed check
    (:func:`reason_of`), uint8 (k,).

    Every check of :func:`_failures` is one comparison over all k rows, so one record or ten
    thousand cost a handful of numpy calls. ``len(records)`` must be a multiple of the record
    size (see :func:`why_refused`, which says why a body is not).
    """
    rows = _columns(records, study)
    verdict = np.zeros(len(rows.words), np.uint8)
    # Assigned from the last check to the first, so each row keeps its first failure.
    for bad, reason, _ in reversed(list(_failures(rows, study, window, now_ms))):
        verdict[bad] = _CODES[reason]
    return verdict


def why_refused(body: bytes, study: Study, window: RecordWindow,
                    now_ms: int) -> tuple[RejectReason, str] | None:
    """Why a request body of the study's records is refused at ``now_ms``, or None if every
    record passes.

    A body that is not a whole number of the study's records is refused as a whole
    (``wrong_dimension`` if its first header names the study's version and another d,
    ``unsupported_version`` if it names the other record version, else ``undecodable``);
    otherwise the first record whose verdict is not OK names the reason.
    """
    size, n = study_record_size(study), len(body)
    if n == size:
        if _clearly_accepted(body, study, window, now_ms):
            return None
        return _first_failure(body, study, window, now_ms)
    if n == 0:
        return RejectReason.UNDECODABLE, "the body holds no record"
    if n % size:
        return _misfit(body, study, size)
    verdict = check_records(body, study, window, now_ms)
    bad = np.flatnonzero(verdict)
    if not bad.size:
        return None
    i = int(bad[0])
    record = body[i * size:(i + 1) * size]
    if reason_of(int(verdict[i])) is RejectReason.DUPLICATE_RECORD:
        ids = _columns(body, study).words[:, RECORD_ID_WORDS]
        first = int(np.flatnonzero((ids == ids[i]).all(axis=1))[0])
        return RejectReason.DUPLICATE_RECORD, (f"record {i} has the record id of record {first}: "
                                               "a request holds each record once")
    return _first_failure(record, study, window, now_ms, i)


def _misfit(body: bytes, study: Study, size: int) -> tuple[RejectReason, str]:
    """Why a body that is not a whole number of the study's records is refused, from its first
    header where that says more than its length."""
    if len(body) >= D_BYTES.stop:
        version = body[VERSION_BYTE]
        if version == study_version(study):
            d = _header_d(body)
            if d != study.d:
                return (RejectReason.WRONG_DIMENSION,
                        f"record 0 has d={d}, study {study.study_id!r} has d={study.d}")
        elif version in _RECORD_VERSIONS:
            return RejectReason.UNSUPPORTED_VERSION, f"record 0: {_version_detail(body, study)}"
    if study.two_server is None:
        formula = f"48 + 16·d, d={study.d}"
    else:
        formula = f"100 + 16·L, L = d(d+3)/2 = {TwoServerLayout(study.d).entries}, d={study.d}"
    return (RejectReason.UNDECODABLE,
            f"body length {len(body)} is not a multiple of the record size {size} ({formula})")


#: The record versions a device sends (version 2 is a container, which only Kafka carries).
_RECORD_VERSIONS = (WIRE_VERSION, TWO_SERVER_WIRE_VERSION)


def _first_failure(record: bytes, study: Study, window: RecordWindow, now_ms: int,
                   i: int = 0) -> tuple[RejectReason, str] | None:
    """The first check of :func:`_failures` that record ``i`` of a request fails, and why."""
    reader = _Record if study.two_server is None else _TwoServerRecord
    for bad, reason, detail in _failures(reader(record, study.d), study, window, now_ms):
        if bad:
            return reason, f"record {i}: {detail or _DETAIL[reason](record, study)}"
    return None


#: The one-record shortcut accepts norms this far (relatively) inside the bounds; a record
#: nearer a bound goes through the checks, which sum like the aggregator.
_SHORTCUT_MARGIN = 1e-9


def _clearly_accepted(record: bytes, study: Study, window: RecordWindow, now_ms: int) -> bool:
    """True only if one record passes every check of :func:`_failures`, decided cheaply: its
    head is the one every record of the study has (version, reserved bytes, d, hash), its time
    inside the window, and for version 1 its values finite and its norms (on Python floats)
    _SHORTCUT_MARGIN inside the bounds, for version 3 its proof length 0. False says nothing:
    the checks decide then."""
    if record[STUDY_HEAD_BYTES] != _study_head(study_version(study), study.d, study.hash):
        return False
    created_ms = int.from_bytes(record[CREATED_MS_BYTES], "little", signed=True)
    if not (now_ms - window.replay_window_ms <= created_ms <= now_ms + window.max_future_skew_ms):
        return False
    if study.two_server is not None:
        return record.endswith(_NO_PROOF)
    values = _values(record)
    if not all(map(isfinite, values)):
        return False
    d, bounds = study.d, study.norm_bounds
    inner, outer = 1.0 + _SHORTCUT_MARGIN, 1.0 - _SHORTCUT_MARGIN
    return (bounds.q_low * inner < hypot(*values[:d]) < bounds.q_high * outer
            and bounds.p_low * inner < hypot(*values[d:]) < bounds.p_high * outer)


#: The proof length that ends a version-3 record without a proof.
_NO_PROOF = bytes(4)


@lru_cache(maxsize=256)
def _study_head(version: int, d: int, study_hash: bytes) -> bytes:
    """The bytes every record of a study starts with (``STUDY_HEAD_BYTES``)."""
    return (version | d << HEAD_D_SHIFT).to_bytes(8, "little") + study_hash


def _values(record: bytes) -> memoryview:
    """q̃ and p̃ of one record, as float64 (native byte order is little-endian on every
    platform the wire format's readers run on: numpy reads them as '<f8')."""
    return memoryview(record)[VALUES_OFFSET:].cast("d")


def _header_d(record: bytes) -> int:
    return int.from_bytes(record[D_BYTES], "little")


def _version_detail(record: bytes, study: Study) -> str:
    """Why a record's version is not the study's: a one-server study takes version 1, a
    two-server study version 3, and a record of the other kind says which kind it is."""
    version, name = record[VERSION_BYTE], study.study_id
    if study.two_server is None:
        if version == TWO_SERVER_WIRE_VERSION:
            return (f"version {version} is a two-server record, and study {name!r} is a "
                    f"one-server study: it takes version {WIRE_VERSION}")
        return f"version {version}, supported: {WIRE_VERSION}"
    if version == WIRE_VERSION:
        return (f"version {version} holds q̃ and p̃ in clear, and study {name!r} is a two-server "
                f"study: it takes version {TWO_SERVER_WIRE_VERSION}, the leader's share and the "
                "helper's sealed share (docs/wire-format.md)")
    return (f"version {version}; study {name!r} is a two-server study: it takes version "
            f"{TWO_SERVER_WIRE_VERSION}")


_DETAIL = {
    RejectReason.UNSUPPORTED_VERSION: _version_detail,
    RejectReason.UNDECODABLE: lambda r, s: f"reserved bytes {r[RESERVED_BYTES].hex()} are not zero",
    RejectReason.WRONG_DIMENSION:
        lambda r, s: f"has d={_header_d(r)}, study {s.study_id!r} has d={s.d}",
    RejectReason.NON_FINITE: lambda r, s: "q̃ or p̃ holds NaN or Inf",
    RejectReason.STUDY_MISMATCH: lambda r, s: f"names another study than {s.study_id!r}",
}
