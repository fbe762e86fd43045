"""Calibration of the two-server mode, and what a two-server device does to one record.

The servers sum fixed-point records (ipdp.fixed_point), not reals, so the guarantee is proven
for what they sum: docs/privacy.md, "Two-server mode: the proof for the fixed-point sums",
Steps 9–14. Each function below names the step it computes.

A device sends, split into two additive shares, the encoding of

    q̃ = q + u,  u ~ N(0, σ_u²/n·I)   (the one-server mode's continuous Gaussian, unchanged)
    p̂ = h_b·(rint(p/h_b) − S),   S = P₁ − P₂, P₁, P₂ ~ Poisson(μ) per coordinate

with M = q̃q̃ᵀ rounded to the encoding's grid h = 2^−f. The trainer decodes the round's sum,
adds a dither V ~ U[−h_b/2, h_b/2)^d to b and solves as in one-server mode.

calibrate_two_server starts from the one-server calibration at the same parameters and keeps
its σ_u, Δ_in and δ split: the rounding of q̃q̃ᵀ costs a little of ε₁ (Step 10), the grid noise a
little of ε₂ and δ_K (Steps 11–12), and σ_b is the least that pays for both.
"""

from __future__ import annotations

import math
import sys

import numpy as np
from pydantic import BaseModel, ConfigDict

from ipdp.calibration import (
    REJECTION_DELTA_SHARE,
    Calibration,
    CalibrationError,
    calibrate,
    eigenvalue_bound,
    linear_term_delta,
    noisy_norm_interval,
    per_record_share,
)
from ipdp.fixed_point import FixedPoint, fraction_bits_for
from ipdp.grid_noise import (
    POISSON_MEAN_MAX,
    dither_density_slack,
    dither_loss_slack,
    skellam,
    skellam_tail_point,
    system_generator,
)
from ipdp.losses import NoiseSource, SystemNoise

CLAMP_DELTA_SHARE = REJECTION_DELTA_SHARE
"""Share of a study's δ spent on clamping (Step 13): a two-server study has no norm check (the
servers see no record), and its clamp takes the check's share."""

BOX_SHARE = 1e-5
"""Share of δ_K spent on the dithered noise leaving the box where its density is compared with
the Gaussian's (Step 12)."""

FLOAT_PRODUCT_ERROR = 2.0**-53
"""Relative error of one double-precision product (round to nearest)."""

SMALLEST_SUBNORMAL = 2.0**-1074


class TwoServerCalibration(BaseModel):
    """The two-server noise, encoding and grids, and the split of (ε, δ) the proof uses."""

    model_config = ConfigDict(frozen=True)

    one_server: Calibration
    """The one-server calibration at the same parameters: σ_u, Δ_in, γ₁, γ₂ and λ′ are its."""
    epsilon: float
    delta: float
    n: int
    d: int
    sigma_u2: float
    sigma_b2: float
    """σ_b² = h_b²·2nμ: the variance of each coordinate of the round's linear noise h_b·S."""
    delta_in: float
    noise_std_q: float
    poisson_mean: float
    """μ: each device draws S = Poisson(μ) − Poisson(μ) per coordinate."""
    linear_bits: int
    """f_b: p̂ lies on the grid h_b = 2^−f_b (f_b ≤ f)."""
    encoding: FixedPoint
    lambda_prime: float
    record_bound: float
    """H_q²: ‖q̃‖² ≤ H_q² for every record of the round on the good event (Step 13)."""
    rounding: float
    """e = d·(h/2 + 2⁻⁵³·H_q²): spectral norm bound of one record's rounding error (Step 10)."""
    beta: float
    """β′ = Δ_in + β₀ − (n−1)·e: the smallest eigenvalue of the others' rounded sum plus the
    ridge (Steps 4 and 10)."""
    box_radius: float
    """r: the box {|y_c| ≤ r√x} where the dithered Skellam density is compared (Step 12)."""
    grid_variance: float
    """x = 2nμ = σ_b²/h_b²: the variance of the round's S in grid units."""
    slack: dict[str, float]
    """η_L (dither and Skellam against Gaussian in the privacy loss), η_ξ (rounding of q̃q̃ᵀ in
    the shift), η₀ (log of the density against the Gaussian's, on the box): Step 12."""
    epsilon_split: dict[str, float]
    """ε = log_det (Step 5's log(1 + λ′/β)) + rounding (what Step 10 adds to it) + grid
    (η_L + η_ξ, Step 12) + linear (the ε₂ the Gaussian bound of Step 6 is evaluated at)."""
    delta_split: dict[str, float]
    """δ ≥ linear + box + gamma_1 + gamma_2 + clamp_q + clamp_p (Step 14)."""
    proven: bool = True

    @property
    def linear_step(self) -> float:
        """h_b = 2^−f_b."""
        return math.ldexp(1.0, -self.linear_bits)

    @property
    def linear_p_bound(self) -> float:
        """P + h_b√d/2: the rounded linear term's bound (‖rint(p/h_b)h_b‖ ≤ P + h_b√d/2)."""
        return self.one_server.p_bound + self.linear_step * math.sqrt(self.d) / 2.0


