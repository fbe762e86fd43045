"""The gateway's per-request credential check, for studies that require credentials.

A device sends its credential as ``Authorization: IPDP-Credential <token>`` (ipdp.credentials).
Admission (gateway.ingest) verifies it before the body is read (ipdp.credentials.CredentialVerifier: a version-1
token's signature once per token and process, a version-2 batch's once for all its devices,
then a few hashes per device); the records' ids must then be slots of that credential, each
once in the request. A credential used again in another request, another worker or after a
restart is answered 202 here and dead-lettered ``credential_reused`` by the aggregator, where
the fold is exactly-once: the gateway keeps no state that workers would have to share.
"""

from __future__ import annotations

import time

from gateway.checks import study_record_size
from ipdp.credentials import (
    AUTH_SCHEME,
    Credential,
    CredentialRefused,
    CredentialVerifier,
    slot_id,
)
from ipdp.signing import TrustedKeys
from ipdp.study import Study
from ipdp.wire import RECORD_ID_BYTES, RejectReason

__all__ = ["DeviceCredentials"]

_SCHEME = AUTH_SCHEME.encode("ascii")


class DeviceCredentials:
    """Verifies the credentials of requests to credential-requiring studies; raises
    CredentialRefused when one does not admit its request."""

    def __init__(self, trusted: TrustedKeys) -> None:
        # The aggregator enforces the not-before time (with its clock-skew allowance) and the
        # longest validity (its replay window); the gateway refuses what it can know: missing,
        # malformed, unpinned, expired, another study's, slots not the credential's.
        self.verifier = CredentialVerifier(trusted, skew_ms=None)

    def verify(self, authorization: bytes | None, study: Study) -> tuple[bytes, Credential]:
        """The token of the request's ``Authorization`` header (its bytes, as the ASGI scope
        holds them) and its credential."""
        if not authorization:
            raise CredentialRefused(RejectReason.CREDENTIAL_MISSING,
                                    f"study {study.study_id!r} requires a device credential: "
                                    f"Authorization: {AUTH_SCHEME} <credential>")
        scheme, _, text = authorization.partition(b" ")
        if scheme != _SCHEME:
            raise CredentialRefused(RejectReason.CREDENTIAL_INVALID,
                                    f"Authorization scheme must be {AUTH_SCHEME}")
        return self.verifier.check_text(text, study.hash, time.time_ns() // 1_000_000)

    @staticmethod
    def check_slots(records: bytes, study: Study, credential: Credential) -> None:
        """Each record id of ``records`` (checked records of the study, back to back, so no id
        twice: gateway.checks refuses a repeated one) must be a slot of ``credential``. A
        version-3 record's id sits where a version-1 record's does."""
        size = study_record_size(study)
        k, m = len(records) // size, study.records_per_device
        if k > m:
            raise CredentialRefused(RejectReason.CREDENTIAL_REUSED,
                                    f"{k} records, but a credential has {m} slot(s)")
        if k == 1:  # one record per request, the device case: one hash per slot, no set
            record_id = records[RECORD_ID_BYTES]
            for s in range(m):
                if record_id == slot_id(credential.credential_id, s):
                    return
            raise _bad_slot(0, m)
        slots = credential.slot_set(m)
        for i in range(k):  # k ≤ records_per_device: a few ids
            if records[i * size:(i + 1) * size][RECORD_ID_BYTES] not in slots:
                raise _bad_slot(i, m)


def _bad_slot(i: int, m: int) -> CredentialRefused:
    """The refusal of record ``i`` of a request, whose id is none of its credential's m slots."""
    return CredentialRefused(RejectReason.CREDENTIAL_BAD_SLOT,
                             f"record {i}: its id is none of the credential's {m} slot id(s)")
