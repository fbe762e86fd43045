"""What the helper receives of a version-3 record, and the checks it makes on its own.

The leader forwards the helper part of each version-3 record (ipdp.helper_protocol: the
record without the leader's share). The helper refuses a record, whatever the leader decided,
when it is not of that layout for the study (``undecodable``, ``unsupported_version``,
``wrong_dimension``, ``study_mismatch``), carries a proof (``unexpected_proof``: no study
requires one yet), was created outside the record window (``stale``, ``future``), repeats an id
of the same job (``duplicate_record``), or its share does not open under the helper's key and
the record's header (``bad_seal``). For a study that requires device credentials, a record is
also refused unless the credential the leader forwards with it verifies under the helper's own
pinned issuer keys and its id is one of that credential's slots (ipdp.credentials.admit_slots,
the leader's check: ``credential_missing``, ``credential_invalid``, ``credential_untrusted``,
``credential_expired``, ``credential_wrong_study``, ``credential_bad_slot``). Replays across
jobs and a slot used again (``credential_reused``) are the store's checks (helper.store).
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

import numpy as np

from ipdp.credentials import CredentialVerifier, admit_slots
from ipdp.helper_protocol import PROOF_LENGTH, TWO_SERVER_VERSION, helper_part_size
from ipdp.sealing import SealError, open_share
from ipdp.wire import (
    CREATED_MS_BYTES,
    D_BYTES,
    HEADER_SIZE,
    RECORD_ID_BYTES,
    RESERVED_BYTES,
    STUDY_HASH_BYTES,
    VERSION_BYTE,
    RecordWindow,
    RejectReason,
)


class HelperRefusal(enum.StrEnum):
    """Why the helper refuses one record of a job: the aggregator's word
    (ipdp.wire.RejectReason) wherever both have the reason, so a dead letter and the helper's
    answer name it alike; the two the leader never decides on its own are the helper's."""

    UNDECODABLE = RejectReason.UNDECODABLE.value
    UNSUPPORTED_VERSION = RejectReason.UNSUPPORTED_VERSION.value
    WRONG_DIMENSION = RejectReason.WRONG_DIMENSION.value
    STUDY_MISMATCH = RejectReason.STUDY_MISMATCH.value
    CLOSED_STUDY = RejectReason.CLOSED_STUDY.value
    UNEXPECTED_PROOF = "unexpected_proof"
    STALE = RejectReason.STALE.value
    FUTURE = RejectReason.FUTURE.value
    DUPLICATE_RECORD = RejectReason.DUPLICATE_RECORD.value
    REPLAYED = RejectReason.REPLAYED.value
    BAD_SEAL = "bad_seal"
    CREDENTIAL_MISSING = RejectReason.CREDENTIAL_MISSING.value
    CREDENTIAL_INVALID = RejectReason.CREDENTIAL_INVALID.value
    CREDENTIAL_UNTRUSTED = RejectReason.CREDENTIAL_UNTRUSTED.value
    CREDENTIAL_EXPIRED = RejectReason.CREDENTIAL_EXPIRED.value
    CREDENTIAL_WRONG_STUDY = RejectReason.CREDENTIAL_WRONG_STUDY.value
    CREDENTIAL_BAD_SLOT = RejectReason.CREDENTIAL_BAD_SLOT.value
    CREDENTIAL_REUSED = RejectReason.CREDENTIAL_REUSED.value


@dataclass(frozen=True)
class CredentialRequirement:
    """What a study that requires device credentials needs of each record at the helper: the
    helper's verifier (its own pinned issuer keys) and the lock that serialises its use (its
    caches are not thread-safe, and prepares run in a thread pool), the token each record came
    with (bytes, None for none, or the CredentialRefused its text gave) and the study's
    records_per_device."""

    verifier: CredentialVerifier
    lock: threading.Lock
    tokens: list
    records_per_device: int


