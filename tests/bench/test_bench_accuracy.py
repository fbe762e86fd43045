"""Smoke test of bench.accuracy (--quick) and hand-checked privacy calibrations of its baselines."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from bench import accuracy
from bench.accuracy import (
    TASKS,
    Config,
    Noise,
    collect_stats,
    fit,
    ip_calibration,
    pieces,
    reg_grid,
    run,
)
from bench.accuracy_data import Synthetic
from bench.baselines import (
    analytic_gaussian_mu,
    gamma_sphere,
    gaussian_output_sigma,
    laplace_output_scale,
    objpert_gauss,
    output_sensitivity,
)
from ipdp.calibration import calibrate
from ipdp.losses import clip, encode, perturb

LINEAR, LOGISTIC = TASKS


@pytest.fixture(scope="module")
def quick():
    """One --quick run: synthetic data, n ∈ {2^7, 2^9, 2^11}, 2 trials, both tasks and ε."""
    return {o.task.name: o for o in run(Config(trials=2, seed=0, quick=True))}


def test_quick_run_np_beats_the_trivial_predictor(quick):
    lin, log = quick["linear"], quick["logistic"]
    np_rmse = lin.scores[0.1, "NP"].mean(axis=0)
    assert (np_rmse < 0.6 * lin.trivial.mean(axis=0)).all()
    # The synthetic target has N(0, 0.05²) noise around a model inside the ball: NP finds it.
    assert np_rmse[-1] == pytest.approx(Synthetic().noise, abs=0.01)
    assert log.scores[1.0, "NP"].mean(axis=0)[-1] > log.trivial.mean(axis=0)[-1] + 0.2


def test_quick_run_rigorous_mode_refuses_the_smallest_n(quick):
    rigorous = quick["linear"].scores[1.0, "IP-rigorous"]
    assert np.isnan(rigorous[:, 0]).all()  # n = 2^7: no guarantee, reported n/a
    assert np.isfinite(rigorous[:, 1:]).all()


def test_main_quick_prints_the_tables(capsys):
    assert accuracy.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "| 2^11 |" in out and "IP-rigorous − ObjPert-Gauss" in out


def _stats(task, n, seed=3):
    source = Synthetic()
    rng = np.random.default_rng(seed)
    [st] = collect_stats(source.train_chunks(rng, pieces([n], chunk=512)), task,
                         np.random.default_rng(seed + 1), [n])
    x, y = source.test_rows(np.random.default_rng(seed + 2), 4096)
    return st, x, task.targets(y)


def test_ip_rigorous_with_huge_epsilon_approaches_np_and_not_with_epsilon_one():
    st, x, y = _stats(LINEAR, 2048)
    noise = Noise.draw(np.random.default_rng(5), st.sp.size)
    w_np = fit("NP", st, LINEAR, 1.0, 0.0, noise)
    w_huge = fit("IP-rigorous", st, LINEAR, 1e6, 0.0, noise)
    w_one = fit("IP-rigorous", st, LINEAR, 1.0, 0.0, noise)
    rmse = LINEAR.score(x @ np.column_stack([w_np, w_huge, w_one]), y)
    assert np.linalg.norm(w_huge - w_np) < 1e-2
    assert rmse[1] == pytest.approx(rmse[0], abs=1e-3)
    assert rmse[2] > rmse[0] + 0.01


def test_noisy_gram_equals_the_sum_over_perturbed_records():
    """Stats.noisy_gram(σ_u/√n) is Σ q̃q̃ᵀ for the q̃ = q + u that ipdp.losses.perturb sends."""
    n, seed = 1000, 11
    x, y = Synthetic().sample(np.random.default_rng(0), n)
    [st] = collect_stats([(x, y)], LINEAR, np.random.default_rng(seed), [n])
    cal = calibrate(mode="rigorous", epsilon=1.0, delta=0.01, n=n, d=x.shape[1], lam=1.0,
                    p_bound=1.0, eta=1.0, delta_in=0.0)
    q, p = clip(*encode("squared", x, y), 1.0, 1.0)
    q_noisy, _ = perturb(q, p, cal, np.random.default_rng(seed))
    np.testing.assert_allclose(st.noisy_gram(cal.noise_std_q), q_noisy.T @ q_noisy,
                               rtol=1e-10, atol=1e-10)


def test_pieces_end_on_every_boundary_and_respect_the_chunk():
    sizes = pieces([128, 512, 2048], chunk=1000)
    assert sizes == [128, 384, 1000, 536]
    assert sum(sizes) == 2048 and max(sizes) <= 1000


def test_rigorous_grid_keeps_contributor_noise_and_objpert_grid_keeps_kifer_ridge():
    for task in TASKS:
        for eps in (0.1, 1.0):
            for delta_in in reg_grid("IP-rigorous", task, eps):
                cal = ip_calibration("rigorous", eps, 2**21, 14, task, delta_in)
                assert cal.sigma_u2 > 0.0
            assert min(reg_grid("ObjPert-Gauss", task, eps)) == 2 * task.lam / eps
            assert min(reg_grid("IP-paper", task, eps)) > 0.0


def test_objpert_gauss_matches_kifer_by_hand():
    # ε = 1, δ = 0.01, λ = P = η = 1 ⇒ ζ = 2, σ² = 4·(8 ln 200 + 4) = 185.5461557, Δ ≥ 2.
    cal = objpert_gauss(epsilon=1.0, delta=0.01, lam=1.0, zeta=2.0)
    assert cal.delta_min == 2.0
    assert cal.sigma**2 == pytest.approx(185.5461557, rel=1e-9)
    # logistic: λ = 1/4, P = 1/2 ⇒ ζ = 3/4; ε = 0.1: σ² = 0.5625·(8 ln 200 + 0.4)/0.01, Δ ≥ 5.
    cal = objpert_gauss(epsilon=0.1, delta=0.01, lam=0.25, zeta=0.75)
    assert cal.delta_min == pytest.approx(5.0)
    assert cal.sigma**2 == pytest.approx(2406.742815, rel=1e-9)


def test_output_perturbation_laplace_matches_chaudhuri_by_hand():
    # n = 1000, Λ = 0.01, ζ = 2: sensitivity 2ζ/(nΛ) = 0.4; at ε = 0.5 the Gamma scale is 0.8.
    assert output_sensitivity(n=1000, reg=0.01, zeta=2.0) == pytest.approx(0.4)
    scale = laplace_output_scale(n=1000, reg=0.01, zeta=2.0, epsilon=0.5)
    assert scale == pytest.approx(0.8)
    rng = np.random.default_rng(0)
    norms = [np.linalg.norm(gamma_sphere(rng.standard_normal(14), rng.gamma(14), scale))
             for _ in range(20_000)]
    assert np.mean(norms) == pytest.approx(14 * 0.8, rel=0.01)  # E‖v‖ = d·scale


def test_output_perturbation_gauss_matches_the_analytic_gaussian_mechanism_by_hand():
    def delta_of(mu: float, eps: float) -> float:
        return norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * norm.cdf(-mu / 2 - eps / mu)

    for eps in (0.1, 1.0):
        mu = brentq(lambda m, e=eps: delta_of(m, e) - 0.01, 1e-3, 50.0, xtol=1e-14)
        assert analytic_gaussian_mu(eps, 0.01) == pytest.approx(mu, rel=1e-9)
    # n = 1000, Λ = 0.01, ζ = 2, ε = 1, δ = 0.01: σ = 0.4 / 0.5325166485 = 0.7511502244.
    sigma = gaussian_output_sigma(n=1000, reg=0.01, zeta=2.0, epsilon=1.0, delta=0.01)
    assert sigma == pytest.approx(0.7511502244, rel=1e-8)
    assert sigma < 0.4 * math.sqrt(2 * math.log(1.25 / 0.01))  # classical (Dwork & Roth): 1.243
