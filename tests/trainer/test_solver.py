"""Behaviour of trainer.solver: argmin_{‖w‖ ≤ η} ½wᵀHw − bᵀw, one problem or a batch."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize

from trainer.solver import Solution, solve_constrained, solve_constrained_batch

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


def test_singular_and_asymmetric_h_are_refused_with_exactly_what_is_wrong() -> None:
    with pytest.raises(ValueError) as refused:
        solve_constrained(np.array([[2.0, 1.0], [0.0, 2.0]]), np.ones(2), 1.0)
    assert str(refused.value) == ("H must be symmetric: max |H - Hᵀ| = 1 exceeds "
                                  "1e-10 × max |H| = 2e-10")
    with pytest.raises(ValueError) as refused:
        solve_constrained(np.diag([1.0, 0.0]), np.array([1.0, 0.0]), 5.0)
    assert str(refused.value) == (
        "H is singular (smallest eigenvalue 0, zero to rounding) and the constraint does not "
        "bind (‖H⁺b‖ = 1 ≤ eta = 5): the minimiser is not unique; H must be positive definite "
        "here")


# --- input types and exact cases ---------------------------------------------------------

H_INT = np.array([[100.0, 20.0], [20.0, 50.0]])  # exact in every type below
B_INT = np.array([30.0, -40.0])


@pytest.mark.parametrize("dtype", [np.int8, np.int64, np.float32, np.longdouble])
@pytest.mark.parametrize("eta", [0.1, 10.0])
def test_h_and_b_of_any_real_type_give_the_float64_answer(dtype, eta: float) -> None:
    # int8 would wrap in H + Hᵀ (100 + 100), and eigh refuses long double: both are read as
    # float64 first, so the answer is the float64 one, bit for bit, and a float64 array.
    want = solve_constrained(H_INT, B_INT, eta)
    for H, b in [(H_INT.astype(dtype), B_INT), (H_INT, B_INT.astype(dtype))]:
        sol = solve_constrained(H, b, eta)
        assert sol.w.dtype == np.float64
        assert np.array_equal(sol.w, want.w)
        assert (sol.multiplier, sol.constrained) == (want.multiplier, want.constrained)


@pytest.mark.parametrize("H", [np.zeros((2, 2)), np.diag([1.0, 0.0])])
def test_a_zero_b_with_a_singular_h_has_no_unique_minimiser(H: np.ndarray) -> None:
    # f(w) = ½wᵀHw is 0 on every null-space vector in the ball: no unique minimiser.
    with pytest.raises(ValueError, match=r"the minimiser is not unique; H must be positive "
                                         r"definite here$"):
        solve_constrained(H, np.zeros(2), 1.0)


def test_a_null_space_part_of_b_at_its_rounding_level_counts_as_zero() -> None:
    # d·eps·‖b‖ = 4.4e-13 here: 1e-14 on H's null space is rounding (the hard case, refused
    # since ‖H⁺b‖ = 1e3 ≤ η), 1e-11 is not (‖p(μ)‖ → ∞ as μ → 0⁺, so the constraint binds).
    H = np.diag([1.0, 0.0])
    with pytest.raises(ValueError, match=r"H is singular"):
        solve_constrained(H, np.array([1e3, 1e-14]), 2e3)
    sol = solve_constrained(H, np.array([1e3, 1e-11]), 2e3)
    assert_binding(H, np.array([1e3, 1e-11]), 2e3, sol)


def test_a_free_minimiser_exactly_on_the_sphere_does_not_bind() -> None:
    # ‖H⁻¹b‖ = ‖(3, 4)‖ = 5 = η exactly: μ = 0 satisfies the KKT conditions.
    sol = solve_constrained(2.0 * np.eye(2), np.array([6.0, 8.0]), 5.0)
    assert (sol.multiplier, sol.constrained) == (0.0, False)
    assert np.array_equal(sol.w, [3.0, 4.0])


def test_the_free_minimiser_never_leaves_the_ball_by_rounding() -> None:
    # η = ‖c/λ‖ exactly as the solver computes it; V·(c/λ) then rounds outside the ball in
    # some of these problems, and the solver must pull it back onto the sphere (the rescaling
    # itself rounds, so to within an ulp).
    pushed_out = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        H, b = spd(8, rng), 10.0 * rng.standard_normal(8)
        lam, V = np.linalg.eigh(H)
        free = (V.T @ b) / lam
        eta = math.hypot(*free)
        pushed_out += math.hypot(*(V @ free)) > eta
        sol = solve_constrained(H, b, eta)
        assert sol.constrained is False
        assert math.hypot(*sol.w) - eta <= math.ulp(eta)  # an ulp out at most, not 2 or more
        np.testing.assert_allclose(sol.w, np.linalg.solve(H, b), rtol=1e-12)
    assert pushed_out > 0  # else this test would not test the pull-back


def test_a_binding_solution_lies_on_the_sphere_to_the_ulp() -> None:
    for seed in range(40):
        rng = np.random.default_rng(seed)
        H, b = spd(8, rng), rng.standard_normal(8)
        eta = 0.5 * np.linalg.norm(np.linalg.solve(H, b))
        sol = solve_constrained(H, b, eta)
        assert abs(math.hypot(*sol.w) - eta) <= math.ulp(eta)


_ULP1 = math.ulp(1.0)

# Problems with an exact root: H = diag(λ), w* of integer entries and integer norm, μ* a dyadic
# number, b = (λ + μ*) w*; every one of these is exact in floating point.
EXACT_ROOTS = [
    ([1.0, 2.0], [3.0, 4.0], 3.0),
    ([0.5, 4.0], [3.0, 4.0], 0.25),
    ([1.0, 2.0, 5.0], [2.0, 3.0, 6.0], 7.0),
    ([0.0, 1.0], [3.0, 4.0], 2.0),  # singular H: Newton starts right of the root
    ([0.0, 0.0, 3.0], [1.0, 2.0, 2.0], 0.5),
    ([1e-3, 1.0, 100.0], [2.0, 3.0, 6.0], 0.125),
    ([2.0, 3.0, 4.0, 5.0], [1.0, 2.0, 2.0, 4.0], 9.0),
    ([0.0, 10.0], [5.0, 12.0], 0.0625),
]


def exact_root_problem(lam, w, mu) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    lam, w = np.array(lam), np.array(w)
    return np.diag(lam), (lam + mu) * w, math.hypot(*w), w


@pytest.mark.parametrize("lam,w,mu", EXACT_ROOTS)
def test_the_multiplier_is_the_exact_root_to_a_few_ulps(lam, w, mu) -> None:
    # Newton converges quadratically: the root to the last bits, not only to the bisection
    # tolerance 1e-14 (which would leave ~20 ulps).
    H, b, eta, w_star = exact_root_problem(lam, w, mu)
    sol = solve_constrained(H, b, eta)
    assert abs(sol.multiplier - mu) <= 4 * math.ulp(mu)
    np.testing.assert_allclose(sol.w, w_star, rtol=4 * _ULP1, atol=0)



@pytest.mark.parametrize("lam,w,mu", EXACT_ROOTS)
def test_scaling_b_and_eta_by_a_power_of_two_scales_w_exactly(lam, w, mu) -> None:
    # The minimiser of (H, s·b, s·η) is s·w with the same μ; with s = 2^±600 every step of the
    # solve scales exactly unless an intermediate overflows or underflows, which it must not.
    H, b, eta, _ = exact_root_problem(lam, w, mu)
    q, _ = np.linalg.qr(np.random.default_rng(len(lam)).standard_normal((len(lam),) * 2))
    H = (q * np.array(lam)) @ q.T
    H, b = 0.5 * (H + H.T), q @ b
    one = solve_constrained(H, b, eta)
    for s in (2.0**600, 2.0**-600):
        scaled = solve_constrained(H, s * b, s * eta)
        assert scaled.multiplier == one.multiplier
        assert np.array_equal(scaled.w, s * one.w)


def test_no_floating_point_exception_on_the_way() -> None:
    # A singular H makes ψ undefined at μ = 0; the solver must never evaluate it there (a
    # division by zero that only the final answer's rounding would hide).
    with np.errstate(all="raise"):
        for lam, w, mu in EXACT_ROOTS:
            solve_constrained(*exact_root_problem(lam, w, mu)[:3])
        solve_constrained(np.zeros((2, 2)), np.array([3.0, 4.0]), 1.0)


@pytest.mark.parametrize("alpha", [1e-3, 0.5, 2.0, 3.0])
@pytest.mark.parametrize("b", [[3.0, 4.0], [1.0, 1.0], [0.1, 0.7, 0.3]])
def test_equal_eigenvalues_give_the_closed_form_multiplier(alpha: float, b: list) -> None:
    # H = αI: ‖b‖/(α + μ) = η at μ = ‖b‖/η − α, which both ends of the bracket equal (every
    # η here is below ‖b‖/α, so the constraint binds).
    for eta in (1e-2, 0.1, 0.25):
        sol = solve_constrained(alpha * np.eye(len(b)), np.array(b), eta)
        assert sol.multiplier == math.hypot(*b) / eta - alpha


# --- the batch solver ---------------------------------------------------------------------


def test_the_batch_solver_reads_any_real_type_as_float64() -> None:
    H, b = np.stack([H_INT, H_INT]), np.stack([B_INT, -B_INT])
    want = solve_constrained_batch(H, b, 0.1)
    for dtype in (np.int8, np.int64, np.float32, np.longdouble):
        for Hx, bx in [(H.astype(dtype), b), (H, b.astype(dtype))]:
            w = solve_constrained_batch(Hx, bx, 0.1)
            assert w.dtype == np.float64
            assert np.array_equal(w, want)


@pytest.mark.parametrize(("H", "b", "eta", "message"), [
    (np.ones((1, 2, 3)), np.ones((1, 2)), 1.0,
     "need H of shape (T, d, d) and b of shape (T, d), got (1, 2, 3), (1, 2)"),
    (np.eye(2)[None], np.ones((1, 3)), 1.0,
     "need H of shape (T, d, d) and b of shape (T, d), got (1, 2, 2), (1, 3)"),
    (np.eye(2), np.ones((2, 2)), 1.0,
     "need H of shape (T, d, d) and b of shape (T, d), got (2, 2), (2, 2)"),
    (np.eye(2)[None], np.array([[1.0, np.nan]]), 1.0, "H and b must be finite"),
    (np.diag([1.0, np.inf])[None], np.ones((1, 2)), 1.0, "H and b must be finite"),
    (np.eye(2)[None], np.ones((1, 2)), 0.0, "eta must be finite and > 0, got 0.0"),
    (np.eye(2)[None], np.ones((1, 2)), -1.0, "eta must be finite and > 0, got -1.0"),
    (np.diag([-1.0, 2.0])[None], np.ones((1, 2)), 1.0, "every H must be positive definite"),
    (np.diag([0.0, 2.0])[None], np.ones((1, 2)), 1.0, "every H must be positive definite"),
])
def test_the_batch_solver_refuses_malformed_input_with_exactly_what_is_wrong(
        H, b, eta, message) -> None:
    with pytest.raises(ValueError) as refused:
        solve_constrained_batch(H, b, eta)
    assert str(refused.value) == message


def test_the_batch_solver_solves_one_dimensional_problems() -> None:
    w = solve_constrained_batch(np.array([[[2.0]], [[4.0]]]), np.array([[1.0], [10.0]]), 1.0)
    assert np.array_equal(w, [[0.5], [1.0]])


@pytest.mark.parametrize("eta", [0.1, 10.0])
def test_the_batch_solver_minimises_the_objective_of_an_asymmetric_h(eta: float) -> None:
    # wᵀHw sees only H's symmetric part, so that part's minimiser is the answer.
    H, b = np.array([[2.0, 1.0], [0.0, 2.0]]), np.array([3.0, -1.0])
    w = solve_constrained_batch(H[None], b[None], eta)[0]
    np.testing.assert_allclose(w, solve_constrained(0.5 * (H + H.T), b, eta).w, rtol=1e-14)


@pytest.mark.parametrize("eta", [0.05, 0.3, 2.0])
def test_the_batch_solver_agrees_with_the_scalar_one_to_rounding(eta: float) -> None:
    # η ≠ 1 (‖b‖/η and ‖b‖·η differ) and most problems binding, each at its own μ.
    rng = np.random.default_rng(5)
    m = rng.normal(size=(50, 5, 5))
    H = m @ m.transpose(0, 2, 1) + 0.1 * np.eye(5)
    b = 3.0 * rng.normal(size=(50, 5))
    w = solve_constrained_batch(H, b, eta)
    want = np.array([solve_constrained(H[t], b[t], eta).w for t in range(50)])
    scale = np.max(np.abs(want), axis=1, keepdims=True)
    assert np.max(np.abs(w - want) / scale) <= 1e-13


@pytest.mark.parametrize("gap", [1e-4, 1e-7, 1e-10])
def test_the_batch_solver_is_as_precise_as_the_scalar_one_where_the_constraint_just_binds(
        gap: float) -> None:
    # ‖H_t⁻¹b_t‖ = 1 for every t and η = 1 − gap: every multiplier is tiny, where a stopping
    # test relative to μ must still find the root and not stop after one step.
    rng = np.random.default_rng(8)
    m = rng.normal(size=(20, 5, 5))
    H = m @ m.transpose(0, 2, 1) + 0.1 * np.eye(5)
    x = rng.normal(size=(20, 5))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    b = np.einsum("tij,tj->ti", H, x)
    w = solve_constrained_batch(H, b, 1.0 - gap)
    want = np.array([solve_constrained(H[t], b[t], 1.0 - gap).w for t in range(20)])
    scale = np.max(np.abs(want), axis=1, keepdims=True)
    assert np.max(np.abs(w - want) / scale) <= 1e-13


def test_the_batch_solver_finds_exact_roots() -> None:
    for lam, w, mu in EXACT_ROOTS:
        if min(lam) > 0.0:  # the batch solver takes positive definite H only
            H, b, eta, w_star = exact_root_problem(lam, w, mu)
            np.testing.assert_allclose(solve_constrained_batch(H[None], b[None], eta)[0],
                                       w_star, rtol=4 * _ULP1, atol=0)
    # Several binding problems in one batch, each with its own root: w* are permutations of
    # (2, 3, 6), so one η = 7 serves all.
    problems = [([1.0, 2.0, 5.0], [2.0, 3.0, 6.0], 7.0),
                ([1e-3, 1.0, 100.0], [6.0, 2.0, 3.0], 0.125),
                ([0.5, 1.0, 3.0], [3.0, 6.0, 2.0], 1.5),
                ([2.0, 2.5, 4.0], [6.0, 3.0, 2.0], 40.0),
                ([0.25, 8.0, 9.0], [2.0, 6.0, 3.0], 0.001)]
    H = np.stack([np.diag(lam) for lam, _, _ in problems])
    b = np.array([(np.array(lam) + mu) * np.array(w) for lam, w, mu in problems])
    w_star = np.array([w for _, w, _ in problems])
    np.testing.assert_allclose(solve_constrained_batch(H, b, 7.0), w_star, rtol=8 * _ULP1, atol=0)


def test_a_binding_batch_solution_lies_on_the_sphere_to_a_few_ulps() -> None:
    # Diagonal H, so w = p exactly and ‖w‖ is the norm the final rescaling sets.
    rng = np.random.default_rng(3)
    lam = np.sort(rng.uniform(0.1, 3.0, (200, 4)), axis=1)
    b = rng.normal(size=(200, 4))
    w = solve_constrained_batch(np.stack([np.diag(x) for x in lam]), b, 0.2)
    assert max(abs(math.hypot(*row) - 0.2) for row in w) <= 4 * math.ulp(0.2)