@dataclass
class CheckedRecords:
    """A job's records after the helper's own checks: per record, its id, creation time, the
    refusal (None: accepted so far), the opened share (accepted records only) and, for a study
    that requires credentials, its credential's expires_ms (None for other studies)."""

    ids: list[bytes]
    created_ms: np.ndarray
    refusals: list[HelperRefusal | None]
    shares: list[bytes | None]
    expires_ms: np.ndarray | None = None


def check_records(parts: list[bytes], *, d: int, study_hash: bytes, open_study: bool,
                  window: RecordWindow, now_ms: int, private_key,
                  credentials: CredentialRequirement | None = None) -> CheckedRecords:
    """Check and open each part (ipdp.helper_protocol.helper_part) of a job for a study of
    dimension ``d`` (and, with ``credentials``, of a study that requires them).

    The cheap checks go first; only a record that passes them is opened (one HPKE open each).
    """
    size = helper_part_size(d)
    k = len(parts)
    ids = [b""] * k
    created = np.zeros(k, dtype=np.int64)
    refusals: list[HelperRefusal | None] = [None] * k
    shares: list[bytes | None] = [None] * k
    seen_in_job: set[bytes] = set()
    for i, part in enumerate(parts):
        if len(part) < HEADER_SIZE:
            refusals[i] = HelperRefusal.UNDECODABLE
            continue
        ids[i] = bytes(part[RECORD_ID_BYTES])
        created[i] = int.from_bytes(part[CREATED_MS_BYTES], "little", signed=True)
        if part[VERSION_BYTE] != TWO_SERVER_VERSION or any(part[RESERVED_BYTES]):
            refusals[i] = HelperRefusal.UNSUPPORTED_VERSION
        elif int.from_bytes(part[D_BYTES], "little") != d:
            refusals[i] = HelperRefusal.WRONG_DIMENSION
        elif part[STUDY_HASH_BYTES] != study_hash:
            refusals[i] = HelperRefusal.STUDY_MISMATCH
        elif (len(part) < size or len(part) != size + PROOF_LENGTH.unpack_from(
                part, size - PROOF_LENGTH.size)[0]):
            refusals[i] = HelperRefusal.UNDECODABLE
        elif len(part) != size:
            refusals[i] = HelperRefusal.UNEXPECTED_PROOF
        elif not open_study:
            refusals[i] = HelperRefusal.CLOSED_STUDY
    pending = np.array([r is None for r in refusals], dtype=bool)
    for where, reason, _ in window.failures(created, now_ms):
        hit = pending & np.asarray(where, dtype=bool)
        for i in np.flatnonzero(hit):
            refusals[i] = HelperRefusal(reason.value)
        pending &= ~hit
    expires = None if credentials is None else np.zeros(k, dtype=np.int64)
    if credentials is not None and pending.any():
        at = np.flatnonzero(pending)
        record_ids = np.frombuffer(b"".join(ids[i] for i in at), np.uint8).reshape(-1, 16)
        with credentials.lock:
            _ok, refused, expires[at] = admit_slots(
                credentials.verifier, [credentials.tokens[i] for i in at], record_ids,
                study_hash, credentials.records_per_device, now_ms)
        for hit, reason, _detail in refused:
            for i in at[hit]:
                refusals[i] = HelperRefusal(reason.value)
            pending[at[hit]] = False
    for i in np.flatnonzero(pending):
        if ids[i] in seen_in_job:
            refusals[i] = HelperRefusal.DUPLICATE_RECORD
            continue
        part = parts[i]
        try:
            shares[i] = open_share(private_key, bytes(part[HEADER_SIZE:size - PROOF_LENGTH.size]),
                                   bytes(part[:HEADER_SIZE]))
        except SealError:
            refusals[i] = HelperRefusal.BAD_SEAL
            continue
        seen_in_job.add(ids[i])
    return CheckedRecords(ids, created, refusals, shares, expires)

