"""The empirical privacy audit and the batched solver it runs the trainer's solve with."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from scipy.stats import ks_2samp

from aggregator.fold import OpenRound, fill_rounds
from bench.audit import (
    Mechanism,
    _Noise,
    add_arguments,
    audit,
    clopper_pearson,
    exact_fold,
    label_flip_neighbours,
    mechanism_for,
    record_fold,
    run,
    two_server_fold,
    worst_case_neighbours,
)
from bench.baselines import analytic_gaussian_mu, kang2020_descent, kang2020_proof_c, kang2020_sigma
from ipdp.losses import perturb
from ipdp.study import Study
from trainer.solver import solve_constrained, solve_constrained_batch

AUDIT = {"epsilon": 2.0, "delta": 0.01, "d": 2, "n": 512, "trials": 20_000}


def _problems(rng: np.random.Generator, t: int, d: int, b_scale: float):
    m = rng.normal(size=(t, d, d))
    h = m @ m.transpose(0, 2, 1) * rng.uniform(0.01, 3.0, size=(t, 1, 1)) + 1e-3 * np.eye(d)
    return h, rng.normal(size=(t, d)) * b_scale


@pytest.mark.parametrize(("d", "b_scale"), [(2, 0.05), (5, 1.0), (14, 30.0)])
def test_batched_solver_equals_the_trainers_solver(d, b_scale):
    h, b = _problems(np.random.default_rng(d), 300, d, b_scale)
    batch = solve_constrained_batch(h, b, 1.0)
    single = np.array([solve_constrained(h[t], b[t], 1.0).w for t in range(len(b))])
    np.testing.assert_allclose(batch, single, rtol=1e-10, atol=1e-12)


def test_batched_solver_handles_active_and_inactive_constraints_together():
    h = np.stack([np.eye(3) * 10.0, np.eye(3) * 0.01])
    b = np.array([[1.0, 0.0, 0.0], [0.0, 5.0, 0.0]])
    w = solve_constrained_batch(h, b, 1.0)
    np.testing.assert_allclose(w[0], [0.1, 0.0, 0.0])
    np.testing.assert_allclose(w[1], [0.0, 1.0, 0.0])


def test_batched_solver_refuses_an_indefinite_hessian():
    with pytest.raises(ValueError, match="positive definite"):
        solve_constrained_batch(-np.eye(2)[None], np.ones((1, 2)), 1.0)


def test_neighbours_differ_in_exactly_one_record_at_the_clipping_bounds():
    for pair in [*worst_case_neighbours(64, 3, lam=1.0, p_bound=1.0, eta=1.0),
                 *label_flip_neighbours(64, 3, lam=1.0)]:
        (q, p, _), (q2, p2, _) = pair.rows(False), pair.rows(True)
        differ = np.flatnonzero(np.any(q != q2, axis=1) | np.any(p != p2, axis=1))
        assert differ.tolist() == [63]
        assert np.all(np.sum(q**2, axis=1) <= 1.0 + 1e-12)
        assert np.all(np.linalg.norm(p, axis=1) <= 1.0 + 1e-12)


def test_clopper_pearson_bounds_bracket_the_frequency():
    lower, upper = clopper_pearson(50, 1000, 0.025)
    assert lower < 0.05 < upper
    assert clopper_pearson(0, 100, 0.025)[0] == 0.0


def test_audit_finds_no_violation_of_the_default_calibration():
    result = audit(**AUDIT, seed=1)
    assert result.epsilon_lower_bound <= result.claimed_epsilon


def test_audit_refutes_a_mechanism_with_a_third_of_the_noise():
    result = audit(**AUDIT, noise_scale=0.3, seed=2)
    assert result.epsilon_lower_bound > result.claimed_epsilon


def test_audit_command_prints_one_json_line_with_the_documented_keys(capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--epsilon", "1", "--delta", "0.01", "--d", "2", "--n", "256",
                              "--trials", "2000", "--seed", "4", "--json"])
    assert run(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert {"claimed_epsilon", "epsilon_lower_bound", "delta", "trials"} <= result.keys()
    assert result["trials"] == 2000 and result["neighbouring"] == "replace-one"
    assert {"pair", "region", "interval"} <= result.keys()
    assert result["pair"]["name"] == result["scenario"]
    assert 0.0 <= result["interval"]["p1_lower"] <= 1.0 and 0.0 < result["interval"]["p0_upper"]


@pytest.mark.parametrize("name", ["ipdp", "kang2020"])
@pytest.mark.parametrize("wrong", [False, True])
def test_the_exact_fold_has_the_distribution_of_the_record_fold(name, wrong):
    # A pair with three groups of equal records and the differing one: every entry of A and b
    # from the exact law against n noisy records each; `wrong` drops a tenth of the feature noise.
    n, d, k = 64, 2, 4000
    pair = (label_flip_neighbours(n, d, 1.0) if name == "kang2020"
            else worst_case_neighbours(n, d, 1.0, 1.0, 1.0))[0]
    mech = Mechanism(name, 0.3, 0.2, 1.0, strong_convexity=0.01)
    exact_mech = Mechanism(name, 0.3 * (0.9 if wrong else 1.0), 0.2, 1.0, strong_convexity=0.01)
    a, b = record_fold(mech, *pair.rows(False), k, np.random.default_rng(5))
    a2, b2 = exact_fold(exact_mech, *pair.rows(False), k, np.random.default_rng(6))
    p_values = [ks_2samp(a[:, i, j], a2[:, i, j]).pvalue for i, j in ((0, 0), (0, 1), (1, 1))]
    p_values += [ks_2samp(b[:, i], b2[:, i]).pvalue for i in range(d)]
    assert (min(p_values) < 1e-3) == wrong, p_values


def test_the_record_fold_sums_what_the_aggregators_fold_sums_of_the_devices_records():
    """The audit's record fold is the deployed path: the devices' noise (ipdp.losses.perturb),
    then the sums the aggregator folds a round into (aggregator.fold.fill_rounds)."""
    n, d, k = 4096, 2, 3
    q, p, t = worst_case_neighbours(n, d, 1.0, 1.0, 1.0)[0].rows(True)
    a, b = record_fold(Mechanism("ipdp", 0.3, 0.2, 1.0), q, p, t, k, np.random.default_rng(9))
    q_noisy, p_noisy = perturb(np.broadcast_to(q, (k, n, d)), np.broadcast_to(p, (k, n, d)),
                               _Noise(0.3, 0.2), np.random.default_rng(9))
    study = Study(study_id="audit", n=n, d=d, epsilon=1.0, delta=0.01)
    for trial in range(k):
        filled = fill_rounds(study, OpenRound(1, 0, np.zeros((d, d)), np.zeros(d)),
                             q_noisy[trial], p_noisy[trial])
        (closed,) = filled.closed
        np.testing.assert_allclose(a[trial], closed.a, rtol=1e-12)
        np.testing.assert_allclose(b[trial], closed.b, rtol=1e-12)


EXACT = {"epsilon": 1.0, "delta": 0.01, "d": 2, "n": 8192, "trials": 20_000, "exact_fold": True}


def test_exact_fold_audit_sees_the_guarantee_and_catches_under_noising():
    fair = audit(**EXACT, seed=1)
    assert 0.2 < fair.epsilon_lower_bound <= fair.claimed_epsilon
    assert audit(**EXACT, noise_scale=0.4, seed=2).epsilon_lower_bound > 1.0


def test_the_audit_refutes_kang_et_al_at_c_one_and_names_the_c_a_proof_needs():
    result = audit(**EXACT, mechanism="kang2020", c=1.0, seed=4)
    assert result.epsilon_lower_bound > result.claimed_epsilon
    assert result.kang_proof_c > 1e4


def test_kang_proof_c_makes_the_label_flip_a_gaussian_mechanism_at_the_claimed_epsilon():
    params = {"lipschitz": 2.0, "steps": 50, "delta": 0.01, "n": 512, "strong_convexity": 0.01,
              "epsilon": 1.0}
    c = kang2020_proof_c(lam=0.25, **params)
    sigma = kang2020_sigma(c=c, **params)
    assert 2.0 * 0.5 / sigma == pytest.approx(analytic_gaussian_mu(1.0, 0.01), rel=1e-9)
    assert kang2020_proof_c(lam=0.25, **{**params, "n": 1024}) == pytest.approx(
        c * 1024 * 1023 / (512 * 511))  # grows like n²


def test_kang_descent_reaches_the_constrained_minimiser():
    h, b = _problems(np.random.default_rng(7), 50, 3, 1.0)
    n, ridge = 10, 0.5
    w = kang2020_descent(h, b, n=n, strong_convexity=ridge, eta=1.0, steps=3000)
    exact = solve_constrained_batch(h / n + ridge * np.eye(3), b / n, 1.0)
    np.testing.assert_allclose(w, exact, atol=1e-6)


def test_the_two_server_audit_sees_the_guarantee_and_catches_under_noising():
    fair = audit(**AUDIT, two_server=True, seed=1)
    assert fair.two_server and fair.epsilon_lower_bound <= fair.claimed_epsilon
    assert audit(**AUDIT, two_server=True, noise_scale=0.3, seed=2).epsilon_lower_bound > 2.0


@pytest.mark.parametrize("wrong", [False, True])
def test_the_two_server_fold_has_the_law_of_the_one_server_fold_up_to_the_grid(wrong):
    # Every entry of A and b through encoding, shares, sums mod 2⁶⁴, decoding and dither, against
    # the real-valued record fold at the same σ_u and σ_b; `wrong` drops a tenth of the noise.
    n, d, k = 64, 2, 4000
    pair = worst_case_neighbours(n, d, 1.0, 1.0, 1.0)[0]
    params = {"mechanism": "ipdp", "epsilon": 2.0, "delta": 0.01, "d": d, "n": n, "mode":
              "rigorous", "lam": 1.0, "p_bound": 1.0, "eta": 1.0, "delta_in": None, "c": 1.0,
              "strong_convexity": 0.0}
    two = mechanism_for(**params, noise_scale=0.9 if wrong else 1.0, two_server=True)
    claimed = mechanism_for(**params, noise_scale=1.0, two_server=True)
    one = Mechanism("ipdp", claimed.std_q, claimed.std_p, 1.0)
    a, b = record_fold(one, *pair.rows(False), k, np.random.default_rng(5))
    a2, b2 = two_server_fold(two, *pair.rows(False), k, np.random.default_rng(6))
    p_values = [ks_2samp(a[:, i, j], a2[:, i, j]).pvalue for i, j in ((0, 0), (0, 1), (1, 1))]
    p_values += [ks_2samp(b[:, i], b2[:, i]).pvalue for i in range(d)]
    assert (min(p_values) < 1e-3) == wrong, p_values
