"""No value on the studies or models topic can stop a reader, and no study parameter makes the
calibration crash (docs/security.md, "Hostile values on the studies and models topics").

Unit level: each hostile value is a MalformedValue with its reason (or a SignatureError when
keys are pinned, before the study text is parsed); the reader skips it, counts it and logs its
offset, never its content; calibrate() over extreme floats returns finite noise or refuses with
a CalibrationError. The same values are replayed against a running gateway, a device and the
aggregator in tests/system/test_hostile_topics.py.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipdp.calibration import calibrate
from ipdp.cli.main import main
from ipdp.errors import CalibrationError, MalformedValue, SignatureError
from ipdp.metrics import EVERY_METRIC
from ipdp.model_message import parse_model_value
from ipdp.signing import SigningKey, TrustedKeys
from ipdp.studies_topic import apply_study_message
from ipdp.study import Study, parse_study_message, signed_bytes, study_message
from tests.hostile import HOSTILE_STUDY_VALUES, SECRET_MARK, bad_signature, signed_text

PARAMS = {"d": 4, "n": 2_000, "epsilon": 1.0, "delta": 0.01}


@dataclass(frozen=True)
class Message:
    """What a Kafka consumer yields, as far as a reader looks at it."""

    key: bytes | None
    value: bytes | None
    offset: int = 7
    partition: int = 0
    topic: str = "ipdp.studies"


@pytest.fixture(scope="module")
def owner() -> SigningKey:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return SigningKey(Ed25519PrivateKey.generate())


def _malformed(reader: str, reason: str, topic: str = "studies") -> float:
    return EVERY_METRIC.get_sample_value("ipdp_topic_values_malformed_total",
                                     {"topic": topic, "reader": reader, "reason": reason}) or 0.0


@pytest.mark.parametrize(("name", "reason"), [(n, r) for n, _, r in HOSTILE_STUDY_VALUES])
def test_every_hostile_study_value_is_malformed_with_its_reason(name, reason, owner):
    value = {n: v for n, v, _ in HOSTILE_STUDY_VALUES}[name](owner)
    with pytest.raises(MalformedValue) as got:
        parse_study_message(value)
    assert got.value.reason == reason
    assert SECRET_MARK not in str(got.value)


def test_a_reader_prepares_a_study_before_it_can_be_used_and_skips_one_it_cannot_prepare():
    entries: dict = {}
    good, bad = Study(study_id="good", **PARAMS), Study(study_id="bad", **PARAMS)

    def prepare(study: Study) -> object:
        if study.study_id == "bad":
            raise CalibrationError("no bounds")
        return study.norm_bounds

    before = _malformed("gateway", "unexpected")
    for study in (good, bad):
        apply_study_message(entries, Message(study.study_id.encode(), study_message(study, "open")),
                            reader="gateway", prepare=prepare)
    assert list(entries) == ["good"]
    assert "norm_bounds" in vars(entries["good"].study)  # computed as it was read
    assert _malformed("gateway", "unexpected") == before + 1


@pytest.mark.parametrize(("name", "reason"), [(n, r) for n, _, r in HOSTILE_STUDY_VALUES])
def test_a_reader_skips_counts_and_logs_the_offset_of_a_hostile_value_and_keeps_the_rest(
        name, reason, owner, caplog):
    value = {n: v for n, v, _ in HOSTILE_STUDY_VALUES}[name](owner)
    good = Study(study_id="good", **PARAMS)
    entries: dict = {}
    apply_study_message(entries, Message(b"good", study_message(good, "open", owner)),
                        reader="gateway")
    before = _malformed("gateway", reason)
    with caplog.at_level(logging.WARNING):
        apply_study_message(entries, Message(b"evil", value, offset=41), reader="gateway")
    assert _malformed("gateway", reason) == before + 1
    assert list(entries) == ["good"]
    logged = [r.getMessage() for r in caplog.records if "offset 41" in r.getMessage()]
    assert len(logged) == 1 and "ipdp.studies[0]" in logged[0]
    assert SECRET_MARK not in caplog.text


def test_with_pinned_keys_nothing_past_the_envelope_is_parsed_before_the_signature_verifies(
        owner):
    """A study text nested past what the parser can follow is refused for its signature, never
    parsed; signed by the owner, it is parsed and refused as too deep."""
    text = "[" * 100_000 + "]" * 100_000
    pinned = TrustedKeys([owner.private.public_key()])
    forged = json.dumps({"format": 2, "study": text, "status": "open", "key_id": owner.key_id,
                         "signature": bad_signature()}).encode()
    with pytest.raises(SignatureError):
        parse_study_message(forged, pinned)
    kid, sig = owner.sign(signed_bytes("open", text))
    genuine = json.dumps({"format": 2, "study": text, "status": "open", "key_id": kid,
                          "signature": sig}).encode()
    with pytest.raises(MalformedValue) as got:
        parse_study_message(genuine, pinned)
    assert got.value.reason == "too_deep"


def test_a_signed_study_with_a_tiny_epsilon_is_malformed_for_a_pinned_reader(owner):
    value = signed_text(owner, epsilon=1e-308)
    with pytest.raises(MalformedValue) as got:
        parse_study_message(value, TrustedKeys([owner.private.public_key()]))
    assert got.value.reason == "invalid"


@pytest.mark.parametrize("value", [
    b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe{", b"[1, 2]", b'{"version": 1e999}',
    b'{"format": 2, "model": ' + json.dumps("[" * 100_000).encode() + b"}",
    b"{" + b" " * (1 << 20) + b"}",
])
def test_every_hostile_model_value_is_malformed(value):
    with pytest.raises(MalformedValue):
        parse_model_value(value)


def test_the_size_cap_applies_before_parsing(owner):
    value = study_message(Study(study_id="good", **PARAMS), "open", owner)
    assert parse_study_message(value, max_bytes=len(value))[0].study_id == "good"
    with pytest.raises(MalformedValue) as got:
        parse_study_message(value, max_bytes=len(value) - 1)
    assert got.value.reason == "too_large"


EXTREMES = [5e-324, 1e-308, 1e-200, 1e-30, 1e-8, 0.5, 1.0, 3.0, 1e8, 1e30, 1e200, 1e308,
            0.0, -1.0, math.inf, -math.inf, math.nan]
extreme_floats = st.one_of(st.sampled_from(EXTREMES), st.floats())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(["rigorous", "paper"]), epsilon=extreme_floats,
       delta=st.one_of(st.sampled_from([5e-324, 1e-308, 1e-30, 0.01, 0.5, 1 - 1e-16, 1.0]),
                       st.floats()),
       n=st.one_of(st.sampled_from([0, 1, 2, 1000, 10**6, 10**18, 10**300]),
                   st.integers(-10, 10**30)),
       d=st.one_of(st.sampled_from([0, 1, 14, 4096]), st.integers(-1, 5000)),
       lam=extreme_floats, p_bound=extreme_floats, eta=extreme_floats,
       delta_in=st.one_of(st.sampled_from([None, 0.0, 1e-308, 1e-6, 1e308]), st.floats()),
       loss=st.sampled_from(["squared", "logistic"]))
def test_calibrate_returns_finite_noise_or_refuses_clearly(mode, epsilon, delta, n, d, lam,
                                                           p_bound, eta, delta_in, loss):
    try:
        cal = calibrate(mode=mode, epsilon=epsilon, delta=delta, n=n, d=d, lam=lam,
                        p_bound=p_bound, eta=eta, delta_in=delta_in, loss=loss)
    except CalibrationError:
        return
    for value in (cal.sigma_u2, cal.sigma_b2, cal.noise_std_q, cal.noise_std_p, cal.delta_in):
        assert math.isfinite(value) and value >= 0.0


@pytest.mark.parametrize("flags", [
    ["--epsilon", "1e-308"], ["--epsilon", "1e308"], ["--delta", "1e-308"], ["--lam", "1e-308"],
    ["--lam", "1e308"], ["--p-bound", "1e308"], ["--eta", "1e308"], ["--eta", "1e-308"],
    ["--n", "1000000000000000000000"], ["--delta-in", "1e308"], ["--epsilon", "nan"],
])
def test_ipdp_calibrate_answers_bad_numbers_with_one_line_never_a_traceback(flags, capsys):
    base = {"--epsilon": "1", "--delta": "0.01", "--n": "1000", "--d": "14"}
    base.update(dict(zip(flags[::2], flags[1::2], strict=True)))
    status = main(["calibrate", *[a for kv in base.items() for a in kv]])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert status in (0, 2)
    if status == 2:
        assert err.startswith("ipdp calibrate: ")
