"""Device credentials (ipdp.credentials): tokens, slots, the verifier's refusals, the study
fields that require them, and `ipdp credentials issue` run from a shell."""

from __future__ import annotations

import time

import pytest

from ipdp.credentials import (
    CREDENTIAL_ID,
    TOKEN_SIZE,
    CredentialRefused,
    CredentialVerifier,
    credentials_header,
    issue_credential,
    parse_token,
    slot_record_ids,
    token_from_text,
    token_text,
    tokens_of_header,
)
from ipdp.signing import SigningKey, TrustedKeys, parse_trusted_keys
from ipdp.study import Study
from ipdp.wire import RejectReason
from tests.system.test_cli import ipdp as run

PARAMS = {"d": 4, "n": 1_000, "epsilon": 1.0, "delta": 0.01}


@pytest.fixture(scope="module")
def issuer() -> SigningKey:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return SigningKey(Ed25519PrivateKey.generate())


@pytest.fixture(scope="module")
def pinned(issuer) -> TrustedKeys:
    return parse_trusted_keys(issuer.public_b64)


def now() -> int:
    return time.time_ns() // 1_000_000


def test_a_study_without_credentials_keeps_its_canonical_text_and_hash():
    # The canonical text of this study before credentials existed, byte for byte: a study created
    # then must keep verifying (its hash is on every record and its signature covers the text).
    study = Study(study_id="old", **PARAMS)
    # Hashes computed by the code without credentials (main at 7277b0e, before they merged).
    assert study.hash.hex() == "a7551dca5ce1c9dbfa325e14425f453d"
    budgeted = Study(study_id="old", budget_epsilon=2.0, budget_delta=0.02, max_rounds=3, **PARAMS)
    assert budgeted.hash.hex() == "c2fb9ca841ef02748d48094b97da0957"
    assert "require_credentials" not in study.canonical_text()
    assert "records_per_device" not in study.canonical_text()
    assert study.hash.hex() == Study.model_validate_json(study.to_json()).hash.hex()
    legacy = ('{"d":4,"delta":0.01,"delta_in":null,"epsilon":1.0,"eta":1.0,"lam":1.0,'
              '"loss":"squared","max_rounds":null,"mode":"rigorous","n":1000,"noise":')
    assert study.canonical_text().startswith(legacy)
    required = Study(study_id="old", require_credentials=True, **PARAMS)
    assert required.hash != study.hash
    assert '"require_credentials":true' in required.canonical_text()
    three = Study(study_id="old", require_credentials=True, records_per_device=3, **PARAMS)
    assert '"records_per_device":3' in three.canonical_text() and three.hash != required.hash


def test_records_per_device_needs_credentials():
    with pytest.raises(ValueError, match="require_credentials"):
        Study(study_id="s", records_per_device=2, **PARAMS)


def test_a_token_round_trips_and_its_slots_are_fixed(issuer, pinned):
    study = Study(study_id="s", require_credentials=True, **PARAMS)
    token = issue_credential(issuer, study.hash, 1_000, 2_000, credential_id=bytes(16))
    assert len(token) == TOKEN_SIZE
    assert token_from_text(token_text(token)) == token
    cred = parse_token(token, pinned)
    assert (cred.study_hash, cred.issued_ms, cred.expires_ms) == (study.hash, 1_000, 2_000)
    assert token[CREDENTIAL_ID] == cred.credential_id == bytes(16)
    slots = slot_record_ids(bytes(16), 3)
    assert slots.shape == (3, 16) and len({r.tobytes() for r in slots}) == 3
    # Fixed by the specification (docs/wire-format.md), so every SDK derives the same ids.
    assert slots[0].tobytes().hex() == \
        __import__("hashlib").sha256(b"ipdp-record-id-v1\n" + bytes(16) + bytes(4)).hexdigest()[:32]
    assert (cred.slot_ids(2) == slots[:2]).all()


def refusal(verifier: CredentialVerifier, token, study_hash: bytes, at: int) -> RejectReason:
    with pytest.raises(CredentialRefused) as exc:
        verifier.check(token, study_hash, at)
    return exc.value.reason


