"""Privacy calibrations and noise of the baselines the accuracy benchmark compares against.

Everything is in the "sum" form the trainer uses: the empirical risk of n records is
J(w) = Σᵢ ½ (qᵢᵀw)² − pᵢᵀw over the ball ‖w‖ ≤ η, each record has smoothness ‖qᵢ‖² ≤ λ and is
ζ-Lipschitz on the ball with ζ = λη + P (docs/privacy.md).

**Neighbouring relation: replace one record**, as in ipdp's own calibration, for every method
here. Where a paper states its sensitivities for add/remove, they are recomputed for replace-one
in the docstring that uses them. The data bounds every method relies on are public: the clipping
‖q‖² ≤ λ, ‖p‖ ≤ P, and for the methods that need per-coordinate bounds (private Frank–Wolfe,
diffprivlib's LinearRegression) the box |x_j| ≤ 1/√d that the data sets' fixed preprocessing
guarantees (bench.accuracy_data).

- Objective perturbation, Gaussian variant (Kifer, Smith & Thakurta 2012, Algorithm 1 and
  Theorem 2): w = argmin_{‖w‖≤η} J(w) + (Δ/2)‖w‖² + bᵀw with Δ ≥ 2λ/ε and b ~ N(0, σ²I),
  σ² = ζ²(8 log(2/δ) + 4ε)/ε². The paper writes the objective divided by n; the minimiser is the
  same. The theorem needs every loss Hessian to have rank one with eigenvalue ≤ λ: here it is qqᵀ.
- Objective perturbation with ipdp's own accounting (`objpert_tight_sigma`): the same mechanism,
  σ for the ridge Δ from ipdp.calibration.objective_perturbation (no noise on q).
- Output perturbation (Chaudhuri, Monteleoni & Sarwate 2011, Algorithm 1): the minimiser w_Λ of
  J(w)/n + (Λ/2)‖w‖² over the ball has L2 sensitivity 2ζ/(nΛ); release w_Λ + v with density
  ∝ exp(−ε‖v‖ / (2ζ/(nΛ))), i.e. ‖v‖ ~ Gamma(d, scale 2ζ/(nΛε)) in a uniform direction: ε-DP.
- Output perturbation with Gaussian noise (Jain & Thakurta 2014): the same w_Λ plus N(0, σ²I);
  for a generalised linear model ⟨v, x⟩ ~ N(0, σ²‖x‖²) whatever d, which is what makes their risk
  bound dimension-independent. We calibrate σ with the analytic Gaussian mechanism (Balle & Wang
  2018, Theorem 8) at sensitivity 2ζ/(nΛ): exact for every ε, where the classical
  σ = Δ₂√(2 log(1.25/δ))/ε needs ε < 1 and is larger.
- Sufficient statistics perturbation, SSP and AdaSSP (Wang 2018): Gaussian noise on QᵀQ and Σp;
  AdaSSP adds a ridge chosen from a private estimate of λ_min(QᵀQ). See `ssp_noise`, `adassp`.
- OpenDP-SSP: QᵀQ and Σp in one Gaussian release whose scale OpenDP's own accountant sets for
  (ε, δ): see `opendp_ssp_sigma`. OpenDP's scikit-learn-style LinearRegression fits one feature
  only, so it cannot be a peer at d = 11 or 14.
- Private Frank–Wolfe over the L1 ball (the simplex of the 2d vertices ±ηeⱼ), one vertex per step
  chosen by the exponential mechanism: see `pfw_step_epsilon`, `private_frank_wolfe`.
- diffprivlib's LinearRegression and LogisticRegression, called as a user would: see
  `diffprivlib_linear`, `diffprivlib_logistic`.
- Input perturbation as Kang et al. (2020) publish it, **no proven guarantee**: every record's
  features get N(0, σ²I) once, labels stay in the clear, and T projected gradient steps run on the
  perturbed data, σ² = c·G²·T·log(1/δ)/(n(n−1)√Δ·ε²) (`kang2020_sigma`, `kang2020_descent`).
  For replace-one the released w is, on a simple pair of data sets, a Gaussian mechanism with
  μ = 2√λ/σ (docs/benchmarks/accuracy.md), so their claim needs c to grow like n²; `kang2020_proof_c`
  gives the least c that pair allows.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import numpy as np

from ipdp.calibration import gaussian_log_delta, kifer_sigma_b2, objective_perturbation
from ipdp.errors import CalibrationError
from trainer.solver import solve_constrained


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


def gaussian_sigma(*, sensitivity: float, epsilon: float, delta: float) -> float:
    """σ = Δ₂/μ*(ε, δ): the smallest Gaussian noise that is (ε, δ)-DP at L2 sensitivity Δ₂.

    Balle & Wang (2018, Theorem 8): exact for the Gaussian mechanism, any ε > 0.
    """
    return sensitivity / analytic_gaussian_mu(epsilon, delta)


def gaussian_output_sigma(*, n: int, reg: float, zeta: float, epsilon: float, delta: float) -> float:
    """σ = (2ζ/(nΛ)) / μ*(ε, δ): analytic Gaussian output perturbation (Jain & Thakurta 2014 style)."""
    return gaussian_sigma(sensitivity=output_sensitivity(n=n, reg=reg, zeta=zeta), epsilon=epsilon,
                          delta=delta)


def gamma_sphere(direction: np.ndarray, radius_gamma: float, scale: float) -> np.ndarray:
    """v = scale·G·g/‖g‖ for G ~ Gamma(d, 1), g ~ N(0, I_d): ‖v‖ ~ Gamma(d, scale), uniform direction."""
    return scale * radius_gamma * direction / np.linalg.norm(direction)


def project_ball(w: np.ndarray, eta: float) -> np.ndarray:
    """Euclidean projection onto ‖w‖ ≤ η: post-processing, so it keeps every guarantee."""
    norm = float(np.linalg.norm(w))
    return w if norm <= eta else w * (eta / norm)


def objpert_tight_sigma(
    *, epsilon: float, delta: float, lam: float, p_bound: float, eta: float, d: int, ridge: float,
) -> float | None:
    """σ of b for objective perturbation with q in the clear and ridge Δ, by ipdp's own accounting.

    The one adapter onto ipdp.calibration: `objective_perturbation`, the proof of docs/privacy.md
    with no noise on q (replace-one; ε₁ = log(1 + λ/Δ) for the log-det term, the rest of ε for
    the linear term, whose σ is the least that keeps its δ ≤ δ). None where the ridge is too
    small for that split (log(1 + λ/Δ) ≥ ε).
    """
    try:
        op = objective_perturbation(lam=lam, p_bound=p_bound, eta=eta, epsilon=epsilon,
                                    delta=delta, d=d, ridge=ridge)
    except CalibrationError:
        return None
    return math.sqrt(op.sigma2)


def gram_sensitivity(lam: float) -> float:
    """√2·λ: replace-one L2 sensitivity of the upper triangle (i ≤ j) of QᵀQ.

    Replacing q by q′ changes QᵀQ by D = q′q′ᵀ − qqᵀ. The upper triangle holds every entry of D
    once, so its squared norm is (‖D‖_F² + Σᵢ Dᵢᵢ²)/2 ≤ ‖D‖_F² = ‖q′‖⁴ + ‖q‖⁴ − 2(qᵀq′)² ≤ 2λ²,
    with equality at q = √λ·e₁, q′ = √λ·e₂. (Add/remove: λ.)
    """
    return math.sqrt(2.0) * lam


def linear_sensitivity(p_bound: float) -> float:
    """2P: replace-one L2 sensitivity of Σp, since ‖p − p′‖ ≤ 2P. (Add/remove: P.)"""
    return 2.0 * p_bound


def eigen_sensitivity(lam: float) -> float:
    """λ: replace-one sensitivity of λ_min(QᵀQ).

    D = q′q′ᵀ − qqᵀ satisfies −λI ⪯ −qqᵀ ⪯ D ⪯ q′q′ᵀ ⪯ λI, and Weyl's inequality moves every
    eigenvalue by at most ‖D‖₂ ≤ λ. (Add/remove: λ too.)
    """
    return lam


@dataclass(frozen=True)
class SSPNoise:
    """Standard deviations of SSP's noise on each upper-triangle entry of QᵀQ and on Σp."""

    sigma_gram: float
    sigma_lin: float


