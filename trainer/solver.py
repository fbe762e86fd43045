"""Exact solver for the norm-constrained quadratic the trainer minimises each round.

Problem (d = dimension)::

    w* = argmin_{‖w‖₂ ≤ η}  ½ wᵀ H w − bᵀ w,   H ∈ R^{d×d} symmetric, b ∈ R^d, η > 0.

KKT conditions: there is a multiplier μ ≥ 0 with

    (H + μ I) w = b,   ‖w‖ ≤ η,   μ (‖w‖ − η) = 0.

Method. Diagonalise H = V diag(λ) Vᵀ once (``np.linalg.eigh``; V: (d, d) orthogonal,
λ: (d,) ascending) and set c = Vᵀ b, shape (d,). Then for every μ ≥ 0

    w(μ) = V p(μ),   p(μ) = c / (λ + μ)  (elementwise),   ‖w(μ)‖ = ‖p(μ)‖,

so the whole problem reduces to the scalar secular equation ‖p(μ)‖ = η:

* if H is positive definite and ‖c/λ‖ ≤ η the constraint is inactive: w = H⁻¹b, μ = 0;
* otherwise ‖p(μ)‖ is strictly decreasing on μ > 0 and the root μ* > 0 lies in
  [max(0, ‖b‖/η − λ_max), ‖b‖/η − λ_min] (because ‖b‖/(λ_max+μ) ≤ ‖p(μ)‖ ≤ ‖b‖/(λ_min+μ)).
  It is found by Newton's method on ψ(μ) = 1/‖p(μ)‖ − 1/η (Moré & Sorensen, 1983), which is
  concave and nearly linear, safeguarded by bisection on the bracket, to relative
  tolerance 1e-14; w = V p(μ*) is finally rescaled to norm exactly η.

H may be positive *semi*-definite when the constraint binds: if b has a component on the
null space of H then ‖p(μ)‖ → ∞ as μ → 0⁺ and the root exists; if it has none and the
minimum-norm solution H⁺b lies inside the ball (the trust-region "hard case") the minimiser
is not unique and a ValueError is raised.

Why an eigendecomposition: it is exact (no iterative linear solves), d is at most ~1000
here, and it costs one O(d³) factorisation per round after which every μ costs O(d).
Norms are ``math.hypot``'s, which neither overflows nor underflows in the squares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Solution", "solve_constrained", "solve_constrained_batch"]

_SYMMETRY_RTOL = 1e-10
_MU_RTOL = 1e-14
# Enough halvings to shrink any finite double bracket to relative width _MU_RTOL, so the loop
# terminates even if every Newton step were rejected; Newton normally needs < 10 iterations.
_MAX_ITER = 2200
_EPS = float(np.finfo(float).eps)


@dataclass(frozen=True)
class Solution:
    """Minimiser of ½ wᵀHw − bᵀw over ‖w‖₂ ≤ η.

    w: the minimiser, shape (d,).
    multiplier: KKT multiplier μ ≥ 0 of the norm constraint, (H + μI) w = b, μ(‖w‖ − η) = 0.
    constrained: True when the constraint binds (‖w‖ = η and μ > 0).
    """

    w: np.ndarray
    multiplier: float
    constrained: bool


def _validate(H, b, eta) -> tuple[np.ndarray, np.ndarray, float]:
    H = np.asarray(H, dtype=float)
    b = np.asarray(b, dtype=float)
    if H.ndim != 2 or H.shape[0] != H.shape[1] or H.shape[0] == 0:
        raise ValueError(f"H must be a non-empty square 2-D matrix, got shape {H.shape}")
    d = H.shape[0]
    if b.shape != (d,):
        raise ValueError(f"b must have shape ({d},) to match H, got shape {b.shape}")
    if not np.all(np.isfinite(H)):
        raise ValueError("H must be finite (it contains NaN or inf)")
    if not np.all(np.isfinite(b)):
        raise ValueError("b must be finite (it contains NaN or inf)")
    scale = float(np.max(np.abs(H)))
    asym = float(np.max(np.abs(H - H.T)))
    if asym > _SYMMETRY_RTOL * scale:
        raise ValueError(
            f"H must be symmetric: max |H - Hᵀ| = {asym:.3g} exceeds "
            f"{_SYMMETRY_RTOL:g} × max |H| = {_SYMMETRY_RTOL * scale:.3g}"
        )
    try:
        eta = float(eta)
    except (TypeError, ValueError):
        raise ValueError(f"eta must be a real number, got {eta!r}") from None
    if not (np.isfinite(eta) and eta > 0.0):
        raise ValueError(f"eta must be finite and > 0, got {eta!r}")
    return 0.5 * (H + H.T), b, eta


def solve_constrained(H: np.ndarray, b: np.ndarray, eta: float) -> Solution:
    """Exact minimiser of ½ wᵀHw − bᵀw subject to ‖w‖₂ ≤ eta.

    H: (d, d) symmetric positive definite (positive semi-definite is accepted when the
    constraint binds and b has a component on H's null space); b: (d,); eta > 0.
    Returns a :class:`Solution`. Raises ValueError on malformed input, on an H with a
    negative eigenvalue, and on a singular H whose minimiser is not unique.
    See the module docstring for the method.
    """
    H, b, eta = _validate(H, b, eta)
    d = H.shape[0]

    lam, V = np.linalg.eigh(H)  # ascending eigenvalues, orthonormal columns
    # Eigenvalues within rounding of zero (relative to ‖H‖₂) are treated as exact zeros.
    lam_tol = d * _EPS * float(np.max(np.abs(lam)))
    lam_min = float(lam[0])
    if lam_min < -lam_tol:
        raise ValueError(
            f"H must be positive definite: its smallest eigenvalue is {lam_min:.6g} < 0"
        )
    lam = lam.copy()
    null = lam <= lam_tol
    lam[null] = 0.0

    c = V.T @ b
    c_norm = math.hypot(*c)
    singular = bool(np.any(null))
    if singular:
        # Components of c on the null space below the rounding level of Vᵀb are zero.
        if math.hypot(*c[null]) <= d * _EPS * c_norm:
            c[null] = 0.0
            c_norm = math.hypot(*c)
            range_ = ~null
            free_norm = math.hypot(*(c[range_] / lam[range_]))  # ‖H⁺b‖
        else:
            free_norm = np.inf  # ‖p(μ)‖ → ∞ as μ → 0⁺
    else:
        free_norm = math.hypot(*(c / lam))  # ‖H⁻¹b‖

    if free_norm <= eta:
        if singular:
            raise ValueError(
                f"H is singular (smallest eigenvalue {lam_min:.3g}, zero to rounding) and "
                f"the constraint does not bind (‖H⁺b‖ = {free_norm:.6g} ≤ eta = {eta:.6g}): "
                "the minimiser is not unique; H must be positive definite here"
            )
        w = V @ (c / lam)
        wn = math.hypot(*w)
        if wn > eta:  # ‖c/λ‖ ≤ η but rounding in V·(c/λ) pushed it out by an ulp or so
            w *= eta / wn
        return Solution(w=w, multiplier=0.0, constrained=False)

    mu = _secular_root(lam, c, c_norm, eta)
    w = V @ (c / (lam + mu))
    wn = math.hypot(*w)
    if wn != eta:
        w *= eta / wn
    return Solution(w=w, multiplier=float(mu), constrained=True)


def _secular_root(lam: np.ndarray, c: np.ndarray, c_norm: float, eta: float) -> float:
    """Root μ > 0 of ‖c/(λ+μ)‖ = η, given λ ≥ 0 and that ‖c/(λ+μ)‖ > η as μ → 0⁺."""
    lam_min, lam_max = float(lam[0]), float(lam[-1])
    hi = c_norm / eta - lam_min
    if not np.isfinite(hi):
        raise ValueError(f"eta = {eta:g} is too small relative to ‖b‖ = {c_norm:g}")
    lo = max(0.0, c_norm / eta - lam_max)
    if hi <= lo:  # all eigenvalues equal: the bounds coincide with the root
        return hi
    # ψ(μ) is concave increasing, so Newton from the left of the root stays left and
    # converges monotonically; start at lo unless ψ(lo) is undefined (λ_min = 0, μ = 0).
    mu = lo if (lo > 0.0 or lam_min > 0.0) else hi
    for _ in range(_MAX_ITER):
        den = lam + mu
        p = c / den
        q = math.hypot(*p)
        if q == eta:
            return mu
        if q > eta:
            lo = mu
        else:
            hi = mu
        # Newton on ψ(μ) = 1/‖p‖ − 1/η:  δ = (‖p‖/η − 1) ‖p‖² / Σ p²/(λ+μ),
        # evaluated on p/max|p| to avoid overflow.
        r = p / np.max(np.abs(p))
        step = (q / eta - 1.0) * float(np.dot(r, r)) / float(np.dot(r, r / den))
        new = mu + step
        if np.isfinite(new) and lo <= new <= hi and abs(step) <= _MU_RTOL * mu:
            return new
        if not (np.isfinite(new) and lo < new < hi):
            new = 0.5 * (lo + hi)
        if hi - lo <= _MU_RTOL * hi:
            return new
        mu = new
    return mu


def solve_constrained_batch(H: np.ndarray, b: np.ndarray, eta: float) -> np.ndarray:
    """Minimisers of ½ wᵀH_t w − b_tᵀw over ‖w‖₂ ≤ eta for T problems at once.

    H: (T, d, d) symmetric positive definite; b: (T, d); returns w: (T, d). The method of
    :func:`solve_constrained` (one batched eigendecomposition, then the secular equation by
    safeguarded Newton on every binding problem in lockstep), for audits and benchmarks that
    solve many small problems; malformed or singular input raises ValueError.
    """
    H = np.asarray(H, dtype=float)
    b = np.asarray(b, dtype=float)
    if H.ndim != 3 or H.shape[1] != H.shape[2] or b.shape != H.shape[:2]:
        raise ValueError(f"need H of shape (T, d, d) and b of shape (T, d), got {H.shape}, {b.shape}")
    if not (np.all(np.isfinite(H)) and np.all(np.isfinite(b))):
        raise ValueError("H and b must be finite")
    eta = float(eta)
    if not (np.isfinite(eta) and eta > 0.0):
        raise ValueError(f"eta must be finite and > 0, got {eta!r}")
    lam, V = np.linalg.eigh(0.5 * (H + np.swapaxes(H, 1, 2)))
    if np.any(lam[:, 0] <= 0.0):
        raise ValueError("every H must be positive definite")
    c = np.einsum("tji,tj->ti", V, b)
    free = c / lam
    binding = np.linalg.norm(free, axis=1) > eta
    p = free
    if np.any(binding):
        lb, cb = lam[binding], c[binding]
        c_norm = np.linalg.norm(cb, axis=1)
        lo = np.maximum(0.0, c_norm / eta - lb[:, -1])
        hi = c_norm / eta - lb[:, 0]
        mu = lo.copy()
        for _ in range(_MAX_ITER):
            pm = cb / (lb + mu[:, None])
            q = np.linalg.norm(pm, axis=1)
            lo = np.where(q > eta, mu, lo)
            hi = np.where(q > eta, hi, mu)
            step = (q / eta - 1.0) * np.sum(pm**2, axis=1) / np.sum(pm**2 / (lb + mu[:, None]),
                                                                        axis=1)
            new = mu + step
            new = np.where((new > lo) & (new < hi), new, 0.5 * (lo + hi))
            done = (np.abs(new - mu) <= _MU_RTOL * np.maximum(new, _EPS)) | (hi - lo <= 0.0)
            mu = new
            if np.all(done):
                break
        pm = cb / (lb + mu[:, None])
        pm *= (eta / np.linalg.norm(pm, axis=1))[:, None]
        p = free.copy()
        p[binding] = pm
    return np.einsum("tij,tj->ti", V, p)
