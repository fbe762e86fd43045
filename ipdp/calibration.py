"""Noise calibration for input perturbation: the paper's Algorithm 1 and the proven default.

Each of n contributors sends q̃ = q + u, u ~ N(0, σ_u²/n · I_d) and p̃ = p − r,
r ~ N(0, σ_b²/n · I_d); the trainer minimises ½ wᵀ(Σ q̃q̃ᵀ + Δ_in I)w − (Σ p̃)ᵀw over ‖w‖ ≤ η.
Neighbouring data sets differ by replacing one record (`NEIGHBOURING`), everywhere in ipdp.

Privacy maps, next to the noise they justify:
- rigorous mode (default): (ε, δ)-DP of the released w, proven step by step in docs/privacy.md;
  every function below that computes a step names it ("Step 3 (noisy record)", …).
- paper mode: the paper's Algorithm 1 verbatim. Its Lemma 7 is wrong for adversarial data, so
  the guarantee is not proven (`proven=False`); kept only to reproduce the paper.
- both: each record on its own is a Gaussian mechanism; its local (ε_loc, δ) is computed exactly
  with the analytic Gaussian mechanism (Balle & Wang 2018).

calibrate() uses only `math` and `statistics`, and results are cached: it runs on every process.
The record checks (record_norm_bounds) take scipy.stats' χ² laws, imported when first needed.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from functools import lru_cache
from numbers import Integral, Real
from statistics import NormalDist
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ipdp.errors import CalibrationError
from ipdp.wire import RejectReason

Mode = Literal["rigorous", "paper"]

NEIGHBOURING = "replace-one"
"""Step 1 (neighbouring relation): D and D′ hold n records each and differ in one of them."""


class Calibration(BaseModel):
    """The noise every contributor adds, the trainer's regulariser, and what they guarantee."""

    model_config = ConfigDict(frozen=True)

    mode: Mode
    epsilon: float
    delta: float
    """δ of the published model, the study's: Steps 1–7 spend ``mechanism_delta`` of it and the
    aggregator's norm check the rest, ``norm_check_delta`` (docs/privacy.md, "The norm check")."""
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
    """λ′: bound on ‖q̃‖² of the differing record and of its replacement (rigorous mode, Step 3)."""
    zeta_prime: float | None = None
    """ζ′ = λ′η + P: Lipschitz constant of the noisy differing record (rigorous mode)."""
    neighbouring: str = NEIGHBOURING
    """The neighbouring relation the guarantee is stated for (Step 1)."""
    linear_sensitivity: float
    """Largest change of the differing record's gradient on ‖w‖ ≤ η: λ′η + 2P (Step 6); the
    paper calibrates to ζ."""
    epsilon_split: dict[str, float]
    """ε = log_det + linear (Step 7)."""
    delta_split: dict[str, float]
    """The parts of ``delta``: Steps 1–7's (they add up to ``mechanism_delta``) and the norm
    check's (``norm_check``); their sum is at most ``delta``."""
    proven: bool
    """True when docs/privacy.md proves the guarantee (rigorous mode); False in paper mode."""
    local_epsilon: float | None
    """ε of one record (q̃, p̃) as a Gaussian mechanism at `local_delta`; None means unbounded."""
    local_delta: float
    predicted_error: float | None = None
    """Predicted excess risk R of the released w (rigorous mode), what Step 8 minimises for
    squared loss; it reads no data."""
    predicted_direction_error: float | None = None
    """Predicted error D of the direction of w, what Step 8 minimises for logistic loss (rigorous
    mode, logistic studies only); it reads no data."""

    noise_std_q: float
    """Per-coordinate standard deviation of u, √(σ_u²/n)."""
    noise_std_p: float
    """Per-coordinate standard deviation of r, √(σ_b²/n)."""
    mechanism_delta: float
    """δ Steps 1–7 prove for the first n records: ``delta`` less ``norm_check_delta``."""
    norm_check_delta: float
    """δ the aggregator's norm check spends, which may refuse an honest record:
    (1 + e^ε)·n·π = REJECTION_DELTA_SHARE·δ (docs/privacy.md, "The norm check")."""
    honest_rejection_probability: float
    """π = REJECTION_DELTA_SHARE·δ/((1 + e^ε)·n): the per-record false-rejection budget of the
    norm check (record_norm_bounds)."""


def kifer_sigma_b2(zeta: float, epsilon: float, delta: float) -> float:
    """σ_b² = ζ²(8 log(2/δ) + 4ε)/ε²: Gaussian objective-perturbation noise (Kifer et al. 2012)."""
    return zeta**2 * (8.0 * math.log(2.0 / delta) + 4.0 * epsilon) / epsilon**2


def paper_a(n: int, delta: float) -> float:
    """a = √(log(2/γ)/n) with γ = δ/2 (Algorithm 1)."""
    return math.sqrt(math.log(2.0 / (delta / 2.0)) / n)


def paper_min_n(delta: float) -> float:
    """Theorem 2's assumption n ≥ 16 log(8/δ)."""
    return 16.0 * math.log(8.0 / delta)


def calibrate_paper(
    *, epsilon: float, delta: float, n: int, d: int, lam: float, p_bound: float, eta: float,
    delta_in: float | None, check_within_delta: bool = True,
) -> Calibration:
    """Algorithm 1 verbatim: γ = δ′ = δ/2, σ_u from Lemma 7's quadratic, σ_b from Kifer et al.

    Not a proof (docs/privacy.md, "The erratum"); `proven=False`. Algorithm 1 runs at the
    mechanism's share of δ (`mechanism_delta`), the norm check takes the rest; with
    `check_within_delta=False` (a study created before that rule) at the whole δ.
    """
    study_delta = delta
    if check_within_delta:
        delta = mechanism_delta(delta)
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
    if delta_in is None or delta_in <= 0.0:
        raise CalibrationError(
            f"delta_in={delta_in} is not allowed in paper mode: Algorithm 2 needs Δ > 2λ/ε, "
            "i.e. Δ_in = Δ − 2λ/ε > 0"
        )
    root = math.sqrt(2 * d * a**2 * lam**2 + (2 * lam / epsilon) * (1 - 2 * a))
    sigma_u = (math.sqrt(2 * d) * a * lam + root) / (1 - 2 * a)
    zeta = lam * eta + p_bound
    sigma_b2 = kifer_sigma_b2(zeta, epsilon, delta / 2.0)
    return _finish(
        mechanism=delta, mode="paper", epsilon=epsilon, delta=study_delta, n=n, d=d, lam=lam, p_bound=p_bound, eta=eta,
        sigma_u2=sigma_u**2, sigma_b2=sigma_b2, delta_in=delta_in, zeta=zeta,
        delta_split={"gamma": delta / 2.0, "delta_prime": delta / 2.0},
        linear_sensitivity=zeta, epsilon_split={"log_det": epsilon / 2.0, "linear": epsilon / 2.0},
        proven=False,
    )