def rounding_slack(fraction_bits: int, d: int, record_bound: float) -> float:
    """e: ‖Â − q̃q̃ᵀ‖₂ ≤ e for a record with ‖q̃‖² ≤ H_q²: Step 10 (rounding slack).

    Each entry is rint(2^f·fl(q̃_iq̃_j))·2^−f with |q̃_iq̃_j| ≤ ‖q̃‖² ≤ H_q²: the product's error is
    at most 2⁻⁵³·H_q² (plus the smallest subnormal), the rounding's h/2. A symmetric matrix with
    entries bounded by t has spectral norm at most d·t (the largest absolute row sum)."""
    step = math.ldexp(1.0, -fraction_bits)
    return d * (step / 2.0 + FLOAT_PRODUCT_ERROR * record_bound + SMALLEST_SUBNORMAL)


def rounded_log_det_epsilon(lambda_prime: float, beta: float, rounding: float, d: int) -> float:
    """log(1 + λ′/β′) + d·log((β′ + e)/(β′ − e)): the Jacobian part of the privacy loss when the
    differing record's matrix is aaᵀ + E, ‖E‖₂ ≤ e < β′: Step 10 (rounding slack)."""
    if not rounding < beta:
        return math.inf
    return math.log1p(lambda_prime / beta) + d * (math.log1p(rounding / beta)
                                                   - math.log1p(-rounding / beta))


def linear_bits_for(sigma_b: float, n: int, fraction_bits: int) -> int:
    """The finest linear grid 2^−f_b (f_b ≤ f) whose Poisson mean σ_b²/(2n·h_b²) is at most
    POISSON_MEAN_MAX (ipdp.grid_noise)."""
    return min(fraction_bits, math.floor(math.log2(math.sqrt(2.0 * n * POISSON_MEAN_MAX)
                                                   / sigma_b)))


class LinearTerm(BaseModel):
    """The dithered grid noise's part of the proof at one σ_b (Step 12)."""

    model_config = ConfigDict(frozen=True)

    linear_bits: int
    grid_variance: float
    box_radius: float
    eta_loss: float
    eta_shift: float
    eta_density: float
    linear_delta: float
    """e^{η₀}·linear_term_delta(ε₂ − η_L − η_ξ, σ_b, λ′η, P + h_b√d/2)."""
    box_delta: float


