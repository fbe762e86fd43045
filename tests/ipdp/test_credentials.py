"""Device credentials (ipdp.credentials): tokens, slots, the verifier's refusals, the study
fields that require them, and `ipdp credentials issue` run from a shell."""

from __future__ import annotations

import hashlib
import time

import pytest

from ipdp import credentials
from ipdp.credentials import (
    MAX_TREE_HEIGHT,
    TOKEN_SIZE,
    CredentialRefused,
    CredentialVerifier,
    credential_id,
    credentials_header,
    issue_batch,
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


def issue_in_batch(key: SigningKey, study_hash: bytes, issued_ms: int, expires_ms: int) -> bytes:
    """A version-2 token: the second of a batch of three (a tree of height 2, one padding leaf)."""
    return issue_batch(key, study_hash, issued_ms, expires_ms, 3)[1]


ISSUERS = pytest.mark.parametrize("issue", [issue_credential, issue_in_batch], ids=["v1", "v2"])


def test_a_study_without_credentials_keeps_its_canonical_text_and_hash():
    # The canonical text of this study before credentials existed, byte for byte: a study created
    # then must keep verifying (its hash is on every record and its signature covers the text).
    # Its text carries the noise chosen then, for the whole δ (before the norm check's share came
    # out of δ), as a study read from its text does.
    noise = {"std_q": 0.08344676065036494, "std_p": 0.31339362884569694}
    study = Study(study_id="old", noise=noise, **PARAMS)
    # Hashes computed by the code without credentials (main at 7277b0e, before they merged).
    assert study.hash.hex() == "a7551dca5ce1c9dbfa325e14425f453d"
    budgeted = Study(study_id="old", budget_epsilon=2.0, budget_delta=0.02, max_rounds=3,
                     noise=noise, **PARAMS)
    assert budgeted.hash.hex() == "c2fb9ca841ef02748d48094b97da0957"
    assert "require_credentials" not in study.canonical_text
    assert "records_per_device" not in study.canonical_text
    assert study.hash.hex() == Study.model_validate_json(study.to_json()).hash.hex()
    legacy = ('{"d":4,"delta":0.01,"delta_in":null,"epsilon":1.0,"eta":1.0,"lam":1.0,'
              '"loss":"squared","max_rounds":null,"mode":"rigorous","n":1000,"noise":')
    assert study.canonical_text.startswith(legacy)
    required = Study(study_id="old", require_credentials=True, noise=noise, **PARAMS)
    assert required.hash != study.hash
    assert '"require_credentials":true' in required.canonical_text
    three = Study(study_id="old", require_credentials=True, records_per_device=3, noise=noise,
                  **PARAMS)
    assert '"records_per_device":3' in three.canonical_text and three.hash != required.hash


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
    assert credential_id(token) == cred.credential_id == bytes(16)
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


@ISSUERS
def test_the_verifier_refuses_each_bad_credential_with_its_reason(issuer, pinned, issue):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    study = Study(study_id="s", require_credentials=True, **PARAMS)
    other = Study(study_id="t", require_credentials=True, **PARAMS)
    t = now()
    v = CredentialVerifier(pinned, max_validity_ms=3_600_000, skew_ms=1_000)
    good = issue(issuer, study.hash, t, t + 60_000)
    assert v.check(good, study.hash, t).expires_ms == t + 60_000
    stranger = SigningKey(Ed25519PrivateKey.generate())
    altered = bytearray(good)
    altered[5] ^= 1  # the study hash: the signature no longer verifies
    cases = {
        RejectReason.CREDENTIAL_MISSING: (None, t),
        RejectReason.CREDENTIAL_INVALID: (bytes(altered), t),
        RejectReason.CREDENTIAL_UNTRUSTED: (issue(stranger, study.hash, t, t + 1), t),
        RejectReason.CREDENTIAL_EXPIRED: (good, t + 60_001),
        RejectReason.CREDENTIAL_WRONG_STUDY: (issue(issuer, other.hash, t, t + 1), t),
    }
    for reason, (token, at) in cases.items():
        assert refusal(v, token, study.hash, at) is reason
    assert refusal(v, good, study.hash, t - 1_001) is RejectReason.CREDENTIAL_INVALID  # early
    too_long = issue(issuer, study.hash, t, t + 3_600_001)
    assert refusal(v, too_long, study.hash, t) is RejectReason.CREDENTIAL_INVALID
    assert refusal(v, good[:-1], study.hash, t) is RejectReason.CREDENTIAL_INVALID
    with pytest.raises(CredentialRefused, match="base64url"):
        token_from_text("not a token!")


def test_the_verifier_verifies_each_token_once(issuer, pinned, monkeypatch):
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


def test_a_batch_issues_tokens_that_verify_each_with_its_own_id(issuer, pinned):
    study = Study(study_id="s", require_credentials=True, **PARAMS)
    ids = [bytes([i]) * 16 for i in range(5)]
    tokens = issue_batch(issuer, study.hash, 1_000, 2_000, 5, credential_ids=ids)
    assert [len(t) for t in tokens] == [158 + 32 * 3] * 5  # 5 leaves: a tree of height 3
    assert len({t[:138] for t in tokens}) == 1  # one batch header, one signature
    for i, token in enumerate(tokens):
        assert token_from_text(token_text(token)) == token
        cred = parse_token(token, pinned)
        assert (cred.study_hash, cred.credential_id, cred.issued_ms, cred.expires_ms) == \
            (study.hash, ids[i], 1_000, 2_000)
        assert credential_id(token) == ids[i]
    # The tree as docs/wire-format.md defines it, by hand: leaf 2 (binary 010) is a left child,
    # then a right one, then a left one.
    token = tokens[2]
    path = [token[158 + 32 * j:190 + 32 * j] for j in range(3)]
    node = hashlib.sha256(b"ipdp-credential-leaf-v2\n" + (2).to_bytes(4, "little") + ids[2])
    node = hashlib.sha256(b"ipdp-credential-node-v2\n" + node.digest() + path[0])
    node = hashlib.sha256(b"ipdp-credential-node-v2\n" + path[1] + node.digest())
    node = hashlib.sha256(b"ipdp-credential-node-v2\n" + node.digest() + path[2])
    assert token[42:74] == node.digest() and token[41] == 3
    single = issue_batch(issuer, study.hash, 1_000, 2_000, 1)[0]  # height 0: the leaf is the root
    assert len(single) == 158 and parse_token(single, pinned).issued_ms == 1_000
    with pytest.raises(ValueError, match="count"):
        issue_batch(issuer, study.hash, 1_000, 2_000, (1 << MAX_TREE_HEIGHT) + 1)


def test_any_altered_byte_of_a_batch_token_is_refused(issuer, pinned):
    study = Study(study_id="s", require_credentials=True, **PARAMS)
    t = now()
    token = issue_batch(issuer, study.hash, t, t + 60_000, 4)[2]
    warm = CredentialVerifier(pinned)
    warm.check(token, study.hash, t)  # its batch header's signature is now verified, and cached
    key_id = range(33, 41)
    for at in range(len(token)):
        altered = bytearray(token)
        altered[at] ^= 0x01
        expected = RejectReason.CREDENTIAL_UNTRUSTED if at in key_id else \
            RejectReason.CREDENTIAL_INVALID
        assert refusal(warm, bytes(altered), study.hash, t) is expected, at
        assert refusal(CredentialVerifier(pinned), bytes(altered), study.hash, t) is expected, at
    assert refusal(warm, token + bytes(32), study.hash, t) is RejectReason.CREDENTIAL_INVALID


def test_the_verifier_checks_each_batch_signature_once(issuer, pinned, monkeypatch):
    study = Study(study_id="s", require_credentials=True, **PARAMS)
    calls = []
    real = credentials._verify
    monkeypatch.setattr(credentials, "_verify", lambda *a: calls.append(1) or real(*a))
    batch = issue_batch(issuer, study.hash, now(), now() + 60_000, 100)
    another = issue_batch(issuer, study.hash, now(), now() + 60_000, 2)
    v = CredentialVerifier(pinned)
    assert len({v.check(t, study.hash, now()).credential_id for t in batch + another}) == 102
    assert len(calls) == 2


def test_a_warm_verifier_decides_every_path_as_a_cold_one(issuer, pinned, monkeypatch):
    # A tree taller than the verified nodes a verifier keeps (MEMO_LEVELS): a new device of a
    # known batch hashes only up to the first verified node, and then its remaining path must
    # equal the verified siblings, so an altered path is refused whatever was seen before.
    study = Study(study_id="s", require_credentials=True, **PARAMS)
    t = now()
    height = credentials.MEMO_LEVELS + 2
    tokens = issue_batch(issuer, study.hash, t, t + 60_000, 1 << height)
    warm = CredentialVerifier(pinned)
    for token in tokens[::7]:
        warm.check(token, study.hash, t)
    fresh = tokens[300]
    path_at = len(fresh) - 32 * height
    for at in [*range(path_at - 20, path_at), *range(path_at, len(fresh), 5)]:
        altered = bytearray(fresh)
        altered[at] ^= 0x01
        assert refusal(warm, bytes(altered), study.hash, t) is RejectReason.CREDENTIAL_INVALID, at
    hashed = []
    real = hashlib.sha256
    monkeypatch.setattr(credentials.hashlib, "sha256", lambda b: hashed.append(1) or real(b))
    assert warm.check(fresh, study.hash, t).credential_id == credential_id(fresh)
    assert len(hashed) <= 3  # leaf, then at most two levels below a verified node
    hashed.clear()
    assert CredentialVerifier(pinned).check(fresh, study.hash, t)
    assert len(hashed) == height + 1  # a cold verifier walks the whole path
    # No state per version-2 token: a million devices of one batch leave the heap as it was,
    # and the paths a batch keeps are bounded by MEMO_LEVELS, not by the devices seen.
    assert not warm._tokens._seen and len(warm._batches._seen) == 1
    for token in tokens:
        warm.check(token, study.hash, t)
    (batch,) = warm._batches._seen.values()
    assert len(batch.boundary) == 1 << credentials.MEMO_LEVELS


def decided(check, *args):
    """What a check answers: its result, or the reason it refused with."""
    try:
        return check(*args)
    except CredentialRefused as exc:
        return exc.reason


def test_a_credential_text_is_decided_as_its_decoded_token(issuer, pinned, monkeypatch):
    # check_text finds a batch it verified before by the first characters of the text and
    # decodes only the rest: every text, altered or not, canonical base64url or not, gets the
    # answer token_from_text then check give in a fresh verifier.
    study = Study(study_id="s", require_credentials=True, **PARAMS)
    other = Study(study_id="t", require_credentials=True, **PARAMS)
    t = now()
    tokens = issue_batch(issuer, study.hash, t, t + 60_000, 40)  # a tree of height 6
    warm = CredentialVerifier(pinned)
    warm.check(tokens[0], study.hash, t)

    def cold(text, study_hash=study.hash, at=t):
        def check():
            token = token_from_text(text)
            return token, CredentialVerifier(pinned).check(token, study_hash, at)
        return decided(check)

    decoded = []
    real = credentials.binascii.a2b_base64
    monkeypatch.setattr(credentials.binascii, "a2b_base64",
                        lambda text: decoded.append(len(text)) or real(text))
    text = token_text(tokens[20]).encode()
    assert warm.check_text(text, study.hash, t) == cold(text) == (tokens[20], cold(text)[1])
    # One decode, of the leaf and path alone (and the "==" that completes them).
    assert decoded[0] == len(text) - credentials.BATCH_PREFIX_TEXT + 2
    variants = [text + b"  ", text[:-1], text[:-4], text + b"AAAA", text[:200] + b"." +
                text[200:], b" " + text, text.replace(b"-", b"+").replace(b"_", b"/"),
                text[:credentials.BATCH_PREFIX_TEXT]]
    for at in range(len(text)):  # each character replaced by another of the alphabet
        variants.append(text[:at] + (b"B" if text[at:at + 1] == b"A" else b"A") + text[at + 1:])
    for variant in variants:
        assert decided(warm.check_text, variant, study.hash, t) == cold(variant), variant
    for token in tokens[1:]:
        text = token_text(token).encode()
        assert decided(warm.check_text, text, study.hash, t) == cold(text)
        assert decided(warm.check_text, text, other.hash, t) is \
            cold(text, other.hash) is RejectReason.CREDENTIAL_WRONG_STUDY
        assert decided(warm.check_text, text, study.hash, t + 60_001) is \
            cold(text, study.hash, t + 60_001) is RejectReason.CREDENTIAL_EXPIRED


def test_the_kafka_header_pairs_each_record_with_its_credential(issuer):
    a, b = (issue_credential(issuer, bytes(16), 0, 1) for _ in range(2))
    name, value = credentials_header([(a, 2), (b, 1)])
    assert tokens_of_header([("study", b"s"), (name, value)]) == [a, a, b]
    # Version-1 runs as written before version 2 existed, byte for byte: (u32 count, token).
    assert value == (2).to_bytes(4, "little") + a + (1).to_bytes(4, "little") + b
    assert tokens_of_header([("study", b"s")]) is None
    c, d = issue_batch(issuer, bytes(16), 0, 1, 2)
    e = issue_batch(issuer, bytes(16), 0, 1, 9)[8]  # another height, another size
    _, mixed = credentials_header([(a, 2), (c, 1), (b, 1), (e, 1), (d, 2)])
    assert tokens_of_header([(name, mixed)]) == [a, a, c, b, e, d, d]
    too_tall = c[:41] + bytes([MAX_TREE_HEIGHT + 1]) + c[42:]
    with pytest.raises(CredentialRefused, match="runs"):
        tokens_of_header([(name, credentials_header([(too_tall, 1)])[1])])
    with pytest.raises(CredentialRefused, match="runs"):
        tokens_of_header([(name, mixed[:-1])])
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
    assert "issued 3 version-2 credential(s) as 1 batch(es), one signature per batch" in out.stderr
    one = run("credentials", "issue", "cred", "--key", str(tmp_path / "issuer.key"),
              "--count", "2", "--token-version", "1", "--json")
    assert one.returncode == 0, one.stderr
    from ipdp.redis_io import redis_client
    from ipdp.state import load_study

    study = load_study(redis_client(redis_settings), "cred")[0]
    pinned = parse_trusted_keys(str(tmp_path / "issuer.pub"))
    verifier = CredentialVerifier(pinned, max_validity_ms=86_400_000)
    creds = [verifier.check(token_from_text(line), study.hash, now()) for line in lines]
    assert [len(token_from_text(line)) for line in lines] == [158 + 64] * 3  # a tree of height 2
    assert creds[0].expires_ms - creds[0].issued_ms == 600_000 and creds[0].issued_ms <= now()
    assert len({c.credential_id for c in creds}) == 3
    for line in one.stdout.splitlines():
        issued = __import__("json").loads(line)
        token = token_from_text(issued["credential"])
        assert len(token) == TOKEN_SIZE
        assert verifier.check(token, study.hash, now()).credential_id.hex() == \
            issued["credential_id"]
    too_long = run("credentials", "issue", "cred", "--key", str(tmp_path / "issuer.key"),
                   "--valid-for", "86401")
    assert too_long.returncode == 2 and "replay window" in too_long.stderr
    plain = run("study", "create", "--study-id", "plain", "--d", "4", "--n", "1000",
                "--epsilon", "1", "--delta", "0.01")
    assert plain.returncode == 0, plain.stderr
    refused = run("credentials", "issue", "plain", "--key", str(tmp_path / "issuer.key"))
    assert refused.returncode == 2 and "does not require credentials" in refused.stderr