_NORMAL = NormalDist()
_SQRT_2PI = math.sqrt(2.0 * math.pi)


def _q(x: float) -> float:
    """Q(x) = P(N(0, 1) > x)."""
    return 0.5 * math.erfc(x / math.sqrt(2.0))


def _q_inv(p: float) -> float:
    """Q⁻¹(p): the z with P(N(0, 1) > z) = p."""
    return -_NORMAL.inv_cdf(p)


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / _SQRT_2PI


def chi_mean(k: int) -> float:
    """E χ_k = √2 Γ((k+1)/2)/Γ(k/2), the mean norm of a standard Gaussian vector in R^k."""
    return math.sqrt(2.0) * math.exp(math.lgamma((k + 1) / 2.0) - math.lgamma(k / 2.0))


def chi2_upper(k: int, probability: float) -> float:
    """c with P(χ²_k ≥ c) ≤ probability (Laurent & Massart 2000, Lemma 1): k + 2√(kx) + 2x."""
    x = math.log(1.0 / probability)
    return k + 2.0 * math.sqrt(k * x) + 2.0 * x


ALONG_SHARE = 0.9
"""Share of each record's γ₁/2 spent on the noise component along q (Step 3); the rest bounds
the orthogonal component, whose effect is s² times smaller."""


def noisy_smoothness(*, sigma_u2: float, n: int, d: int, lam: float, gamma1: float) -> float:
    """λ′ with P(‖q + u‖² > λ′) ≤ γ₁/2 for every ‖q‖² ≤ λ: Step 3 (noisy record) of docs/privacy.md.

    With s² = σ_u²/n, z = q̂ᵀu/s ~ N(0, 1) and c = ‖u − (q̂ᵀu)q̂‖²/s² ~ χ²_{d−1} independent,
    ‖q + u‖² = (‖q‖ + s·z)² + s²·c; the worst case is ‖q‖ = √λ.
    """
    s = math.sqrt(sigma_u2 / n)
    if s == 0.0:
        return lam
    budget = gamma1 / 2.0
    along = budget if d == 1 else ALONG_SHARE * budget
    reach = 2.0 * math.sqrt(lam) / s
    # (√λ + s·Z)² > (√λ + s·z)² iff Z > z or Z < −z − 2√λ/s: choose z with Q(z) + Q(z + reach) ≤ along.
    z = _q_inv(along - _q(_q_inv(along) + reach))
    across = 0.0 if d == 1 else chi2_upper(d - 1, budget - along)
    return (math.sqrt(lam) + s * z) ** 2 + s * s * across


def eigenvalue_gap(n: int, d: int, gamma2: float) -> float:
    """g with P(λ_min(A₋ₙ) < (σ_u²/n)·g²) ≤ γ₂ when g > 0: Step 4 (smallest eigenvalue).

    g = E χ_m − E χ_d − 1/√(2π) − Q⁻¹(γ₂) with m = n − 1 − d rows of Gaussian noise left after
    projecting off the other records' clean rows (Gordon's bound on E s_min, the median within
    1/√(2π) of the mean, and the Gaussian isoperimetric tail of a 1-Lipschitz function).
    """
    m = n - 1 - d
    if m < d:
        return -math.inf
    return chi_mean(m) - chi_mean(d) - 1.0 / _SQRT_2PI - _q_inv(gamma2)


def eigenvalue_bound(sigma_u2: float, n: int, d: int, gamma2: float) -> float:
    """(σ_u²/n)·g²: w.p. ≥ 1 − γ₂ a lower bound on λ_min(A₋ₙ) (Step 4 (smallest eigenvalue))."""
    g = eigenvalue_gap(n, d, gamma2)
    return sigma_u2 / n * g * g if g > 0.0 else 0.0


def log_det_epsilon(lambda_prime: float, beta: float) -> float:
    """log(1 + λ′/β): bound on the Jacobian part of the privacy loss, Step 5 (log-det term)."""
    return math.log1p(lambda_prime / beta)


def linear_sensitivity(lambda_prime: float, eta: float, p_bound: float) -> float:
    """Γ = λ′η + 2P: sup of ‖(q̃q̃ᵀ − q̃′q̃′ᵀ)w + p′ − p‖ on ‖w‖ ≤ η, Step 6 (linear term)."""
    return lambda_prime * eta + 2.0 * p_bound


def _chi3_hockey(c: float, alpha: float) -> float:
    """E[(1 − e^{c − αX})₊] for X ~ χ_3 and α ≥ 0, in closed form (Step 6 (linear term))."""
    if alpha <= 0.0:
        return -math.expm1(c) if c < 0.0 else 0.0
    if alpha > 35.0:
        return 1.0  # the expectation is ≤ 1; this keeps e^{α²/2} finite
    x0 = max(0.0, c / alpha)
    y0 = x0 + alpha
    tail = 2.0 * (x0 * _phi(x0) + _q(x0))
    # e^{c + α²/2}·φ(y₀) and e^{c + α²/2}·Q(y₀) with the exponents summed first: for a large c
    # (ε₂ in the hundreds) e^{c + α²/2} alone overflows while the products are small.
    lift = c + 0.5 * alpha * alpha
    shifted = 2.0 * ((y0 - 2.0 * alpha) * math.exp(lift - 0.5 * y0 * y0) / _SQRT_2PI
                     + (1.0 + alpha * alpha) * math.exp(lift + _log_ndtr(-y0)))
    return max(0.0, tail - shifted)


LINEAR_NODES = 24
"""Cells of the upper Riemann sum over the angle in linear_term_delta."""