def dithered_linear_term(*, epsilon2: float, sigma_b: float, n: int, d: int, kappa: float,
                         p_bound: float, shift_rounding: float, fraction_bits: int,
                         box_delta: float) -> LinearTerm | None:
    """Step 12 (dithered linear term): the δ of the linear term for the dithered Skellam noise.

    In grid units y = R/h_b has density g(y) = pmf(k(y)), k(y) the integer nearest y. On the box
    {|y_c| ≤ r√x}, with y′ = y + g/h_b and K = r√x + ½:
    log g(y)/g(y′) ≤ (‖y′‖² − ‖y‖²)/(2x) + η_L (Step 11 and |k − y| ≤ ½), the rounding of q̃q̃ᵀ adds
    η_ξ to the Gaussian loss, and g ≤ e^{η₀}·N(0, xI) there. The box is left with probability at
    most box_delta (Chernoff). None when ε₂ does not cover the slack.
    """
    linear_bits = linear_bits_for(sigma_b, n, fraction_bits)
    h_b = math.ldexp(1.0, -linear_bits)
    x = (sigma_b / h_b) ** 2
    p_eff = p_bound + h_b * math.sqrt(d) / 2.0
    rho = 2.0 * p_eff
    shift = kappa + rho + shift_rounding  # Γ″ ≥ ‖g‖
    tail = skellam_tail_point(box_delta / (2.0 * d), x)
    radius_grid = tail + 0.5 + shift / h_b  # r√x: |y_c| ≤ r√x − Γ″/h_b leaves y and y′ in the box
    eta_loss = dither_loss_slack(x, radius_grid, shift / h_b, d)
    radius = radius_grid * h_b  # rσ in real units
    eta_shift = (2.0 * math.sqrt(d) * radius * shift_rounding
                 + 2.0 * (kappa + rho) * shift_rounding + shift_rounding**2) / (2.0 * sigma_b**2)
    eta_density = dither_density_slack(x, radius_grid, d)
    left = epsilon2 - eta_loss - eta_shift
    if left <= 0.0:
        return None
    linear = math.exp(eta_density) * linear_term_delta(left, sigma_b, kappa, p_eff)
    return LinearTerm(linear_bits=linear_bits, grid_variance=x,
                      box_radius=radius_grid / math.sqrt(x), eta_loss=eta_loss,
                      eta_shift=eta_shift, eta_density=eta_density, linear_delta=min(1.0, linear),
                      box_delta=box_delta)


def clamp_bounds(*, one: Calibration, linear_bits: int, poisson_mean: float,
                 share: float | None = None) -> tuple[float, float, float, float]:
    """Step 13 (clamping and range): (H_q², B_q, B_p, τ_S).

    τ_q = share/(2(n+1)) per record: ‖q̃‖ ≤ H_q except with probability τ_q (noncentral χ²_d at
    the worst clean norm, as the norm check; without noise, √λ and clipping's rounding).
    τ_S = share/(2(1 + e^ε)n): a device's S has |S_j| ≤ k for every j except with probability
    τ_S (Chernoff, union over 2d tails). A matrix entry stays within B_q = fl(H_q²) (plus h/2,
    checked with the encoding): |q̃_jq̃_k| ≤ ‖q̃‖² ≤ H_q² and rounding to nearest is monotone, so
    fl(q̃_jq̃_k) ≤ fl(H_q·H_q). A linear entry stays within B_p = P + h_b(k + ½). ``share`` is
    the δ the clamp spends (default CLAMP_DELTA_SHARE·δ; a larger one only in tests, so that
    clamps can be counted). Raises CalibrationError when τ_S/(2d) is not a normal double.
    """
    half = (CLAMP_DELTA_SHARE * one.delta if share is None else share) / 2.0
    tau_q = half / (one.n + 1)
    high = noisy_norm_interval(one.noise_std_q, one.d, math.sqrt(one.lam), tau_q)[1]
    record_bound = high * high
    tau_s = per_record_share(half, one.epsilon, one.n)
    if tau_s / (2.0 * one.d) < sys.float_info.min:
        # The Chernoff tail point is found in double precision; a subnormal tail is not.
        raise CalibrationError(
            f"ε={one.epsilon:g} leaves the linear clamp's tail τ_S = {tau_s:.3g} per device "
            "below double precision's normal range (Step 13); such an ε protects nothing anyway")
    k = skellam_tail_point(tau_s / (2.0 * one.d), 2.0 * poisson_mean)
    h_b = math.ldexp(1.0, -linear_bits)
    return record_bound, record_bound, one.p_bound + h_b * (k + 0.5), tau_s


def _fits(bound: float, fp: FixedPoint) -> bool:
    """B ≥ the largest value an unclamped entry may take, rounding included."""
    return bound + fp.step / 2.0 <= math.ldexp(1.0, fp.clamp_log2)


