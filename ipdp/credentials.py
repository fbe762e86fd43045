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

**Token, version 2: a batch under one signature** (158 + 32·h bytes). The issuer puts the ids
of up to 2^h credentials of one study and one validity window in the leaves of a Merkle tree of
height h and signs the root once; a device holds the signed batch header, its leaf and the path
from its leaf to the root::

    offset size  field
    0      1     version, u8, = 2
    1      16    study hash
    17     8     issued_ms, i64 little-endian
    25     8     expires_ms, i64 little-endian
    33     8     key id
    41     1     tree height h, u8, 0 … MAX_TREE_HEIGHT
    42     32    root
    74     64    Ed25519 signature of b"ipdp-credential-v2\\n" + bytes 0..74 (the batch header)
    138    4     leaf index i, u32 little-endian, i < 2^h
    142    16    credential id
    158    32·h  authentication path: the sibling of the node on the way up, leaf level first

leaf = SHA-256(b"ipdp-credential-leaf-v2\\n" ‖ bytes 138..158), node =
SHA-256(b"ipdp-credential-node-v2\\n" ‖ left ‖ right); at level l the node on the way up is the
right child when bit l of i is 1. The tags keep leaves, nodes and signed headers apart; the index
in the leaf ties a credential id to one position. A batch of fewer than 2^h credentials is padded
with leaves of random ids that the issuer forgets, so every path has h nodes (one fixed token
size per batch, a verifier without special cases) and the batch's true size is hidden below 2^h.
Verifying a token costs, once per distinct batch header and process, one signature
verification, and h + 1 SHA-256 calls for its path; a verifier that keeps a batch's verified
paths (CredentialVerifier) hashes only up to the level MEMO_LEVELS below the root and compares
the rest of the path with a verified one in one step, so a new device of a known batch costs
max(0, h − MEMO_LEVELS) + 1 SHA-256 calls (three for a tree of height 10) once a path through
the same node of that level was verified, h + 1 before, instead of a signature verification
(docs/benchmarks.md, "Device credentials").

**On Kafka**, each record's credential travels in the ``credentials`` header of its message, as
runs: repeated (u32 little-endian count, token), the counts adding up to the message's records
in order (one run for a plain record or a one-device container). A token says its own size (its
version byte, and for version 2 its height), so the runs are self-describing and headers written
before version 2 read unchanged.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import struct
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
from cryptography.exceptions import InvalidSignature

from ipdp.errors import IpdpError
from ipdp.signing import SigningKey, TrustedKeys
from ipdp.wire import RejectReason

__all__ = [
    "CREDENTIALS_HEADER",
    "MAX_TREE_HEIGHT",
    "TOKEN_SIZE",
    "Credential",
    "CredentialRefused",
    "CredentialVerifier",
    "admit_slots",
    "credential_id",
    "credential_run_size",
    "credentials_header",
    "issue_batch",
    "issue_credential",
    "parse_token",
    "slot_id",
    "slot_record_ids",
    "token_from_text",
    "token_size",
    "token_text",
    "tokens_of_header",
]

TOKEN_VERSION = 1
SIGNED_SIZE = 57
#: The size of a version-1 token.
TOKEN_SIZE = SIGNED_SIZE + 64
SIGNING_TAG = b"ipdp-credential-v1\n"
BATCH_VERSION = 2
BATCH_SIGNING_TAG = b"ipdp-credential-v2\n"
LEAF_TAG = b"ipdp-credential-leaf-v2\n"
NODE_TAG = b"ipdp-credential-node-v2\n"
#: The tallest batch tree: 2^20 credentials under one signature, tokens of 798 bytes.
MAX_TREE_HEIGHT = 20
_BATCH_HEADER = struct.Struct("<B16sqq8sB32s")
#: Where a version-2 token holds its tree height h (after version, study hash, validity, key id).
_HEIGHT_AT = struct.calcsize("<B16sqq8s")
#: A version-2 token's batch header and signature: the part every credential of a batch shares.
BATCH_PREFIX_SIZE = _BATCH_HEADER.size + 64
_LEAF = struct.Struct("<I16s")
_PATH_AT = BATCH_PREFIX_SIZE + _LEAF.size
RECORD_ID_TAG = b"ipdp-record-id-v1\n"
#: The Kafka header holding each record's credential (runs, module docstring).
CREDENTIALS_HEADER = "credentials"
#: More records than one Kafka message can hold: a run's count is capped here before expanding.
MAX_RECORDS_PER_HEADER = 1 << 20
#: The HTTP Authorization scheme of a device's credential.
AUTH_SCHEME = "IPDP-Credential"
_PAYLOAD = struct.Struct("<B16s16sqq8s")
#: Where a version-1 token holds its credential id (after version and study hash), and where a
#: version-2 leaf holds it (after the leaf index).
_V1_ID_AT = struct.calcsize("<B16s")
_LEAF_ID_AT = struct.calcsize("<I")
_FROM_URLSAFE = bytes.maketrans(b"-_", b"+/")
_RUN = struct.Struct("<I")