def ssp_noise(*, epsilon: float, delta: float, lam: float, p_bound: float) -> SSPNoise:
    """Sufficient statistics perturbation: QᵀQ and Σp each released (ε/2, δ/2)-DP.

    Vu & Slavkovic (2009), Foulds et al. (2016); the SSP baseline of Wang (2018). Each release is
    a Gaussian mechanism calibrated exactly (`gaussian_sigma`) at its replace-one sensitivity
    (`gram_sensitivity`, `linear_sensitivity`); basic composition gives (ε, δ). The noise on
    QᵀQ is a symmetric matrix with i.i.d. entries on and above the diagonal. The model is the
    minimiser over the ball of the released quadratic (`solve_trust_region`: the noisy Gram
    matrix may be indefinite), which is post-processing.
    """
    half_e, half_d = epsilon / 2.0, delta / 2.0
    return SSPNoise(
        sigma_gram=gaussian_sigma(sensitivity=gram_sensitivity(lam), epsilon=half_e, delta=half_d),
        sigma_lin=gaussian_sigma(sensitivity=linear_sensitivity(p_bound), epsilon=half_e,
                                 delta=half_d),
    )


@functools.cache
def opendp_ssp_sigma(*, epsilon: float, delta: float, lam: float, p_bound: float, d: int) -> float:
    """σ of OpenDP-SSP: the vector (upper triangle of QᵀQ, Σp) released once with N(0, σ²) per
    entry, σ the least scale OpenDP's own accountant proves (ε, δ) for.

    The measurement is OpenDP's ``make_gaussian`` on a vector of d(d+1)/2 + d floats under the
    L2 distance (ρ-zCDP, ρ = Δ²/(2σ²)), chained with ``make_zCDP_to_approxDP`` and
    ``make_fix_delta(δ)``, whose privacy map at the replace-one sensitivity
    Δ = √(gram_sensitivity(λ)² + linear_sensitivity(P)²) = √(2λ² + 4P²) gives (ε′, δ);
    ``binary_search_param`` finds the least σ with ε′ ≤ ε. OpenDP 0.16's scikit-learn-style
    ``LinearRegression`` is a private Theil–Sen estimator of one feature (its ``x_bounds`` must
    hold exactly one interval), so the library's d-dimensional regression is built, as a user
    would, from its Gaussian mechanism and accountant. The model is the minimiser over the ball
    of the released quadratic (post-processing), as for SSP.
    """
    import opendp.prelude as dp

    dp.enable_features("contrib")
    size = d * (d + 1) // 2 + d
    space = (dp.vector_domain(dp.atom_domain(T=float, nan=False), size=size),
             dp.l2_distance(T=float))
    sensitivity = math.hypot(gram_sensitivity(lam), linear_sensitivity(p_bound))

    def release(scale: float):
        gaussian = dp.m.make_gaussian(*space, scale=scale)
        return dp.c.make_fix_delta(dp.c.make_zCDP_to_approxDP(gaussian), delta=delta)

    return float(dp.binary_search_param(release, d_in=sensitivity, d_out=(epsilon, delta)))


