"""Study validation at the boundary; encoders, clipping and the contributor's noise."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError

from ipdp.losses import clip, encode, perturb, prepare
from ipdp.study import Study

BASE = {"study_id": "s1", "d": 14, "n": 10_000, "epsilon": 1.0, "delta": 0.01}


def test_default_study_is_rigorous_with_the_ridge_of_least_predicted_error():
    s = Study(**BASE)
    assert s.mode == "rigorous"
    assert s.resolved_delta_in is None
    zero_ridge = Study(**BASE, delta_in=0.0).calibration
    assert s.calibration.sigma_u2 == zero_ridge.sigma_u2
    assert 0.0 < s.calibration.delta_in and s.calibration.sigma_b2 < zero_ridge.sigma_b2
    assert s.calibration.predicted_error < zero_ridge.predicted_error
    assert s.calibration.proven
    assert len(s.hash) == 16


def test_study_round_trips_through_json():
    s = Study(**BASE, loss="logistic", max_rounds=3)
    assert Study.model_validate_json(s.to_json()) == s


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"epsilon": 0.0}, "epsilon=0.0 must be a finite number > 0"),
        ({"epsilon": -1.0}, "epsilon"),
        ({"delta": 0.0}, r"delta=0.0 must lie in the open interval \(0, 1\)"),
        ({"delta": 1.0}, "delta"),
        ({"eta": math.inf}, "eta"),
        ({"delta_in": -0.1}, "delta_in"),
        ({"n": 30}, r"too small for rigorous mode.*√\(n−1−d\)"),
        ({"n": 100, "mode": "paper"}, r"n ≥ 16·log\(8/δ\)"),
        ({"n": 20, "mode": "paper"}, "1 − 2a"),
        ({"mode": "paper", "delta_in": 0.0}, "Δ > 2λ/ε"),
        ({"loss": "hinge"}, "loss"),
        ({"study_id": "has space"}, "study_id"),
        ({"d": 0}, "d"),
    ],
)
def test_invalid_study_is_refused_naming_the_parameter_and_bound(override, match):
    with pytest.raises(ValidationError, match=match):
        Study(**{**BASE, **override})


def test_squared_and_logistic_encodings():
    x = np.array([[0.3, -0.4], [1.0, 2.0]])
    y = np.array([2.0, -1.0])
    q, p = encode("squared", x, y)
    np.testing.assert_array_equal(q, x)
    np.testing.assert_array_equal(p, y[:, None] * x)
    q, p = encode("logistic", x, y.clip(-1, 1))
    np.testing.assert_array_equal(q, x / 2)
    np.testing.assert_array_equal(p, np.array([[0.15, -0.2], [-0.5, -1.0]]))


def test_logistic_encoding_refuses_labels_outside_plus_minus_one():
    with pytest.raises(ValueError) as refused:
        encode("logistic", np.ones((2, 3)), np.array([1.0, 0.0]))
    assert str(refused.value) == "logistic loss needs labels y ∈ {−1, +1}"


def test_clipping_never_exceeds_the_public_bounds_and_keeps_small_rows():
    rng = np.random.default_rng(3)
    q = rng.normal(0, 10, size=(10_000, 14)) * rng.uniform(0, 1, size=(10_000, 1))
    p = rng.normal(0, 10, size=(10_000, 14))
    q[:5] = 0.0
    cq, cp = clip(q, p, lam=0.5, p_bound=2.0)
    assert (np.einsum("ij,ij->i", cq, cq) <= 0.5 * (1 + 1e-12)).all()
    assert (np.linalg.norm(cp, axis=1) <= 2.0 * (1 + 1e-12)).all()
    inside = np.linalg.norm(q, axis=1) <= math.sqrt(0.5)
    assert inside.sum() > 100
    np.testing.assert_array_equal(cq[inside], q[inside])
    # Clipping only scales: the direction of every non-zero row is kept.
    big = ~inside
    cos = np.einsum("ij,ij->i", cq[big], q[big]) / (
        np.linalg.norm(cq[big], axis=1) * np.linalg.norm(q[big], axis=1))
    np.testing.assert_allclose(cos, 1.0, rtol=1e-12)


def test_perturbation_noise_has_the_calibrated_variance():
    study = Study(**BASE)
    cal = study.calibration
    k = 200_000
    q = np.zeros((k, study.d))
    p = np.zeros((k, study.d))
    qt, pt = perturb(q, p, cal, np.random.default_rng(2024))
    # k·d = 2.8e6 draws: the sample variance's relative standard error is √(2/2.8e6) ≈ 0.085 %,
    # so a 1 % tolerance is ≈ 12 standard errors — and σ² vs σ²/n differ by a factor 10⁴.
    assert qt.var() == pytest.approx(cal.sigma_u2 / cal.n, rel=0.01)
    assert pt.var() == pytest.approx(cal.sigma_b2 / cal.n, rel=0.01)
    assert abs(qt.mean()) < 5 * math.sqrt(cal.sigma_u2 / cal.n / qt.size)
    # Each coordinate gets its own independent draw: no correlation between q̃ and p̃ noise.
    assert abs(np.corrcoef(qt[:, 0], pt[:, 0])[0, 1]) < 0.02


def test_single_record_and_batch_perturbation_agree_in_shape_and_seeded_values():
    cal = Study(**BASE).calibration
    x = np.linspace(-1, 1, 14)
    one = prepare("squared", x, 0.5, cal, np.random.default_rng(1))
    many = prepare("squared", x[None, :], np.array([0.5]), cal, np.random.default_rng(1))
    assert one[0].shape == (14,)
    np.testing.assert_array_equal(one[0], many[0][0])
    np.testing.assert_array_equal(one[1], many[1][0])


@pytest.mark.parametrize(("x", "y", "message"), [
    (np.ones((2, 2, 2)), np.ones((2, 2)), "x must have shape (d,) or (k, d), got (2, 2, 2)"),
    (np.ones((3, 2)), np.ones(2), "y must have shape (3,), got (2,)"),
    (np.ones(2), np.ones(3), "y must have shape (), got (3,)"),
    (np.ones((3, 2)), np.array([1.0, np.nan, 1.0]), "x and y must be finite"),
    (np.array([[1.0, np.inf]]), np.ones(1), "x and y must be finite"),
])
def test_an_example_of_the_wrong_shape_or_not_finite_is_refused_with_what_is_wrong(x, y, message):
    with pytest.raises(ValueError) as refused:
        encode("squared", x, y)
    assert str(refused.value) == message


def test_an_unknown_loss_is_refused_by_name():
    with pytest.raises(ValueError) as refused:
        encode("hinge", np.ones(2), 1.0)
    assert str(refused.value) == "unknown loss 'hinge'; expected 'squared' or 'logistic'"


def test_integer_features_encode_as_floats():
    q, p = encode("squared", np.array([[1, 2]]), np.array([3]))
    assert q.dtype == p.dtype == np.float64
    np.testing.assert_array_equal(q, [[1.0, 2.0]])
    np.testing.assert_array_equal(p, [[3.0, 6.0]])


def test_system_noise_is_box_muller_on_the_top_53_bits_of_each_kernel_word(monkeypatch):
    """Fixed kernel bytes give the transform's exact output: U₁ = (k₁ + 1)/2⁵³ never 0,
    U₂ = k₂/2⁵³, Z₁ = √(−2 ln U₁)·cos 2πU₂, Z₂ = √(−2 ln U₁)·sin 2πU₂, the cosines first."""
    from ipdp import losses

    # (k₁, k₂) per pair, each shifted above the 11 bits the transform drops.
    pairs = [(0, 0), (2**52 - 1, 2**50), (2**53 - 1, 3 * 2**51)]
    words = np.array([k << 11 | 0x7FF for pair in pairs for k in pair], dtype="<u8")
    asked = []

    def kernel(size: int) -> bytes:
        asked.append(size)
        return words.tobytes()[:size]

    monkeypatch.setattr(losses.os, "urandom", kernel)
    radius = [math.sqrt(-2.0 * math.log((k1 + 1) * 2.0**-53)) for k1, _ in pairs]
    angle = [2.0 * math.pi * k2 * 2.0**-53 for _, k2 in pairs]
    cos = [r * math.cos(a) for r, a in zip(radius, angle, strict=True)]
    sin = [r * math.sin(a) for r, a in zip(radius, angle, strict=True)]
    z = losses.SystemNoise().normal(1.0, 2.0, size=(2, 2))
    np.testing.assert_allclose(z, 1.0 + 2.0 * np.array([cos[:2], sin[:2]]), rtol=1e-15)
    assert radius[0] == pytest.approx(math.sqrt(106 * math.log(2)))
    z = losses.SystemNoise().normal(0.0, 1.0, size=5)
    np.testing.assert_allclose(z, [*cos, *sin[:2]], rtol=1e-15)
    assert losses.SystemNoise().normal(0.0, 1.0).shape == ()
    np.testing.assert_allclose(losses.SystemNoise().normal(size=2), [cos[0], sin[0]], rtol=1e-15)
    assert asked == [32, 48, 16, 16], "two words per pair of normals, a pair per two draws"


def test_perturb_adds_the_first_draw_to_q_and_subtracts_the_second_from_p():
    """Algorithm 1, lines 3–5: q̃ = q + u, p̃ = p − r, u drawn before r."""
    cal = Study(**BASE).calibration
    q, p = np.full((2, 14), 0.1), np.full((2, 14), 0.2)
    twin = np.random.default_rng(8)
    u = twin.normal(0.0, cal.noise_std_q, size=q.shape)
    r = twin.normal(0.0, cal.noise_std_p, size=p.shape)
    q_noisy, p_noisy = perturb(q, p, cal, np.random.default_rng(8))
    np.testing.assert_array_equal(q_noisy, q + u)
    np.testing.assert_array_equal(p_noisy, p - r)
