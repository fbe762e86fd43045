"""Privacy calibrations and noise of the baselines the accuracy benchmark compares against.

Everything is in the "sum" form the trainer uses: the empirical risk of n records is
J(w) = Σᵢ ½ (qᵢᵀw)² − pᵢᵀw over the ball ‖w‖ ≤ η, each record has smoothness ‖qᵢ‖² ≤ λ and is
ζ-Lipschitz on the ball with ζ = λη + P (docs/privacy.md). Neighbouring data sets differ in one record
(replace-one), as in all three references.

- Objective perturbation, Gaussian variant (Kifer, Smith & Thakurta 2012, Algorithm 1 and
  Theorem 2): w = argmin_{‖w‖≤η} J(w) + (Δ/2)‖w‖² + bᵀw with Δ ≥ 2λ/ε and b ~ N(0, σ²I),
  σ² = ζ²(8 log(2/δ) + 4ε)/ε². The paper writes the objective divided by n; the minimiser is the
  same. The theorem needs every loss Hessian to have rank one with eigenvalue ≤ λ: here it is qqᵀ.
- Output perturbation (Chaudhuri, Monteleoni & Sarwate 2011, Algorithm 1): the minimiser w_Λ of
  J(w)/n + (Λ/2)‖w‖² over the ball has L2 sensitivity 2ζ/(nΛ); release w_Λ + v with density
  ∝ exp(−ε‖v‖ / (2ζ/(nΛ))), i.e. ‖v‖ ~ Gamma(d, scale 2ζ/(nΛε)) in a uniform direction: ε-DP.
- Output perturbation with Gaussian noise (Jain & Thakurta 2014): the same w_Λ plus N(0, σ²I);
  for a generalised linear model ⟨v, x⟩ ~ N(0, σ²‖x‖²) whatever d, which is what makes their risk
  bound dimension-independent. We calibrate σ with the analytic Gaussian mechanism (Balle & Wang
  2018, Theorem 8) at sensitivity 2ζ/(nΛ): exact for every ε, where the classical
  σ = Δ₂√(2 log(1.25/δ))/ε needs ε < 1 and is larger.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ipdp.calibration import gaussian_log_delta, kifer_sigma_b2


@dataclass(frozen=True)
class ObjPertGauss:
    """Kifer et al. (2012, Thm 2): the smallest admissible ridge Δ and the std σ of b."""

    delta_min: float
    sigma: float


def objpert_gauss(*, epsilon: float, delta: float, lam: float, zeta: float) -> ObjPertGauss:
    """Δ ≥ 2λ/ε and σ² = ζ²(8 log(2/δ) + 4ε)/ε² (Kifer, Smith & Thakurta 2012, Theorem 2)."""
    return ObjPertGauss(
        delta_min=2.0 * lam / epsilon, sigma=math.sqrt(kifer_sigma_b2(zeta, epsilon, delta))
    )


def output_sensitivity(*, n: int, reg: float, zeta: float) -> float:
    """2ζ/(nΛ): L2 sensitivity of argmin_{‖w‖≤η} J(w)/n + (Λ/2)‖w‖² (Chaudhuri et al. 2011, §3).

    Both objectives are Λ-strongly convex and differ by g = (ℓ′ − ℓ)/n, which is 2ζ/n-Lipschitz on
    the ball; adding the two strong-convexity inequalities at the two constrained minimisers gives
    Λ‖w₁ − w₂‖² ≤ g(w₁) − g(w₂) ≤ (2ζ/n)‖w₁ − w₂‖.
    """
    return 2.0 * zeta / (n * reg)


def laplace_output_scale(*, n: int, reg: float, zeta: float, epsilon: float) -> float:
    """Scale 2ζ/(nΛε) of ‖v‖ ~ Gamma(d, ·) for density ∝ exp(−ε‖v‖/Δ₂) (Chaudhuri et al. 2011)."""
    return output_sensitivity(n=n, reg=reg, zeta=zeta) / epsilon


def analytic_gaussian_mu(epsilon: float, delta: float) -> float:
    """Largest μ = Δ₂/σ with δ(ε; μ) ≤ δ for the Gaussian mechanism (Balle & Wang 2018, Thm 8).

    δ(ε; μ) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ) increases with μ; bisection in log μ.
    """
    target = math.log(delta)
    lo, hi = 1e-3, 1.0
    while gaussian_log_delta(hi, epsilon) <= target:
        lo, hi = hi, 2.0 * hi
    while gaussian_log_delta(lo, epsilon) > target:
        lo, hi = lo / 2.0, lo
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if gaussian_log_delta(mid, epsilon) <= target:
            lo = mid
        else:
            hi = mid
        if hi / lo - 1.0 <= 1e-13:
            break
    return lo


def gaussian_output_sigma(*, n: int, reg: float, zeta: float, epsilon: float, delta: float) -> float:
    """σ = (2ζ/(nΛ)) / μ*(ε, δ): analytic Gaussian output perturbation (Jain & Thakurta 2014 style)."""
    return output_sensitivity(n=n, reg=reg, zeta=zeta) / analytic_gaussian_mu(epsilon, delta)


def gamma_sphere(direction: np.ndarray, radius_gamma: float, scale: float) -> np.ndarray:
    """v = scale·G·g/‖g‖ for G ~ Gamma(d, 1), g ~ N(0, I_d): ‖v‖ ~ Gamma(d, scale), uniform direction."""
    return scale * radius_gamma * direction / np.linalg.norm(direction)


def project_ball(w: np.ndarray, eta: float) -> np.ndarray:
    """Euclidean projection onto ‖w‖ ≤ η: post-processing, so it keeps every guarantee."""
    norm = float(np.linalg.norm(w))
    return w if norm <= eta else w * (eta / norm)
