"""Behaviour of trainer.solver.solve_constrained: argmin_{‖w‖ ≤ η} ½wᵀHw − bᵀw."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize

from trainer.solver import Solution, solve_constrained

DIMS = [1, 2, 14, 100]
SEEDS = [0, 1, 2]


def spd(d: int, rng: np.random.Generator, cond: float = 30.0, lam_max: float = 3.0) -> np.ndarray:
    """Random symmetric positive definite (d, d) matrix with the given condition number."""
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    lam = lam_max * np.geomspace(1.0, 1.0 / cond, d) if d > 1 else np.array([lam_max])
    h = (q * lam) @ q.T
    return 0.5 * (h + h.T)


def objective(H: np.ndarray, b: np.ndarray, w: np.ndarray) -> float:
    return 0.5 * float(w @ H @ w) - float(b @ w)


def objective_gap(H: np.ndarray, b: np.ndarray, w: np.ndarray, v: np.ndarray) -> float:
    """f(v) − f(w), computed as ½δᵀHδ + (Hw − b)ᵀδ with δ = v − w.

    Evaluating f(v) and f(w) separately cancels catastrophically when ‖w‖ is large (the
    rounding error of ½wᵀHw is ~eps ‖H‖ ‖w‖²); this form is accurate to ~eps ‖∇f(w)‖ ‖δ‖.
    """
    delta = v - w
    return 0.5 * float(delta @ H @ delta) + float((H @ w - b) @ delta)


def kkt_residual(H: np.ndarray, b: np.ndarray, sol: Solution) -> float:
    return float(np.linalg.norm(H @ sol.w + sol.multiplier * sol.w - b))


def scipy_solution(H: np.ndarray, b: np.ndarray, eta: float) -> np.ndarray:
    """Independent reference: SLSQP with the smooth constraint η² − ‖w‖² ≥ 0."""
    d = b.shape[0]
    res = minimize(
        lambda w: objective(H, b, w),
        x0=np.zeros(d),
        jac=lambda w: H @ w - b,
        method="SLSQP",
        constraints=[{"type": "ineq", "fun": lambda w: eta**2 - w @ w, "jac": lambda w: -2 * w}],
        options={"ftol": 1e-15, "maxiter": 1000},
    )
    return res.x


def assert_binding(H: np.ndarray, b: np.ndarray, eta: float, sol: Solution) -> None:
    assert sol.constrained is True
    assert sol.multiplier > 0.0
    assert abs(np.linalg.norm(sol.w) - eta) <= 1e-12 * eta


# --- constraint inactive ---------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("d", DIMS)
def test_inactive_constraint_returns_unconstrained_minimiser(d: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    H, b = spd(d, rng), rng.standard_normal(d)
    x = np.linalg.solve(H, b)
    sol = solve_constrained(H, b, 2.0 * np.linalg.norm(x))
    assert isinstance(sol, Solution)
    assert sol.w.shape == (d,)
    assert sol.multiplier == 0.0
    assert sol.constrained is False
    np.testing.assert_allclose(sol.w, x, rtol=1e-11, atol=1e-12 * np.linalg.norm(x))
    assert kkt_residual(H, b, sol) <= 1e-9 * (np.linalg.norm(b) + 1)


def test_zero_b_gives_zero_w() -> None:
    H = spd(5, np.random.default_rng(3))
    sol = solve_constrained(H, np.zeros(5), 1.0)
    assert np.array_equal(sol.w, np.zeros(5))
    assert (sol.multiplier, sol.constrained) == (0.0, False)


# --- constraint binds ------------------------------------------------------------------


@pytest.mark.parametrize("shrink", [0.9, 0.3, 1e-3])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("d", DIMS)
def test_binding_constraint_satisfies_kkt(d: int, seed: int, shrink: float) -> None:
    rng = np.random.default_rng(seed)
    H, b = spd(d, rng), rng.standard_normal(d)
    eta = shrink * np.linalg.norm(np.linalg.solve(H, b))
    sol = solve_constrained(H, b, eta)
    assert_binding(H, b, eta, sol)
    assert kkt_residual(H, b, sol) <= 1e-9 * (np.linalg.norm(b) + 1)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("d", DIMS)
def test_binding_constraint_agrees_with_scipy_and_is_no_worse(d: int, seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    H, b = spd(d, rng), rng.standard_normal(d)
    eta = 0.5 * np.linalg.norm(np.linalg.solve(H, b))
    sol = solve_constrained(H, b, eta)
    assert_binding(H, b, eta, sol)

    ref = scipy_solution(H, b, eta)
    np.testing.assert_allclose(sol.w, ref, atol=1e-5 * max(eta, 1.0))
    # SLSQP may sit just outside the ball; project it back so the comparison is fair.
    ref_feasible = ref * min(1.0, eta / np.linalg.norm(ref))
    assert objective_gap(H, b, sol.w, ref_feasible) >= -1e-10


def test_binding_constraint_with_equal_eigenvalues_is_exact() -> None:
    # H = αI: the bracket collapses onto the root μ = ‖b‖/η − α.
    b = np.array([3.0, 4.0])
    sol = solve_constrained(2.0 * np.eye(2), b, 1.0)
    assert sol.multiplier == pytest.approx(3.0, rel=1e-15)
    np.testing.assert_allclose(sol.w, b / 5.0, rtol=1e-15)


@pytest.mark.parametrize("rel", [1.0 - 1e-12, 1.0 + 1e-12])
def test_solution_is_continuous_where_the_constraint_starts_binding(rel: float) -> None:
    rng = np.random.default_rng(7)
    H, b = spd(14, rng), rng.standard_normal(14)
    x = np.linalg.solve(H, b)
    sol = solve_constrained(H, b, rel * np.linalg.norm(x))
    assert sol.constrained is (rel < 1.0)
    assert 0.0 <= sol.multiplier < 1e-9
    np.testing.assert_allclose(sol.w, x, rtol=1e-9, atol=1e-9 * np.linalg.norm(x))


# --- ill-conditioned H -----------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("d", [2, 14, 100])
def test_ill_conditioned_inactive_matches_linear_solve(d: int, seed: int) -> None:
    rng = np.random.default_rng(200 + seed)
    cond = 1e8
    H, b = spd(d, rng, cond=cond, lam_max=1.0), rng.standard_normal(d)
    x = np.linalg.solve(H, b)
    sol = solve_constrained(H, b, 2.0 * np.linalg.norm(x))
    assert sol.constrained is False
    # Both solvers are backward stable; forward errors are O(cond · eps).
    assert np.linalg.norm(sol.w - x) <= 1e-13 * cond * np.linalg.norm(x)
    # Residuals have an O(eps ‖H‖ ‖w‖) floor in double precision, whoever computes w.
    assert kkt_residual(H, b, sol) <= 1e-13 * (np.linalg.norm(H, 2) * np.linalg.norm(x) + 1)


@pytest.mark.parametrize("shrink", [0.5, 1e-4])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("d", [2, 14, 100])
def test_ill_conditioned_binding_is_optimal(d: int, seed: int, shrink: float) -> None:
    rng = np.random.default_rng(300 + seed)
    H, b = spd(d, rng, cond=1e8, lam_max=1.0), rng.standard_normal(d)
    eta = shrink * np.linalg.norm(np.linalg.solve(H, b))
    sol = solve_constrained(H, b, eta)
    assert_binding(H, b, eta, sol)
    norm_A = np.linalg.norm(H, 2) + sol.multiplier
    assert kkt_residual(H, b, sol) <= 1e-13 * (norm_A * eta + np.linalg.norm(b))
    ref = scipy_solution(H, b, eta)
    ref_feasible = ref * min(1.0, eta / np.linalg.norm(ref))
    # |f| reaches 1e8 here; ‖w‖ itself is only exact to an ulp, which moves f by ~eps μ η².
    scale = abs(objective(H, b, sol.w)) + 1.0
    assert objective_gap(H, b, sol.w, ref_feasible) >= -1e-10 * scale


# --- positive semi-definite H ----------------------------------------------------------


def psd(d: int, rng: np.random.Generator, rank: int) -> np.ndarray:
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    lam = np.concatenate([np.zeros(d - rank), rng.uniform(0.5, 3.0, rank)])
    h = (q * lam) @ q.T
    return 0.5 * (h + h.T)


@pytest.mark.parametrize("eta", [1e-3, 0.5, 10.0, 1e4])
@pytest.mark.parametrize("d,rank", [(1, 0), (2, 1), (14, 10), (100, 60)])
def test_psd_h_binds_when_b_reaches_the_null_space(d: int, rank: int, eta: float) -> None:
    rng = np.random.default_rng(d + rank)
    H, b = psd(d, rng, rank), rng.standard_normal(d)  # b has components on all eigenvectors
    sol = solve_constrained(H, b, eta)
    assert_binding(H, b, eta, sol)
    assert kkt_residual(H, b, sol) <= 1e-9 * (np.linalg.norm(b) + 1)
    ref = scipy_solution(H, b, eta)
    ref_feasible = ref * min(1.0, eta / np.linalg.norm(ref))
    # |f| reaches 1e8 here; ‖w‖ itself is only exact to an ulp, which moves f by ~eps μ η².
    scale = abs(objective(H, b, sol.w)) + 1.0
    assert objective_gap(H, b, sol.w, ref_feasible) >= -1e-10 * scale


def test_psd_h_binds_when_b_is_in_the_range_but_pinv_solution_is_outside() -> None:
    rng = np.random.default_rng(11)
    H = psd(14, rng, 10)
    b = H @ rng.standard_normal(14)  # no null-space component
    eta = 0.5 * np.linalg.norm(np.linalg.pinv(H) @ b)
    sol = solve_constrained(H, b, eta)
    assert_binding(H, b, eta, sol)
    assert kkt_residual(H, b, sol) <= 1e-9 * (np.linalg.norm(b) + 1)


def test_psd_hard_case_is_rejected_as_singular() -> None:
    rng = np.random.default_rng(12)
    H = psd(14, rng, 10)
    b = H @ rng.standard_normal(14)  # no null-space component, ‖H⁺b‖ < η: not unique
    eta = 2.0 * np.linalg.norm(np.linalg.pinv(H) @ b)
    with pytest.raises(ValueError, match=r"H is singular \(smallest eigenvalue .*not unique"):
        solve_constrained(H, b, eta)


# --- property: no feasible point does better -------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    d=st.integers(1, 8),
    log_cond=st.floats(0.0, 8.0),
    log_eta=st.floats(-4.0, 3.0),
)
def test_no_feasible_point_beats_the_solution(
    seed: int, d: int, log_cond: float, log_eta: float
) -> None:
    rng = np.random.default_rng(seed)
    H, b = spd(d, rng, cond=10.0**log_cond, lam_max=1.0), rng.standard_normal(d)
    eta = 10.0**log_eta
    sol = solve_constrained(H, b, eta)
    assert np.linalg.norm(sol.w) <= eta * (1 + 1e-12)
    assert sol.multiplier >= 0.0
    assert sol.constrained == (sol.multiplier > 0.0)
    if sol.constrained:
        assert abs(np.linalg.norm(sol.w) - eta) <= 1e-12 * eta
    tol = 1e-12 * (abs(objective(H, b, sol.w)) + 1.0)
    # Random feasible points, and small feasible perturbations of the solution.
    pts = rng.standard_normal((200, d))
    pts *= (eta * rng.uniform(0, 1, (200, 1)) ** (1 / d)) / np.linalg.norm(pts, axis=1)[:, None]
    near = sol.w + 1e-3 * eta * rng.standard_normal((200, d))
    near *= np.minimum(1.0, eta / np.linalg.norm(near, axis=1))[:, None]
    for v in np.vstack([pts, near]):
        assert objective_gap(H, b, sol.w, v) >= -tol


# --- invalid input ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "H,b,eta,message",
    [
        (np.ones((2, 3)), np.ones(2), 1.0, r"H must be a non-empty square 2-D matrix"),
        (np.ones(3), np.ones(3), 1.0, r"H must be a non-empty square 2-D matrix"),
        (np.zeros((0, 0)), np.zeros(0), 1.0, r"H must be a non-empty square 2-D matrix"),
        (np.eye(3), np.ones(2), 1.0, r"b must have shape \(3,\)"),
        (np.eye(3), np.ones((3, 1)), 1.0, r"b must have shape \(3,\)"),
        (np.array([[2.0, 1.0], [0.0, 2.0]]), np.ones(2), 1.0, r"H must be symmetric"),
        (np.array([[1.0, np.nan], [np.nan, 1.0]]), np.ones(2), 1.0, r"H must be finite"),
        (np.diag([np.inf, 1.0]), np.ones(2), 1.0, r"H must be finite"),
        (np.eye(2), np.array([1.0, np.nan]), 1.0, r"b must be finite"),
        (np.eye(2), np.ones(2), 0.0, r"eta must be finite and > 0"),
        (np.eye(2), np.ones(2), -1.0, r"eta must be finite and > 0"),
        (np.eye(2), np.ones(2), np.nan, r"eta must be finite and > 0"),
        (np.eye(2), np.ones(2), "big", r"eta must be a real number"),
        (
            np.diag([2.0, -0.75]),
            np.ones(2),
            1.0,
            r"H must be positive definite: its smallest eigenvalue is -0\.75 < 0",
        ),
    ],
)
def test_invalid_input_is_rejected_with_a_clear_message(H, b, eta, message) -> None:
    with pytest.raises(ValueError, match=message):
        solve_constrained(H, b, eta)


def test_symmetry_is_checked_relative_to_scale() -> None:
    H = 1e6 * np.array([[2.0, 1.0], [1.0 + 1e-12, 2.0]])  # asymmetry 1e-12 relative: accepted
    sol = solve_constrained(H, np.ones(2), 1.0)
    assert sol.constrained is False
    with pytest.raises(ValueError, match=r"H must be symmetric"):
        solve_constrained(H + np.array([[0.0, 1e-3], [0.0, 0.0]]), np.ones(2), 1.0)


def test_singular_h_with_inactive_constraint_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"H is singular"):
        solve_constrained(np.diag([1.0, 0.0]), np.array([1.0, 0.0]), 5.0)


@pytest.mark.parametrize(("H", "b", "eta", "message"), [
    (np.array([[1.0, np.nan], [np.nan, 1.0]]), np.ones(2), 1.0,
     "H must be finite (it contains NaN or inf)"),
    (np.eye(2), np.array([1.0, np.nan]), 1.0, "b must be finite (it contains NaN or inf)"),
    (np.eye(2), np.array([1e300, 1e300]), 1e-300, ("eta = 1e-300 is too small relative to "
                                                   "‖b‖ = 1.41421e+300")),
])
def test_non_finite_input_and_a_vanishing_eta_are_refused_with_exactly_what_is_wrong(
        H, b, eta, message) -> None:
    with pytest.raises(ValueError) as refused:
        solve_constrained(H, b, eta)
    assert str(refused.value) == message
