"""producer/web/test-vectors.json is what the Python implementation produces, byte for byte.

The browser SDK's tests (producer/web/test/) check their encoder, clipping, study hash and
signature check against this file, so Python stays the one source of truth for the format. The
file is committed; this test regenerates it in memory and fails when the committed copy differs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from ipdp.credentials import (
    credential_id,
    issue_batch,
    issue_credential,
    slot_record_ids,
    token_text,
)
from ipdp.fixed_point import FixedPoint
from ipdp.fixed_point import encode as fixed_point_encode
from ipdp.losses import clip, encode
from ipdp.sealing import HelperKey, SealError, open_share
from ipdp.signing import SigningKey
from ipdp.study import Study, parse_study_message, study_message
from ipdp.two_server_wire import (
    TwoServerLayout,
    encode_two_server_batch,
    headers,
    seal_helper_shares,
)
from ipdp.wire import encode_record

VECTORS = Path(__file__).resolve().parents[2] / "producer" / "web" / "test-vectors.json"
REGENERATE = "IPDP_WRITE_VECTORS=1 .venv/bin/python -m pytest tests/producer/test_web_vectors.py"

#: Fixed Ed25519 seeds of the test study owner and of a stranger; never use them for real studies.
OWNER_SEED = bytes(range(32))
STRANGER_SEED = bytes(range(32, 64))
#: Fixed Ed25519 seed of the test credential issuer.
ISSUER_SEED = bytes(range(64, 96))
#: Fixed X25519 private key of the test two-server study's helper.
HELPER_SEED = bytes(range(96, 128))
TWO_SERVER_CASES = Path(__file__).resolve().parents[1] / "ipdp" / "two_server_vectors.json"


def _study_hash(study_text: str) -> bytes:
    return hashlib.sha256(study_text.encode("utf-8")).digest()[:16]


def _spread(d: int, salt: int, exponent_range: int = 0) -> list[float]:
    """Deterministic values without an RNG stream (which numpy may change between versions).

    Integer arithmetic, one correctly rounded division and an exact power of two per entry.
    ``exponent_range`` > 0 spreads magnitudes over 2^±range so the order of summation in the
    norm shows in the last bits.
    """
    out = []
    for i in range(d):
        v = ((i * 7919 + salt * 104729) % 2003 - 1001) / 97.0
        if exponent_range:
            v *= 2.0 ** ((i * 5 + salt) % (2 * exponent_range + 1) - exponent_range)
        out.append(v)
    return out


def _noise(d: int, salt: int, std: float) -> list[float]:
    return [((i * 3571 + salt * 7907) % 1999 - 999) / 1000.0 * std for i in range(d)]


def _record_case(name: str, *, loss: str, lam: float, p_bound: float, x: list[float], y: float,
                 u: list[float], r: list[float], study_hash: bytes, salt: int) -> dict:
    q, p = encode(loss, np.array(x), y)
    q, p = clip(q, p, lam, p_bound)
    q_noisy, p_noisy = q + np.array(u), p - np.array(r)
    record_id = hashlib.sha256(f"record-{salt}".encode()).digest()[:16]
    created_ms = 1_700_000_000_000 + salt
    return {
        "name": name, "loss": loss, "lam": lam, "p_bound": p_bound, "x": x, "y": y,
        "q": q.tolist(), "p": p.tolist(), "u": u, "r": r,
        "q_noisy": q_noisy.tolist(), "p_noisy": p_noisy.tolist(),
        "study_hash": study_hash.hex(), "record_id": record_id.hex(), "created_ms": created_ms,
        "record": encode_record(study_hash, record_id, created_ms, q_noisy, p_noisy).hex(),
    }


def _wire_case(name: str, *, study_hash: bytes, record_id: bytes, created_ms: int,
               q_noisy: list[float], p_noisy: list[float]) -> dict:
    return {
        "name": name, "study_hash": study_hash.hex(), "record_id": record_id.hex(),
        "created_ms": created_ms, "q_noisy": q_noisy, "p_noisy": p_noisy,
        "record": encode_record(study_hash, record_id, created_ms, q_noisy, p_noisy).hex(),
    }


def _schema_studies() -> list[tuple[Study, list[dict]]]:
    """A numeric-target study with an intercept and a class-target one without, with raw rows
    inside, on and outside their ranges (fractional ranges, so the map rounds)."""
    rents = Study(study_id="web-vectors-schema", n=1000, epsilon=1.0, delta=0.01, eta=2.0,
                  schema={"features": [{"name": "area", "min": 20, "max": 150},
                                       {"name": "floor", "min": -1.5, "max": 11.3},
                                       {"name": "distance km", "min": 0.1, "max": 30}],
                          "target": {"name": "rent", "min": 0, "max": 2500}})
    loans = Study(study_id="web-vectors-classes", loss="logistic", n=1000, epsilon=1.0,
                  delta=0.01, schema={"features": [{"name": "income", "min": 0, "max": 200},
                                                   {"name": "debt", "min": 0, "max": 50}],
                                      "target": {"name": "approved", "classes": ["no", "yes"]},
                                      "intercept": False})
    return [
        (rents, [{"area": 64, "floor": 2, "distance km": 4.2, "rent": 1310},
                 {"area": 400, "floor": -3, "distance km": 0.1, "rent": 2600.5},
                 {"area": 20, "floor": 11.3, "distance km": 17.77, "rent": -1}]),
        (loans, [{"income": 120, "debt": 10, "approved": "yes"},
                 {"income": 250.5, "debt": 0.3, "approved": "no"}]),
    ]


def _schema_case(owner: SigningKey, study: Study, rows: list[dict]) -> dict:
    encoded = [study.schema_.encode({k: [v] for k, v in row.items()}) for row in rows]
    return {
        "envelope": json.loads(study_message(study, "open", owner)),
        "rows": [{"row": row, "x": e.x[0].tolist(), "y": float(e.y[0]),
                  "clipped": [name for name, k in e.clipped.items() if k]}
                 for row, e in zip(rows, encoded, strict=True)],
    }


def _committed_two_server() -> dict[str, str]:
    """name → the committed Python-sealed record of each two-server case (HPKE seals with a
    fresh ephemeral key, so a seal is kept from the committed file while it still opens to the
    same share under the same header; :func:`_two_server_case` checks that)."""
    if not VECTORS.exists():
        return {}
    committed = json.loads(VECTORS.read_text(encoding="utf-8")).get("two_server", {})
    return {c["name"]: c["record"] for c in committed.get("cases", [])}


def _two_server_case(name: str, *, helper: HelperKey, study_hash: bytes, record_id: bytes,
                     created_ms: int, encoding: FixedPoint, q_tilde: list[float],
                     p_hat: list[float], helper_share: bytes, committed: dict[str, str]) -> dict:
    values, clamped = fixed_point_encode(np.array([q_tilde]), np.array([p_hat]), encoding)
    helper_words = np.frombuffer(helper_share, "<u8").reshape(values.shape)
    leader = values - helper_words
    header = headers(study_hash, np.frombuffer(record_id, np.uint8).reshape(1, 16),
                     np.array([created_ms]), encoding.d)
    unsealed = header[0].tobytes() + leader.astype("<u8").tobytes()
    layout = TwoServerLayout(encoding.d)
    old = bytes.fromhex(committed.get(name, ""))
    try:
        keep = (len(old) == layout.size and old[:layout.sealed.start] == unsealed
                and open_share(helper.private, old[layout.sealed], header[0].tobytes())
                == helper_share)
    except SealError:
        keep = False
    record = old if keep else encode_two_server_batch(
        header, leader, seal_helper_shares(helper.public, header, helper_words))[0]
    return {
        "name": name, "d": encoding.d, "fraction_bits": encoding.fraction_bits,
        "clamp_log2": encoding.clamp_log2, "study_hash": study_hash.hex(),
        "record_id": record_id.hex(), "created_ms": created_ms, "q_tilde": q_tilde,
        "p_hat": p_hat, "values": [str(v) for v in values[0].tolist()], "clamped": clamped,
        "helper_share": helper_share.hex(), "header": header[0].tobytes().hex(),
        "leader_share": leader.astype("<u8").tobytes().hex(), "unsealed": unsealed.hex(),
        "record": record.hex(),
    }


def _two_server_vectors(owner: SigningKey) -> dict:
    """A signed two-server study, and version-3 records for fixed (q̃, p̂), ids, times and
    helper shares: the fixed-point cases of tests/ipdp/two_server_vectors.json (ties, the clamp,
    n = 1,000 at the largest f) and one record of the study at d = 14."""
    helper = HelperKey(X25519PrivateKey.from_private_bytes(HELPER_SEED))
    study = Study(study_id="web-vectors-two-server", d=14, n=2_000, epsilon=1.0, delta=0.01,
                  two_server={"helper_id": "helper-a",
                              "helper_url": "https://helper.example.org",
                              "helper_key": helper.public_b64})
    committed = _committed_two_server()
    cases = []
    fixed = json.loads(TWO_SERVER_CASES.read_text(encoding="utf-8"))["cases"]
    for i, case in enumerate(fixed):
        encoding = FixedPoint(**case["encoding"])
        for j, (q_tilde, p_hat) in enumerate(zip(case["q_tilde"], case["p_hat"], strict=True)):
            cases.append(_two_server_case(
                f"{case['name']} record {j}", helper=helper, study_hash=study.hash,
                record_id=hashlib.sha256(f"two-server-{i}-{j}".encode()).digest()[:16],
                created_ms=1_700_000_000_000 + 10 * i + j, encoding=encoding, q_tilde=q_tilde,
                p_hat=p_hat, helper_share=bytes.fromhex(case["helper_share_hex"][j]),
                committed=committed))
    two = study.two_server_calibration
    grid = 2.0 ** -two.linear_bits
    d14 = study.encoding
    cases.append(_two_server_case(
        "web-vectors-two-server d=14", helper=helper, study_hash=study.hash,
        record_id=hashlib.sha256(b"two-server-d14").digest()[:16], created_ms=2**53 - 1,
        encoding=d14, q_tilde=[v / 64.0 + n for v, n in zip(
            _spread(14, 21), _noise(14, 22, two.noise_std_q), strict=True)],
        p_hat=[float(k) * grid for k in (int(v * 1e4) for v in _spread(14, 23))],
        helper_share=hashlib.shake_256(b"two-server-d14").digest(8 * d14.entries),
        committed=committed))
    return {
        "envelope": json.loads(study_message(study, "open", owner)),
        "study_hash": study.hash.hex(),
        "helper_private_key": helper.private.private_bytes_raw().hex(),
        "helper_public_key": helper.public_b64,
        "cases": cases,
    }


def build_vectors() -> dict:
    """Every vector, computed from ipdp's Python code."""
    owner = SigningKey(Ed25519PrivateKey.from_private_bytes(OWNER_SEED))
    stranger = SigningKey(Ed25519PrivateKey.from_private_bytes(STRANGER_SEED))
    squared = Study(study_id="web-vectors-squared", loss="squared", d=14, n=10_000, epsilon=1.0,
                    delta=0.01, lam=1.0, p_bound=1.0, max_rounds=3)
    logistic = Study(study_id="web-vectors-logistic", loss="logistic", d=3, n=2_000,
                     epsilon=0.5, delta=1e-5, lam=0.25, p_bound=0.5, mode="paper")
    studies = []
    for study, status in ((squared, "open"), (logistic, "closed")):
        text = study.canonical_text
        studies.append({
            "name": f"{study.study_id} ({status})",
            "envelope": json.loads(study_message(study, status, owner)),
            "signed_message": f"ipdp-study-v2\n{status}\n{text}",
            "study_hash": _study_hash(text).hex(),
        })

    sq_hash = squared.hash
    std_q, std_p = squared.calibration.noise_std_q, squared.calibration.noise_std_p
    lg_hash = logistic.hash
    records = [
        _record_case("squared d=14 inside the bounds, study web-vectors-squared", loss="squared",
                     lam=1.0, p_bound=1.0, x=[v / 64.0 for v in _spread(14, 1)], y=0.25,
                     u=_noise(14, 1, std_q), r=_noise(14, 2, std_p), study_hash=sq_hash, salt=1),
        _record_case("squared d=14 both clipped, magnitudes over 2^±20", loss="squared", lam=1.0,
                     p_bound=1.0, x=_spread(14, 3, 20), y=-3.5, u=_noise(14, 3, std_q),
                     r=_noise(14, 4, std_p), study_hash=sq_hash, salt=2),
        _record_case("squared d=2 negative zero kept", loss="squared", lam=4.0, p_bound=2.0,
                     x=[-0.0, 0.5], y=2.0, u=[-0.0, 0.125], r=[0.0, -0.25],
                     study_hash=sq_hash, salt=3),
        _record_case("squared d=1 clipped, negative label", loss="squared", lam=2.0, p_bound=0.5,
                     x=[3.0], y=-1.5, u=[0.1], r=[-0.2], study_hash=sq_hash, salt=4),
        _record_case("squared d=3 zero example", loss="squared", lam=1.0, p_bound=1.0,
                     x=[0.0, 0.0, 0.0], y=7.0, u=[0.5, -0.5, 1e-300], r=[5e-324, 0.0, -1.0],
                     study_hash=sq_hash, salt=5),
        _record_case("logistic d=3 y=-1 q clipped, study web-vectors-logistic", loss="logistic",
                     lam=0.25, p_bound=0.5, x=_spread(3, 6), y=-1.0, u=_noise(3, 6, 0.3),
                     r=_noise(3, 7, 2.0), study_hash=lg_hash, salt=6),
        _record_case("logistic d=1 y=+1 inside the bounds", loss="logistic", lam=1.0,
                     p_bound=1.0, x=[0.75], y=1.0, u=[-0.03125], r=[0.0625],
                     study_hash=lg_hash, salt=7),
        _record_case("logistic d=14 y=+1 both clipped", loss="logistic", lam=1.0, p_bound=0.25,
                     x=_spread(14, 8, 6), y=1.0, u=_noise(14, 8, 0.9), r=_noise(14, 9, 3.0),
                     study_hash=lg_hash, salt=8),
    ]
    # Pairwise summation in the norm changes shape at 8 and 128 terms: cover both sides.
    for d in (7, 8, 9, 17, 129, 300):
        records.append(_record_case(
            f"squared d={d} clipped, summation order", loss="squared", lam=1.0, p_bound=1.0,
            x=_spread(d, 10 + d, 12), y=1.25, u=_noise(d, 11, 0.5), r=_noise(d, 12, 0.5),
            study_hash=sq_hash, salt=10 + d))
    wire = [
        _wire_case("docs/wire-format.md example", study_hash=Study(
            study_id="example-study", d=2, n=1000, epsilon=1.0, delta=0.01).hash,
            record_id=bytes.fromhex("3f2a9c1e7b4d4e8a9c215d6e7f801a2b"),
            created_ms=1_700_000_000_000, q_noisy=[0.5, -1.25], p_noisy=[1.0, -0.0]),
        _wire_case("extremes: created_ms 0, subnormal, largest double", study_hash=bytes(16),
                   record_id=bytes([255] * 16), created_ms=0,
                   q_noisy=[5e-324, -1.7976931348623157e308, 1e-310],
                   p_noisy=[-5e-324, 1.7976931348623157e308, 2.0**-1074 * 3]),
        _wire_case("created_ms 2^53 - 1", study_hash=sq_hash, record_id=bytes(range(16)),
                   created_ms=2**53 - 1, q_noisy=[0.1], p_noisy=[-0.1]),
    ]
    issuer = SigningKey(Ed25519PrivateKey.from_private_bytes(ISSUER_SEED))
    credentialed = Study(study_id="web-vectors-credentials", d=3, n=2_000, epsilon=1.0,
                         delta=0.01, require_credentials=True, records_per_device=3)
    issued_ms, expires_ms = 1_700_000_000_000, 1_700_003_600_000

    def credential_vector(token: bytes) -> dict:
        return {
            "envelope": json.loads(study_message(credentialed, "open", owner)),
            "study_hash": credentialed.hash.hex(),
            "issuer_public_key": issuer.public_b64,
            "credential": token_text(token),
            "credential_id": credential_id(token).hex(),
            "issued_ms": issued_ms,
            "expires_ms": expires_ms,
            "records_per_device": credentialed.records_per_device,
            "slot_record_ids": [row.tobytes().hex() for row in slot_record_ids(
                credential_id(token), credentialed.records_per_device)],
        }

    credentials = credential_vector(issue_credential(
        issuer, credentialed.hash, issued_ms, expires_ms, credential_id=bytes(range(100, 116))))
    # A full batch of four (no random padding leaves): the same bytes on every run.
    batch = issue_batch(issuer, credentialed.hash, issued_ms, expires_ms, 4,
                        credential_ids=[bytes(range(16 * i, 16 * i + 16)) for i in range(4)])
    return {
        "schemas": [_schema_case(owner, study, rows) for study, rows in _schema_studies()],
        "about": "Generated from ipdp's Python implementation by tests/producer/test_web_vectors"
                 f".py; do not edit. Regenerate: {REGENERATE}",
        "keys": {
            "owner_public_key": owner.public_b64,
            "owner_key_id": studies[0]["envelope"]["key_id"],
            "stranger_public_key": stranger.public_b64,
        },
        "studies": studies,
        "records": records,
        "wire": wire,
        "credentials": credentials,
        "batch_credential": credential_vector(batch[2]),
        "two_server": _two_server_vectors(owner),
    }