class CredentialRefused(IpdpError):
    """A credential that does not admit a record; ``reason`` is its dead-letter reason."""

    def __init__(self, reason: RejectReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason, self.detail = RejectReason(reason), detail


class Credential(NamedTuple):
    """A parsed, signature-checked credential. A plain tuple: a verifier builds one for every
    new device, and a tuple of bytes and numbers costs the collector nothing once cached."""

    study_hash: bytes
    credential_id: bytes
    issued_ms: int
    expires_ms: int
    key_id: str

    def slot_ids(self, records_per_device: int) -> np.ndarray:
        """The record ids this credential may use, (records_per_device, 16) uint8."""
        return slot_record_ids(self.credential_id, records_per_device)

    def slot_set(self, records_per_device: int) -> frozenset[bytes]:
        """The same ids as 16-byte strings, for a few lookups (no numpy: the gateway builds
        one per new device)."""
        return frozenset(_slot_ids(self.credential_id, records_per_device))


def slot_record_ids(credential_id: bytes, records_per_device: int) -> np.ndarray:
    """Record ids of slots 0 … records_per_device − 1 of a credential, (m, 16) uint8."""
    raw = b"".join(_slot_ids(credential_id, records_per_device))
    return np.frombuffer(raw, np.uint8).reshape(records_per_device, 16)


def _slot_ids(credential_id: bytes, records_per_device: int) -> list[bytes]:
    return [slot_id(credential_id, s) for s in range(records_per_device)]


def slot_id(credential_id: bytes, slot: int) -> bytes:
    """The record id of one slot of a credential (16 bytes)."""
    return hashlib.sha256(RECORD_ID_TAG + credential_id + _RUN.pack(slot)).digest()[:16]


def issue_credential(key: SigningKey, study_hash: bytes, issued_ms: int, expires_ms: int,
                     credential_id: bytes | None = None) -> bytes:
    """A signed version-1 token for one device (a fresh random credential id unless one is
    given)."""
    _check_window(study_hash, issued_ms, expires_ms)
    cid = os.urandom(16) if credential_id is None else credential_id
    payload = _PAYLOAD.pack(TOKEN_VERSION, study_hash, cid, issued_ms, expires_ms,
                            bytes.fromhex(key.key_id))
    return payload + key.private.sign(SIGNING_TAG + payload)


def issue_batch(key: SigningKey, study_hash: bytes, issued_ms: int, expires_ms: int,
                count: int, credential_ids: list[bytes] | None = None) -> list[bytes]:
    """``count`` version-2 tokens under one signature: one batch, one validity window (fresh
    random credential ids unless given; padded to a power of two with random ids nobody keeps)."""
    _check_window(study_hash, issued_ms, expires_ms)
    if not 1 <= count <= 1 << MAX_TREE_HEIGHT:
        raise ValueError(f"count {count} must lie in 1 … {1 << MAX_TREE_HEIGHT}")
    height = (count - 1).bit_length()
    ids = [os.urandom(16) for _ in range(count)] if credential_ids is None else credential_ids
    if len(ids) != count:
        raise ValueError(f"{len(ids)} credential ids for {count} credentials")
    leaves = [_LEAF.pack(i, cid) for i, cid in
              enumerate(ids + [os.urandom(16) for _ in range((1 << height) - count)])]
    levels = [[hashlib.sha256(LEAF_TAG + leaf).digest() for leaf in leaves]]
    while len(levels[-1]) > 1:
        below = levels[-1]
        levels.append([hashlib.sha256(NODE_TAG + below[j] + below[j + 1]).digest()
                       for j in range(0, len(below), 2)])
    header = _BATCH_HEADER.pack(BATCH_VERSION, study_hash, issued_ms, expires_ms,
                                bytes.fromhex(key.key_id), height, levels[-1][0])
    prefix = header + key.private.sign(BATCH_SIGNING_TAG + header)
    return [prefix + leaves[i] + b"".join(levels[level][(i >> level) ^ 1]
                                          for level in range(height))
            for i in range(count)]


def _check_window(study_hash: bytes, issued_ms: int, expires_ms: int) -> None:
    if len(study_hash) != 16:
        raise ValueError("study_hash must be 16 bytes")
    if expires_ms <= issued_ms:
        raise ValueError(f"expires_ms {expires_ms} must be after issued_ms {issued_ms}")


def token_size(buffer: bytes, at: int = 0) -> int | None:
    """The size of the token starting at ``buffer[at]``, read from its version byte (and its
    height for version 2); None when no supported token starts there."""
    version = buffer[at] if len(buffer) > at else None
    if version == TOKEN_VERSION:
        return TOKEN_SIZE
    if version == BATCH_VERSION and len(buffer) > at + _HEIGHT_AT:
        height = buffer[at + _HEIGHT_AT]
        if height <= MAX_TREE_HEIGHT:
            return _PATH_AT + 32 * height
    return None


def credential_id(token: bytes) -> bytes:
    """The credential id of a well-formed token of either version (its slots derive from it)."""
    at = _V1_ID_AT if token[0] == TOKEN_VERSION else BATCH_PREFIX_SIZE + _LEAF_ID_AT
    return bytes(token[at:at + 16])


def token_text(token: bytes) -> str:
    """The token as a device stores and sends it: unpadded base64url."""
    return base64.urlsafe_b64encode(token).rstrip(b"=").decode("ascii")


def token_from_text(text: str | bytes) -> bytes:
    """Inverse of :func:`token_text` (the text, or its ASCII bytes as an HTTP header holds
    them); CredentialRefused (``credential_invalid``) if malformed."""
    try:
        raw = _b64url(text.encode("ascii") if isinstance(text, str) else text)
    except (binascii.Error, ValueError):
        raise CredentialRefused(RejectReason.CREDENTIAL_INVALID, "not base64url") from None
    _check_size(raw)
    return raw


def _b64url(text: bytes) -> bytes:
    """Unpadded base64url → bytes: to base64, then the C decoder; surplus padding is ignored, so
    "==" always completes the unpadded form (what base64.urlsafe_b64decode does, in fewer
    steps). binascii.Error if malformed."""
    return binascii.a2b_base64(text.strip().translate(_FROM_URLSAFE) + b"==")


def _check_size(token: bytes) -> None:
    size = token_size(token)
    if size is None:
        raise CredentialRefused(RejectReason.CREDENTIAL_INVALID,
                                f"version {token[:1].hex() or 'missing'} or height unsupported: "
                                f"version {TOKEN_VERSION} tokens have {TOKEN_SIZE} bytes, version "
                                f"{BATCH_VERSION} ones {_PATH_AT} + 32 × height "
                                f"(height ≤ {MAX_TREE_HEIGHT})")
    if len(token) != size:
        raise CredentialRefused(RejectReason.CREDENTIAL_INVALID,
                                f"{len(token)} bytes, this credential's version has {size}")


class _Remembered:
    """The outcomes of a costly check (a value, or the CredentialRefused it raised) for the
    ``size`` keys used most recently."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._seen: OrderedDict[bytes, object] = OrderedDict()

    def get(self, key: bytes, check, *args):
        """``check(*args)``'s outcome for ``key``, computed once while remembered; refusals
        re-raised."""
        result = self._seen.get(key, self)
        if result is not self:
            self._seen.move_to_end(key)
        else:
            try:
                result = check(*args)
            except CredentialRefused as refusal:
                result = refusal
            self._seen[key] = result
            if len(self._seen) > self.size:
                self._seen.popitem(last=False)
        if isinstance(result, CredentialRefused):
            raise result
        return result


#: Levels of a batch's tree below the root whose verified paths a verifier keeps (see _Batch).
MEMO_LEVELS = 8
#: The text (unpadded base64url) of a version-2 batch prefix: 138 bytes, 46 whole groups of 3,
#: so a token's text starts with its batch prefix's text and the rest decodes on its own.
BATCH_PREFIX_TEXT = BATCH_PREFIX_SIZE * 4 // 3
assert BATCH_PREFIX_SIZE % 3 == 0


class _Batch:
    """A version-2 batch whose header's signature verified in this process: the fields its
    credentials share, read once, and verified paths of its tree.

    The paths are kept at the *boundary* level b = max(0, h − MEMO_LEVELS): for each node there
    that a verified path went through, its value followed by the siblings above it, up to the
    root (``boundary``, by heap number: the root is 1, the children of node k are 2k and
    2k + 1). A token's path then costs the b + 1 hashes up to the boundary, and one comparison
    of the rest with the kept path: equal, the token is on the tree; different, it is not, as a
    different path to the same root would be a SHA-256 collision. At most 2^min(h, MEMO_LEVELS)
    entries of 32·(min(h, MEMO_LEVELS) + 1) bytes: 74 KB of paths for any tree of height 8 or
    more, 97 KiB with their objects and dictionary."""

    __slots__ = ("boundary", "expires_ms", "height", "issued_ms", "key_id", "low", "prefix",
                 "root", "study_hash", "tail_size", "text")

    def __init__(self, prefix: bytes, trusted: TrustedKeys) -> None:
        _version, sh, issued, expires, kid, height, root = _BATCH_HEADER.unpack_from(prefix)
        _verify(_pinned(trusted, kid), kid, prefix[_BATCH_HEADER.size:],
                BATCH_SIGNING_TAG + prefix[:_BATCH_HEADER.size])
        self.study_hash, self.issued_ms, self.expires_ms = sh, issued, expires
        self.key_id, self.height, self.root = kid.hex(), height, root
        self.prefix, self.text = prefix, base64.urlsafe_b64encode(prefix)
        self.tail_size = _LEAF.size + 32 * height  # leaf index, credential id, path
        self.low = max(0, height - MEMO_LEVELS)
        self.boundary: dict[int, bytes] = {}

    def on_tree(self, tail: bytes, index: int) -> bool:
        """Whether a token's leaf and path (``tail``, its bytes after the batch prefix; leaf
        ``index`` < 2^h) lead to the signed root; a path verified in full is kept."""
        sha256 = hashlib.sha256
        node = sha256(LEAF_TAG + tail[:_LEAF.size]).digest()
        number = (1 << self.height) + index  # the leaf's heap number
        at = _LEAF.size
        for _ in range(self.low):
            sibling = tail[at:at + 32]
            at += 32
            node = sha256(NODE_TAG + (sibling + node if number & 1 else node + sibling)).digest()
            number >>= 1
        above = tail[at:]  # the siblings of the boundary node and of its ancestors
        known = self.boundary.get(number)
        if known is not None:
            return known == node + above
        top, up = node, number
        for at in range(0, len(above), 32):
            sibling = above[at:at + 32]
            top = sha256(NODE_TAG + (sibling + top if up & 1 else top + sibling)).digest()
            up >>= 1
        if top != self.root:
            return False
        self.boundary[number] = node + above
        if above:  # the sibling's path is verified too: its sibling is this node
            self.boundary[number ^ 1] = above[:32] + node + above[32:]
        return True

    def credential(self, tail: bytes) -> Credential | None:
        """The credential of a token of this batch (``tail``: its bytes after the batch prefix),
        None when its leaf index or its path is not this batch's."""
        index, cid = _LEAF.unpack_from(tail)
        if index >> self.height or not self.on_tree(tail, index):
            return None
        return Credential(self.study_hash, cid, self.issued_ms, self.expires_ms, self.key_id)


