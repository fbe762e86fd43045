"""Sealing a helper's share (ipdp.sealing): cryptography's HPKE against RFC 9180's published
vector (A.1.1, through the independent implementation pyhpke, which reproduces it) and against
pyhpke both ways; a share opens only under its key and its record's header."""

from __future__ import annotations

import os
import stat

import pyhpke
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from ipdp.errors import ConfigurationError
from ipdp.sealing import (
    SEAL_OVERHEAD,
    SealError,
    generate_helper_key_files,
    load_helper_key,
    open_share,
    parse_helper_public_key,
    seal_share,
)

# RFC 9180, Appendix A.1.1: DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, AES-128-GCM, base mode.
RFC = {k: bytes.fromhex(v) for k, v in {
    "skRm": "4612c550263fc8ad58375df3f557aac531d26850903e55a9f23f21d8534e8ac8",
    "pkRm": "3948cfe0ad1ddb695d780e59077195da6c56506b027329794ab02bca80815c4d",
    "skEm": "52c4a758a802cd8b936eceea314432798d5baf2d7e9235dc084ab1b9cfa2f736",
    "enc": "37fda3567bdbd628e88668c3c8d7e97d1d1253b6d4ea6d44c150f741f1bf4431",
    "info": "4f6465206f6e2061204772656369616e2055726e",
    "pt": "4265617574792069732074727574682c20747275746820626561757479",
    "aad": "436f756e742d30",
    "ct": "f938558b5d72f1a23810b4be2ab4f84331acc02fc97babc53a52ae8218a355a96d8770ac83d07bea87e13c512a",
}.items()}


def _suite():
    return pyhpke.CipherSuite.new(pyhpke.KEMId.DHKEM_X25519_HKDF_SHA256,
                                  pyhpke.KDFId.HKDF_SHA256, pyhpke.AEADId.AES128_GCM)


def _pyhpke_seal(public_raw: bytes, plaintext: bytes, info: bytes, aad: bytes = b"",
                 ephemeral: bytes | None = None) -> tuple[bytes, bytes]:
    suite = _suite()
    eks = None
    if ephemeral is not None:
        sk = suite.kem.deserialize_private_key(ephemeral)
        pk = suite.kem.deserialize_public_key(
            X25519PrivateKey.from_private_bytes(ephemeral).public_key().public_bytes(
                Encoding.Raw, PublicFormat.Raw))
        eks = pyhpke.KEMKeyPair(sk, pk)
    enc, sender = suite.create_sender_context(suite.kem.deserialize_public_key(public_raw),
                                              info=info, eks=eks)
    return enc, sender.seal(plaintext, aad=aad)


def test_the_reference_reproduces_rfc_9180_a_1_1_and_ours_opens_what_it_seals_there():
    enc, ct = _pyhpke_seal(RFC["pkRm"], RFC["pt"], RFC["info"], RFC["aad"], RFC["skEm"])
    assert (enc, ct) == (RFC["enc"], RFC["ct"])
    # The same key schedule (RFC's recipient and ephemeral keys, its info), with the empty
    # additional data the single-shot API uses: ours opens it to the RFC's plaintext.
    enc, ct = _pyhpke_seal(RFC["pkRm"], RFC["pt"], RFC["info"], b"", RFC["skEm"])
    recipient = X25519PrivateKey.from_private_bytes(RFC["skRm"])
    assert recipient.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw) == RFC["pkRm"]
    assert open_share(recipient, enc + ct, RFC["info"]) == RFC["pt"]


def test_ours_and_the_reference_open_each_others_shares():
    helper = X25519PrivateKey.generate()
    public_raw = helper.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    header, share = os.urandom(48), os.urandom(952)
    sealed = seal_share(helper.public_key(), share, header)
    assert len(sealed) == len(share) + SEAL_OVERHEAD
    suite = _suite()
    recipient = suite.create_recipient_context(
        sealed[:32], suite.kem.deserialize_private_key(
            helper.private_bytes_raw()), info=header)
    assert recipient.open(sealed[32:], aad=b"") == share
    enc, ct = _pyhpke_seal(public_raw, share, header)
    assert open_share(helper, enc + ct, header) == share


def test_a_share_opens_only_under_its_key_and_its_header():
    helper = X25519PrivateKey.generate()
    header, share = b"study|record-id|created", os.urandom(64)
    sealed = seal_share(helper.public_key(), share, header)
    assert open_share(helper, sealed, header) == share
    flipped = bytearray(sealed)
    flipped[40] ^= 1
    for key, bad, head in [(X25519PrivateKey.generate(), sealed, header),
                           (helper, sealed, b"study|other-record|created"),
                           (helper, bytes(flipped), header), (helper, sealed[:40], header)]:
        with pytest.raises(SealError):
            open_share(key, bad, head)


def test_helper_key_files_round_trip_and_are_never_overwritten(tmp_path):
    prefix = tmp_path / "helper"
    key = generate_helper_key_files(prefix)
    assert stat.S_IMODE(os.stat(f"{prefix}.key").st_mode) == 0o600
    loaded = load_helper_key(f"{prefix}.key")
    public = parse_helper_public_key((tmp_path / "helper.pub").read_text())
    assert public.public_bytes(Encoding.Raw, PublicFormat.Raw) == loaded.public.public_bytes(
        Encoding.Raw, PublicFormat.Raw) == key.public.public_bytes(Encoding.Raw, PublicFormat.Raw)
    share = os.urandom(32)
    assert open_share(loaded.private, seal_share(public, share, b"h"), b"h") == share
    with pytest.raises(ConfigurationError, match="refusing to overwrite"):
        generate_helper_key_files(prefix)
    with pytest.raises(ConfigurationError, match="32 bytes"):
        parse_helper_public_key("AAAA")


def test_a_signing_key_is_not_a_helper_key(tmp_path):
    from ipdp.signing import generate_key_files

    generate_key_files(tmp_path / "owner")
    with pytest.raises(ConfigurationError, match="not X25519"):
        load_helper_key(tmp_path / "owner.key")


def test_ipdp_keys_generate_helper_writes_a_pair_that_seals_and_opens(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "ipdp.cli", "keys", "generate", "--out",
                          str(tmp_path / "helper"), "--helper"], capture_output=True, text=True,
                         check=True).stdout
    line = (tmp_path / "helper.pub").read_text().strip()
    assert f"public key  {line}" in out
    share = os.urandom(16)
    sealed = seal_share(parse_helper_public_key(line), share, b"header")
    assert open_share(load_helper_key(tmp_path / "helper.key").private, sealed, b"header") == share