def render(vectors: dict) -> str:
    """The file's exact text: stable key order and indentation, floats as Python repr."""
    return json.dumps(vectors, indent=1, ensure_ascii=True, allow_nan=False) + "\n"


def test_committed_web_vectors_match_the_python_implementation():
    text = render(build_vectors())
    if os.environ.get("IPDP_WRITE_VECTORS") == "1":
        VECTORS.write_text(text, encoding="utf-8")
    committed = VECTORS.read_text(encoding="utf-8") if VECTORS.exists() else ""
    assert committed == text, (
        f"{VECTORS.relative_to(VECTORS.parents[2])} is stale: the Python implementation now "
        f"produces different vectors. Regenerate with `{REGENERATE}`, then run "
        "`cd producer/web && npm test` and commit both.")


def test_vectors_decode_back_to_what_they_encode():
    from ipdp.wire import decode_record

    vectors = build_vectors()
    for case in vectors["records"] + vectors["wire"]:
        rec = decode_record(bytes.fromhex(case["record"]))
        assert rec.study_hash.hex() == case["study_hash"], case["name"]
        assert rec.record_id.hex() == case["record_id"], case["name"]
        assert rec.created_ms == case["created_ms"], case["name"]
        assert rec.q.tobytes() == np.array(case["q_noisy"], dtype=np.float64).tobytes()
        assert rec.p.tobytes() == np.array(case["p_noisy"], dtype=np.float64).tobytes()