def calibrate_two_server(*, epsilon: float, delta: float, n: int, d: int, lam: float = 1.0,
                         p_bound: float = 1.0, eta: float = 1.0, delta_in: float | None = None,
                         loss: str = "squared") -> TwoServerCalibration:
    """Step 14 (two-server budget): the two-server calibration at the one-server split.

    Keeps the one-server σ_u, Δ_in, γ₁, γ₂, δ_K; ε₁ becomes the rounded log-det bound (Step 10)
    and σ_b the least (to 10⁻⁹ relative, rounded up) with linear + box ≤ δ_K (Step 12) at
    ε₂ = ε − ε₁. The clamp's share replaces the norm check's (Step 13). Raises
    CalibrationError when the rounding or the grid leave no room, or the clamp's tail τ_S
    (about 10⁻³δ·e^−ε/n) is beyond double precision.
    """
    one = calibrate(mode="rigorous", epsilon=epsilon, delta=delta, n=n, d=d, lam=lam,
                    p_bound=p_bound, eta=eta, delta_in=delta_in, loss=loss)
    gamma1, gamma2 = one.delta_split["gamma_1"], one.delta_split["gamma_2"]
    delta_k = one.delta_split["delta_k"]
    box = BOX_SHARE * delta_k
    beta_one = one.delta_in + (eigenvalue_bound(one.sigma_u2, n, d, gamma2)
                               if one.sigma_u2 > 0.0 else 0.0)
    kappa = one.lambda_prime * eta
    sigma_one = math.sqrt(one.sigma_b2)
    guess_bits = linear_bits_for(sigma_one, n, 62)
    record_bound, bound_q, bound_p, _ = clamp_bounds(
        one=one, linear_bits=guess_bits,
        poisson_mean=one.sigma_b2 / (2.0 * n * math.ldexp(1.0, -guess_bits) ** 2))
    # The least power of two over the bounds at the one-server σ_b; the loop below only grows it,
    # as σ_b and with it B_p only grow from there.
    clamp_log2 = math.ceil(math.log2(max(bound_q, bound_p)))
    while True:
        fraction_bits = fraction_bits_for(n, clamp_log2)
        if fraction_bits < 0:
            raise CalibrationError(
                f"n={n} records with entries up to 2^{clamp_log2} do not fit in 64 bits")
        fp = FixedPoint(d=d, n=n, fraction_bits=fraction_bits, clamp_log2=clamp_log2)
        e = rounding_slack(fraction_bits, d, record_bound)
        beta = beta_one - (n - 1) * e
        eps1 = rounded_log_det_epsilon(one.lambda_prime, beta, e, d)
        if not eps1 < epsilon:
            raise CalibrationError(
                f"the rounding of q̃q̃ᵀ at f={fraction_bits} (n={n}) leaves no ε for the linear "
                f"term: ε₁ = {eps1:.4g} ≥ ε (Step 10)")
        shift_rounding = 2.0 * e * eta

        def term(sigma_b: float, fraction_bits=fraction_bits, shift_rounding=shift_rounding,
                 eps1=eps1) -> LinearTerm | None:
            return dithered_linear_term(
                epsilon2=epsilon - eps1, sigma_b=sigma_b, n=n, d=d, kappa=kappa,
                p_bound=p_bound, shift_rounding=shift_rounding, fraction_bits=fraction_bits,
                box_delta=box)

        def holds(t: LinearTerm | None) -> bool:
            return t is not None and t.linear_delta + t.box_delta <= delta_k

        lo, hi = sigma_one, sigma_one
        while not holds(term(hi)):
            lo, hi = hi, hi * 1.01
            if hi > 1e6 * sigma_one:
                raise CalibrationError("no σ_b meets Step 12 at these parameters")
        while hi - lo > 1e-9 * hi:
            mid = 0.5 * (lo + hi)
            if holds(term(mid)):
                hi = mid
            else:
                lo = mid
        t = term(hi)
        h_b = math.ldexp(1.0, -t.linear_bits)
        mu = hi * hi / (2.0 * n * h_b * h_b)
        record_bound, bound_q, bound_p, tau_s = clamp_bounds(one=one, linear_bits=t.linear_bits,
                                                             poisson_mean=mu)
        if _fits(bound_q, fp) and _fits(bound_p, fp):
            break
        clamp_log2 += 1
    sigma_b2 = (h_b * h_b) * (2.0 * n * mu)
    clamp_q = CLAMP_DELTA_SHARE * one.delta / 2.0  # (n + 1)·τ_q
    clamp_p = (1.0 + math.exp(epsilon)) * n * tau_s  # finite: clamp_bounds refuses a subnormal τ_S
    log_det = math.log1p(one.lambda_prime / beta_one)
    return TwoServerCalibration(
        one_server=one, epsilon=epsilon, delta=one.delta, n=n, d=d, sigma_u2=one.sigma_u2,
        sigma_b2=sigma_b2, delta_in=one.delta_in, noise_std_q=one.noise_std_q, poisson_mean=mu,
        linear_bits=t.linear_bits, encoding=fp, lambda_prime=one.lambda_prime,
        record_bound=record_bound, rounding=e, beta=beta, box_radius=t.box_radius,
        grid_variance=t.grid_variance,
        slack={"eta_loss": t.eta_loss, "eta_shift": t.eta_shift, "eta_density": t.eta_density},
        epsilon_split={"log_det": log_det, "rounding": eps1 - log_det,
                       "grid": t.eta_loss + t.eta_shift,
                       "linear": epsilon - eps1 - t.eta_loss - t.eta_shift},
        delta_split={"linear": t.linear_delta, "box": t.box_delta, "gamma_1": gamma1,
                     "gamma_2": gamma2, "clamp_q": clamp_q, "clamp_p": clamp_p},
    )


