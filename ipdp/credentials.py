"""Device credentials: who may contribute to a study that requires them, and how often.

A *credential* is issued to one device for one study by whoever vouches for devices (the study
owner, or an app backend), signed with the issuer's Ed25519 key (ipdp.signing). The gateway and
the aggregator pin the issuer keys (``IPDP_TRUSTED_CREDENTIAL_KEYS``) as they pin study keys.

**Token, version 1** (121 bytes; text form: unpadded base64url, 162 characters)::

    offset size  field
    0      1     version, u8, = 1
    1      16    study hash: the study's wire hash (binds its id and every parameter)
    17     16    credential id: 16 random bytes chosen by the issuer
    33     8     issued_ms, i64 little-endian: valid from then (less the allowed clock skew)
    41     8     expires_ms, i64 little-endian: valid until then
    49     8     key id: SHA-256(issuer's raw public key)[:8]
    57     64    Ed25519 signature of b"ipdp-credential-v1\\n" + bytes 0..57

**Slots.** A study states ``records_per_device`` = m. A credential may contribute the m records
whose ids are ``slot_record_id(credential id, s)`` = SHA-256(b"ipdp-record-id-v1\\n" ‖ credential
id ‖ s as u32 little-endian)[:16], s = 0 … m − 1, and no other. The aggregator's replay state
(aggregator/replay.py) already refuses a record id it folded within its replay window, so a slot
is folded at most once for as long as the credential is valid (``credential_reused``), provided
its validity does not exceed that window: :meth:`CredentialVerifier.check` refuses one that does.

**On Kafka**, each record's credential travels in the ``credentials`` header of its message, as
runs: repeated (u32 little-endian count, 121-byte token), the counts adding up to the message's
records in order (one run for a plain record or a one-device container).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from cryptography.exceptions import InvalidSignature

from ipdp.errors import IpdpError
from ipdp.signing import SigningKey, TrustedKeys
from ipdp.wire import RejectReason

__all__ = ["CREDENTIALS_HEADER", "CREDENTIAL_ID", "TOKEN_SIZE", "Credential", "CredentialRefused",
           "CredentialVerifier", "credentials_header", "issue_credential", "parse_token",
           "slot_record_ids", "token_from_text", "token_text", "tokens_of_header"]

TOKEN_VERSION = 1
SIGNED_SIZE = 57
TOKEN_SIZE = SIGNED_SIZE + 64
SIGNING_TAG = b"ipdp-credential-v1\n"
RECORD_ID_TAG = b"ipdp-record-id-v1\n"
#: The Kafka header holding each record's credential (runs, module docstring).
CREDENTIALS_HEADER = "credentials"
#: More records than one Kafka message can hold: a run's count is capped here before expanding.
MAX_RECORDS_PER_HEADER = 1 << 20
#: The HTTP Authorization scheme of a device's credential.
AUTH_SCHEME = "IPDP-Credential"
_PAYLOAD = struct.Struct("<B16s16sqq8s")
#: Where a token holds its credential id.
CREDENTIAL_ID = slice(17, 33)
_RUN = struct.Struct("<I")


class CredentialRefused(IpdpError):
    """A credential that does not admit a record; ``reason`` is its dead-letter reason."""

    def __init__(self, reason: RejectReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason, self.detail = RejectReason(reason), detail


@dataclass(frozen=True)
class Credential:
    """A parsed, signature-checked credential."""

    study_hash: bytes
    credential_id: bytes
    issued_ms: int
    expires_ms: int
    key_id: str

    @cached_property
    def _slots(self) -> dict[int, np.ndarray]:
        return {}

    def slot_ids(self, records_per_device: int) -> np.ndarray:
        """The record ids this credential may use, (records_per_device, 16) uint8 (cached)."""
        ids = self._slots.get(records_per_device)
        if ids is None:
            ids = self._slots[records_per_device] = slot_record_ids(
                self.credential_id, records_per_device)
        return ids

    @cached_property
    def _slot_sets(self) -> dict[int, frozenset[bytes]]:
        return {}

    def slot_set(self, records_per_device: int) -> frozenset[bytes]:
        """The same ids as 16-byte strings, for a few lookups (cached; no numpy: the gateway
        builds one per new device)."""
        ids = self._slot_sets.get(records_per_device)
        if ids is None:
            ids = self._slot_sets[records_per_device] = frozenset(
                _slot_ids(self.credential_id, records_per_device))
        return ids


def slot_record_ids(credential_id: bytes, records_per_device: int) -> np.ndarray:
    """Record ids of slots 0 … records_per_device − 1 of a credential, (m, 16) uint8."""
    raw = b"".join(_slot_ids(credential_id, records_per_device))
    return np.frombuffer(raw, np.uint8).reshape(records_per_device, 16)


def _slot_ids(credential_id: bytes, records_per_device: int) -> list[bytes]:
    return [hashlib.sha256(RECORD_ID_TAG + credential_id + _RUN.pack(s)).digest()[:16]
            for s in range(records_per_device)]


def issue_credential(key: SigningKey, study_hash: bytes, issued_ms: int, expires_ms: int,
                     credential_id: bytes | None = None) -> bytes:
    """A signed token for one device (a fresh random credential id unless one is given)."""
    if len(study_hash) != 16:
        raise ValueError("study_hash must be 16 bytes")
    if expires_ms <= issued_ms:
        raise ValueError(f"expires_ms {expires_ms} must be after issued_ms {issued_ms}")
    cid = os.urandom(16) if credential_id is None else credential_id
    payload = _PAYLOAD.pack(TOKEN_VERSION, study_hash, cid, issued_ms, expires_ms,
                            bytes.fromhex(key.key_id))
    return payload + key.private.sign(SIGNING_TAG + payload)


def token_text(token: bytes) -> str:
    """The token as a device stores and sends it: unpadded base64url."""
    return base64.urlsafe_b64encode(token).rstrip(b"=").decode("ascii")


def token_from_text(text: str) -> bytes:
    """Inverse of :func:`token_text`; CredentialRefused (``credential_invalid``) if malformed."""
    try:
        raw = base64.urlsafe_b64decode(text.strip() + "=" * (-len(text.strip()) % 4))
    except (binascii.Error, ValueError):
        raise CredentialRefused(RejectReason.CREDENTIAL_INVALID, "not base64url") from None
    if len(raw) != TOKEN_SIZE:
        raise CredentialRefused(RejectReason.CREDENTIAL_INVALID,
                                f"{len(raw)} bytes, a credential has {TOKEN_SIZE}")
    return raw


def parse_token(token: bytes, trusted: TrustedKeys) -> Credential:
    """The credential of a token whose signature verifies under a pinned key, or
    CredentialRefused: ``credential_invalid`` (malformed, altered) or ``credential_untrusted``."""
    if len(token) != TOKEN_SIZE:
        raise CredentialRefused(RejectReason.CREDENTIAL_INVALID,
                                f"{len(token)} bytes, a credential has {TOKEN_SIZE}")
    version, sh, cid, issued, expires, kid = _PAYLOAD.unpack_from(token)
    if version != TOKEN_VERSION:
        raise CredentialRefused(RejectReason.CREDENTIAL_INVALID,
                                f"version {version}, supported: {TOKEN_VERSION}")
    key = trusted.key(kid.hex())
    if key is None:
        raise CredentialRefused(RejectReason.CREDENTIAL_UNTRUSTED,
                                f"issued by key {kid.hex()}, not a pinned credential issuer")
    try:
        key.verify(token[SIGNED_SIZE:], SIGNING_TAG + token[:SIGNED_SIZE])
    except InvalidSignature:
        raise CredentialRefused(RejectReason.CREDENTIAL_INVALID,
                                f"signature does not verify under key {kid.hex()}") from None
    return Credential(sh, cid, issued, expires, kid.hex())


class CredentialVerifier:
    """Checks credentials against pinned issuer keys, one signature verification per distinct
    token and process: results (credential or refusal) are kept for the ``cache_size`` tokens
    used most recently, so a device sending k records, or an attacker repeating a bad token,
    costs one verification.

    ``max_validity_ms``: the longest validity accepted (the aggregator's replay window, so that
    the window's forgetting can never re-admit a slot; None: not checked); ``skew_ms``: how
    early before ``issued_ms`` a credential is accepted (clocks differ; None: not checked).
    """

    def __init__(self, trusted: TrustedKeys, *, max_validity_ms: int | None = None,
                 skew_ms: int | None = 0, cache_size: int = 100_000) -> None:
        self.trusted = trusted
        self.max_validity_ms, self.skew_ms = max_validity_ms, skew_ms
        self.cache_size = cache_size
        self._seen: OrderedDict[bytes, Credential | CredentialRefused] = OrderedDict()

    def parsed(self, token: bytes) -> Credential:
        """:func:`parse_token`, cached by the token's bytes."""
        result = self._seen.get(token)
        if result is not None:
            self._seen.move_to_end(token)
        else:
            try:
                result = parse_token(token, self.trusted)
            except CredentialRefused as refusal:
                result = refusal
            self._seen[token] = result
            if len(self._seen) > self.cache_size:
                self._seen.popitem(last=False)
        if isinstance(result, CredentialRefused):
            raise result
        return result

    def check(self, token: bytes | None, study_hash: bytes, now_ms: int) -> Credential:
        """The credential, if it admits records of the study with hash ``study_hash`` now;
        otherwise CredentialRefused with the reason."""
        if not token:
            raise CredentialRefused(RejectReason.CREDENTIAL_MISSING,
                                    "the study requires a device credential")
        cred = self.parsed(token)
        if cred.study_hash != study_hash:
            raise CredentialRefused(RejectReason.CREDENTIAL_WRONG_STUDY,
                                    f"issued for study hash {cred.study_hash.hex()}")
        if self.max_validity_ms is not None and \
                cred.expires_ms - cred.issued_ms > self.max_validity_ms:
            raise CredentialRefused(
                RejectReason.CREDENTIAL_INVALID,
                f"valid for {(cred.expires_ms - cred.issued_ms) // 1000} s, longer than the "
                f"replay window ({self.max_validity_ms // 1000} s)")
        if now_ms > cred.expires_ms:
            raise CredentialRefused(RejectReason.CREDENTIAL_EXPIRED,
                                    f"expired at {cred.expires_ms} ms, now {now_ms} ms")
        if self.skew_ms is not None and now_ms < cred.issued_ms - self.skew_ms:
            raise CredentialRefused(RejectReason.CREDENTIAL_INVALID,
                                    f"not valid before {cred.issued_ms} ms, now {now_ms} ms")
        return cred


def credentials_header(runs: list[tuple[bytes, int]]) -> tuple[str, bytes]:
    """The Kafka header of a message whose records use these (token, count) runs in order."""
    return CREDENTIALS_HEADER, b"".join(_RUN.pack(k) + token for token, k in runs)


def tokens_of_header(headers) -> list[bytes] | None:
    """The tokens of a message's records in order, from its headers (a list of (name, value)),
    None when it has no credentials header. CredentialRefused (``credential_invalid``) when the
    header is not whole runs; the caller pairs the i-th record with the i-th token."""
    value = None
    for name, v in headers or ():
        if name == CREDENTIALS_HEADER:
            value = v
            break
    if value is None:
        return None
    out: list[bytes] = []
    pos, size = 0, _RUN.size + TOKEN_SIZE
    while pos + size <= len(value) and len(out) <= MAX_RECORDS_PER_HEADER:
        (count,) = _RUN.unpack_from(value, pos)
        out += [bytes(value[pos + _RUN.size:pos + size])] * min(count, MAX_RECORDS_PER_HEADER)
        pos += size
    if pos != len(value) or not out:
        raise CredentialRefused(RejectReason.CREDENTIAL_INVALID,
                                f"the {CREDENTIALS_HEADER} header is not whole (count, "
                                "credential) runs")
    return out