def test_vectors_exercise_clipping_both_losses_and_negative_zero():
    records = build_vectors()["records"]
    clipped = [c for c in records
               if not np.allclose(c["q"], encode(c["loss"], np.array(c["x"]), c["y"])[0])]
    assert len(clipped) >= 5
    assert {c["loss"] for c in records} == {"squared", "logistic"}
    assert {len(c["x"]) for c in records} >= {1, 14, 129}
    assert any(np.signbit(c["q_noisy"][0]) and c["q_noisy"][0] == 0 for c in records)


def test_envelope_signature_verifies_with_the_owner_key_only():
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    vectors = build_vectors()
    owner = Ed25519PublicKey.from_public_bytes(
        base64.b64decode(vectors["keys"]["owner_public_key"]))
    stranger = Ed25519PublicKey.from_public_bytes(
        base64.b64decode(vectors["keys"]["stranger_public_key"]))
    for case in vectors["studies"]:
        env = case["envelope"]
        message = case["signed_message"].encode("utf-8")
        signature = base64.b64decode(env["signature"])
        owner.verify(signature, message)
        try:
            stranger.verify(signature, message)
        except InvalidSignature:
            pass
        else:
            raise AssertionError("a stranger's key verified the owner's signature")
        assert case["study_hash"] == _study_hash(env["study"]).hex()
        assert json.loads(env["study"])["noise"]["std_q"] > 0