ADASSP_RHO = 0.05
"""Failure probability ρ of AdaSSP's ridge choice; 0.05 as in the author's experiments."""


@dataclass(frozen=True)
class AdaSSP:
    """AdaSSP's noise (standard deviations) and the constants of its ridge rule."""

    sigma_eig: float
    """Noise on λ_min(QᵀQ)."""
    sigma_gram: float
    """Noise on each upper-triangle entry of QᵀQ."""
    sigma_lin: float
    """Noise on each entry of Σp."""
    eig_shift: float
    """σ_eig·√(log(6/δ)): the released λ_min is shifted down by this, so it rarely overshoots."""
    ridge_target: float
    """σ_gram·√(d·log(2d²/ρ)): the smallest eigenvalue the ridged noisy Gram matrix aims for."""


def adassp(
    *, epsilon: float, delta: float, lam: float, p_bound: float, d: int, rho: float = ADASSP_RHO
) -> AdaSSP:
    """Wang (2018), Algorithm 2 (AdaSSP), with the paper's budget split and replace-one noise.

    Three Gaussian releases, each (ε/3, δ/3)-DP, so (ε, δ)-DP by basic composition, the split
    the paper states:
    1. λ̃_min = max(λ_min(QᵀQ) + σ_eig·Z − σ_eig·√(log(6/δ)), 0), sensitivity λ
       (`eigen_sensitivity`);
    2. ridge = max(0, σ_gram·√(d·log(2d²/ρ)) − λ̃_min): post-processing of step 1;
    3. QᵀQ + σ_gram·Z_sym, sensitivity √2·λ (`gram_sensitivity`);
    4. Σp + σ_lin·z, sensitivity 2P (`linear_sensitivity`);
    w = argmin_{‖w‖≤η} ½wᵀ(QᵀQ + σ_gram·Z_sym + ridge·I)w − (Σp + σ_lin·z)ᵀw.

    Differences from the paper, none of which weakens the guarantee: (a) sensitivities for
    replace-one (the paper's 𝒳², 𝒳𝒴 are add/remove bounds; ours are √2·λ and 2P for the two
    statistics); (b) each σ from the analytic Gaussian mechanism, where the paper writes
    √(log(6/δ))/(ε/3) times the sensitivity (`adassp_paper_sigma`; ours is 1.42× smaller at
    ε = 1 and 2.68× at ε = 0.1, δ = 0.01); the shift and the ridge target keep the paper's form
    in units of the σ actually used, so with the paper's σ they are its log(6/δ)/(ε/3) and
    √(d·log(6/δ)·log(2d²/ρ))·𝒳²/(ε/3); (c) the model is the minimiser over the ball, like
    every method here, not (…)⁻¹(…).
    """
    e3, d3 = epsilon / 3.0, delta / 3.0
    sigma_eig = gaussian_sigma(sensitivity=eigen_sensitivity(lam), epsilon=e3, delta=d3)
    sigma_gram = gaussian_sigma(sensitivity=gram_sensitivity(lam), epsilon=e3, delta=d3)
    return AdaSSP(
        sigma_eig=sigma_eig,
        sigma_gram=sigma_gram,
        sigma_lin=gaussian_sigma(sensitivity=linear_sensitivity(p_bound), epsilon=e3, delta=d3),
        eig_shift=sigma_eig * math.sqrt(math.log(6.0 / delta)),
        ridge_target=sigma_gram * math.sqrt(d * math.log(2.0 * d * d / rho)),
    )


