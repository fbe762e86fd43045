"""Versioned binary wire format for one perturbed record, with vectorised batch decoding.

Version 1 layout, all little-endian: a 48-byte header followed by q̃ and p̃ as d float64 each.

====== ====== ===================================================================
offset size   field
====== ====== ===================================================================
0      1      version, u8, = 1
1      3      reserved, must be zero
4      4      d, u32
8      16     study hash: first 16 bytes of SHA-256 of the UTF-8 canonical study text
24     16     record id: 16 random bytes chosen by the device
40     8      created_ms, i64, milliseconds since the Unix epoch
48     8·d    q̃, d float64
48+8d  8·d    p̃, d float64
====== ====== ===================================================================

``decode_batch`` groups values by byte length and parses each group with one
``np.frombuffer`` call on a structured dtype; ``decode_record`` is the one-value case of it,
so both apply the same checks in the same order. See docs/wire-format.md.
"""

from __future__ import annotations

import enum
import hashlib
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

WIRE_VERSION: int = 1
HEADER_SIZE: int = 48

#: Bytes of a study hash and of a record id.
ID_SIZE = 16

# The fields of a version-1 record by name (the layout table above): every reader of raw
# records slices with these.
VERSION_BYTE = 0
RESERVED_BYTES = slice(1, 4)
D_BYTES = slice(4, 8)
STUDY_HASH_BYTES = slice(8, 8 + ID_SIZE)
RECORD_ID_BYTES = slice(24, 24 + ID_SIZE)
CREATED_MS_BYTES = slice(40, 48)
#: What every record of one study shares: version, reserved bytes, d and study hash.
STUDY_HEAD_BYTES = slice(0, STUDY_HASH_BYTES.stop)
#: Where q̃ starts (p̃ follows it).
VALUES_OFFSET = HEADER_SIZE

# The same fields as little-endian 64-bit words (a record is 6 + 2·d of them), for readers that
# view k records as a (k, 6 + 2·d) array: word 0 holds the version in its low byte, the reserved
# bytes above it and d in its high half.
HEAD_WORD = 0
HEAD_WORD_BYTES = slice(0, 8)
STUDY_HASH_WORDS = slice(1, 3)
RECORD_ID_WORDS = slice(3, 5)
CREATED_MS_WORD = 5
VALUES_WORD = 6
HEAD_VERSION_MASK = 0xFF
HEAD_RESERVED_MASK = 0xFFFFFF00
HEAD_D_SHIFT = 32


def head_word(d: int) -> int:
    """Word 0 of every well-formed version-1 record of dimension ``d``."""
    return WIRE_VERSION | d << HEAD_D_SHIFT


_I64_MIN = -(2**63)
_I64_MAX = 2**63 - 1


class RejectReason(enum.StrEnum):
    """Machine-readable reason a record is dead-lettered, or a gateway request refused.

    The one vocabulary of refusals: the aggregator's dead letters, the gateway's error answers
    and the gateway's OpenAPI document all name these values. ``HELPER_REFUSED`` is a record of
    a two-server study that its helper refused (the detail is the helper's reason). The members
    after it concern an HTTP request as a whole (the gateway maps each to its status in
    ``gateway.checks.HTTP_STATUS``); the aggregator never dead-letters them.
    """

    UNDECODABLE = "undecodable"
    UNSUPPORTED_VERSION = "unsupported_version"
    WRONG_DIMENSION = "wrong_dimension"
    NON_FINITE = "non_finite"
    NORM_OUT_OF_BOUNDS = "norm_out_of_bounds"
    UNKNOWN_STUDY = "unknown_study"
    STUDY_MISMATCH = "study_mismatch"
    UNTRUSTED_STUDY = "untrusted_study"
    CLOSED_STUDY = "closed_study"
    REPLAYED = "replayed"
    STALE = "stale"
    FUTURE = "future"
    OVERSIZED = "oversized"
    CREDENTIAL_MISSING = "credential_missing"
    CREDENTIAL_INVALID = "credential_invalid"
    CREDENTIAL_UNTRUSTED = "credential_untrusted"
    CREDENTIAL_EXPIRED = "credential_expired"
    CREDENTIAL_WRONG_STUDY = "credential_wrong_study"
    CREDENTIAL_BAD_SLOT = "credential_bad_slot"
    CREDENTIAL_REUSED = "credential_reused"
    HELPER_REFUSED = "helper_refused"
    DUPLICATE_RECORD = "duplicate_record"
    TOO_LARGE = "too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    RATE_LIMITED = "rate_limited"
    KAFKA_UNAVAILABLE = "kafka_unavailable"
    STUDIES_UNAVAILABLE = "studies_unavailable"
    NOT_READY = "not_ready"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    BAD_REQUEST = "bad_request"


