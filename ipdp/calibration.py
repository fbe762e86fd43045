"""Noise calibration for input perturbation: the paper's Algorithm 1 and the rigorous repair.

Notation follows docs/privacy.md and Fukuchi, Tran & Sakuma (2017): each of n contributors sends
q̃ = q + u, u ~ N(0, σ_u²/n · I_d) and p̃ = p − r, r ~ N(0, σ_b²/n · I_d); the trainer minimises
½ wᵀ(Σ q̃q̃ᵀ + Δ_in I)w − (Σ p̃)ᵀw over ‖w‖ ≤ η. Every function here is pure and cheap (closed
forms plus one bisection), so studies are calibrated on every process that needs the numbers.

Privacy maps, next to the noise they justify:
- paper mode: (ε, δ)-DP of the released w by the paper's Theorem 2 — whose Lemma 7 is wrong for
  adversarial data (see docs/privacy.md); kept only to reproduce the paper.
- rigorous mode: (ε, δ)-DP with δ = δ_K + γ₁ + γ₂, by Kifer et al. (2012, Thm 2) conditioned on
  the noise, using a high-probability bound on the noisy record's norm (γ₁) and on the smallest
  eigenvalue of everyone else's noisy Gram matrix (γ₂).
- both: each record on its own is a Gaussian mechanism; its local (ε_loc, δ) is computed exactly
  with the analytic Gaussian mechanism (Balle & Wang 2018).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ipdp.errors import CalibrationError

Mode = Literal["rigorous", "paper"]


class Calibration(BaseModel):
    """The noise every contributor adds, the trainer's regulariser, and what they guarantee."""

    model_config = ConfigDict(frozen=True)

    mode: Mode
    epsilon: float
    delta: float
    n: int
    d: int
    lam: float
    p_bound: float
    eta: float
    sigma_u2: float
    """σ_u²: the per-coordinate variance of u is σ_u²/n (Algorithm 1, line 3)."""
    sigma_b2: float
    """σ_b²: the per-coordinate variance of r is σ_b²/n (Algorithm 1, line 4)."""
    delta_in: float
    """Δ_in: ridge added by the trainer, H = Σ q̃q̃ᵀ + Δ_in I (Algorithm 2)."""
    zeta: float
    """ζ = λη + P: Lipschitz constant of the clean loss on ‖w‖ ≤ η (§3.1)."""
    lambda_prime: float | None = None
    """λ′ = (√λ + τ)²: smoothness of the noisy differing record (rigorous mode)."""
    zeta_prime: float | None = None
    """ζ′ = λ′η + P: Lipschitz constant of the noisy differing record (rigorous mode)."""
    delta_split: dict[str, float]
    local_epsilon: float | None
    """ε of one record (q̃, p̃) as a Gaussian mechanism at `local_delta`; None means unbounded."""
    local_delta: float

    @property
    def noise_std_q(self) -> float:
        """Per-coordinate standard deviation of u, √(σ_u²/n)."""
        return math.sqrt(self.sigma_u2 / self.n)

    @property
    def noise_std_p(self) -> float:
        """Per-coordinate standard deviation of r, √(σ_b²/n)."""
        return math.sqrt(self.sigma_b2 / self.n)


def kifer_sigma_b2(zeta: float, epsilon: float, delta: float) -> float:
    """σ_b² = ζ²(8 log(2/δ) + 4ε)/ε²: Gaussian objective-perturbation noise (Kifer et al. 2012)."""
    return zeta**2 * (8.0 * math.log(2.0 / delta) + 4.0 * epsilon) / epsilon**2


def paper_a(n: int, delta: float) -> float:
    """a = √(log(2/γ)/n) with γ = δ/2 (Algorithm 1)."""
    return math.sqrt(math.log(2.0 / (delta / 2.0)) / n)


def paper_min_n(delta: float) -> float:
    """Theorem 2's assumption n ≥ 16 log(8/δ)."""
    return 16.0 * math.log(8.0 / delta)


def rigorous_gap(n: int, d: int, gamma2: float) -> float:
    """√(n−1−d) − √d − √(2 log(1/γ₂)): must be > 0 for the smallest-eigenvalue bound to bite."""
    if n - 1 - d <= 0:
        return -math.inf
    return math.sqrt(n - 1 - d) - math.sqrt(d) - math.sqrt(2.0 * math.log(1.0 / gamma2))