def linear_term_delta(epsilon2: float, sigma: float, kappa: float, p_bound: float) -> float:
    """δ of the linear term at ε₂ with b-noise std σ: Step 6 (linear term) of docs/privacy.md.

    The privacy loss is at most Λ = (κ + 2P·v₊)·X/σ + Γ²/(2σ²) with X ~ χ_3, v ~ U[−1, 1]
    independent, κ = λ′η, Γ = κ + 2P. Returns an upper bound on E[(1 − e^{ε₂ − Λ})₊]: the
    integral over v ≥ 0 is an upper Riemann sum of an increasing integrand.
    """
    gamma = kappa + 2.0 * p_bound
    c = epsilon2 - gamma * gamma / (2.0 * sigma * sigma)
    total = 0.5 * _chi3_hockey(c, kappa / sigma)
    cells = sum(_chi3_hockey(c, (kappa + 2.0 * p_bound * i / LINEAR_NODES) / sigma)
                for i in range(1, LINEAR_NODES + 1))
    return min(1.0, total + 0.5 * cells / LINEAR_NODES)


def linear_term_sigma(epsilon2: float, delta_k: float, kappa: float, p_bound: float,
                      rel_tol: float = 1e-9) -> float:
    """Least σ (to rel_tol, rounded up) with linear_term_delta ≤ δ_K: Step 6 (linear term).

    A bracket [lo, hi] with linear_term_delta(lo) > δ_K ≥ linear_term_delta(hi) narrowed by
    the Illinois variant of regula falsi on log δ against log σ (smooth, so a few steps do);
    the returned hi always meets the bound.
    """
    log_target = math.log(delta_k)

    def excess(log_sigma: float) -> float:
        """log linear_term_delta − log δ_K: ≤ 0 when σ = e^log_sigma suffices."""
        d = linear_term_delta(epsilon2, math.exp(log_sigma), kappa, p_bound)
        return math.log(d) - log_target if d > 0.0 else -math.inf

    gamma = kappa + 2.0 * p_bound
    b = math.log(gamma * math.sqrt(2.0 * math.log(1.25 / delta_k)) / epsilon2)
    fb = excess(b)
    while fb > 0.0:
        b += math.log(2.0)
        fb = excess(b)
    a = b - math.log(2.0)
    fa = excess(a)
    while fa <= 0.0:
        a, b, fb = a - math.log(2.0), a, fa
        fa = excess(a)
    width, side = math.log1p(rel_tol), 0
    while b - a > width:
        c = 0.5 * (a + b) if math.isinf(fb) else b - fb * (b - a) / (fb - fa)
        # Stay a little inside the bracket so that the step that ends the search straddles it.
        c = min(max(c, a + 0.4 * width), b - 0.4 * width)
        fc = excess(c)
        if fc <= 0.0:
            b, fb = c, fc
            if side == -1:
                fa *= 0.5
            side = -1
        else:
            a, fa = c, fc
            if side == 1:
                fb *= 0.5
            side = 1
    return math.exp(b)


@dataclass(frozen=True)
class _Problem:
    epsilon: float
    delta: float
    n: int
    d: int
    lam: float
    p_bound: float
    eta: float
    delta_in: float
    loss: str = "squared"
    check_within_delta: bool = True
    """Steps 1–7 spend mechanism_delta(δ), the norm check the rest; False: the whole δ (a study
    created before the norm check's share came out of δ keeps its noise that way)."""

    @property
    def mechanism_delta(self) -> float:
        return mechanism_delta(self.delta) if self.check_within_delta else self.delta


@dataclass(frozen=True)
class _Point:
    """One admissible choice of the free splits and the σ_u² it needs (Steps 3–5)."""

    eps1: float
    gamma1: float
    gamma2: float
    sigma_u2: float
    lambda_prime: float

    def kappa(self, pr: _Problem) -> float:
        return self.lambda_prime * pr.eta

    def delta_k(self, pr: _Problem) -> float:
        return pr.mechanism_delta - self.gamma1 - self.gamma2


def _sigma_u2(pr: _Problem, eps1: float, gamma1: float, gamma2: float) -> float | None:
    """Least σ_u² with Δ_in + eigenvalue_bound ≥ λ′/(e^{ε₁} − 1) (Step 5 (log-det term)).

    In s = σ_u/√n the condition is E(Δ_in + g²s²) ≥ (√λ + z s)² + c s² with E = e^{ε₁} − 1,
    a quadratic whose larger root is exact up to Step 3's negligible two-sided correction to z;
    the result is checked against the exact condition and nudged up until it holds.
    """
    # e^{ε₁} − 1 overflows past ε₁ ≈ 709; capping ε₁ there only asks for more noise (safe).
    e = math.expm1(min(eps1, 700.0))
    g = eigenvalue_gap(pr.n, pr.d, gamma2)
    if g <= 0.0:
        return None
    budget = gamma1 / 2.0
    along = budget if pr.d == 1 else ALONG_SHARE * budget
    z = _q_inv(along)
    c = 0.0 if pr.d == 1 else chi2_upper(pr.d - 1, budget - along)
    qa = g * g * e - z * z - c
    if qa <= 0.0:
        return None
    qb = -2.0 * math.sqrt(pr.lam) * z
    qc = e * pr.delta_in - pr.lam
    s = (-qb + math.sqrt(qb * qb - 4.0 * qa * qc)) / (2.0 * qa)

    def holds(s: float) -> bool:
        # The same arithmetic as Step 5's final check (log_det_epsilon on eigenvalue_bound), so
        # that no rounding difference lets the chosen σ_u² miss it by an ulp.
        sigma_u2 = pr.n * s * s
        lp = noisy_smoothness(sigma_u2=sigma_u2, n=pr.n, d=pr.d, lam=pr.lam, gamma1=gamma1)
        beta = pr.delta_in + eigenvalue_bound(sigma_u2, pr.n, pr.d, gamma2)
        return beta > 0.0 and log_det_epsilon(lp, beta) <= min(eps1, 700.0)

    root, step = s, 1e-12
    while not holds(s):
        s, step = root * (1.0 + step), step * 2.0
        if step > 1.0:
            return None
    return pr.n * s * s


def _point(pr: _Problem, eps1: float, gamma1: float, gamma2: float) -> _Point | None:
    sigma_u2 = _sigma_u2(pr, eps1, gamma1, gamma2)
    if sigma_u2 is None:
        return None
    lp = noisy_smoothness(sigma_u2=sigma_u2, n=pr.n, d=pr.d, lam=pr.lam, gamma1=gamma1)
    return _Point(eps1, gamma1, gamma2, sigma_u2, lp)


def _noise_free_point(pr: _Problem) -> _Point | None:
    """σ_u = 0 when the ridge alone meets Step 5: ε₁ = log(1 + λ/Δ_in), no γ₁, γ₂ needed."""
    if pr.delta_in <= 0.0:
        return None
    eps1 = log_det_epsilon(pr.lam, pr.delta_in)
    return _Point(eps1, 0.0, 0.0, 0.0, pr.lam) if eps1 < pr.epsilon else None


