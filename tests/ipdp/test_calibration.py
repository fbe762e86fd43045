"""Calibration against the reference table in docs/privacy.md, the analytic Gaussian mechanism, the erratum."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import norm

from ipdp.calibration import (
    CalibrationError,
    calibrate,
    calibrate_rigorous,
    gaussian_log_delta,
    local_epsilon,
    rigorous_eigen_bound,
)

REFERENCE = {"epsilon": 1.0, "delta": 0.01, "lam": 1.0, "p_bound": 1.0, "eta": 1.0}

# docs/privacy.md's reference table: (d, n, paper σ_u², rigorous σ_u²)
TABLE = [
    (14, 1_000, 4.399, 10.21),
    (14, 10_000, 2.537, 2.94),
    (14, 2_097_152, 2.032, 2.05),
    (100, 10_000, 3.456, 4.46),
]


@pytest.mark.parametrize(("d", "n", "paper", "rigorous"), TABLE)
def test_paper_mode_reproduces_reference_sigma_u2_to_four_digits(d, n, paper, rigorous):
    cal = calibrate(mode="paper", n=n, d=d, delta_in=1e-6, **REFERENCE)
    assert float(f"{cal.sigma_u2:.4g}") == paper


@pytest.mark.parametrize(("d", "n", "paper", "rigorous"), TABLE)
def test_rigorous_mode_reproduces_reference_sigma_u2_within_one_percent(d, n, paper, rigorous):
    cal = calibrate(mode="rigorous", n=n, d=d, delta_in=0.0, **REFERENCE)
    assert cal.sigma_u2 == pytest.approx(rigorous, rel=0.01)
    assert cal.sigma_u2 > calibrate(mode="paper", n=n, d=d, delta_in=1e-6, **REFERENCE).sigma_u2


def test_paper_sigma_b2_is_kifer_noise_at_half_delta():
    cal = calibrate(mode="paper", n=10_000, d=14, delta_in=1e-6, **REFERENCE)
    zeta = 1.0 * 1.0 + 1.0
    assert cal.zeta == zeta
    assert cal.sigma_b2 == pytest.approx(zeta**2 * (8 * math.log(2 / 0.005) + 4) / 1.0)
    assert cal.delta_split == {"gamma": 0.005, "delta_prime": 0.005}


@pytest.mark.parametrize(("d", "n"), [(14, 1_000), (14, 10_000), (100, 10_000), (3, 500)])
@pytest.mark.parametrize("delta_in", [0.0, 0.5])
def test_rigorous_sigma_u_is_the_smallest_that_meets_the_eigenvalue_condition(d, n, delta_in):
    cal = calibrate(mode="rigorous", n=n, d=d, delta_in=delta_in, **REFERENCE)
    gamma1, gamma2 = cal.delta_split["gamma_1"], cal.delta_split["gamma_2"]

    def slack(sigma_u2: float) -> float:
        tau = math.sqrt(sigma_u2 / n) * (math.sqrt(d) + math.sqrt(2 * math.log(1 / gamma1)))
        lam_prime = (1.0 + tau) ** 2
        return delta_in + rigorous_eigen_bound(sigma_u2, n, d, gamma2) - 2 * lam_prime / 1.0

    assert slack(cal.sigma_u2) == pytest.approx(0.0, abs=1e-9)
    assert slack(cal.sigma_u2 * 0.999) < 0.0
    assert slack(cal.sigma_u2 * 1.001) > 0.0
    tau = math.sqrt(cal.sigma_u2 / n) * (math.sqrt(d) + math.sqrt(2 * math.log(1 / gamma1)))
    assert cal.lambda_prime == pytest.approx((1 + tau) ** 2)
    assert cal.zeta_prime == pytest.approx(cal.lambda_prime * 1.0 + 1.0)
    assert cal.sigma_b2 == pytest.approx(
        cal.zeta_prime**2 * (8 * math.log(2 / cal.delta_split["delta_k"]) + 4)
    )


def test_rigorous_delta_split_adds_up_to_delta():
    cal = calibrate(mode="rigorous", n=10_000, d=14, delta_in=0.0, **REFERENCE)
    assert sum(cal.delta_split.values()) == pytest.approx(0.01)
    assert set(cal.delta_split) == {"delta_k", "gamma_1", "gamma_2"}


def test_large_delta_in_needs_no_noise_on_q_and_reports_no_local_guarantee():
    cal = calibrate_rigorous(n=10_000, d=14, delta_in=2.0, **REFERENCE)
    assert cal.sigma_u2 == 0.0
    assert cal.local_epsilon is None


@pytest.mark.parametrize(
    ("mode", "n", "d", "delta_in", "match"),
    [
        ("paper", 20, 14, 1e-6, "1 − 2a"),
        ("paper", 100, 14, 1e-6, r"16·log\(8/δ\)"),
        ("paper", 10_000, 14, 0.0, "Δ > 2λ/ε"),
        ("rigorous", 30, 14, 0.0, r"√\(n−1−d\)"),
        ("rigorous", 10_000, 14, -1.0, "delta_in"),
    ],
)
def test_parameters_outside_the_proof_are_refused_with_the_bound(mode, n, d, delta_in, match):
    with pytest.raises(CalibrationError, match=match):
        calibrate(mode=mode, n=n, d=d, delta_in=delta_in, **REFERENCE)


@pytest.mark.parametrize("mu", [0.1, 1.0, 3.0, 10.0])
@pytest.mark.parametrize("eps", [0.0, 0.5, 1.0, 5.0])
def test_analytic_gaussian_delta_matches_balle_wang_formula(mu, eps):
    expected = norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * norm.cdf(-mu / 2 - eps / mu)
    assert math.exp(gaussian_log_delta(mu, eps)) == pytest.approx(expected, rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("mu", [0.5, 2.0, 50.0, 400.0])
def test_local_epsilon_is_where_the_analytic_delta_meets_the_target(mu):
    eps = local_epsilon(sensitivity_over_sigma=mu, delta=1e-5)
    assert gaussian_log_delta(mu, eps) <= math.log(1e-5) + 1e-9
    assert gaussian_log_delta(mu, eps * (1 - 1e-6)) > math.log(1e-5)


def test_local_epsilon_beats_the_classical_gaussian_bound():
    # Classical: σ = Δ√(2 ln(1.25/δ))/ε is (ε, δ)-DP for ε < 1; analytic is never worse.
    delta, eps_classical = 1e-5, 0.9
    mu = eps_classical / math.sqrt(2 * math.log(1.25 / delta))
    assert local_epsilon(sensitivity_over_sigma=mu, delta=delta) < eps_classical


def test_local_epsilon_of_a_record_is_large_and_shrinks_with_central_epsilon():
    loose = calibrate(mode="rigorous", n=10_000, d=14, delta_in=0.0, **REFERENCE)
    tight = calibrate(mode="rigorous", n=10_000, d=14, delta_in=0.0,
                      **{**REFERENCE, "epsilon": 0.1})
    assert loose.local_epsilon > 10 * math.sqrt(10_000) * 0.1  # O(√n·ε): large, as documented
    assert tight.local_epsilon < loose.local_epsilon


def _adversarial_trials(sigma_u2: float, *, n: int, d: int, trials: int, seed: int):
    """All rows equal e₁ (the worst case for Lemma 7); yields (U, Q) per trial."""
    rng = np.random.default_rng(seed)
    q = np.zeros((n, d))
    q[:, 0] = 1.0
    for _ in range(trials):
        yield rng.normal(0.0, math.sqrt(sigma_u2 / n), size=(n, d)), q


def test_erratum_paper_noise_leaves_the_hessian_below_two_lambda_over_epsilon():
    n, d = 10_000, 14
    cal = calibrate(mode="paper", n=n, d=d, delta_in=1e-6, **REFERENCE)
    minima = []
    for u, q in _adversarial_trials(cal.sigma_u2, n=n, d=d, trials=20, seed=7):
        m = u.T @ u + u.T @ q + q.T @ u
        minima.append(np.linalg.eigvalsh(m)[0])
    # Lemma 7 claims UᵀU + UᵀQ + QᵀU ⪰ (2λ/ε)·I = 2·I w.p. ≥ 1−γ = 0.995; it fails in every
    # trial, and in most of them the matrix is not even positive semi-definite.
    assert max(minima) < 2.0
    assert sum(m < 0.0 for m in minima) >= len(minima) // 2


def test_erratum_rigorous_noise_meets_its_condition_in_every_trial():
    n, d = 10_000, 14
    cal = calibrate(mode="rigorous", n=n, d=d, delta_in=0.0, **REFERENCE)
    required = 2.0 * cal.lambda_prime / cal.epsilon
    tau = math.sqrt(cal.lambda_prime) - 1.0
    for u, q in _adversarial_trials(cal.sigma_u2, n=n, d=d, trials=20, seed=11):
        rows = q + u
        a_minus_n = rows[:-1].T @ rows[:-1]
        assert np.linalg.eigvalsh(a_minus_n)[0] + cal.delta_in >= required
        assert np.linalg.norm(u[-1]) <= tau