#: The reasons the aggregator dead-letters a record for (the members before ``TOO_LARGE``).
DEAD_LETTER_REASONS = tuple(RejectReason)[:list(RejectReason).index(RejectReason.TOO_LARGE)]


class MalformedRecord(ValueError):
    """A value that is not a well-formed record; ``reason`` says why, ``detail`` says how."""

    def __init__(self, reason: RejectReason, detail: str):
        super().__init__(reason, detail)
        self.reason = RejectReason(reason)
        self.detail = detail

    def __str__(self) -> str:
        """Return ``"<reason>: <detail>"``."""
        return f"{self.reason.value}: {self.detail}"


@dataclass(frozen=True)
class RecordWindow:
    """The creation times accepted at ``now_ms``: from now − the replay window (an older record's
    id may be forgotten already, so it could be replayed: ``stale``) to now + the largest clock
    lead of a device (``future``). One definition for the aggregator (aggregator/validate.py)
    and the gateway (gateway/checks.py). Settings: ipdp.settings.RecordWindowSettings."""

    replay_window_ms: int
    max_future_skew_ms: int

    def failures(self, created_ms, now_ms: int) -> list[tuple[object, RejectReason, str]]:
        """Stale, then future, for one creation time or an array of them: ``(where it fails,
        reason, detail)`` triples, as :meth:`ipdp.calibration.RecordNormBounds.failures`."""
        return [
            (created_ms < now_ms - self.replay_window_ms, RejectReason.STALE,
             "created before the replay window"),
            (created_ms > now_ms + self.max_future_skew_ms, RejectReason.FUTURE,
             "created too far in the future"),
        ]


def study_hash(study_text: str) -> bytes:
    """Return the 16-byte wire identifier of a study: SHA-256 of its UTF-8 canonical text
    (ipdp.study.Study.canonical_text: every parameter and the noise stds), truncated."""
    return hashlib.sha256(study_text.encode("utf-8")).digest()[:ID_SIZE]


#: Kafka header naming the study a device meant. Diagnostic only: it picks `study_mismatch` over
#: `unknown_study` for a record whose hash matches no study; the fold trusts the hash alone.
STUDY_HEADER = "study"


def study_headers(study_id: str) -> list[tuple[str, bytes]]:
    """The Kafka headers every producer of records (device, load generator, gateway) sets."""
    return [(STUDY_HEADER, study_id.encode("utf-8"))]


def header_study(headers) -> str | None:
    """The study id of :func:`study_headers` in a Kafka record's headers, if any."""
    for name, value in headers or ():
        if name == STUDY_HEADER and value is not None:
            return bytes(value).decode("utf-8", "replace")
    return None


def record_size(d: int) -> int:
    """Return the encoded size in bytes of a record of dimension ``d``."""
    if d < 1:
        raise ValueError(f"d must be >= 1, got {d}")
    return HEADER_SIZE + 16 * d


@lru_cache(maxsize=64)
def _record_dtype(d: int) -> np.dtype:
    """Return the packed structured dtype of a version-1 record of dimension ``d``."""
    return np.dtype(
        [
            ("version", "u1"),
            ("reserved", "u1", (3,)),
            ("d", "<u4"),
            ("study_hash", "u1", (ID_SIZE,)),
            ("record_id", "u1", (ID_SIZE,)),
            ("created_ms", "<i8"),
            ("q", "<f8", (d,)),
            ("p", "<f8", (d,)),
        ]
    )


@dataclass(frozen=True, eq=False)
class Record:
    """One decoded record; ``q`` and ``p`` are float64 arrays of shape (d,)."""

    study_hash: bytes
    record_id: bytes
    created_ms: int
    q: np.ndarray
    p: np.ndarray