def calibrate_paper(
    *, epsilon: float, delta: float, n: int, d: int, lam: float, p_bound: float, eta: float,
    delta_in: float,
) -> Calibration:
    """Algorithm 1 verbatim: γ = δ′ = δ/2, σ_u from Lemma 7's quadratic, σ_b from Kifer et al."""
    a = paper_a(n, delta)
    if 1.0 - 2.0 * a <= 0.0:
        raise CalibrationError(
            f"n={n} is too small for paper mode: 1 − 2a = {1 - 2 * a:.4g} must be > 0 "
            f"(a = √(log(4/δ)/n) = {a:.4g})"
        )
    if n < paper_min_n(delta):
        raise CalibrationError(
            f"n={n} is too small for paper mode: Theorem 2 assumes n ≥ 16·log(8/δ) = "
            f"{paper_min_n(delta):.1f}"
        )
    if delta_in <= 0.0:
        raise CalibrationError(
            f"delta_in={delta_in} is not allowed in paper mode: Algorithm 2 needs Δ > 2λ/ε, "
            "i.e. Δ_in = Δ − 2λ/ε > 0"
        )
    root = math.sqrt(2 * d * a**2 * lam**2 + (2 * lam / epsilon) * (1 - 2 * a))
    sigma_u = (math.sqrt(2 * d) * a * lam + root) / (1 - 2 * a)
    zeta = lam * eta + p_bound
    sigma_b2 = kifer_sigma_b2(zeta, epsilon, delta / 2.0)
    return _finish(
        mode="paper", epsilon=epsilon, delta=delta, n=n, d=d, lam=lam, p_bound=p_bound, eta=eta,
        sigma_u2=sigma_u**2, sigma_b2=sigma_b2, delta_in=delta_in, zeta=zeta,
        delta_split={"gamma": delta / 2.0, "delta_prime": delta / 2.0},
    )


def calibrate_rigorous(
    *, epsilon: float, delta: float, n: int, d: int, lam: float, p_bound: float, eta: float,
    delta_in: float, split: tuple[float, float, float] = (0.5, 0.25, 0.25),
) -> Calibration:
    """Smallest σ_u with Δ_in + λ_min-bound(A₋ₙ) ≥ 2λ′/ε, then σ_b from the noisy ζ′.

    With s = σ_u, τ = k·s where k = (√d + √(2 log(1/γ₁)))/√n, and the eigenvalue bound c·s² where
    c = gap²/n, the condition Δ_in + c s² ≥ (2/ε)(√λ + k s)² is the quadratic
    (c − 2k²/ε) s² − (4√λ k/ε) s + (Δ_in − 2λ/ε) ≥ 0, whose smallest non-negative solution is
    found in closed form (exact, where a bisection would only approximate it; the tests
    check it against the defining inequality).
    """
    if delta_in < 0.0:
        raise CalibrationError(f"delta_in={delta_in} must be ≥ 0")
    delta_k, gamma1, gamma2 = (delta * f for f in split)
    gap = rigorous_gap(n, d, gamma2)
    if gap <= 0.0:
        raise CalibrationError(
            f"n={n} is too small for rigorous mode at d={d}: need √(n−1−d) > √d + "
            f"√(2 log(1/γ₂)) = {math.sqrt(d) + math.sqrt(2 * math.log(1 / gamma2)):.4g} "
            f"(γ₂ = δ/4 = {gamma2:.3g})"
        )
    c = gap**2 / n
    k = (math.sqrt(d) + math.sqrt(2.0 * math.log(1.0 / gamma1))) / math.sqrt(n)
    quad_a = c - 2.0 * k**2 / epsilon
    quad_b = -4.0 * math.sqrt(lam) * k / epsilon
    quad_c = delta_in - 2.0 * lam / epsilon
    if quad_c >= 0.0:
        sigma_u = 0.0
    elif quad_a <= 0.0:
        raise CalibrationError(
            f"n={n} is too small for rigorous mode at d={d}, ε={epsilon}: the noise that "
            "lifts the smallest eigenvalue grows the noisy record's norm faster "
            f"(c = {c:.4g} ≤ 2k²/ε = {2 * k**2 / epsilon:.4g})"
        )
    else:
        sigma_u = (-quad_b + math.sqrt(quad_b**2 - 4.0 * quad_a * quad_c)) / (2.0 * quad_a)
    tau = k * sigma_u
    lambda_prime = (math.sqrt(lam) + tau) ** 2
    zeta_prime = lambda_prime * eta + p_bound
    return _finish(
        mode="rigorous", epsilon=epsilon, delta=delta, n=n, d=d, lam=lam, p_bound=p_bound,
        eta=eta, sigma_u2=sigma_u**2, sigma_b2=kifer_sigma_b2(zeta_prime, epsilon, delta_k),
        delta_in=delta_in, zeta=lam * eta + p_bound, lambda_prime=lambda_prime,
        zeta_prime=zeta_prime,
        delta_split={"delta_k": delta_k, "gamma_1": gamma1, "gamma_2": gamma2},
    )


def rigorous_eigen_bound(sigma_u2: float, n: int, d: int, gamma2: float) -> float:
    """(σ_u²/n)(√(n−1−d) − √d − √(2 log(1/γ₂)))²: w.p. ≥ 1−γ₂ a lower bound on λ_min(A₋ₙ)."""
    return sigma_u2 / n * rigorous_gap(n, d, gamma2) ** 2