def adassp_paper_sigma(*, sensitivity: float, epsilon: float, delta: float) -> float:
    """The paper's noise for one AdaSSP release: sensitivity·√(log(6/δ))/(ε/3) (Wang 2018)."""
    return sensitivity * math.sqrt(math.log(6.0 / delta)) / (epsilon / 3.0)


def adassp_ridge(lam_min: float, z: float, cal: AdaSSP) -> float:
    """Steps 1–2 of AdaSSP: the ridge from λ̃_min = max(λ_min + σ_eig·z − shift, 0)."""
    noisy_min = max(lam_min + cal.sigma_eig * z - cal.eig_shift, 0.0)
    return max(0.0, cal.ridge_target - noisy_min)


KANG_STEPS = 50
"""T: projected gradient steps of the Kang et al. (2020) baseline."""


def kang2020_sigma(*, c: float, lipschitz: float, steps: int, delta: float, n: int,
                   strong_convexity: float, epsilon: float) -> float:
    """σ of the feature noise, σ² = c·G²·T·log(1/δ)/(n(n−1)√Δ·ε²) (Kang et al. 2020), with
    G the Lipschitz constant of the loss on the ball and Δ the strong convexity of the mean
    objective (1/n)Σℓ + (Δ/2)‖w‖²."""
    return math.sqrt(c * lipschitz**2 * steps * math.log(1.0 / delta)
                     / (n * (n - 1) * math.sqrt(strong_convexity) * epsilon**2))