@dataclass
class RecordBatch:
    """Decoded records of one dimension ``d`` as plain arrays, one row per record."""

    d: int
    index: np.ndarray
    study_hash: np.ndarray
    record_id: np.ndarray
    created_ms: np.ndarray
    q: np.ndarray
    p: np.ndarray
    sq_q: np.ndarray | None = None
    """‖q̃‖² per row (computed by the decoder, which needs it for its finiteness check)."""
    sq_p: np.ndarray | None = None
    """‖p̃‖² per row."""

    def __len__(self) -> int:
        """Return the number of records."""
        return int(self.index.shape[0])

    def take(self, mask_or_indices) -> RecordBatch:
        """Return the rows selected by a boolean mask or an array of row positions."""
        sel = np.asarray(mask_or_indices)
        if sel.dtype != np.bool_:
            sel = sel.astype(np.intp, copy=False)
        return RecordBatch(
            d=self.d,
            index=self.index[sel],
            study_hash=self.study_hash[sel],
            record_id=self.record_id[sel],
            created_ms=self.created_ms[sel],
            q=self.q[sel],
            p=self.p[sel],
            sq_q=None if self.sq_q is None else self.sq_q[sel],
            sq_p=None if self.sq_p is None else self.sq_p[sel],
        )


def encode_batch(
    study_hash: bytes,
    record_ids: np.ndarray,
    created_ms: np.ndarray,
    q: np.ndarray,
    p: np.ndarray,
) -> list[bytes]:
    """Encode k records of one study: record_ids (k,16) uint8, created_ms (k,), q and p (k,d)."""
    sh = _as_id(study_hash, "study_hash")
    rid = np.asarray(record_ids)
    if rid.dtype != np.uint8 or rid.ndim != 2 or rid.shape[1] != ID_SIZE:
        raise ValueError(f"record_ids must be uint8 of shape (k, 16), got {rid.dtype} {rid.shape}")
    k = rid.shape[0]
    ms = np.asarray(created_ms)
    if ms.shape != (k,) or not np.can_cast(ms.dtype, np.int64):
        raise ValueError(f"created_ms must be integers of shape ({k},), got {ms.dtype} {ms.shape}")
    qa, pa = _as_real(q, "q"), _as_real(p, "p")
    if qa.ndim != 2 or qa.shape[0] != k or qa.shape[1] < 1 or pa.shape != qa.shape:
        raise ValueError(f"q and p must both have shape ({k}, d >= 1), got {qa.shape}, {pa.shape}")
    d = qa.shape[1]
    arr = np.zeros(k, dtype=_record_dtype(d))
    arr["version"] = WIRE_VERSION
    arr["d"] = d
    arr["study_hash"] = np.frombuffer(sh, dtype=np.uint8)
    arr["record_id"] = rid
    arr["created_ms"] = ms
    arr["q"] = qa
    arr["p"] = pa
    buf = arr.tobytes()
    size = arr.dtype.itemsize
    return [buf[i * size : (i + 1) * size] for i in range(k)]


def encode_record(study_hash: bytes, record_id: bytes, created_ms: int, q, p) -> bytes:
    """Encode one record; q and p are 1-D arrays of the same length d >= 1."""
    rid = _as_id(record_id, "record_id")
    ms = operator.index(created_ms)
    if not _I64_MIN <= ms <= _I64_MAX:
        raise ValueError(f"created_ms {ms} does not fit in a signed 64-bit integer")
    qa, pa = _as_real(q, "q"), _as_real(p, "p")
    if qa.ndim != 1 or pa.shape != qa.shape:
        raise ValueError(f"q and p must be 1-D of the same length, got {qa.shape}, {pa.shape}")
    return encode_batch(
        study_hash,
        np.frombuffer(rid, dtype=np.uint8).reshape(1, ID_SIZE),
        np.array([ms], dtype=np.int64),
        qa[np.newaxis],
        pa[np.newaxis],
    )[0]


#: Version byte of a multi-record container (one Kafka message, many records).
CONTAINER_VERSION: int = 2
CONTAINER_HEADER_SIZE: int = 8
#: Where a container's record count k (u32, little-endian) sits in its header.
CONTAINER_COUNT_BYTES = slice(4, 8)


def container_count(value: bytes | bytearray | memoryview) -> int:
    """The record count k a container's header states (the value is not checked)."""
    return int.from_bytes(value[CONTAINER_COUNT_BYTES], "little")


#: Bytes of a version-3 record besides its two shares (ipdp.two_server_wire): the header, the
#: seal's encapsulated key and tag (32 + 16) and the proof length (4).
_TWO_SERVER_FIXED_BYTES = HEADER_SIZE + 48 + 4