def _point_for_noise(pr: _Problem, sigma_u2: float, gamma1: float, gamma2: float) -> _Point | None:
    """The split a given σ_u² allows: ε₁ = log(1 + λ′/β), the least Step 5 (log-det term) accepts."""
    lp = noisy_smoothness(sigma_u2=sigma_u2, n=pr.n, d=pr.d, lam=pr.lam, gamma1=gamma1)
    beta = pr.delta_in + eigenvalue_bound(sigma_u2, pr.n, pr.d, gamma2)
    if beta <= 0.0:
        return None
    eps1 = log_det_epsilon(lp, beta)
    return _Point(eps1, gamma1, gamma2, sigma_u2, lp) if eps1 < LOG_DET_SHARE_MAX * pr.epsilon \
        else None


def predicted_error(*, sigma_u2: float, sigma_b2: float, delta_in: float, n: int, d: int,
                    lam: float, eta: float) -> float:
    """R = μ(d·σ_b² + η²ρ²)/(nμ + ρ)², ρ = σ_u² + Δ_in, μ = λ/d: Step 8 (choice of the splits).

    The excess risk (w − w*)ᵀ(nμ I)(w − w*)/n of the released w when the records' curvature is
    isotropic, Σ qqᵀ ≈ nμ I, and ‖w*‖ = η: public parameters only, no data.
    """
    mu = lam / d
    rho = sigma_u2 + delta_in
    return mu * (d * sigma_b2 + eta * eta * rho * rho) / (n * mu + rho) ** 2


def predicted_direction_error(*, sigma_u2: float, sigma_b2: float, delta_in: float, n: int,
                              d: int, lam: float, eta: float) -> float:
    """D = d·σ_b²/(nμη)² + (d + 1)(2μσ_u² + σ_u⁴/n)/(nμ + ρ)²: Step 8 (choice of the splits)
    for a classifier, ρ = σ_u² + Δ_in, μ = λ/d.

    The squared error of the direction of the released w, to first order, in the model of
    `predicted_error`: b's noise and the zero-mean fluctuation of Σ q̃q̃ᵀ, each against the
    signal Σ p = nμw*. The ridge and the mean σ_u² I of Σ uuᵀ scale w without turning it; they
    only damp the fluctuation. Public parameters only, no data.
    """
    mu = lam / d
    rho = sigma_u2 + delta_in
    fluctuation = (d + 1) * (2.0 * mu * sigma_u2 + sigma_u2 * sigma_u2 / n)
    return d * sigma_b2 / (n * mu * eta) ** 2 + fluctuation / (n * mu + rho) ** 2


LOSSES = ("squared", "logistic")
"""The study's loss: it only chooses Step 8's criterion (R for squared, D for logistic)."""
LOG_DET_SHARE_MAX = 0.999
"""ε₁ stays below this share of ε, so that ε₂ > 0 (Step 7)."""
_GAMMA_SHARES = (math.log(1e-6), math.log(0.45))
"""Search range of log(γ₁/δ) and log(γ₂/δ); each ≤ 0.45 δ keeps δ_K ≥ 0.1 δ."""
_SPENT_SHARES = (math.log(1e-6), 0.0)
"""Range of log(γ/δ) when checking a given noise: up to δ, the δ the split spends decides."""
_STARTS = ((math.log(0.01), math.log(0.01)), (math.log(0.45), math.log(0.45)))
"""Starting δ splits (γ₁/δ, γ₂/δ): a typical optimum, then the most generous, for small n."""
_NOISE_SPAN = math.log(1e4)
"""σ_u² is searched between the least one a δ split admits and 10⁴ times that."""
_SEARCH_TOLERANCE = 1e-4
"""Relative precision of σ_b while searching; the chosen split gets linear_term_sigma's 1e-9."""
_SWEEPS, _ITERATIONS = 3, 20


