"""How far k accepted records can move a round's model: the bound of docs/security.md.

Differential privacy bounds what the model reveals about one record, not how far records can
steer it. What does bound the steering is the acceptance check (ipdp.calibration's
record_norm_bounds) together with the curvature the honest records bring: the trainer minimises
F(w) = ½wᵀ(A + Δ_in I)w − bᵀw over ‖w‖ ≤ η, and the n − k honest records' part of it is
m-strongly convex with m = λ_min(A_honest) + Δ_in. Replacing k records changes ∇F by at most
k·Γ on the ball, Γ = q_high²·η + 2·p_high, so the minimiser moves by at most k·Γ/m
(docs/security.md, "Bounded influence").
"""

from __future__ import annotations

import math

from ipdp.calibration import Calibration, eigenvalue_gap, record_norm_bounds


def accepted_gradient_change(cal: Calibration) -> float:
    """Γ = q_high²·η + 2·p_high: the largest ‖∇ℓ′(w) − ∇ℓ(w)‖ on ‖w‖ ≤ η between two accepted
    records, ∇ℓ(w) = q̃q̃ᵀw − p̃ (q̃q̃ᵀ − q̃′q̃′ᵀ has eigenvalues in [−q_high², q_high²])."""
    bounds = record_norm_bounds(cal)
    return bounds.q_high**2 * cal.eta + 2.0 * bounds.p_high


def honest_curvature(cal: Calibration, honest: int, failure_probability: float) -> float:
    """m = Δ_in + (σ_u²/n)·g² with g the gap of Step 4 (smallest eigenvalue) for `honest` noisy
    rows: λ_min(A_honest) + Δ_in ≥ m with probability ≥ 1 − failure_probability over the honest
    devices' noise, whatever their clean rows."""
    # eigenvalue_gap(N, …) counts N − 1 − d noise rows left after projecting off the clean rows.
    g = eigenvalue_gap(honest + 1, cal.d, failure_probability)
    return cal.delta_in + (cal.noise_std_q**2 * g * g if g > 0.0 else 0.0)


def influence_bound(cal: Calibration, k: int, failure_probability: float | None = None) -> float:
    """Largest ‖w′ − w‖ when any k of a round's n records are replaced by any k accepted records:
    k·Γ/m, with probability ≥ 1 − failure_probability (default δ) over the honest noise.

    Infinite when m = 0; the move is also never more than 2η, so a bound ≥ 2η says nothing.
    """
    if not 1 <= k < cal.n:
        raise ValueError(f"k={k} must lie in [1, n) with n={cal.n}")
    gamma = cal.delta if failure_probability is None else failure_probability
    m = honest_curvature(cal, cal.n - k, gamma)
    return math.inf if m <= 0.0 else k * accepted_gradient_change(cal) / m