def _batch_token(token: bytes, trusted: TrustedKeys,
                 batches: _Remembered | None) -> tuple[_Batch, Credential]:
    """A well-sized version-2 token's batch (its signature checked, or found in ``batches``)
    and credential; CredentialRefused otherwise."""
    index = _LEAF.unpack_from(token, BATCH_PREFIX_SIZE)[0]
    if index >> token[_HEIGHT_AT]:
        raise CredentialRefused(RejectReason.CREDENTIAL_INVALID,
                                f"leaf {index} of a batch of height {token[_HEIGHT_AT]}")
    prefix = token[:BATCH_PREFIX_SIZE]
    batch = _Batch(prefix, trusted) if batches is None else batches.get(prefix, _Batch, prefix,
                                                                        trusted)
    cred = batch.credential(token[BATCH_PREFIX_SIZE:])
    if cred is None:
        raise CredentialRefused(RejectReason.CREDENTIAL_INVALID,
                                "the credential's path does not lead to its batch's root")
    return batch, cred


def parse_token(token: bytes, trusted: TrustedKeys,
                batches: _Remembered | None = None) -> Credential:
    """The credential of a token whose signature verifies under a pinned key, or
    CredentialRefused: ``credential_invalid`` (malformed, altered) or ``credential_untrusted``.
    ``batches`` remembers the version-2 batches whose header's signature was checked, and the
    paths of their trees verified since."""
    _check_size(token)
    if token[0] == TOKEN_VERSION:
        _version, sh, cid, issued, expires, kid = _PAYLOAD.unpack_from(token)
        _verify(_pinned(trusted, kid), kid, token[SIGNED_SIZE:],
                SIGNING_TAG + token[:SIGNED_SIZE])
        return Credential(sh, cid, issued, expires, kid.hex())
    return _batch_token(token, trusted, batches)[1]