def _golden(f, lo: float, hi: float, iterations: int = _ITERATIONS) -> float:
    """Argmin of f on [lo, hi] by golden-section search.

    f is unimodal where finite and infinite only below some point of [lo, hi] (not enough noise
    for a proof), so two infinite probes move the bracket up.
    """
    r = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = lo + (1 - r) * (hi - lo), lo + r * (hi - lo)
    fa, fb = f(a), f(b)
    for _ in range(iterations):
        if fa <= fb and not math.isinf(fa):
            hi, b, fb = b, a, fa
            a = lo + (1 - r) * (hi - lo)
            fa = f(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + r * (hi - lo)
            fb = f(b)
    return a if fa <= fb else b


def _descend(cost, start: list[float], bounds, sweeps: int = _SWEEPS,
             iterations: int = _ITERATIONS) -> list[float]:
    """Coordinate descent: golden-section search on each coordinate in turn, `sweeps` times.

    bounds[i](x) gives the range of coordinate i at the current point x.
    """
    x = list(start)
    for _ in range(sweeps):
        for i, bound in enumerate(bounds):
            def along(v, i=i):
                return cost([*x[:i], v, *x[i + 1:]])
            x[i] = _golden(along, *bound(x), iterations)
    return x


def _gammas(pr: _Problem, lg1: float, lg2: float) -> tuple[float, float]:
    return pr.delta * math.exp(lg1), pr.delta * math.exp(lg2)


def _sigma_b2(pr: _Problem, pt: _Point, rel_tol: float = 1e-9) -> float:
    return linear_term_sigma(pr.epsilon - pt.eps1, pt.delta_k(pr), pt.kappa(pr), pr.p_bound,
                             rel_tol) ** 2


def _error(pr: _Problem, pt: _Point | None) -> float:
    """Step 8's predicted error at a point, σ_b to the search tolerance; inf without a proof."""
    if pt is None:
        return math.inf
    sigma_b2 = _sigma_b2(pr, pt, _SEARCH_TOLERANCE)
    if pr.loss == "logistic":
        return predicted_direction_error(sigma_u2=pt.sigma_u2, sigma_b2=sigma_b2,
                                         delta_in=pr.delta_in, n=pr.n, d=pr.d, lam=pr.lam,
                                         eta=pr.eta)
    return predicted_error(sigma_u2=pt.sigma_u2, sigma_b2=sigma_b2, delta_in=pr.delta_in,
                           n=pr.n, d=pr.d, lam=pr.lam, eta=pr.eta)


def _least_noise(pr: _Problem, lg1: float, lg2: float) -> float | None:
    """log of the least σ_u² for which the δ split (γ₁, γ₂) admits a proof (ε₁ < ε), or None."""
    sigma_u2 = _sigma_u2(pr, LOG_DET_SHARE_MAX * pr.epsilon, *_gammas(pr, lg1, lg2))
    return None if sigma_u2 is None else math.log(sigma_u2) + 1e-9


def _least_error(pr: _Problem) -> _Point | None:
    """Stage 1 of Step 8 (choice of the splits): least predicted error over (σ_u², γ₁, γ₂).

    ε₁ follows from the noise (`_point_for_noise`); coordinates x = (log σ_u², log γ₁/δ, log γ₂/δ).
    """
    def point(x: list[float]) -> _Point | None:
        return _point_for_noise(pr, math.exp(x[0]), *_gammas(pr, x[1], x[2]))

    def noise_range(x: list[float]) -> tuple[float, float]:
        low = _least_noise(pr, x[1], x[2])
        low = x[0] if low is None else low
        return low, low + _NOISE_SPAN

    for lg1, lg2 in _STARTS:
        low = _least_noise(pr, lg1, lg2)
        if low is not None:
            best = point(_descend(lambda x: _error(pr, point(x)), [low + 1.0, lg1, lg2],
                                  [noise_range, lambda x: _GAMMA_SHARES, lambda x: _GAMMA_SHARES]))
            if best is not None:
                return best
    return None


def _least_error_at_share(pr: _Problem, share: float) -> _Point | None:
    """Step 8 with ε₁ = share·ε fixed: least predicted error over (γ₁, γ₂), least σ_u² each."""
    def point(x: list[float]) -> _Point | None:
        return _point(pr, share * pr.epsilon, *_gammas(pr, *x))

    for start in _STARTS:
        if point(list(start)) is not None:
            best = point(_descend(lambda x: _error(pr, point(x)), list(start),
                                  [lambda x: _GAMMA_SHARES] * 2))
            if best is not None:
                return best
    return None


def _least_error_ridge(pr: _Problem, floor: _Point) -> tuple[_Problem, _Point]:
    """Stage 2 of Step 8 (choice of the splits), Δ_in left unset: least predicted error over
    (Δ_in, γ₁, γ₂) with σ_u² kept at stage 1's choice, so the ridge never replaces noise."""
    def problem(ridge: float) -> _Problem:
        return replace(pr, delta_in=ridge)

    def point(x: list[float]) -> _Point | None:
        return _point_for_noise(problem(x[0]), floor.sigma_u2, *_gammas(pr, x[1], x[2]))

    start = [0.0, math.log(floor.gamma1 / pr.delta), math.log(floor.gamma2 / pr.delta)]
    ridge_range = (0.0, 2.0 * (floor.sigma_u2 + pr.lam / pr.epsilon))
    x = _descend(lambda x: _error(problem(x[0]), point(x)), start,
                 [lambda x: ridge_range, lambda x: _GAMMA_SHARES, lambda x: _GAMMA_SHARES])
    best = point(x)
    if best is None or _error(problem(x[0]), best) >= _error(pr, floor):
        return pr, floor
    return problem(x[0]), best


def _proof_for_noise(pr: _Problem, sigma_u2: float, sigma_b: float) -> _Point | None:
    """A split under which Steps 3–7 prove (ε, pr.mechanism_delta) for the given noise, or None.

    Minimises the δ the split spends, γ₁ + γ₂ + linear_term_delta(ε − ε₁, σ_b), over (γ₁, γ₂)
    with ε₁ the least the noise allows; a proof exists when that is at most pr.mechanism_delta. Without noise on q
    the split is the ridge's alone (`_noise_free_point`).
    """
    if sigma_u2 == 0.0:
        free = _noise_free_point(pr)
        fits = free is not None and linear_term_delta(
            pr.epsilon - free.eps1, sigma_b, free.kappa(pr), pr.p_bound,
        ) <= pr.mechanism_delta
        return free if fits else None

    def spent(x: list[float]) -> float:
        pt = _point_for_noise(pr, sigma_u2, *_gammas(pr, *x))
        if pt is None:
            return math.inf
        return pt.gamma1 + pt.gamma2 + linear_term_delta(pr.epsilon - pt.eps1, sigma_b,
                                                         pt.kappa(pr), pr.p_bound)

    for start in _STARTS:
        if not math.isinf(spent(list(start))):
            x = _descend(spent, list(start), [lambda x: _SPENT_SHARES] * 2, sweeps=6,
                         iterations=48)
            pt = _point_for_noise(pr, sigma_u2, *_gammas(pr, *x))
            if pt is not None and pt.delta_k(pr) > 0.0 and linear_term_delta(
                    pr.epsilon - pt.eps1, sigma_b, pt.kappa(pr), pr.p_bound) <= pt.delta_k(pr):
                return pt
    return None


def calibrate_rigorous(
    *, epsilon: float, delta: float, n: int, d: int, lam: float, p_bound: float, eta: float,
    delta_in: float | None, log_det_share: float | None = None,
    noise_std: tuple[float, float] | None = None, loss: str = "squared",
) -> Calibration:
    """The proven calibration of docs/privacy.md, Steps 1–8, with its free splits optimised.

    Step 2 (conditioning on the noise) and Step 7 (the budget): on the event of Steps 3–4 the
    conditional mechanism is (ε₁ + ε₂, δ_K)-DP, so the released w is (ε, δ_K + γ₁ + γ₂)-DP with
    δ_K + γ₁ + γ₂ = mechanism_delta(δ); the norm check spends the rest of δ.

    Step 8 (choice of the splits): the split, and Δ_in when it is None, with the least
    `predicted_error`, or for `loss="logistic"` the least `predicted_direction_error`.
    `log_det_share` fixes ε₁ = share·ε (then the δ split minimises it).
    `noise_std` = (std_q, std_p) is the noise a study's text carries: when it is not this
    version's choice, the calibration keeps it (with its ridge) if it is an earlier version's
    choice (`_earlier_choices`), or if Steps 3–7 prove (ε, mechanism_delta(δ)) for it at Δ_in
    (0 if None) under some split, and raises CalibrationError otherwise. An earlier choice is
    proven again at mechanism_delta(δ) with its ridge; where that fails it keeps its proof at
    the whole δ and reports δ plus the norm check's share, which is what it spends.
    """
    if delta_in is not None and delta_in < 0.0:
        raise CalibrationError(f"delta_in={delta_in} must be ≥ 0")
    if log_det_share is not None and not 0.0 < log_det_share < 1.0:
        raise CalibrationError(f"log_det_share={log_det_share} must lie in (0, 1)")
    if loss not in LOSSES:
        raise CalibrationError(f"loss={loss!r} must be one of {', '.join(LOSSES)}")
    pr = _Problem(float(epsilon), float(delta), int(n), int(d), float(lam), float(p_bound),
                  float(eta), 0.0 if delta_in is None else float(delta_in), loss)
    cal = _calibrate_rigorous(pr, log_det_share, delta_in is None)
    if noise_std is None or tuple(noise_std) == (cal.noise_std_q, cal.noise_std_p):
        return cal
    std_q, std_p = float(noise_std[0]), float(noise_std[1])
    for earlier in _earlier_choices(pr, log_det_share, delta_in is None):
        if (std_q, std_p) == (earlier.noise_std_q, earlier.noise_std_p):
            try:
                return _calibrate_for_noise(replace(pr, delta_in=earlier.delta_in), std_q, std_p)
            except CalibrationError:
                return earlier
    try:
        return _calibrate_for_noise(pr, std_q, std_p)
    except CalibrationError:
        return _calibrate_for_noise(replace(pr, check_within_delta=False), std_q, std_p)


def _earlier_choices(pr: _Problem, share: float | None, choose_ridge: bool):
    """The calibrations earlier versions chose for these parameters, each with its ridge: Steps
    1–7 at the whole δ (before the norm check's share came out of it), and for a classifier the
    squared-error rule's split, which every loss got before the rule for classifiers."""
    whole = replace(pr, check_within_delta=False)
    yield _calibrate_rigorous(whole, share, choose_ridge)
    if pr.loss != "squared":
        yield _calibrate_rigorous(replace(pr, loss="squared"), share, choose_ridge)
        yield _calibrate_rigorous(replace(whole, loss="squared"), share, choose_ridge)


@lru_cache(maxsize=256)
def _calibrate_rigorous(pr: _Problem, share: float | None, choose_ridge: bool) -> Calibration:
    free = _noise_free_point(pr)
    if free is not None and (share is None or free.eps1 <= share * pr.epsilon):
        pt = free
    elif share is None:
        pt = _least_error(pr)
    else:
        pt = _least_error_at_share(pr, share)
    if pt is None:
        _refuse(pr)
    if choose_ridge and share is None:
        pr, pt = _least_error_ridge(pr, pt)
    return _rigorous(pr, pt, _sigma_b2(pr, pt))


@lru_cache(maxsize=256)
def _calibrate_for_noise(pr: _Problem, std_q: float, std_p: float) -> Calibration:
    sigma_u2, sigma_b2 = pr.n * std_q * std_q, pr.n * std_p * std_p
    pt = _proof_for_noise(pr, sigma_u2, math.sqrt(sigma_b2))
    if pt is None:
        raise CalibrationError(
            f"the noise std_q={std_q!r}, std_p={std_p!r} is not proven for these parameters: no "
            "split of ε and δ meets Steps 3–7 with it (docs/privacy.md)")
    return _rigorous(pr, pt, sigma_b2)


def _rigorous(pr: _Problem, pt: _Point, sigma_b2: float) -> Calibration:
    lp = pt.lambda_prime
    return _finish(
        mechanism=pr.mechanism_delta, mode="rigorous", epsilon=pr.epsilon, delta=pr.delta, n=pr.n, d=pr.d, lam=pr.lam,
        p_bound=pr.p_bound, eta=pr.eta, sigma_u2=pt.sigma_u2, sigma_b2=sigma_b2,
        delta_in=pr.delta_in, zeta=pr.lam * pr.eta + pr.p_bound, lambda_prime=lp,
        zeta_prime=lp * pr.eta + pr.p_bound,
        linear_sensitivity=linear_sensitivity(lp, pr.eta, pr.p_bound),
        epsilon_split={"log_det": pt.eps1, "linear": pr.epsilon - pt.eps1},
        delta_split={"delta_k": pt.delta_k(pr), "gamma_1": pt.gamma1, "gamma_2": pt.gamma2},
        proven=True,
        predicted_error=predicted_error(sigma_u2=pt.sigma_u2, sigma_b2=sigma_b2,
                                        delta_in=pr.delta_in, n=pr.n, d=pr.d, lam=pr.lam,
                                        eta=pr.eta),
        predicted_direction_error=None if pr.loss != "logistic" else predicted_direction_error(
            sigma_u2=pt.sigma_u2, sigma_b2=sigma_b2, delta_in=pr.delta_in, n=pr.n, d=pr.d,
            lam=pr.lam, eta=pr.eta),
    )


def _refuse(pr: _Problem) -> None:
    gap = eigenvalue_gap(pr.n, pr.d, 0.9 * pr.delta)
    if gap <= 0.0:
        raise CalibrationError(
            f"n={pr.n} is too small for rigorous mode at d={pr.d}: the smallest-eigenvalue bound "
            f"(Step 4) needs E χ_(n−1−d) − E χ_d ≈ √(n−1−d) − √d to exceed "
            f"1/√(2π) + Q⁻¹(γ₂) ≥ {1 / _SQRT_2PI + _q_inv(0.9 * pr.delta):.4g}"
        )
    raise CalibrationError(
        f"n={pr.n} is too small for rigorous mode at d={pr.d}, ε={pr.epsilon}: no split of ε "
        "and δ lets the noise that lifts the smallest eigenvalue outgrow the noisy record's norm "
        "(Steps 3–5); raise n or ε, or add a ridge Δ_in"
    )


@dataclass(frozen=True)
class ObjectivePerturbation:
    """Gaussian objective perturbation with clean features, under the accounting of Steps 5–7."""

    sigma2: float
    """Variance of each coordinate of the linear noise b ~ N(0, σ²I) (sum form)."""
    ridge: float
    """Δ: the objective is Σᵢ ½(qᵢᵀw)² − pᵢᵀw + (Δ/2)‖w‖² + bᵀw over ‖w‖ ≤ η."""
    epsilon_split: dict[str, float]


def objective_perturbation(
    *, lam: float, p_bound: float, eta: float, epsilon: float, delta: float, d: int,
    ridge: float | None = None,
) -> ObjectivePerturbation:
    """σ² and ridge of objective perturbation (no noisy features) with ipdp's tight accounting.

    The proof of docs/privacy.md with σ_u = 0: λ′ = λ and λ_min of everyone else's Hessian is at
    least Δ, so no γ₁, γ₂ are spent; ε₁ = log(1 + λ/Δ) (Step 5 (log-det term)) and σ is the
    least with linear_term_delta(ε − ε₁, σ, λη, P) ≤ δ (Step 6 (linear term)), under the
    replace-one relation of Step 1. The bound does not depend on d; the ridge defaults to 2λ/ε,
    Kifer et al.'s choice.
    """
    ridge = 2.0 * lam / epsilon if ridge is None else ridge
    if ridge <= 0.0:
        raise CalibrationError(f"ridge={ridge} must be > 0 for objective perturbation")
    eps1 = log_det_epsilon(lam, ridge)
    if eps1 >= epsilon:
        raise CalibrationError(
            f"ridge={ridge:.4g} is too small at ε={epsilon}: log(1 + λ/Δ) = {eps1:.4g} ≥ ε"
        )
    sigma = linear_term_sigma(epsilon - eps1, delta, lam * eta, p_bound)
    return ObjectivePerturbation(sigma2=sigma * sigma, ridge=ridge,
                                 epsilon_split={"log_det": eps1, "linear": epsilon - eps1})


def norm_check_delta(delta: float) -> float:
    """The norm check's share of a study's δ (REJECTION_DELTA_SHARE·δ, "The norm check")."""
    return REJECTION_DELTA_SHARE * delta


def mechanism_delta(delta: float) -> float:
    """The share of a study's δ that Steps 1–7 may spend: δ − norm_check_delta(δ), rounded down
    so that the two shares add up to at most δ in floating point too."""
    check = norm_check_delta(delta)
    share = delta - check
    while share + check > delta:
        share = math.nextafter(share, 0.0)
    return share


def per_record_share(share: float, epsilon: float, n: int) -> float:
    """π = share/((1 + e^ε)·n): a per-record probability of an event that changes what is
    released costs (1 + e^ε)·n·π of δ, so π spends exactly ``share`` ("The norm check"; the
    two-server clamp's τ_S, Step 13). 0.0 where e^ε overflows."""
    try:
        return share / ((1.0 + math.exp(epsilon)) * n)
    except OverflowError:
        return 0.0


def _finish(*, mechanism: float, **kw) -> Calibration:
    """The Calibration of a mode's noise, with every number derived from it computed here, once.

    ``kw["delta"]`` is the study's δ, ``mechanism`` the δ Steps 1–7 spend and ``kw["delta_split"]``
    its parts; the norm check's part joins them here. The δ reported is the study's when the two
    fit in it, else (a study created before the rule) their sum."""
    n, lam, p_bound, epsilon, delta = kw["n"], kw["lam"], kw["p_bound"], kw["epsilon"], kw["delta"]
    std_q = math.sqrt(kw["sigma_u2"] / n)
    std_p = math.sqrt(kw["sigma_b2"] / n)
    local = local_epsilon(
        sensitivity_over_sigma=_pair_mu(2.0 * math.sqrt(lam), std_q, 2.0 * p_bound, std_p),
        delta=delta,
    )
    check = norm_check_delta(delta)
    spent = max(delta, mechanism + check)
    per_record = per_record_share(check, epsilon, n)
    if per_record < sys.float_info.min:
        # The check's bounds are quantiles at π/4; a subnormal π has none in double precision,
        # and a π rounded up to one would cost more than the norm check's share of δ.
        raise CalibrationError(
            f"ε={epsilon:g} leaves the norm check's rejection budget π = {per_record:.3g} per "
            "record below double precision's normal range (\"The norm check\"); such an ε "
            "protects nothing anyway")
    return Calibration(
        **{**kw, "delta": spent, "delta_split": {**kw["delta_split"], "norm_check": check}},
        local_epsilon=local, local_delta=delta, noise_std_q=std_q, noise_std_p=std_p,
        mechanism_delta=mechanism, norm_check_delta=check,
        honest_rejection_probability=per_record)


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
    # Past x² ≈ 1e100 the correction terms are below double precision (and x2**3 overflows).
    series = 1.0 if x2 > 1e100 else 1.0 - 1.0 / x2 + 3.0 / x2**2 - 15.0 / x2**3
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
    eta: float, delta_in: float | None, log_det_share: float | None = None,
    noise_std: tuple[float, float] | None = None, loss: str = "squared",
) -> Calibration:
    """Dispatch on `mode`; raises CalibrationError naming the violated bound.

    Rigorous mode only: `delta_in=None` lets Step 8 choose Δ_in, `log_det_share` fixes ε₁/ε,
    `noise_std` keeps a study's own proven noise, `loss` (the study's, public) picks Step 8's
    criterion (calibrate_rigorous). Paper mode needs Δ_in, and its noise is Algorithm 1's.
    """
    common = {"epsilon": epsilon, "delta": delta, "n": n, "d": d, "lam": lam,
              "p_bound": p_bound, "eta": eta, "delta_in": delta_in}
    _check_inputs(**common)
    try:
        if mode == "paper":
            cal = calibrate_paper(**common)
            if noise_std is not None and tuple(noise_std) != (cal.noise_std_q, cal.noise_std_p):
                # A paper-mode study created before the norm check's share came out of δ.
                cal = calibrate_paper(**common, check_within_delta=False)
            if noise_std is not None and tuple(noise_std) != (cal.noise_std_q, cal.noise_std_p):
                raise CalibrationError(
                    f"the noise std_q={noise_std[0]!r}, std_p={noise_std[1]!r} is not paper "
                    "mode's (Algorithm 1)")
        else:
            cal = calibrate_rigorous(**common, log_det_share=log_det_share, noise_std=noise_std,
                                     loss=loss)
    except OverflowError:
        raise CalibrationError(
            f"ε={epsilon} is beyond what the calibration evaluates in double precision (e^ε "
            "overflows); such an ε protects nothing anyway") from None
    except CalibrationError:
        raise
    except (ArithmeticError, ValueError):  # ZeroDivisionError, a math domain error, inv_cdf(0)
        raise CalibrationError(_beyond_double_precision(common)) from None
    if not all(math.isfinite(v) for v in (cal.sigma_u2, cal.sigma_b2, cal.noise_std_q,
                                          cal.noise_std_p)):
        raise CalibrationError(_beyond_double_precision(common))
    return cal