def is_record_size(size: int) -> bool:
    """True if ``size`` is the length of a record of some d ≥ 1: 48 + 16·d (version 1), or
    100 + 16·L with L = d(d+3)/2 (version 3, ``ipdp.two_server_wire.TwoServerLayout``). The two
    never coincide: the first is a multiple of 16, the second 4 more than one."""
    if size >= HEADER_SIZE + 16 and (size - HEADER_SIZE) % 16 == 0:
        return True
    shares, rest = divmod(size - _TWO_SERVER_FIXED_BYTES, 16)
    if shares < 2 or rest:
        return False
    # L = d(d+3)/2 ⟺ d = (√(9 + 8L) − 3)/2; 9 + 8L is odd, so a whole root is odd and d whole.
    root = math.isqrt(9 + 8 * shares)
    return root * root == 9 + 8 * shares


def encode_container(records: Sequence[bytes]) -> bytes:
    """Pack k ≥ 1 records of one version and dimension (version 1, or version 3 from the
    gateway) into one container value.

    Layout: u8 version = 2, 3 reserved zero bytes, u32 k (little-endian), then the k records
    back to back. The records are not re-encoded: a container holds exactly the bytes the devices
    sent.
    """
    if not records:
        raise ValueError("a container holds at least one record")
    size = len(records[0])
    if any(len(r) != size for r in records):
        raise ValueError("a container's records must all have the same length (one d)")
    return container_of(b"".join(records), len(records))


def container_of(records: bytes | bytearray | memoryview, k: int) -> bytes:
    """The container of k ≥ 1 records of one version and dimension given back to back in
    ``records`` (as :func:`encode_container` would make of them, without splitting them)."""
    if k < 1 or len(records) % k:
        raise ValueError(f"{len(records)} bytes are not k={k} records of one length")
    return b"".join((bytes((CONTAINER_VERSION, 0, 0, 0)), k.to_bytes(4, "little"), records))


def split_container(value: bytes | bytearray | memoryview) -> list[bytes] | None:
    """The records of a container value, or None if ``value`` is not a well-formed container.

    A value whose first byte is not 2 is not a container (a single record, or garbage for the
    record decoder to reject). A container whose count or length does not add up (k records of
    one record size, :func:`is_record_size`) is malformed: None as well, and the caller rejects
    the whole value as undecodable.
    """
    buf = bytes(value)
    if len(buf) < CONTAINER_HEADER_SIZE or buf[VERSION_BYTE] != CONTAINER_VERSION \
            or any(buf[RESERVED_BYTES]):
        return None
    k = container_count(buf)
    body = len(buf) - CONTAINER_HEADER_SIZE
    if k < 1 or body % k:
        return None
    size = body // k
    if not is_record_size(size):
        return None  # not k records of one dimension: no record decoder could read them
    # A void dtype converts to bytes without stripping anything (an "S" dtype would strip
    # trailing NULs), and tolist() makes the k values in one C loop.
    return np.frombuffer(buf, f"V{size}", k, CONTAINER_HEADER_SIZE).tolist()


def decode_record(buf: bytes, max_size: int | None = None) -> Record:
    """Decode one value; raise MalformedRecord if it is not a well-formed version-1 record."""
    batches, rejects = decode_batch([buf], max_size)
    if rejects:
        raise rejects[0][1]
    b = batches[0]
    return Record(
        study_hash=b.study_hash[0].tobytes(),
        record_id=b.record_id[0].tobytes(),
        created_ms=int(b.created_ms[0]),
        q=b.q[0],
        p=b.p[0],
    )


