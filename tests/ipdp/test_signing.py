"""Signed studies: the canonical text, the hash that binds it, the envelope and its keys."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat

import pytest

from ipdp.errors import ConfigurationError, SignatureError
from ipdp.signing import generate_key_files, load_signing_key, parse_trusted_keys
from ipdp.study import Study, StudyStatus, parse_study_message, study_message

BASE = {"study_id": "s1", "d": 14, "n": 2_000, "epsilon": 1.0, "delta": 0.01}


@pytest.fixture
def owner(tmp_path):
    return generate_key_files(tmp_path / "owner"), tmp_path / "owner"


def test_key_files_are_a_0600_pem_and_a_one_line_base64_public_key(owner):
    key, prefix = owner
    private = prefix.with_suffix(".key")
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o600
    assert private.read_text().startswith("-----BEGIN PRIVATE KEY-----")
    line = prefix.with_suffix(".pub").read_text()
    assert line.endswith("\n") and line.count("\n") == 1
    raw = base64.b64decode(line.strip(), validate=True)
    assert len(raw) == 32 and key.key_id == hashlib.sha256(raw).digest()[:8].hex()
    assert load_signing_key(private).key_id == key.key_id
    with pytest.raises(ConfigurationError, match="exists"):
        generate_key_files(prefix)


def test_the_study_hash_binds_every_parameter_and_the_noise():
    s = Study(**BASE)
    text = s.canonical_text
    obj = json.loads(text)
    assert obj["noise"] == {"std_q": s.calibration.noise_std_q, "std_p": s.calibration.noise_std_p}
    assert s.hash == hashlib.sha256(text.encode()).digest()[:16]
    assert Study(**{**BASE, "epsilon": 100.0}).hash != s.hash
    assert Study(**{**BASE, "max_rounds": 3}).hash != s.hash


def test_a_signed_study_verifies_under_its_owner_key_only(owner, tmp_path):
    key, prefix = owner
    s = Study(**BASE)
    value = study_message(s, "open", key)
    env = json.loads(value)
    assert env["format"] == 2 and env["key_id"] == key.key_id and env["study"] == s.canonical_text
    assert parse_study_message(value, parse_trusted_keys(f"{prefix}.pub")) == (s, StudyStatus.OPEN)
    stranger = generate_key_files(tmp_path / "stranger")
    with pytest.raises(SignatureError, match="signature"):
        parse_study_message(value, parse_trusted_keys(stranger.public_b64))
    with pytest.raises(SignatureError, match="signature"):
        parse_study_message(study_message(s, "open"), parse_trusted_keys(key.public_b64))


def test_a_forged_calibration_or_status_does_not_verify(owner):
    key, _ = owner
    trusted = parse_trusted_keys(key.public_b64)
    env = json.loads(study_message(Study(**BASE), "closed", key))
    forged = Study(**{**BASE, "epsilon": 100.0})
    for change in ({"study": forged.canonical_text}, {"status": "open"}):
        with pytest.raises(SignatureError, match="signature does not verify"):
            parse_study_message(json.dumps({**env, **change}).encode(), trusted)


def test_without_pinned_keys_an_unsigned_study_is_read_and_a_non_canonical_one_refused():
    s = Study(**BASE)
    assert parse_study_message(study_message(s, "open")) == (s, StudyStatus.OPEN)
    env = json.loads(study_message(s, "open"))
    obj = json.loads(env["study"])
    env["study"] = json.dumps(obj, sort_keys=True)  # the same study, not in canonical form
    with pytest.raises(ConfigurationError, match="canonical"):
        parse_study_message(json.dumps(env).encode())
    obj["noise"]["std_q"] /= 10  # a device would add a tenth of the calibrated noise
    env["study"] = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    with pytest.raises(ConfigurationError, match="not proven"):
        parse_study_message(json.dumps(env).encode())


def test_devices_read_pinned_keys_from_the_environment_or_as_given(owner, monkeypatch):
    from producer.contributor import trusted_study_keys

    key, prefix = owner
    monkeypatch.setenv("IPDP_TRUSTED_STUDY_KEYS", f" {prefix}.pub , {key.public_b64}")
    assert trusted_study_keys(None).ids == [key.key_id]
    assert not trusted_study_keys([])  # an explicit empty list pins nothing
    monkeypatch.delenv("IPDP_TRUSTED_STUDY_KEYS")
    assert not trusted_study_keys(None)
    with pytest.raises(ConfigurationError, match="3 bytes, not 32"):
        parse_trusted_keys("AAAA")