def _finish(**kw) -> Calibration:
    n, lam, p_bound = kw["n"], kw["lam"], kw["p_bound"]
    std_q = math.sqrt(kw["sigma_u2"] / n)
    std_p = math.sqrt(kw["sigma_b2"] / n)
    local = local_epsilon(
        sensitivity_over_sigma=_pair_mu(2.0 * math.sqrt(lam), std_q, 2.0 * p_bound, std_p),
        delta=kw["delta"],
    )
    return Calibration(**kw, local_epsilon=local, local_delta=kw["delta"])


def _pair_mu(sens_q: float, std_q: float, sens_p: float, std_p: float) -> float:
    """μ = ‖(Δ_q/σ_q, Δ_p/σ_p)‖: the pair of Gaussian releases is one Gaussian mechanism."""
    if std_q == 0.0 or std_p == 0.0:
        return math.inf
    return math.hypot(sens_q / std_q, sens_p / std_p)


def _log_ndtr(x: float) -> float:
    """log Φ(x), accurate in the far left tail where Φ underflows."""
    if x > -20.0:
        return math.log(0.5 * math.erfc(-x / math.sqrt(2.0)))
    # Asymptotic series of Mills' ratio: Φ(x) ≈ φ(x)/|x| · (1 − 1/x² + 3/x⁴ − 15/x⁶).
    x2 = x * x
    series = 1.0 - 1.0 / x2 + 3.0 / x2**2 - 15.0 / x2**3
    return -0.5 * x2 - math.log(-x) - 0.5 * math.log(2.0 * math.pi) + math.log(series)


def gaussian_log_delta(mu: float, epsilon: float) -> float:
    """log δ(ε) of a Gaussian mechanism with Δ/σ = μ (Balle & Wang 2018, Thm 8), exact.

    δ(ε) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ), evaluated in log space so ε in the thousands works.
    """
    log_a = _log_ndtr(mu / 2.0 - epsilon / mu)
    log_b = epsilon + _log_ndtr(-mu / 2.0 - epsilon / mu)
    ratio = math.exp(min(0.0, log_b - log_a))
    if ratio >= 1.0:
        return -math.inf
    return log_a + math.log1p(-ratio)


def local_epsilon(*, sensitivity_over_sigma: float, delta: float) -> float | None:
    """Smallest ε with δ(ε) ≤ δ for a Gaussian mechanism with Δ/σ = μ; None when μ = ∞."""
    mu = sensitivity_over_sigma
    if math.isinf(mu):
        return None
    target = math.log(delta)
    if gaussian_log_delta(mu, 0.0) <= target:
        return 0.0
    lo, hi = 0.0, 1.0
    while gaussian_log_delta(mu, hi) > target:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if gaussian_log_delta(mu, mid) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    return hi


def calibrate(
    *, mode: Mode, epsilon: float, delta: float, n: int, d: int, lam: float, p_bound: float,
    eta: float, delta_in: float,
) -> Calibration:
    """Dispatch on `mode`; raises CalibrationError naming the violated bound."""
    fn = calibrate_rigorous if mode == "rigorous" else calibrate_paper
    return fn(
        epsilon=epsilon, delta=delta, n=n, d=d, lam=lam, p_bound=p_bound, eta=eta,
        delta_in=delta_in,
    )


#: Probability that an honest record is rejected by the norm check (union over q̃ and p̃).
HONEST_REJECTION_PROBABILITY = 1e-9


def gaussian_norm_tail(std: float, d: int, probability: float) -> float:
    """t with P(‖g‖ > t) ≤ probability for g ~ N(0, std²·I_d).

    Laurent & Massart (2000, Lemma 1): P(χ²_d ≥ d + 2√(d·x) + 2x) ≤ e^{−x}; take x = log(1/prob).
    """
    x = math.log(1.0 / probability)
    return std * math.sqrt(d + 2.0 * math.sqrt(d * x) + 2.0 * x)


def record_norm_bounds(
    cal: Calibration, probability: float = HONEST_REJECTION_PROBABILITY
) -> tuple[float, float]:
    """Largest ‖q̃‖ and ‖p̃‖ an honest record can show, except with total probability ≤ `probability`.

    ‖q̃‖ ≤ ‖q‖ + ‖u‖ ≤ √λ + t_q and ‖p̃‖ ≤ P + t_r, each tail taken at probability/2.
    """
    t_q = gaussian_norm_tail(cal.noise_std_q, cal.d, probability / 2.0)
    t_p = gaussian_norm_tail(cal.noise_std_p, cal.d, probability / 2.0)
    return math.sqrt(cal.lam) + t_q, cal.p_bound + t_p
