"""Ed25519 keys and signatures: who may define a study, and who may publish a model.

Key files (``ipdp keys generate --out PREFIX``):

* ``PREFIX.key`` — the private key, PKCS#8 PEM, unencrypted, mode 0600. Only the study owner (or
  the trainer, for its own key) reads it.
* ``PREFIX.pub`` — one line: standard padded base64 of the raw 32-byte public key. This is what a
  device, the aggregator or a model consumer pins (``--trust PREFIX.pub`` or the base64 itself).

A key is named by its *key id*: the hex of SHA-256(raw public key)[:8]. Every signed message
carries the key id and a signature over bytes that begin with a domain tag (``ipdp-study-v2``,
``ipdp-model-v2``), so a signature made for one purpose never verifies for another.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
    load_pem_private_key,
)

from ipdp.errors import ConfigurationError, SignatureError

__all__ = [
    "SigningKey",
    "TrustedKeys",
    "generate_key_files",
    "key_id",
    "load_signing_key",
    "parse_trusted_keys",
]


def key_id(public_raw: bytes) -> str:
    """Hex of SHA-256(raw 32-byte public key)[:8]: how a signed message names its key."""
    return hashlib.sha256(public_raw).digest()[:8].hex()


@dataclass(frozen=True)
class SigningKey:
    """A private Ed25519 key and the id of its public half."""

    private: Ed25519PrivateKey

    @property
    def public_raw(self) -> bytes:
        """The raw 32-byte public key."""
        return self.private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    @property
    def key_id(self) -> str:
        return key_id(self.public_raw)

    @property
    def public_b64(self) -> str:
        """The ``.pub`` line: standard padded base64 of the raw public key."""
        return base64.b64encode(self.public_raw).decode("ascii")

    def sign(self, message: bytes) -> tuple[str, str]:
        """(key id, standard padded base64 of the 64-byte signature of ``message``)."""
        return self.key_id, base64.b64encode(self.private.sign(message)).decode("ascii")


class TrustedKeys:
    """The public keys a reader pins; a message verifies if any of them signed it (rotation)."""

    def __init__(self, keys: Iterable[Ed25519PublicKey] = ()) -> None:
        self._by_id = {key_id(k.public_bytes(Encoding.Raw, PublicFormat.Raw)): k for k in keys}

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def ids(self) -> list[str]:
        return sorted(self._by_id)

    def key(self, kid: str) -> Ed25519PublicKey | None:
        """The pinned key with id ``kid``, if any."""
        return self._by_id.get(kid)

    def verify(self, kid: str, signature_b64: str, message: bytes, what: str) -> None:
        """Raise :class:`SignatureError` unless a pinned key with id ``kid`` signed ``message``."""
        key = self._by_id.get(kid) if isinstance(kid, str) else None
        if key is None:
            raise SignatureError(
                f"{what}: signature by key {kid or '(none: unsigned)'!s} is not by a trusted key "
                f"(trusted: {', '.join(self.ids)})")
        try:
            signature = base64.b64decode(signature_b64, validate=True)
        except (binascii.Error, ValueError, TypeError):
            raise SignatureError(f"{what}: signature is not base64") from None
        if len(signature) != 64:
            raise SignatureError(f"{what}: signature has {len(signature)} bytes, not 64")
        try:
            key.verify(signature, message)
        except InvalidSignature:
            raise SignatureError(f"{what}: signature does not verify under key {kid}") from None


def _public_key(spec: str) -> Ed25519PublicKey:
    """A pinned key from a ``.pub`` path or the base64 line itself."""
    text = spec.strip()
    path = Path(text)
    if text.endswith(".pub") or (len(text) != 44 and path.is_file()):
        try:
            text = path.read_text(encoding="ascii").strip()
        except OSError as exc:
            raise ConfigurationError(f"cannot read public key file {spec!r}: {exc}") from None
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ConfigurationError(f"public key {spec!r} is not standard base64") from None
    if len(raw) != 32:
        raise ConfigurationError(f"public key {spec!r} is {len(raw)} bytes, not 32 (Ed25519)")
    return Ed25519PublicKey.from_public_bytes(raw)


def parse_trusted_keys(specs: str | Iterable[str] | None) -> TrustedKeys:
    """Pinned keys from a comma-separated string or a list: base64 keys and/or ``.pub`` paths."""
    if specs is None:
        return TrustedKeys()
    if isinstance(specs, str):
        specs = specs.split(",")
    return TrustedKeys(_public_key(s) for s in specs if s.strip())


def read_private_key(path: str | os.PathLike, what: str = "signing key"):
    """The private key of a ``PREFIX.key`` file (PKCS#8 PEM, unencrypted), any type."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigurationError(f"cannot read {what} {str(path)!r}: {exc}") from None
    try:
        return load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(f"{str(path)!r} is not an unencrypted PEM private key: {exc}") \
            from None


def load_signing_key(path: str | os.PathLike) -> SigningKey:
    """The private key of a ``PREFIX.key`` file (PKCS#8 PEM, unencrypted)."""
    key = read_private_key(path)
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigurationError(f"{str(path)!r} holds a {type(key).__name__}, not Ed25519")
    return SigningKey(key)


def generate_key_files(prefix: str | os.PathLike) -> SigningKey:
    """Write ``PREFIX.key`` (0600, created exclusively) and ``PREFIX.pub``; returns the key."""
    key = SigningKey(Ed25519PrivateKey.generate())
    write_key_files(prefix, key.private, key.public_b64)
    return key


def write_key_files(prefix: str | os.PathLike, private, public_b64: str) -> None:
    """``PREFIX.key``: ``private`` as PKCS#8 PEM, mode 0600, created exclusively;
    ``PREFIX.pub``: the ``public_b64`` line. Refuses to overwrite either."""
    private_path, public_path = Path(f"{prefix}.key"), Path(f"{prefix}.pub")
    for p in (private_path, public_path):
        if p.exists():
            raise ConfigurationError(f"{p} exists; refusing to overwrite a key")
    pem = private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public_path.write_text(public_b64 + "\n", encoding="ascii")


_WARNED: set[tuple[str, ...]] = set()
_WARNED_LOCK = threading.Lock()


def warn_once(logger: logging.Logger, about: tuple[str, ...], message: str, *args: object) -> None:
    """Log a warning about an unsigned study or an unpinned key once per process for each
    ``about``: readers that poll would otherwise repeat it at every read."""
    with _WARNED_LOCK:
        if about in _WARNED:
            return
        _WARNED.add(about)
    logger.warning(message, *args)
