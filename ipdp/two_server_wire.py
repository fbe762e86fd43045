"""Wire version 3: a two-server record, one message per device to the leader
(docs/wire-format.md, "Two-server records: the message").

====== ========= ================================================================
offset size      field
====== ========= ================================================================
0      48        the header, a version-1 record's layout (ipdp.wire) with version 3
48     8·L       the leader's share: L = d(d+3)/2 uint64 words, little-endian
48+8L  8·L + 48  the helper's share sealed to the study's helper key
                 (ipdp.sealing.seal_share: enc(32) ‖ ciphertext(8L) ‖ tag(16));
                 HPKE info = the 48 header bytes
96+16L 4         proof length, u32 little-endian: 0 (room for a validity proof; a
                 non-zero length is refused)
====== ========= ================================================================

At d = 14 (L = 119) a record is 48 + 952 + 1,000 + 4 = 2,004 bytes. The leader reads the header
and its share; the sealed part opens only with the helper's private key and only under the
header it was sealed with. Everything here works on a batch of k records as numpy arrays, except
sealing, which HPKE does one record at a time.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

from ipdp.fixed_point import FixedPoint, RandomBytes, encode, entries, split
from ipdp.sealing import SEAL_OVERHEAD, seal_share
from ipdp.wire import (
    CREATED_MS_BYTES,
    D_BYTES,
    HEADER_SIZE,
    ID_SIZE,
    RECORD_ID_BYTES,
    RESERVED_BYTES,
    STUDY_HASH_BYTES,
    VERSION_BYTE,
    MalformedRecord,
    RejectReason,
)

TWO_SERVER_WIRE_VERSION: int = 3
#: Bytes of the proof length field that ends every version-3 record.
PROOF_LENGTH_SIZE = 4


@dataclass(frozen=True)
class TwoServerLayout:
    """Where each part of a version-3 record of dimension d sits: the one definition of the
    offsets every encoder and decoder slices with."""

    d: int

    @property
    def entries(self) -> int:
        """L = d(d+3)/2 words per share."""
        return entries(self.d)

    @property
    def share_size(self) -> int:
        return 8 * self.entries

    @property
    def leader(self) -> slice:
        return slice(HEADER_SIZE, HEADER_SIZE + self.share_size)

    @property
    def sealed(self) -> slice:
        start = self.leader.stop
        return slice(start, start + self.share_size + SEAL_OVERHEAD)

    @property
    def proof_length(self) -> slice:
        start = self.sealed.stop
        return slice(start, start + PROOF_LENGTH_SIZE)

    @property
    def size(self) -> int:
        """48 + 16·L + 48 + 4 bytes."""
        return self.proof_length.stop


def two_server_record_size(d: int) -> int:
    """The size of a version-3 record of dimension ``d`` (2,004 bytes at d = 14)."""
    return TwoServerLayout(d).size


def headers(study_hash: bytes, record_ids: np.ndarray, created_ms: np.ndarray,
            d: int) -> np.ndarray:
    """The 48-byte headers of k version-3 records as a (k, 48) uint8 array."""
    rid = np.asarray(record_ids, dtype=np.uint8)
    if rid.ndim != 2 or rid.shape[1] != ID_SIZE:
        raise ValueError(f"record_ids must have shape (k, {ID_SIZE}), got {rid.shape}")
    if len(study_hash) != ID_SIZE:
        raise ValueError(f"study_hash must be {ID_SIZE} bytes, got {len(study_hash)}")
    k = rid.shape[0]
    out = np.zeros((k, HEADER_SIZE), dtype=np.uint8)
    out[:, VERSION_BYTE] = TWO_SERVER_WIRE_VERSION
    out[:, D_BYTES] = np.frombuffer(int(d).to_bytes(4, "little"), dtype=np.uint8)
    out[:, STUDY_HASH_BYTES] = np.frombuffer(study_hash, dtype=np.uint8)
    out[:, RECORD_ID_BYTES] = rid
    out[:, CREATED_MS_BYTES] = np.asarray(created_ms, dtype="<i8").reshape(k, 1).view(np.uint8)
    return out


def seal_helper_shares(public_key: X25519PublicKey, header_rows: np.ndarray,
                       helper: np.ndarray) -> list[bytes]:
    """Each record's helper share (a row of ``helper``, (k, L) uint64) sealed to the helper's
    key under that record's header (a row of ``header_rows``)."""
    shares = np.ascontiguousarray(helper, dtype="<u8")
    return [seal_share(public_key, shares[i].tobytes(), header_rows[i].tobytes())
            for i in range(shares.shape[0])]


def encode_two_server_batch(header_rows: np.ndarray, leader: np.ndarray,
                            sealed: Sequence[bytes]) -> list[bytes]:
    """k version-3 records from their headers (k, 48), leader shares (k, L) and sealed helper
    shares (8L + 48 bytes each), with a zero proof length."""
    header_rows = np.asarray(header_rows, dtype=np.uint8)
    k = header_rows.shape[0]
    d = int(header_rows[0, D_BYTES].view("<u4")[0]) if k else 0
    layout = TwoServerLayout(d)
    leader = np.ascontiguousarray(leader, dtype="<u8")
    if leader.shape != (k, layout.entries) or len(sealed) != k:
        raise ValueError(f"{k} headers need leader shares of shape ({k}, {layout.entries}) and "
                         f"{k} sealed shares, got {leader.shape} and {len(sealed)}")
    if any(len(s) != layout.sealed.stop - layout.sealed.start for s in sealed):
        raise ValueError(f"a sealed share at d={d} is {layout.share_size + SEAL_OVERHEAD} bytes")
    out = np.zeros((k, layout.size), dtype=np.uint8)
    out[:, :HEADER_SIZE] = header_rows
    out[:, layout.leader] = leader.view(np.uint8).reshape(k, layout.share_size)
    out[:, layout.sealed] = np.frombuffer(b"".join(sealed), dtype=np.uint8).reshape(k, -1)
    return out.view(f"V{layout.size}").ravel().tolist()