#: Where the calibration's double-precision evaluation is trusted. Far outside, the noise
#: underflows, overflows or its searches stop converging; inside, every parameter a study can
#: mean is covered (ε = 10⁻⁶ is a billion times more noise than ε = 1 needs).
PARAMETER_RANGES: dict[str, tuple[float, float]] = {
    "epsilon": (1e-6, 1e6), "delta": (1e-100, 1.0), "lam": (1e-12, 1e12),
    "p_bound": (1e-12, 1e12), "eta": (1e-12, 1e12), "delta_in": (0.0, 1e12),
    "n": (2, 10**15), "d": (1, 10**6),
}


def _check_inputs(**params) -> None:
    """Refuse what the calibration cannot evaluate, before any arithmetic (a study read off the
    topic, a flag): each parameter must be a finite number within PARAMETER_RANGES (Δ_in may
    be None: Step 8 chooses it)."""
    for name, value in params.items():
        if name == "delta_in" and value is None:
            continue
        lo, hi = PARAMETER_RANGES[name]
        integral = name in ("n", "d")
        kind = Integral if integral else Real
        if (isinstance(value, bool) or not isinstance(value, kind)
                or not (math.isfinite(value) and lo <= value <= hi)
                or (name == "delta" and value >= 1.0)):
            interval = f"[{lo:g}, {hi:g}{')' if name == 'delta' else ']'}"
            raise CalibrationError(
                f"{name}={value} must be {'an integer' if integral else 'a finite number'} in "
                f"{interval}, where the calibration is evaluated reliably")