def kang2020_proof_c(*, lam: float, lipschitz: float, steps: int, delta: float, n: int,
                     strong_convexity: float, epsilon: float) -> float:
    """The least c for which the pair "other labels 0, (√λe₁, +1) against (√λe₁, −1)" is
    (ε, δ)-DP: the released w is a Gaussian mechanism with μ = 2√λ/σ, so σ ≥ 2√λ/μ*(ε, δ)."""
    sigma = 2.0 * math.sqrt(lam) / analytic_gaussian_mu(epsilon, delta)
    unit = kang2020_sigma(c=1.0, lipschitz=lipschitz, steps=steps, delta=delta, n=n,
                          strong_convexity=strong_convexity, epsilon=epsilon)
    return (sigma / unit) ** 2


def kang2020_descent(h: np.ndarray, lin: np.ndarray, *, n: int, strong_convexity: float,
                     eta: float, steps: int) -> np.ndarray:
    """T projected gradient steps from w = 0 on (1/n)(½wᵀhw − linᵀw) + (Δ/2)‖w‖² over ‖w‖ ≤ η.

    h, lin: (..., d, d) and (..., d), batched over leading axes; step 1/L with L the largest
    eigenvalue of h/n + ΔI (per problem).
    """
    d = lin.shape[-1]
    hessian = h / n + strong_convexity * np.eye(d)
    step = 1.0 / np.linalg.eigvalsh(hessian)[..., -1:]
    w = np.zeros_like(lin)
    for _ in range(steps):
        w = w - step * (np.einsum("...ij,...j->...i", hessian, w) - lin / n)
        norm = np.linalg.norm(w, axis=-1, keepdims=True)
        w = w * np.minimum(1.0, eta / np.maximum(norm, 1e-300))
    return w


def symmetric_normal(rng: np.random.Generator, d: int) -> np.ndarray:
    """d×d symmetric matrix with i.i.d. N(0, 1) entries on and above the diagonal."""
    upper = np.triu(rng.standard_normal((d, d)))
    return upper + np.triu(upper, 1).T


def solve_trust_region(h: np.ndarray, lin: np.ndarray, eta: float) -> np.ndarray:
    """argmin_{‖w‖≤η} ½wᵀhw − linᵀw for a symmetric h that may be indefinite (noisy Gram matrix).

    A positive semi-definite h goes to ipdp.solver.solve_constrained. Otherwise the minimiser lies
    on the sphere ‖w‖ = η (Moré & Sorensen 1983), where the objective differs from that of
    h − λ_min·I by a constant, so the same solver on the shifted matrix finds it; in the "hard
    case" (lin orthogonal to the bottom eigenvector) the free solution is completed along that
    eigenvector up to the sphere. Post-processing of released statistics.
    """
    h = 0.5 * (h + h.T)
    eig, vec = np.linalg.eigh(h)
    if eig[0] >= 0.0:
        return solve_constrained(h, lin, eta).w
    shifted = eig - eig[0]
    try:
        return solve_constrained(h - eig[0] * np.eye(len(lin)), lin, eta).w
    except ValueError:
        c = vec.T @ lin
        free = shifted > len(lin) * np.finfo(float).eps * shifted[-1]
        coef = np.zeros_like(c)
        coef[free] = c[free] / shifted[free]
        coef[0] = math.sqrt(max(eta * eta - float(coef @ coef), 0.0))
        return vec @ coef


