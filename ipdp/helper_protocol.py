"""The contract between a two-server study's leader and its helper: what the leader forwards of
each record (docs/architecture.md, "The helper").

A device's version-3 record (docs/wire-format.md, "Two-server records") is

    header (48 bytes, version 3) ‖ leader share (8L) ‖ sealed helper share (8L + 48) ‖
    u32 proof length ‖ proof,           L = d(d+3)/2.

The leader keeps its share and forwards the rest, :func:`helper_part`, so the helper never
holds both shares of a record. Both servers keep, per round, the :func:`id_checksum` of the ids
they folded, so the trainer combines a round only when both folded the same set.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

import numpy as np

from ipdp.fixed_point import entries
from ipdp.sealing import SEAL_OVERHEAD
from ipdp.wire import HEADER_SIZE

#: The record version whose helper share is sealed to the helper's key.
TWO_SERVER_VERSION = 3
#: The proof length field after the sealed share (u32, little-endian).
PROOF_LENGTH = struct.Struct("<I")
#: Bytes of a round's id checksum.
CHECKSUM_BYTES = 32


def share_bytes(d: int) -> int:
    """Bytes of one share at dimension ``d``: 8·L."""
    return 8 * entries(d)


def helper_part_size(d: int) -> int:
    """Bytes the helper receives of a record without a proof: header, sealed share, length."""
    return HEADER_SIZE + share_bytes(d) + SEAL_OVERHEAD + PROOF_LENGTH.size


def helper_part(record: bytes, d: int) -> bytes:
    """The helper's part of a version-3 record of dimension ``d``: the record without the
    leader's share."""
    leader_end = HEADER_SIZE + share_bytes(d)
    if len(record) < leader_end:
        raise ValueError(f"a version-3 record at d={d} has at least {leader_end} bytes")
    return record[:HEADER_SIZE] + record[leader_end:]


def id_checksum(ids: Iterable[bytes], start: bytes | None = None) -> bytes:
    """XOR of SHA-256(id) over the 16-byte ``ids``, XORed into ``start`` (a round's checksum so
    far; none: zero): equal on both servers iff (with overwhelming probability) they folded the
    same set of ids."""
    digests = b"".join(hashlib.sha256(bytes(i)).digest() for i in ids)
    total = np.bitwise_xor.reduce(np.frombuffer(digests, np.uint8).reshape(-1, CHECKSUM_BYTES),
                                  axis=0) if digests else np.zeros(CHECKSUM_BYTES, np.uint8)
    if start is not None:
        total = total ^ np.frombuffer(start, np.uint8)
    return total.tobytes()