def _beyond_double_precision(params: dict) -> str:
    shown = ", ".join(f"{k}={v:g}" for k, v in params.items() if v is not None)
    return (f"the noise for {shown} is not a finite number in double precision (a tiny ε, δ "
            "or extreme bounds): choose parameters within a few orders of magnitude of 1")


REJECTION_DELTA_SHARE = 1e-3
"""Share of a study's δ the norm check spends: each honest record is rejected with probability
at most π = share·δ/((1 + e^ε)·n), so a round's n records spend at most share·δ, and Steps 1–7
get the rest (docs/privacy.md, "The norm check")."""


CLIPPING_ROUNDING = 1e-9
"""Relative slack over a clipping bound for noise-free vectors: a row scaled to norm B by
ipdp.losses.clip_rows can come out a few ulps above B."""


@dataclass(frozen=True)
class RecordNormBounds:
    """The records the aggregator folds and the gateway admits: q_low ≤ ‖q̃‖ ≤ q_high and
    p_low ≤ ‖p̃‖ ≤ p_high (one definition for both: aggregator/validate.py dead-letters what
    fails, gateway/checks.py refuses it at once)."""

    q_low: float
    q_high: float
    p_low: float
    p_high: float
    probability: float
    """π: an honest record is rejected with probability ≤ π, whatever its clean (q, p)."""

    def failures(self, sq_q, sq_p) -> list[tuple[object, RejectReason, str]]:
        """Where the squared norms (ipdp.wire.squared_norms, so that a record at a bound gets one
        verdict wherever it is checked) fail this check: ``(where, reason, detail)`` triples in
        the order the aggregator and the gateway apply them, for arrays or scalars."""
        return [
            (sq_q > self.q_high**2, RejectReason.NORM_OUT_OF_BOUNDS,
             f"‖q̃‖ exceeds {self.q_high:.4g}"),
            (sq_p > self.p_high**2, RejectReason.NORM_OUT_OF_BOUNDS,
             f"‖p̃‖ exceeds {self.p_high:.4g}"),
            (sq_q < self.q_low**2, RejectReason.NORM_OUT_OF_BOUNDS,
             f"‖q̃‖ is below {self.q_low:.4g}: less noise than any honest device adds"),
            (sq_p < self.p_low**2, RejectReason.NORM_OUT_OF_BOUNDS,
             f"‖p̃‖ is below {self.p_low:.4g}: less noise than any honest device adds"),
        ]