def _pinned(trusted: TrustedKeys, kid: bytes):
    key = trusted.key(kid.hex())
    if key is None:
        raise CredentialRefused(RejectReason.CREDENTIAL_UNTRUSTED,
                                f"issued by key {kid.hex()}, not a pinned credential issuer")
    return key


def _verify(key, kid: bytes, signature: bytes, message: bytes) -> None:
    try:
        key.verify(signature, message)
    except InvalidSignature:
        raise CredentialRefused(RejectReason.CREDENTIAL_INVALID,
                                f"signature does not verify under key {kid.hex()}") from None


class CredentialVerifier:
    """Checks credentials against pinned issuer keys, with one signature verification per
    distinct version-1 token, or version-2 batch header, and process. Version-1 outcomes
    (credential or refusal) are kept for the ``cache_size`` tokens used most recently, so a
    device sending k records, or an attacker repeating a bad token, costs no further
    verification. For version 2, the ``batch_cache_size`` batches used most recently are kept,
    each with verified paths of its tree (_Batch): a new device of a known batch costs three
    SHA-256 calls for a tree of height 10, a bad path at most h + 1, and the heap does not grow
    with the devices.

    ``max_validity_ms``: the longest validity accepted (the aggregator's replay window, so that
    the window's forgetting can never re-admit a slot; None: not checked); ``skew_ms``: how
    early before ``issued_ms`` a credential is accepted (clocks differ; None: not checked).
    """

    def __init__(self, trusted: TrustedKeys, *, max_validity_ms: int | None = None,
                 skew_ms: int | None = 0, cache_size: int = 100_000,
                 batch_cache_size: int = 1024) -> None:
        self.trusted = trusted
        self.max_validity_ms, self.skew_ms = max_validity_ms, skew_ms
        self._tokens = _Remembered(cache_size)
        self._batches = _Remembered(batch_cache_size)
        # The verified batches by their prefix's text, for check_text (at most batch_cache_size:
        # emptied when full, refilled by the next token of each batch in use).
        self._texts: dict[bytes, _Batch] = {}

    def parsed(self, token: bytes) -> Credential:
        """:func:`parse_token`: a version-1 token's outcome cached by its bytes (a signature
        each); a version-2 token checked against its cached batch (a few hashes, no per-token
        state: a million devices of one batch do not grow the heap)."""
        if token and token[0] == BATCH_VERSION:
            _check_size(token)
            batch, cred = _batch_token(token, self.trusted, self._batches)
            if batch.text not in self._texts:
                if len(self._texts) >= self._batches.size:
                    self._texts.clear()
                self._texts[batch.text] = batch
            return cred
        return self._tokens.get(token, lambda: parse_token(token, self.trusted))

    def check(self, token: bytes | None, study_hash: bytes, now_ms: int) -> Credential:
        """The credential, if it admits records of the study with hash ``study_hash`` now;
        otherwise CredentialRefused with the reason."""
        if not token:
            raise CredentialRefused(RejectReason.CREDENTIAL_MISSING,
                                    "the study requires a device credential")
        cred = self.parsed(token)
        self._admits(cred, study_hash, now_ms)
        return cred

    def check_text(self, text: bytes, study_hash: bytes, now_ms: int
                   ) -> tuple[bytes, Credential]:
        """:meth:`check` of the token whose text (unpadded base64url, as an HTTP header holds
        it) is ``text``: the token and its credential. A version-2 token of a batch verified
        before is found by its text's first BATCH_PREFIX_TEXT characters, and only the rest
        (its leaf and path) is decoded; any other text takes :func:`token_from_text` and
        :meth:`check`, which also give every refusal."""
        batch = self._texts.get(text[:BATCH_PREFIX_TEXT])
        if batch is not None:
            try:
                tail = _b64url(text[BATCH_PREFIX_TEXT:])
            except (binascii.Error, ValueError):
                tail = b""
            cred = batch.credential(tail) if len(tail) == batch.tail_size else None
            if cred is not None:
                self._admits(cred, study_hash, now_ms)
                return batch.prefix + tail, cred
        token = token_from_text(text)
        return token, self.check(token, study_hash, now_ms)

    def _admits(self, cred: Credential, study_hash: bytes, now_ms: int) -> None:
        """CredentialRefused unless the verified credential admits records of the study with
        hash ``study_hash`` now."""
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