def decode_batch(
    values: Sequence[bytes | bytearray | memoryview | None], max_size: int | None = None
) -> tuple[list[RecordBatch], list[tuple[int, MalformedRecord]]]:
    """Decode many values: one RecordBatch per distinct d, and (input index, error) rejects."""
    same = _one_length(values)
    if same is not None:  # the usual poll: records of one study, one d, no tombstone
        joined, length = same
        if (max_size is None or length <= max_size) and length >= HEADER_SIZE + 16 \
                and (length - HEADER_SIZE) % 16 == 0:
            rejects: list[tuple[int, MalformedRecord]] = []
            batch = _parse_group(None, np.arange(len(values), dtype=np.int64),
                                 (length - HEADER_SIZE) // 16, rejects, joined=joined)
            return ([batch] if len(batch) else []), rejects
    bufs = [v if type(v) is bytes else _as_byte_buffer(v) for v in values]
    lengths = np.array([-1 if b is None else len(b) for b in bufs], dtype=np.int64)
    batches: list[RecordBatch] = []
    rejects: list[tuple[int, MalformedRecord]] = []
    if lengths.size == 0:
        return batches, rejects
    uniq, inverse, counts = np.unique(lengths, return_inverse=True, return_counts=True)
    order = np.argsort(inverse, kind="stable")
    ends = np.cumsum(counts)
    for length, end, count in zip(uniq.tolist(), ends.tolist(), counts.tolist()):
        idx = order[end - count : end].astype(np.int64)
        if length < 0:
            detail = "value is None or not bytes-like"
            rejects.extend(
                (i, MalformedRecord(RejectReason.UNDECODABLE, detail)) for i in idx.tolist()
            )
        elif max_size is not None and length > max_size:
            detail = f"length {length} exceeds max_size {max_size}"
            rejects.extend(
                (i, MalformedRecord(RejectReason.OVERSIZED, detail)) for i in idx.tolist()
            )
        elif length < HEADER_SIZE + 16 or (length - HEADER_SIZE) % 16:
            rejects.extend((i, _bad_length(bufs[i], length)) for i in idx.tolist())
        else:
            batch = _parse_group(bufs, idx, (length - HEADER_SIZE) // 16, rejects)
            if len(batch):
                batches.append(batch)
    rejects.sort(key=operator.itemgetter(0))
    return batches, rejects


def decode_joined(
    buf: bytes | bytearray | memoryview, d: int
) -> tuple[list[RecordBatch], list[tuple[int, MalformedRecord]]]:
    """Decode ``buf`` as version-1 records of dimension ``d`` back to back (a device's POST
    body): :func:`decode_batch` of its record-sized slices, without making them."""
    size = record_size(d)
    if len(buf) % size:
        raise ValueError(f"{len(buf)} bytes are not records of {size} bytes (d={d})")
    rejects: list[tuple[int, MalformedRecord]] = []
    batch = _parse_group(None, np.arange(len(buf) // size, dtype=np.int64), d, rejects,
                         joined=buf)
    return ([batch] if len(batch) else []), rejects


def _one_length(values: Sequence) -> tuple[bytes, int] | None:
    """(all values joined, their common length) when every value is bytes-like of one length."""
    if not values:
        return None
    try:
        joined = b"".join(values)
    except TypeError:  # a tombstone (None) or something that is not a buffer
        return None
    length = len(values[0])
    if len(joined) != length * len(values):
        return None
    if list(map(len, values)).count(length) != len(values):
        return None
    return joined, length


def _parse_group(
    bufs: list | None, idx: np.ndarray, d: int, rejects: list[tuple[int, MalformedRecord]],
    joined: bytes | None = None,
) -> RecordBatch:
    """Parse values of one valid length with one frombuffer; append bad rows to ``rejects`` in
    the order of ``idx``.

    The records are read as rows of little-endian 64-bit words (48 + 16·d is a multiple of 8):
    word 0 holds version, reserved bytes and d, so one comparison checks all three; q̃ and p̃ are
    float64 views of words 6.. (no copy). A row's squared norm is finite only if every value in
    it is, so the norms the validator needs also decide finiteness; only rows that fail either
    check are looked at again (:func:`_row_errors`, as arrays), in the order version, reserved
    bytes, d, finite values.
    """
    if joined is None:
        joined = b"".join([bufs[i] for i in idx.tolist()])
    size = HEADER_SIZE + 16 * d
    n = len(joined) // size
    words = np.frombuffer(joined, "<u8").reshape(n, size // 8)
    values = words.view("<f8")
    q, p = values[:, VALUES_WORD:VALUES_WORD + d], values[:, VALUES_WORD + d:]
    sq_q, sq_p = squared_norms(q, p)
    ok = (words[:, HEAD_WORD] == head_word(d)) & np.isfinite(sq_q) & np.isfinite(sq_p)
    raw = np.frombuffer(joined, np.uint8).reshape(n, size)
    if not ok.all():
        bad = np.flatnonzero(~ok)
        errors, which = _row_errors(raw[bad], values[bad, VALUES_WORD:], d, size)
        ok[bad[which < 0]] = True  # finite values whose square overflows: the norm check's
        rejects += [(i, errors[w]) for i, w in zip(idx[bad].tolist(), which.tolist(),
                                                    strict=True) if w >= 0]
    # Writeable, C-contiguous arrays of their own (not views of the input): one copy each.
    columns = (raw[:, STUDY_HASH_BYTES], raw[:, RECORD_ID_BYTES],
               words[:, CREATED_MS_WORD].view("<i8"), q, p)
    if ok.all():
        study_hash, record_id, created_ms, q, p = (a.copy() for a in columns)
    else:
        study_hash, record_id, created_ms, q, p = (a[ok] for a in columns)
        idx, sq_q, sq_p = idx[ok], sq_q[ok], sq_p[ok]
    return RecordBatch(
        d=d,
        index=idx,
        study_hash=study_hash,
        record_id=record_id,
        created_ms=created_ms,
        q=q,
        p=p,
        sq_q=sq_q,
        sq_p=sq_p,
    )


def squared_norms(q: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """‖q̃‖² and ‖p̃‖² per row of (k, d) arrays: the one summation every norm check uses, so a
    record at a bound gets the same verdict from the gateway and the aggregator."""
    return np.einsum("ij,ij->i", q, q), np.einsum("ij,ij->i", p, p)


def _row_errors(raw: np.ndarray, values: np.ndarray, d: int, size: int
                ) -> tuple[list[MalformedRecord], np.ndarray]:
    """Why each record of the right length (rows of bytes, and of their 2·d float64 values) is
    malformed, in the order version, reserved bytes, d, finite values: the distinct errors, and
    per row the position of its error (-1: it is not malformed). One error object per distinct
    detail, whatever the number of rows."""
    which = np.full(len(raw), -1, np.int64)
    errors: list[MalformedRecord] = []

    def refuse(hit: np.ndarray, keys: np.ndarray, error) -> None:
        hit &= which < 0
        for key in np.unique(keys[hit]).tolist():
            which[hit & (keys == key)] = len(errors)
            errors.append(error(key))

    version = raw[:, VERSION_BYTE]
    refuse(version != WIRE_VERSION, version, lambda v: MalformedRecord(
        RejectReason.UNSUPPORTED_VERSION, f"version {v}, supported: {WIRE_VERSION}"))
    reserved = raw[:, RESERVED_BYTES].astype(np.int64) @ np.array([1, 1 << 8, 1 << 16])
    refuse(reserved != 0, reserved, lambda r: MalformedRecord(
        RejectReason.UNDECODABLE, f"reserved bytes {r.to_bytes(3, 'little').hex()} are not zero"))
    header_d = np.ascontiguousarray(raw[:, D_BYTES]).view("<u4").ravel()
    refuse(header_d != d, header_d, lambda h: MalformedRecord(
        RejectReason.UNDECODABLE, f"header d={h} but length {size} implies d={d}"))
    refuse(~np.isfinite(values).all(axis=1), np.zeros(len(raw), np.int64),
           lambda _: MalformedRecord(RejectReason.NON_FINITE, "q̃ or p̃ holds NaN or Inf"))
    return errors, which


def _bad_length(buf: bytes | bytearray | memoryview, length: int) -> MalformedRecord:
    """Return the error for a value whose length is not 48 + 16·d for any d >= 1."""
    if length == 0:
        return MalformedRecord(RejectReason.UNDECODABLE, "value is empty")
    if buf[VERSION_BYTE] != WIRE_VERSION:
        return MalformedRecord(
            RejectReason.UNSUPPORTED_VERSION,
            f"version {buf[VERSION_BYTE]}, supported: {WIRE_VERSION}"
        )
    return MalformedRecord(
        RejectReason.UNDECODABLE, f"length {length} is not {HEADER_SIZE} + 16·d for any d >= 1"
    )


def _as_byte_buffer(value) -> bytes | bytearray | memoryview | None:
    """Return ``value`` as a flat byte buffer, or None if it is None or not bytes-like."""
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        return value
    try:
        view = memoryview(value)
    except TypeError:
        return None
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view
    return view.tobytes()


def _as_real(values, name: str) -> np.ndarray:
    """Return ``values`` as float64, or raise TypeError for complex values (numpy would keep
    only their real part)."""
    array = np.asarray(values)
    if array.dtype.kind == "c":
        raise TypeError(f"{name} must be real, got {array.dtype}")
    return array.astype(np.float64, copy=False)


def _as_id(value: bytes, name: str) -> bytes:
    """Return ``value`` as 16 bytes or raise ValueError."""
    raw = bytes(memoryview(value))
    if len(raw) != ID_SIZE:
        raise ValueError(f"{name} must be {ID_SIZE} bytes, got {len(raw)}")
    return raw