def project_l1_ball(v: np.ndarray, eta: float) -> np.ndarray:
    """Euclidean projection onto ‖w‖₁ ≤ η (Duchi, Shalev-Shwartz, Singer & Chandra 2008)."""
    a = np.abs(v)
    if a.sum() <= eta:
        return v.copy()
    u = np.sort(a)[::-1]
    cs = np.cumsum(u)
    k = int(np.nonzero(u * np.arange(1, len(u) + 1) > cs - eta)[0][-1])
    theta = (cs[k] - eta) / (k + 1)
    return np.sign(v) * np.maximum(a - theta, 0.0)


def solve_l1_ball(
    h: np.ndarray, lin: np.ndarray, eta: float, *, tol: float = 1e-12, max_iter: int = 100_000
) -> np.ndarray:
    """argmin_{‖w‖₁≤η} ½wᵀhw − linᵀw for a positive semi-definite h.

    Accelerated projected gradient (FISTA, Beck & Teboulle 2009) with step 1/λ_max(h) and the
    gradient restart of O'Donoghue & Candès (2015), stopped when an iterate moves less than
    tol·η. The L1 ball is the simplex of the 2d vertices ±η·eⱼ, the domain of the simplex
    variant of the accuracy study.
    """
    step = 1.0 / max(float(np.linalg.eigvalsh(h)[-1]), np.finfo(float).tiny)
    w = np.zeros_like(lin)
    y, t = w, 1.0
    for _ in range(max_iter):
        w_next = project_l1_ball(y - step * (h @ y - lin), eta)
        moved = w_next - w
        if float(np.linalg.norm(moved)) <= tol * eta:
            return w_next
        if float((y - w_next) @ moved) > 0.0:  # momentum points uphill: restart
            t = 1.0
        t_next = 0.5 * (1.0 + math.sqrt(1.0 + 4.0 * t * t))
        y = w_next + ((t - 1.0) / t_next) * moved
        w, t = w_next, t_next
    return w


def zcdp_rho(epsilon: float, delta: float) -> float:
    """Largest ρ with ρ + 2√(ρ·log(1/δ)) ≤ ε.

    ρ-zCDP implies (ρ + 2√(ρ·log(1/δ)), δ)-DP (Bun & Steinke 2016, Proposition 1.3).
    """
    log_inv = math.log(1.0 / delta)
    root = math.sqrt(log_inv + epsilon) - math.sqrt(log_inv)
    return root * root


def pfw_step_epsilon(*, epsilon: float, delta: float, steps: int) -> float:
    """ε₀ of each step's exponential mechanism so that `steps` of them are (ε, δ)-DP together.

    An exponential mechanism whose log-probabilities move by at most ε₀ between neighbours in
    total range (ε₀-bounded range) is ε₀²/8-zCDP (Cesar & Rogers 2021); zCDP adds up under
    adaptive composition (Bun & Steinke 2016), so T steps are T·ε₀²/8-zCDP. Hence
    ε₀ = √(8ρ/T) with ρ = zcdp_rho(ε, δ).
    """
    return math.sqrt(8.0 * zcdp_rho(epsilon, delta) / steps)


def pfw_score_width(*, coord_bound: float, eta: float) -> float:
    """W = 4ηb(bη + 1): range of one step's score change between replace-one neighbours.

    The score of vertex v = ±η·eⱼ is ⟨∇J(w), v⟩ = ±η·∂ⱼJ(w). Replacing one record (q, p) by
    (q′, p′) changes ∂ⱼJ by (qᵀw)qⱼ − pⱼ − (q′ᵀw)q′ⱼ + p′ⱼ, and with ‖q‖_∞, ‖p‖_∞ ≤ b
    (p = y·q, |y| ≤ 1) and ‖w‖₁ ≤ η that is at most 2b²η + 2b in absolute value. Over the 2d
    vertices the score changes therefore span an interval of width ≤ 2η(2b²η + 2b).
    """
    return 4.0 * eta * coord_bound * (coord_bound * eta + 1.0)


