"""Sealing a two-server record's helper share to the helper's key, so the leader that carries it
cannot read it (docs/security.md, "Two-server studies").

HPKE (RFC 9180) in base mode with DHKEM(X25519, HKDF-SHA256), HKDF-SHA256 and AES-128-GCM, the
suite of RFC 9180 Appendix A.1, from ``cryptography``'s public ``hpke`` module: nothing of the
construction is written here. A sealed share is ``enc ‖ ciphertext`` (32 bytes of encapsulated
key, then the share and a 16-byte tag). The record's header is the HPKE ``info``, so a share
opens only under the header it was sealed with: a leader that moves it to another record,
study or time gets an open error from the helper, not another record's share.

Key files, like the study owner's (ipdp.signing): ``PREFIX.key`` (the private key, PKCS#8 PEM,
mode 0600) and ``PREFIX.pub`` (one line, standard base64 of the raw 32-byte public key), which a
two-server study carries in its signed text.
"""

from __future__ import annotations

import base64
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.hpke import AEAD, KDF, KEM, Suite
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from ipdp.errors import ConfigurationError, IpdpError
from ipdp.signing import read_private_key, write_key_files

__all__ = [
    "ENC_BYTES",
    "SEAL_OVERHEAD",
    "SUITE",
    "HelperKey",
    "SealError",
    "generate_helper_key_files",
    "load_helper_key",
    "open_share",
    "parse_helper_public_key",
    "seal_share",
]

#: RFC 9180 A.1's suite: DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, AES-128-GCM.
SUITE = Suite(KEM.X25519, KDF.HKDF_SHA256, AEAD.AES_128_GCM)
#: The encapsulated key's length (X25519's public key).
ENC_BYTES = 32
#: What sealing adds to a share: the encapsulated key and AES-GCM's tag.
SEAL_OVERHEAD = ENC_BYTES + 16


class SealError(IpdpError):
    """A sealed share that does not open: another key, another header, or altered bytes."""


def seal_share(public_key: X25519PublicKey, share: bytes, header: bytes) -> bytes:
    """``share`` sealed to the helper's ``public_key``, bound to the record's ``header``:
    ``enc ‖ ciphertext``, len(share) + :data:`SEAL_OVERHEAD` bytes."""
    return SUITE.encrypt(share, public_key, info=header)


def open_share(private_key: X25519PrivateKey, sealed: bytes, header: bytes) -> bytes:
    """The share :func:`seal_share` sealed under ``header``; SealError if it does not open."""
    if len(sealed) < SEAL_OVERHEAD:
        raise SealError(f"a sealed share has at least {SEAL_OVERHEAD} bytes, not {len(sealed)}")
    try:
        return SUITE.decrypt(sealed, private_key, info=header)
    except (InvalidTag, ValueError) as exc:
        raise SealError(f"the share does not open under this key and header ({type(exc).__name__})"
                        ) from None


class HelperKey:
    """A helper's X25519 key pair."""

    def __init__(self, private: X25519PrivateKey) -> None:
        self.private = private
        self.public = private.public_key()

    @property
    def public_b64(self) -> str:
        """The ``.pub`` line: standard padded base64 of the raw 32-byte public key."""
        raw = self.public.public_bytes(Encoding.Raw, PublicFormat.Raw)
        return base64.b64encode(raw).decode("ascii")


def parse_helper_public_key(text: str) -> X25519PublicKey:
    """A helper's public key from its ``.pub`` line (standard base64 of 32 raw bytes)."""
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except ValueError:
        raise ConfigurationError("a helper public key is standard base64") from None
    if len(raw) != 32:
        raise ConfigurationError(f"a helper public key is 32 bytes (X25519), not {len(raw)}")
    return X25519PublicKey.from_public_bytes(raw)


def load_helper_key(path: str | os.PathLike) -> HelperKey:
    """The helper's key pair from its ``PREFIX.key`` file (PKCS#8 PEM, unencrypted)."""
    key = read_private_key(path, "helper key")
    if not isinstance(key, X25519PrivateKey):
        raise ConfigurationError(f"{str(path)!r} holds a {type(key).__name__}, not X25519")
    return HelperKey(key)


def generate_helper_key_files(prefix: str | os.PathLike) -> HelperKey:
    """Write ``PREFIX.key`` (0600, created exclusively) and ``PREFIX.pub``; returns the key."""
    key = HelperKey(X25519PrivateKey.generate())
    write_key_files(prefix, key.private, key.public_b64)
    return key