def perturb_two_server(q: np.ndarray, p: np.ndarray, cal: TwoServerCalibration,
                       noise: NoiseSource | None = None,
                       generator: np.random.Generator | None = None,
                       ) -> tuple[np.ndarray, np.ndarray]:
    """(q̃, p̂) of one or many records (Step 9 (the two-server mechanism)).

    q̃ = q + u with the one-server Gaussian u (``noise``, default the OS's CSPRNG);
    p̂ = h_b·(rint(p/h_b) − S), S symmetric Skellam(μ) from ``generator`` (default a fresh
    ipdp.grid_noise.system_generator per call). Seeded sources are for simulations and tests.
    """
    noise = SystemNoise() if noise is None else noise
    generator = system_generator() if generator is None else generator
    h_b = cal.linear_step
    u = noise.normal(0.0, cal.noise_std_q, size=np.shape(q))
    grid = np.rint(np.ldexp(np.asarray(p, dtype=np.float64), cal.linear_bits))
    s = skellam(cal.poisson_mean, np.shape(p), generator)
    return np.asarray(q, dtype=np.float64) + u, (grid - s) * h_b


def main(argv: list[str] | None = None) -> int:
    """``python -m ipdp.two_server``: the two-server calibration next to the one-server one."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ipdp.two_server", allow_abbrev=False,
                                     description=main.__doc__)
    parser.add_argument("--epsilon", type=float, nargs="+", default=[1.0])
    parser.add_argument("--delta", type=float, default=0.01)
    parser.add_argument("--n", type=int, nargs="+", default=[512, 10_000, 2**21])
    parser.add_argument("--d", type=int, nargs="+", default=[14])
    args = parser.parse_args(argv)
    header = ("ε", "d", "n", "σ_b² one-server", "σ_b² two-server", "difference", "f", "f_b",
              "μ", "B", "ε rounding", "ε grid")
    rows, refused = [], []
    for epsilon in args.epsilon:
        for d in args.d:
            for n in args.n:
                try:
                    cal = calibrate_two_server(epsilon=epsilon, delta=args.delta, n=n, d=d)
                except CalibrationError as exc:
                    refused.append(f"ε={epsilon:g}, d={d}, n={n}: refused: {exc}")
                    continue
                one = cal.one_server
                rows.append((f"{epsilon:g}", str(d), f"{n:,}", f"{one.sigma_b2:.6g}",
                             f"{cal.sigma_b2:.6g}",
                             f"{100 * (cal.sigma_b2 / one.sigma_b2 - 1):+.4f} %",
                             str(cal.encoding.fraction_bits), str(cal.linear_bits),
                             f"{cal.poisson_mean:.3g}", f"2^{cal.encoding.clamp_log2}",
                             f"{cal.epsilon_split['rounding']:.2g}",
                             f"{cal.epsilon_split['grid']:.2g}"))
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print("\n".join(refused))
    return 0 if rows else 2


if __name__ == "__main__":
    raise SystemExit(main())