def two_server_records(study_hash: bytes, record_ids: np.ndarray, created_ms: np.ndarray,
                       q_tilde: np.ndarray, p_hat: np.ndarray, encoding: FixedPoint,
                       helper_key: X25519PublicKey, random_bytes: RandomBytes = os.urandom,
                       ) -> list[bytes]:
    """What a device sends for k perturbed records (q̃, p̂ from
    ipdp.two_server.perturb_two_server): encode in fixed point → split into shares (the helper's
    from ``random_bytes``, the kernel's CSPRNG unless a test passes another) → seal each helper
    share under its record's header → version-3 bytes."""
    values, _ = encode(q_tilde, p_hat, encoding)
    values = np.atleast_2d(values)
    leader, helper = split(values, random_bytes)
    rows = headers(study_hash, record_ids, created_ms, encoding.d)
    return encode_two_server_batch(rows, leader, seal_helper_shares(helper_key, rows, helper))


@dataclass
class TwoServerBatch:
    """Decoded version-3 records of one dimension: header columns, the leader's shares and the
    sealed helper shares, one row per record."""

    d: int
    index: np.ndarray
    """Position of each record in the decoder's input."""
    study_hash: np.ndarray
    record_id: np.ndarray
    created_ms: np.ndarray
    header: np.ndarray
    """(k, 48) uint8: the bytes each sealed share is bound to."""
    leader: np.ndarray
    """(k, L) uint64."""
    sealed: list[bytes]

    def __len__(self) -> int:
        return int(self.index.shape[0])

    def take(self, keep: np.ndarray) -> TwoServerBatch:
        """The records where (or at the positions) ``keep``."""
        picked = np.flatnonzero(keep) if keep.dtype == bool else keep
        return TwoServerBatch(
            d=self.d, index=self.index[picked], study_hash=self.study_hash[picked],
            record_id=self.record_id[picked], created_ms=self.created_ms[picked],
            header=self.header[picked], leader=self.leader[picked],
            sealed=[self.sealed[i] for i in picked.tolist()])


def decode_two_server_batch(values: Sequence[bytes], d: int
                            ) -> tuple[TwoServerBatch, list[tuple[int, MalformedRecord]]]:
    """Decode values that should be version-3 records of dimension ``d``: the well-formed ones
    as one batch, and (input index, error) for the others, checked in the order length,
    version, reserved bytes, d, proof length."""
    layout = TwoServerLayout(d)
    rejects: list[tuple[int, MalformedRecord]] = []
    good = []
    for i, value in enumerate(values):
        if value is None or len(value) != layout.size:
            size = "no value" if value is None else f"length {len(value)}"
            rejects.append((i, MalformedRecord(
                RejectReason.UNDECODABLE, f"{size}: a version-3 record at d={d} is "
                f"{layout.size} bytes")))
        else:
            good.append(i)
    raw = np.frombuffer(b"".join(bytes(values[i]) for i in good), dtype=np.uint8
                        ).reshape(len(good), layout.size)
    checks = [
        (raw[:, VERSION_BYTE] != TWO_SERVER_WIRE_VERSION, RejectReason.UNSUPPORTED_VERSION,
         f"not version {TWO_SERVER_WIRE_VERSION}"),
        (raw[:, RESERVED_BYTES].any(axis=1), RejectReason.UNDECODABLE,
         "reserved bytes are not zero"),
        (np.ascontiguousarray(raw[:, D_BYTES]).view("<u4").ravel() != d,
         RejectReason.UNDECODABLE, f"header d is not {d}"),
        (np.ascontiguousarray(raw[:, layout.proof_length]).view("<u4").ravel() != 0,
         RejectReason.UNDECODABLE, "a validity proof is not accepted yet (proof length ≠ 0)"),
    ]
    ok = np.ones(len(good), dtype=bool)
    for failed, reason, detail in checks:
        hit = failed & ok
        rejects += [(good[j], MalformedRecord(reason, detail)) for j in np.flatnonzero(hit)]
        ok &= ~failed
    rejects.sort(key=lambda r: r[0])
    kept = raw[ok]
    sealed_rows = np.ascontiguousarray(kept[:, layout.sealed])
    return TwoServerBatch(
        d=d,
        index=np.asarray(good, dtype=np.int64)[ok],
        study_hash=kept[:, STUDY_HASH_BYTES].copy(),
        record_id=kept[:, RECORD_ID_BYTES].copy(),
        created_ms=np.ascontiguousarray(kept[:, CREATED_MS_BYTES]).view("<i8").ravel(),
        header=kept[:, :HEADER_SIZE].copy(),
        leader=np.ascontiguousarray(kept[:, layout.leader]).view("<u8").astype(np.uint64),
        sealed=[row.tobytes() for row in sealed_rows],
    ), rejects
