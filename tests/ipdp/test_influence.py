"""Bounded influence (docs/security.md) and the norm check's false-rejection rate
(docs/privacy.md, "The norm check"), with the device's own noise."""

from __future__ import annotations

import numpy as np
import pytest

from bench.influence import SCENARIOS, accepted_rows, crafted, model
from ipdp.calibration import noisy_norm_rejection, record_norm_bounds
from ipdp.influence import influence_bound
from ipdp.losses import prepare
from ipdp.study import Study
from producer.datasets import synthetic


def _honest_round(study: Study, seed: int) -> tuple[np.ndarray, np.ndarray]:
    data = synthetic(study.n, study.d, "squared", seed=seed)
    return prepare("squared", data.x, data.y, study.calibration, np.random.default_rng(seed))


@pytest.mark.parametrize(("n", "d", "delta_in", "k"), [
    (1000, 14, None, 1), (10_000, 14, None, 1),  # the default study: Step 8 chooses Δ_in
    (1000, 4, 50.0, 1), (1000, 4, 50.0, 10), (1000, 14, 100.0, 1), (1000, 14, 100.0, 10)])
def test_k_accepted_records_move_the_model_no_further_than_the_bound(n, d, delta_in, k):
    # Where docs/security.md says the bound is useful: one record by default, ten with a ridge.
    study = Study(study_id="influence", d=d, n=n, epsilon=1.0, delta=0.01, delta_in=delta_in)
    cal = study.calibration
    bound = influence_bound(cal, k)
    assert bound < 2.0 * cal.eta  # not vacuous: the ball's diameter bounds any move
    worst = 0.0
    for seed in range(5):
        q, p = _honest_round(study, seed)
        w0 = model(cal, q, p)
        keep_q, keep_p = q[k:], p[k:]
        for scenario in SCENARIOS[1:]:
            new_q, new_p = crafted(scenario, k, cal, w0, keep_q.T @ keep_q)
            ok = accepted_rows(study, new_q, new_p)
            if scenario != "noise-free":
                assert ok.all(), scenario  # the attack uses only what the checks accept
            w = model(cal, np.concatenate([keep_q, new_q[ok]]), np.concatenate([keep_p, new_p[ok]]))
            worst = max(worst, float(np.linalg.norm(w - w0)))
    assert 0.0 < worst <= bound


@pytest.mark.parametrize(("n", "delta_in", "most"), [
    (1000, None, 5), (10_000, None, 4), (10**6, None, 5),
    (1000, 0.0, 1), (10_000, 0.0, 3), (10**6, 0.0, 4)])
def test_the_bound_says_something_for_at_most_a_few_records(n, delta_in, most):
    # docs/security.md: how far k goes by default and without a ridge (d = 14, ε = 1).
    cal = Study(study_id="influence", d=14, n=n, epsilon=1.0, delta=0.01,
                delta_in=delta_in).calibration
    assert influence_bound(cal, most) < 2.0 * cal.eta <= influence_bound(cal, most + 1)


@pytest.mark.parametrize("delta_in", [None, 0.0])
def test_for_ten_records_the_bound_says_nothing_by_default_or_without_a_ridge(delta_in):
    # docs/security.md: the noise and Step 8's ridge lift the honest curvature to 8–25 at these
    # sizes, too little against ten records' 10·Γ.
    for n in (1000, 10_000, 10**6):
        cal = Study(study_id="influence", d=14, n=n, epsilon=1.0, delta=0.01,
                    delta_in=delta_in).calibration
        assert influence_bound(cal, 10) > 2.0 * cal.eta


@pytest.mark.parametrize("clean_norm", [0.0, 1.0])
def test_honest_records_are_rejected_at_the_exact_rate_the_bounds_imply(clean_norm):
    # The worst clean records (at 0 for the lower tails, at the clipping bound for the upper
    # ones), perturbed by the device code with its OS noise, against bounds at a deliberately
    # loose rate π = 0.02 so that rejections are frequent enough to count.
    study = Study(study_id="rate", d=14, n=1000, epsilon=1.0, delta=0.01)
    cal, draws, rate = study.calibration, 200_000, 0.02
    bounds = record_norm_bounds(cal, probability=rate)
    x = np.zeros((draws, study.d))
    x[:, 0] = clean_norm
    q, p = prepare("squared", x, np.ones(draws), cal)
    norm_q, norm_p = np.linalg.norm(q, axis=1), np.linalg.norm(p, axis=1)
    rejected = ((norm_q < bounds.q_low) | (norm_q > bounds.q_high)
                | (norm_p < bounds.p_low) | (norm_p > bounds.p_high)).mean()
    rho_q = noisy_norm_rejection(cal.noise_std_q, study.d, clean_norm * np.sqrt(cal.lam),
                                 bounds.q_low, bounds.q_high)
    rho_p = noisy_norm_rejection(cal.noise_std_p, study.d, clean_norm * cal.p_bound,
                                 bounds.p_low, bounds.p_high)
    exact = 1.0 - (1.0 - rho_q) * (1.0 - rho_p)
    assert rate / 4 < exact <= rate  # each worst case spends at least one tail's π/4
    assert abs(rejected - exact) <= 5.0 * np.sqrt(exact * (1.0 - exact) / draws)


@pytest.mark.parametrize("delta_in", [None, 100.0])  # 100: a ridge so large that σ_u = 0
def test_the_aggregator_accepts_every_one_of_many_honest_records_at_the_default_rate(delta_in):
    study = Study(study_id="rate", d=14, n=1000, epsilon=1.0, delta=0.01, delta_in=delta_in)
    assert record_norm_bounds(study.calibration).probability < 1e-8
    data = synthetic(100_000, study.d, "squared", seed=3)
    q, p = prepare("squared", data.x, data.y, study.calibration)
    assert accepted_rows(study, q, p).all()