def test_the_verifier_refuses_each_bad_credential_with_its_reason(issuer, pinned):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    study = Study(study_id="s", require_credentials=True, **PARAMS)
    other = Study(study_id="t", require_credentials=True, **PARAMS)
    t = now()
    v = CredentialVerifier(pinned, max_validity_ms=3_600_000, skew_ms=1_000)
    good = issue_credential(issuer, study.hash, t, t + 60_000)
    assert v.check(good, study.hash, t).expires_ms == t + 60_000
    stranger = SigningKey(Ed25519PrivateKey.generate())
    altered = bytearray(good)
    altered[40] ^= 1
    cases = {
        RejectReason.CREDENTIAL_MISSING: (None, t),
        RejectReason.CREDENTIAL_INVALID: (bytes(altered), t),
        RejectReason.CREDENTIAL_UNTRUSTED: (issue_credential(stranger, study.hash, t, t + 1), t),
        RejectReason.CREDENTIAL_EXPIRED: (good, t + 60_001),
        RejectReason.CREDENTIAL_WRONG_STUDY: (issue_credential(issuer, other.hash, t, t + 1), t),
    }
    for reason, (token, at) in cases.items():
        assert refusal(v, token, study.hash, at) is reason
    assert refusal(v, good, study.hash, t - 1_001) is RejectReason.CREDENTIAL_INVALID  # early
    too_long = issue_credential(issuer, study.hash, t, t + 3_600_001)
    assert refusal(v, too_long, study.hash, t) is RejectReason.CREDENTIAL_INVALID
    assert refusal(v, good[:-1], study.hash, t) is RejectReason.CREDENTIAL_INVALID
    with pytest.raises(CredentialRefused, match="base64url"):
        token_from_text("not a token!")


def test_the_verifier_verifies_each_token_once(issuer, pinned, monkeypatch):
    from ipdp import credentials

    study = Study(study_id="s", require_credentials=True, **PARAMS)
    calls = []
    real = credentials.parse_token
    monkeypatch.setattr(credentials, "parse_token", lambda *a: calls.append(1) or real(*a))
    v = CredentialVerifier(pinned, cache_size=2)
    tokens = [issue_credential(issuer, study.hash, now(), now() + 60_000) for _ in range(3)]
    bad = tokens[0][:-1] + bytes([tokens[0][-1] ^ 1])
    for token in (tokens[0], tokens[0], bad, bad):
        try:
            v.check(token, study.hash, now())
        except CredentialRefused:
            pass
    assert len(calls) == 2  # a good and a bad token, each verified once
    for token in tokens:
        v.check(token, study.hash, now())
    assert len(calls) == 4  # tokens[0] was cached
    v.check(tokens[0], study.hash, now())  # evicted (cache of 2): verified again
    assert len(calls) == 5


def test_the_kafka_header_pairs_each_record_with_its_credential(issuer):
    a, b = (issue_credential(issuer, bytes(16), 0, 1) for _ in range(2))
    name, value = credentials_header([(a, 2), (b, 1)])
    assert tokens_of_header([("study", b"s"), (name, value)]) == [a, a, b]
    assert tokens_of_header([("study", b"s")]) is None
    with pytest.raises(CredentialRefused, match="runs"):
        tokens_of_header([(name, value[:-1])])
    with pytest.raises(CredentialRefused, match="runs"):
        tokens_of_header([(name, b"")])


def test_credentials_issue_runs_from_a_shell(env_topics, kafka_settings, redis_settings,
                                             tmp_path):
    assert run("keys", "generate", "--out", str(tmp_path / "issuer")).returncode == 0
    made = run("study", "create", "--study-id", "cred", "--d", "4", "--n", "1000",
               "--epsilon", "1", "--delta", "0.01", "--require-credentials",
               "--records-per-device", "2")
    assert made.returncode == 0, made.stderr
    shown = run("study", "show", "cred")
    assert "required, 2 record(s) per credential" in shown.stdout
    out = run("credentials", "issue", "cred", "--key", str(tmp_path / "issuer.key"),
              "--count", "3", "--valid-for", "600")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert len(lines) == 3 and len(set(lines)) == 3
    assert "issued 3 credential(s) for study cred" in out.stderr
    from ipdp.redis_io import redis_client
    from ipdp.registry import load_study

    study = load_study(redis_client(redis_settings), "cred")[0]
    pinned = parse_trusted_keys(str(tmp_path / "issuer.pub"))
    cred = CredentialVerifier(pinned, max_validity_ms=600_000).check(
        token_from_text(lines[0]), study.hash, now())
    assert 599_000 <= cred.expires_ms - now() <= 600_000
    too_long = run("credentials", "issue", "cred", "--key", str(tmp_path / "issuer.key"),
                   "--valid-for", "86401")
    assert too_long.returncode == 2 and "replay window" in too_long.stderr
    plain = run("study", "create", "--study-id", "plain", "--d", "4", "--n", "1000",
                "--epsilon", "1", "--delta", "0.01")
    assert plain.returncode == 0, plain.stderr
    refused = run("credentials", "issue", "plain", "--key", str(tmp_path / "issuer.key"))
    assert refused.returncode == 2 and "does not require credentials" in refused.stderr
