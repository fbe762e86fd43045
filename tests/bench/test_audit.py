"""The empirical privacy audit and the batched solver it runs the trainer's solve with."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from bench.audit import add_arguments, audit, clopper_pearson, run, worst_case_neighbours
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
    for pair in worst_case_neighbours(64, 3, lam=1.0, p_bound=1.0, eta=1.0):
        (q, p), (q2, p2) = pair.rows(False), pair.rows(True)
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
