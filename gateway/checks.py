"""The gateway's per-record checks, pure and vectorised, and the HTTP status of every reason.

A POST goes through, in order: admission (rate limit, study open, the device credential of a
study that requires one: gateway.credentials), the checks of its records (:func:`first_rejection`),
the group commit (:class:`gateway.batcher.GroupCommit`), and the acknowledgement of the container
holding them. :func:`check_records` takes the records of a request of several, or the coalesced
records of many, and returns each record's verdict from the one vocabulary,
``ipdp.wire.RejectReason``; a request of one record (what a device sends) gets the same checks
on Python scalars. Further per-record checks belong here, as more columns of the same pass and
in those scalar checks.
"""

from __future__ import annotations

from functools import lru_cache
from math import hypot, isfinite

import numpy as np

from ipdp.study import Study
from ipdp.wire import WIRE_VERSION, RecordWindow, RejectReason, record_size, squared_norms

__all__ = ["HTTP_STATUS", "RECORD_OK", "check_records", "first_rejection", "reason_of"]

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
    RejectReason.REQUEST_TIMEOUT: 408,
    RejectReason.TOO_LARGE: 413,
    RejectReason.UNSUPPORTED_MEDIA_TYPE: 415,
    RejectReason.RATE_LIMITED: 429,
    RejectReason.HEADERS_TOO_LARGE: 431,
    RejectReason.KAFKA_UNAVAILABLE: 503,
    RejectReason.STUDIES_UNAVAILABLE: 503,
    RejectReason.NOT_READY: 503,
}

#: The verdict of a record that passed every check (reason codes are 1 + the member's position).
RECORD_OK = 0
_REASONS = list(RejectReason)


def reason_of(code: int) -> RejectReason:
    """The reason a non-zero verdict of :func:`check_records` stands for."""
    return _REASONS[code - 1]


def _code(reason: RejectReason) -> int:
    return _REASONS.index(reason) + 1


_UNSUPPORTED_VERSION = _code(RejectReason.UNSUPPORTED_VERSION)
_UNDECODABLE = _code(RejectReason.UNDECODABLE)
_WRONG_DIMENSION = _code(RejectReason.WRONG_DIMENSION)
_NON_FINITE = _code(RejectReason.NON_FINITE)
_STUDY_MISMATCH = _code(RejectReason.STUDY_MISMATCH)
_CODES = {reason: _code(reason) for reason in RejectReason}

#: The one-record shortcut accepts norms this far (relatively) inside the bounds; a record
#: nearer a bound goes through _acceptance_failure, which sums like the aggregator.
_SHORTCUT_MARGIN = 1e-9