def test_python_seals_in_the_vectors_open_to_their_helper_share_under_their_header_only():
    two = build_vectors()["two_server"]
    helper = HelperKey(X25519PrivateKey.from_private_bytes(HELPER_SEED))
    for case in two["cases"]:
        layout = TwoServerLayout(case["d"])
        record = bytes.fromhex(case["record"])
        assert record[:layout.sealed.start].hex() == case["unsealed"]
        assert record[layout.proof_length] == bytes(4)
        header = bytes.fromhex(case["header"])
        assert open_share(helper.private, record[layout.sealed], header).hex() == \
            case["helper_share"]
        moved = bytes([header[0]]) + header[1:40] + bytes(8)
        with pytest.raises(SealError):
            open_share(helper.private, record[layout.sealed], moved)


#: Node, on the built SDK: each two-server vector sealed by TypeScript, and one record a device
#: of the vectors' study prepares with fresh noise and shares. Prints one JSON object.
TS_SEALS = """
import { readFileSync } from "node:fs";
import * as sdkMain from "%s";
import * as sdkTwo from "%s";
const sdk = { ...sdkMain, ...sdkTwo };
const two = JSON.parse(readFileSync(process.argv[2], "utf8")).two_server;
const pub = Uint8Array.from(Buffer.from(two.helper_public_key, "base64"));
const out = { cases: [], device: null };
for (const c of two.cases) {
  const { values } = sdk.encodeFixedPoint(c.q_tilde, c.p_hat, c.fraction_bits, c.clamp_log2);
  const helper = sdk.fromShareBytes(sdk.fromHex(c.helper_share));
  const header = sdk.twoServerHeader(sdk.fromHex(c.study_hash), sdk.fromHex(c.record_id),
                                     c.created_ms, c.d);
  const sealed = await sdk.sealShare(pub, sdk.shareBytes(helper), header);
  out.cases.push(sdk.toHex(sdk.encodeTwoServerRecord(header, sdk.leaderShare(values, helper),
                                                     sealed)));
}
const key = await sdk.importTrustedKey(process.argv[3]);
const verified = await sdk.verifyStudyEnvelope(two.envelope, [key]);
const x = Array.from({ length: 14 }, (_, i) => (i - 7) / 40);
const device = await sdk.prepareTwoServerRecord(verified, x, 0.3);
out.device = { record: sdk.toHex(device.bytes), q_tilde: [...device.qNoisy],
               p_hat: [...device.pNoisy] };
console.log(JSON.stringify(out));
"""