def private_frank_wolfe(
    h: np.ndarray, lin: np.ndarray, *, eta: float, beta: float, gumbel: np.ndarray
) -> np.ndarray:
    """Frank–Wolfe over ‖w‖₁ ≤ η, each step's vertex chosen by the exponential mechanism.

    From w = 0, step t draws v ∈ {±η·eⱼ} with probability ∝ exp(−β⟨∇J(w), v⟩), ∇J(w) = hw − lin
    (the Gumbel-max trick on gumbel[t], shape (2d,)), and moves to (1 − μ)w + μv, μ = 2/(t + 2);
    len(gumbel) steps. Talwar, Thakurta & Zhang (2015). With β = ε₀/`pfw_score_width`, each step
    is ε₀-bounded range (`pfw_step_epsilon`).
    """
    d = len(lin)
    w = np.zeros(d)
    for t, g in enumerate(gumbel):
        grad = h @ w - lin
        k = int(np.argmax(-beta * eta * np.concatenate([grad, -grad]) + g))
        mu = 2.0 / (t + 2.0)
        w *= 1.0 - mu
        w[k % d] += mu * (eta if k < d else -eta)
    return w


def diffprivlib_linear(
    x: np.ndarray, y: np.ndarray, *, epsilon: float, coord_bound: float, y_bound: float, seed: int
) -> np.ndarray:
    """Coefficients of diffprivlib_linear_model's model fitted to (x, y)."""
    return _fit_quietly(diffprivlib_linear_model(epsilon=epsilon, coord_bound=coord_bound,
                                                 y_bound=y_bound, seed=seed), x, y)


def diffprivlib_linear_model(*, epsilon: float, coord_bound: float, y_bound: float, seed: int):
    """diffprivlib's LinearRegression, unfitted, set up as a user would, with public bounds.

    The functional mechanism (Zhang et al. 2012): Laplace noise on each of the 1 + d + d(d+1)/2
    coefficients of the squared loss as a polynomial in w, each at ε/(1 + d + d(d+1)/2), each
    scaled to the range of one record's contribution computed from bounds_X = ±coord_bound per
    feature and bounds_y = ±y_bound (replace-one). Pure ε-DP. No intercept (the features carry
    one where the data set needs it), so no budget goes to centring. The data is never read to
    set a bound: a PrivacyLeakWarning would be raised as an error.
    """
    from diffprivlib.accountant import BudgetAccountant
    from diffprivlib.models import LinearRegression

    return LinearRegression(epsilon=epsilon, bounds_X=(-coord_bound, coord_bound),
                            bounds_y=(-y_bound, y_bound), fit_intercept=False,
                            random_state=seed, accountant=BudgetAccountant())


def diffprivlib_logistic(
    x: np.ndarray, labels: np.ndarray, *, epsilon: float, data_norm: float, c: float, seed: int
) -> np.ndarray:
    """Coefficients of diffprivlib_logistic_model's model fitted to (x, labels)."""
    return _fit_quietly(diffprivlib_logistic_model(epsilon=epsilon, data_norm=data_norm, c=c,
                                                   seed=seed), x, labels)


def diffprivlib_logistic_model(*, epsilon: float, data_norm: float, c: float, seed: int):
    """diffprivlib's LogisticRegression (real logistic loss), unfitted, with a public norm.

    Objective perturbation of Chaudhuri, Monteleoni & Sarwate (2011, Algorithm 2): a random
    linear term whose norm is Gamma-distributed is added to the L2-regularised logistic loss,
    mean loss + ‖w‖²/(2Cn), with ‖x‖ ≤ data_norm; pure ε-DP, replace-one (their neighbouring
    relation). No intercept.
    """
    from diffprivlib.accountant import BudgetAccountant
    from diffprivlib.models import LogisticRegression

    return LogisticRegression(epsilon=epsilon, data_norm=data_norm, C=c, fit_intercept=False,
                              random_state=seed, accountant=BudgetAccountant())


def _fit_quietly(model, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Fit; convergence and overflow warnings are the library's business, a privacy leak is ours."""
    from diffprivlib.utils import PrivacyLeakWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.simplefilter("error", PrivacyLeakWarning)
        model.fit(x, y)
    return np.asarray(model.coef_, dtype=np.float64).ravel()