def check_records(records: bytes, study: Study, window: RecordWindow, now_ms: int) -> np.ndarray:
    """The verdict of each record of ``records`` (version-1 records of the study's size, back to
    back) at time ``now_ms``: ``RECORD_OK`` or the code of its first failed check
    (:func:`reason_of`), uint8 (k,).

    Checks, in order: version, reserved bytes, the header's d against the study's, finite q̃ and
    p̃, the study hash, then what the aggregator would dead-letter (``RecordNormBounds`` and
    ``RecordWindow``): norms outside the study's two-sided bounds, creation time outside
    ``window``. Every check is one comparison over all k rows of 64-bit words (the header word
    holds version, reserved bytes and d), so one record or ten thousand cost a handful of numpy
    calls. ``len(records)`` must be a multiple of the record size (see :func:`first_rejection`,
    which says why a body is not).

    A device's request holds one record, and for one record the numpy calls cost more than the
    checks: :func:`first_rejection` decides a single record by the same checks on Python
    scalars, accepted or refused, and comes here only for a body of several
    (tests/gateway/test_checks.py checks that both agree on every reason). A check added here
    is added to those scalar checks too.
    """
    d = study.d
    size = record_size(d)
    words = np.frombuffer(records, "<u8").reshape(-1, size // 8)
    header = words[:, 0]
    study_hash = np.frombuffer(study.hash, "<u8")
    verdict = np.zeros(words.shape[0], np.uint8)
    values = words[:, 6:].view("<f8")
    finite = np.isfinite(values).all(axis=1)
    sq_q, sq_p = squared_norms(values[:, :d], values[:, d:])
    # Assigned from the last check to the first, so each row keeps its first failure.
    for bad, reason, _ in reversed(study.norm_bounds.failures(sq_q, sq_p)
                                   + window.failures(words[:, 5].view("<i8"), now_ms)):
        verdict[bad] = _CODES[reason]
    verdict[(words[:, 1] != study_hash[0]) | (words[:, 2] != study_hash[1])] = _STUDY_MISMATCH
    verdict[~finite] = _NON_FINITE
    verdict[(header >> np.uint64(32)) != d] = _WRONG_DIMENSION
    verdict[(header & np.uint64(0xFFFFFF00)) != 0] = _UNDECODABLE
    verdict[(header & np.uint64(0xFF)) != WIRE_VERSION] = _UNSUPPORTED_VERSION
    return verdict


def first_rejection(body: bytes, study: Study, window: RecordWindow,
                    now_ms: int) -> tuple[RejectReason, str] | None:
    """Why a request body of version-1 records is refused at ``now_ms``, or None if every
    record passes.

    A body that is not a whole number of the study's records is refused as a whole
    (``wrong_dimension`` if its first header names another d, else ``undecodable``); otherwise
    the first record whose verdict is not OK names the reason.
    """
    size, n = record_size(study.d), len(body)
    if n == size:
        if body[:24] == _header(study.d, study.hash) \
                and all(map(isfinite, values := _values(body))) \
                and _inside(study, values, window, _created_ms(body), now_ms):
            return None  # every check passed: the scalar form of check_records' checks
        return _one_rejection(body, study, window, now_ms)
    if n == 0:
        return RejectReason.UNDECODABLE, "the body holds no record"
    if n % size:
        if n >= 8 and body[0] == WIRE_VERSION:
            d = int.from_bytes(body[4:8], "little")
            if d != study.d:
                return (RejectReason.WRONG_DIMENSION,
                        f"record 0 has d={d}, study {study.study_id!r} has d={study.d}")
        detail = f"body length {n} is not a multiple of the record size {size} (48 + 16·d, "
        return RejectReason.UNDECODABLE, detail + f"d={study.d})"
    verdict = check_records(body, study, window, now_ms)
    bad = np.flatnonzero(verdict)
    if not bad.size:
        return None
    i = int(bad[0])
    reason = reason_of(int(verdict[i]))
    record = body[i * size:(i + 1) * size]
    if reason in _DETAIL:
        return reason, f"record {i}: {_DETAIL[reason](record, study)}"
    return reason, f"record {i}: {_acceptance_failure(record, study, window, now_ms)[1]}"


def _one_rejection(record: bytes, study: Study, window: RecordWindow,
                   now_ms: int) -> tuple[RejectReason, str] | None:
    """:func:`check_records`' verdict on one record, on Python scalars, for the one a device
    sends that the shortcut did not accept: a request refused costs about what one accepted
    does, not a pass of numpy calls. The same checks in the same order; the norms are summed by
    ``squared_norms``, as there and in the aggregator."""
    if record[0] != WIRE_VERSION:
        reason = RejectReason.UNSUPPORTED_VERSION
    elif record[1:4] != b"\0\0\0":
        reason = RejectReason.UNDECODABLE
    elif _header_d(record) != study.d:
        reason = RejectReason.WRONG_DIMENSION
    elif not all(map(isfinite, _values(record))):
        reason = RejectReason.NON_FINITE
    elif record[8:24] != study.hash:
        reason = RejectReason.STUDY_MISMATCH
    else:
        failure = _acceptance_failure(record, study, window, now_ms)
        return None if failure is None else (failure[0], f"record 0: {failure[1]}")
    return reason, f"record 0: {_DETAIL[reason](record, study)}"


def _inside(study: Study, values: memoryview, window: RecordWindow, created_ms: int,
            now_ms: int) -> bool:
    """The norm and time checks of one record, on Python floats: True only when the record is
    clearly accepted (norms _SHORTCUT_MARGIN inside the bounds)."""
    d, bounds = study.d, study.norm_bounds
    inner, outer = 1.0 + _SHORTCUT_MARGIN, 1.0 - _SHORTCUT_MARGIN
    return (bounds.q_low * inner < hypot(*values[:d]) < bounds.q_high * outer
            and bounds.p_low * inner < hypot(*values[d:]) < bounds.p_high * outer
            and now_ms - window.replay_window_ms <= created_ms
            <= now_ms + window.max_future_skew_ms)


def _acceptance_failure(record: bytes, study: Study, window: RecordWindow,
                        now_ms: int) -> tuple[RejectReason, str] | None:
    """The reason and detail of the first acceptance check (norms, then time window) one record
    fails, or None."""
    values = np.frombuffer(record, "<f8", offset=48).reshape(1, -1)
    sq_q, sq_p = squared_norms(values[:, :study.d], values[:, study.d:])
    checks = (study.norm_bounds.failures(sq_q[0], sq_p[0])
              + window.failures(_created_ms(record), now_ms))
    return next(((reason, detail) for bad, reason, detail in checks if bad), None)


def _created_ms(record: bytes) -> int:
    return int.from_bytes(record[40:48], "little", signed=True)


@lru_cache(maxsize=256)
def _header(d: int, study_hash: bytes) -> bytes:
    """The first 24 bytes every record of a study has: version, reserved zeros, d, hash."""
    return bytes((WIRE_VERSION, 0, 0, 0)) + d.to_bytes(4, "little") + study_hash


def _values(record: bytes) -> memoryview:
    """q̃ and p̃ of one record, as float64 (native byte order is little-endian on every
    platform the wire format's readers run on: numpy reads them as '<f8')."""
    return memoryview(record)[48:].cast("d")


def _header_d(record: bytes) -> int:
    return int.from_bytes(record[4:8], "little")


_DETAIL = {
    RejectReason.UNSUPPORTED_VERSION: lambda r, s: f"version {r[0]}, supported: {WIRE_VERSION}",
    RejectReason.UNDECODABLE: lambda r, s: f"reserved bytes {r[1:4].hex()} are not zero",
    RejectReason.WRONG_DIMENSION:
        lambda r, s: f"has d={_header_d(r)}, study {s.study_id!r} has d={s.d}",
    RejectReason.NON_FINITE: lambda r, s: "q̃ or p̃ holds NaN or Inf",
    RejectReason.STUDY_MISMATCH: lambda r, s: f"names another study than {s.study_id!r}",
}