def test_typescript_seals_open_in_python_and_its_unsealed_bytes_are_pythons(tmp_path):
    """The browser SDK's version-3 records (node runs the built SDK): the unsealed part of each
    vector byte for byte, the seal opened by ipdp.sealing, and a device's fresh record whose two
    shares sum to the fixed-point values of what it says it perturbed."""
    import subprocess

    from ipdp.fixed_point import combine
    from ipdp.two_server_wire import decode_two_server_batch
    from tests.tooling import require_tool, unavailable

    node = require_tool("node", "running the browser SDK's two-server encoder")
    web = VECTORS.parent
    index = web / "dist" / "src" / "index.js"
    module = web / "dist" / "src" / "two-server.js"
    sources = list((web / "src").glob("*.ts"))
    if not module.is_file() or not (web / "node_modules" / "@hpke" / "core").is_dir():
        unavailable("producer/web is not built; run `cd producer/web && npm ci && npm run build`")
    if max(f.stat().st_mtime for f in sources) > module.stat().st_mtime:
        pytest.fail("producer/web/dist is older than producer/web/src; run "
                    "`cd producer/web && npm run build`", pytrace=False)
    vectors = build_vectors()
    (tmp_path / "vectors.json").write_text(render(vectors), encoding="utf-8")
    script = tmp_path / "seal.mjs"
    script.write_text(TS_SEALS % (index.as_uri(), module.as_uri()), encoding="utf-8")
    ran = subprocess.run([node, str(script), str(tmp_path / "vectors.json"),
                          vectors["keys"]["owner_public_key"]],
                         capture_output=True, text=True, timeout=60, check=False)
    assert ran.returncode == 0, ran.stderr
    out = json.loads(ran.stdout)
    helper = HelperKey(X25519PrivateKey.from_private_bytes(HELPER_SEED))
    two = vectors["two_server"]
    for case, record_hex in zip(two["cases"], out["cases"], strict=True):
        layout = TwoServerLayout(case["d"])
        record = bytes.fromhex(record_hex)
        assert record[:layout.sealed.start].hex() == case["unsealed"], case["name"]
        assert record[layout.proof_length] == bytes(4)
        assert open_share(helper.private, record[layout.sealed],
                          bytes.fromhex(case["header"])).hex() == case["helper_share"]
    study, _ = parse_study_message(json.dumps(two["envelope"]).encode())
    batch, rejects = decode_two_server_batch([bytes.fromhex(out["device"]["record"])], 14)
    assert rejects == [] and batch.study_hash[0].tobytes() == study.hash
    helper_share = np.frombuffer(open_share(helper.private, batch.sealed[0],
                                            batch.header[0].tobytes()), "<u8")
    values, _ = fixed_point_encode(np.array(out["device"]["q_tilde"]),
                                   np.array(out["device"]["p_hat"]), study.encoding)
    assert np.array_equal(combine(batch.leader[0], helper_share), values)
    assert not np.array_equal(batch.leader[0], values)