def admit_slots(verifier: CredentialVerifier, tokens: list, record_ids: np.ndarray,
                study_hash: bytes, records_per_device: int, now_ms: int
                ) -> tuple[np.ndarray, list[tuple[np.ndarray, RejectReason, str]], np.ndarray]:
    """Which records a credential admits: record i, of id ``record_ids[i]`` ((k, 16) uint8),
    came with ``tokens[i]`` (the token, None for none, or the CredentialRefused its transport
    already gave). Each distinct token is checked once (:meth:`CredentialVerifier.check`), and
    every record id is compared with its credential's slot ids in one numpy comparison. Returns
    the mask of admitted records; per refused credential (and for the ids outside their
    credential's slots, ``credential_bad_slot``), (mask of its records, reason, detail); and
    per record its credential's expires_ms (0 where refused), until when its slot must be
    remembered. A slot used twice is the caller's to refuse, where its fold is exactly-once."""
    m = records_per_device
    distinct: dict[object, int] = {}
    which = np.fromiter((distinct.setdefault(t, len(distinct)) for t in tokens), np.int64,
                        len(tokens))
    slots, refusals = [], {}
    expires = np.zeros(len(distinct), np.int64)
    no_slots = bytes(16 * m)
    for token, u in distinct.items():
        try:
            if isinstance(token, CredentialRefused):
                raise token
            cred = verifier.check(token, study_hash, now_ms)
            slots.append(cred.slot_ids(m))
            expires[u] = cred.expires_ms
        except CredentialRefused as refusal:
            refusals[u] = refusal
            slots.append(no_slots)
    ok = np.ones(len(tokens), bool)
    refused = []
    for u, refusal in refusals.items():
        hit = which == u
        refused.append((hit, refusal.reason, refusal.detail))
        ok &= ~hit
    # Every record against its credential's slots at once: (records, m, 16) comparisons.
    expected = np.frombuffer(b"".join(
        s if type(s) is bytes else s.tobytes() for s in slots), np.uint8).reshape(-1, m, 16)
    in_slots = (record_ids[:, None, :] == expected[which]).all(axis=2).any(axis=1)
    outside = ok & ~in_slots
    if outside.any():
        refused.append((outside, RejectReason.CREDENTIAL_BAD_SLOT,
                        f"record id is none of its credential's {m} slot id(s)"))
        ok &= in_slots
    return ok, refused, np.where(ok, expires[which], 0)


def credential_run_size(token: bytes) -> int:
    """Bytes one (count, token) run takes in the ``credentials`` header."""
    return _RUN.size + len(token)


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
    pos = 0
    while pos < len(value) and len(out) <= MAX_RECORDS_PER_HEADER:
        size = token_size(value, pos + _RUN.size)
        end = pos + _RUN.size + (size or 0)
        if size is None or end > len(value):
            break
        (count,) = _RUN.unpack_from(value, pos)
        out += [bytes(value[pos + _RUN.size:end])] * min(count, MAX_RECORDS_PER_HEADER)
        pos = end
    if pos != len(value) or not out:
        raise CredentialRefused(RejectReason.CREDENTIAL_INVALID,
                                f"the {CREDENTIALS_HEADER} header is not whole (count, "
                                "credential) runs")
    return out