def record_norm_bounds(cal: Calibration, probability: float | None = None) -> RecordNormBounds:
    """The two-sided norm check of docs/privacy.md ("The norm check"), from the exact laws.

    With s the noise std and c the clean vector (‖c‖ ≤ B: √λ for q, P for p), ‖c + g‖²/s² is
    noncentral χ²_d(‖c‖²/s²), stochastically increasing in ‖c‖: the upper tail is largest at
    ‖c‖ = B, the lower tail at c = 0. Each of the four tails gets π/4, so an honest record is
    rejected with probability ≤ π (default: ``cal.honest_rejection_probability``).
    """
    if probability is None:
        probability = cal.honest_rejection_probability
    if not 0.0 < probability < 1.0:
        raise CalibrationError(f"rejection probability {probability} must lie in (0, 1)")
    q_low, q_high = noisy_norm_interval(cal.noise_std_q, cal.d, math.sqrt(cal.lam),
                                        probability / 4.0)
    p_low, p_high = noisy_norm_interval(cal.noise_std_p, cal.d, cal.p_bound, probability / 4.0)
    return RecordNormBounds(q_low, q_high, p_low, p_high, probability)


def noisy_norm_interval(std: float, d: int, bound: float, tail: float) -> tuple[float, float]:
    """[L, H] with P(‖c + g‖ < L) ≤ tail and P(‖c + g‖ > H) ≤ tail for every ‖c‖ ≤ bound,
    g ~ N(0, std²·I_d): L = std·√(χ²_d quantile at tail), H = std·√(χ²_d(bound²/std²)
    quantile at 1 − tail). Step "The norm check" of docs/privacy.md."""
    if std == 0.0:
        # No noise: ‖c‖ itself, which a device's clipping leaves a rounding error above bound.
        return 0.0, bound * (1.0 + CLIPPING_ROUNDING)
    # scipy.stats costs about a second to import and only the record checks need it.
    from scipy.stats import chi2, ncx2

    low = std * math.sqrt(chi2.ppf(tail, d))
    high = std * math.sqrt(ncx2.isf(tail, d, (bound / std) ** 2))
    return low, high


def noisy_norm_rejection(std: float, d: int, clean_norm: float, low: float,
                         high: float) -> float:
    """P(‖c + g‖ ∉ [low, high]) for ‖c‖ = clean_norm, g ~ N(0, std²·I_d), exactly."""
    if std == 0.0:
        return float(not low <= clean_norm <= high)
    from scipy.stats import ncx2

    nc = (clean_norm / std) ** 2
    return float(ncx2.cdf((low / std) ** 2, d, nc) + ncx2.sf((high / std) ** 2, d, nc))
