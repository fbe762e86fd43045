"""Noise on the grid for the two-server mode: symmetric Skellam draws, the trainer's dither, and
the bounds on the Skellam law that the proof uses (docs/privacy.md, "Two-server mode: the proof
for the fixed-point sums").

Each device subtracts h_b·S_i from its rounded linear term, S_i = P₁ − P₂ with P₁, P₂ independent
Poisson(μ) per coordinate (numpy's ``Generator.poisson``). A sum of n such draws is again
symmetric Skellam, with each side Poisson(nμ): variance x = 2nμ in grid units, so the trainer's
b is exactly Σ rint(p_i/h_b)·h_b − h_b·S with S of a known law. The trainer adds a dither
V ~ U[−h_b/2, h_b/2)^d so that b has a density (Step 12 (dithered linear term)).

Two kinds of generator, as for the Gaussian noise (ipdp.losses): :func:`system_generator` for a
real device (a fresh generator per record, seeded with 256 bits from ``os.urandom``), and a seeded
``numpy.random.Generator`` for simulations and tests only.

The bounds are in grid units. With x = 2nμ the law of S is pmf(k) = e^{−x}·I_{|k|}(x), and for
ν ≥ 0 the ratio r_ν = I_{ν+1}(x)/I_ν(x) satisfies (Amos 1974; Segura 2011)

    x/(ν + 1 + √((ν+1)² + x²)) ≤ r_ν ≤ x/(ν + ½ + √((ν+½)² + x²)),

that is asinh((ν+½)/x) ≤ log(I_ν/I_{ν+1}) ≤ asinh((ν+1)/x) (Step 11 (Skellam ratio bounds)).
"""

from __future__ import annotations

import math
import os

import numpy as np

POISSON_MEAN_MAX = 2.0**30
"""Largest per-device Poisson mean μ ipdp asks numpy for. numpy's own limit is about 9.2·10¹⁸
("lam value too large"), but for μ ≥ 10 ``Generator.poisson`` runs Hörmann's transformed
rejection (PTRS), whose acceptance test evaluates −μ + k·log μ − log Γ(k + 1) in double
precision: the cancellation leaves an absolute error of order 2⁻⁵²·μ·log μ in the log-probability
it accepts with (about 5·10⁻⁶ at 2³⁰). The proof treats the sampler as exact, as it treats the
Gaussian one; this cap keeps the difference far below any ε that is reported."""


def system_generator() -> np.random.Generator:
    """A fresh generator for one record, seeded with 256 bits from the kernel's CSPRNG.

    PCG64 is not a cryptographic generator: its state can be recovered from enough of its output.
    A device therefore never keeps one across records: each record's 2d Poisson draws come from a
    generator whose seed no other record shares, and its output is never sent (only the sum of the
    rounded data and the noise, split into shares)."""
    entropy = int.from_bytes(os.urandom(32), "little")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


def skellam(mu: float, size, generator: np.random.Generator) -> np.ndarray:
    """Symmetric Skellam draws P₁ − P₂, P₁, P₂ ~ Poisson(μ) independent (int64, shape ``size``)."""
    if not (math.isfinite(mu) and 0.0 <= mu <= POISSON_MEAN_MAX):
        raise ValueError(
            f"Poisson mean μ={mu!r} is outside [0, {POISSON_MEAN_MAX:.0f}]: beyond it numpy's "
            "sampler loses precision in its acceptance test (POISSON_MEAN_MAX); use a coarser "
            "linear grid (fewer linear_bits)")
    return generator.poisson(mu, size) - generator.poisson(mu, size)


def dither(shape, step: float, generator: np.random.Generator) -> np.ndarray:
    """V ~ U[−step/2, step/2) of the given shape: the trainer's dither of b (Step 12)."""
    return (generator.random(shape) - 0.5) * step


def log_bessel_ratio_bounds(nu: np.ndarray | float, x: float) -> tuple[np.ndarray, np.ndarray]:
    """(asinh((ν+½)/x), asinh((ν+1)/x)): lower and upper bounds on log(I_ν(x)/I_{ν+1}(x)) for
    ν ≥ 0, x > 0 (Step 11 (Skellam ratio bounds); Amos 1974, Segura 2011)."""
    nu = np.asarray(nu, dtype=np.float64)
    return np.arcsinh((nu + 0.5) / x), np.arcsinh((nu + 1.0) / x)


def log_pmf_ratio_excess(k: np.ndarray, k_other: np.ndarray, x: float) -> np.ndarray:
    """An upper bound on log pmf(k)/pmf(k′) − (k′² − k²)/(2x) for the symmetric Skellam law of
    variance x (Step 11 (Skellam ratio bounds)).

    With a = |k|, a′ = |k′| (the law and the Gaussian exponent depend on |k| only, so the signs of
    k and k′ do not matter): log pmf(k)/pmf(k′) = Σ_{ν=a}^{a′−1} log(I_ν/I_{ν+1}) when a ≤ a′,
    which asinh(t) ≤ t bounds by (a′² − a²)/(2x) + (a′ − a)/(2x); and −Σ_{ν=a′}^{a−1} log(I_ν/I_{ν+1})
    when a > a′, which asinh(t) ≥ t − t³/6 bounds by (a′² − a²)/(2x) + Σ_{ν=a′}^{a−1} ((ν+½)/x)³/6.
    The sum is at most ((a⁴ − a′⁴)/4)/(6x³) ((ν+½)³ ≤ ∫_ν^{ν+1} t³ dt, t³ being convex).
    """
    a = np.abs(np.asarray(k, dtype=np.float64))
    b = np.abs(np.asarray(k_other, dtype=np.float64))
    up = (b - a) / (2.0 * x)
    down = (a**4 - b**4) / (24.0 * x**3)
    return np.where(a <= b, up, down)


def log_pmf_ratio_gaussian(k: np.ndarray, k_other: np.ndarray, x: float) -> np.ndarray:
    """(k′² − k²)/(2x): the log-density ratio of N(0, x) at k against k′."""
    k = np.asarray(k, dtype=np.float64)
    k_other = np.asarray(k_other, dtype=np.float64)
    return (k_other**2 - k**2) / (2.0 * x)


def skellam_tail(t: float, x: float) -> float:
    """Chernoff bound on P(S ≥ t) for t ≥ 0, S symmetric Skellam of variance x (Step 12).

    E e^{θS} = exp(x(cosh θ − 1)); at θ = asinh(t/x) the bound is
    exp(−(t·asinh(t/x) − x(√(1 + (t/x)²) − 1)))."""
    if t <= 0.0:
        return 1.0
    u = t / x
    # x(√(1 + u²) − 1) written as x·u²/(√(1 + u²) + 1): u is 10⁻⁵ or less at the variances the
    # mode uses, where the difference would cancel to a relative error of 10⁻⁶.
    exponent = t * math.asinh(u) - x * u * u / (math.hypot(1.0, u) + 1.0)
    return math.exp(-exponent)


def skellam_tail_point(probability: float, x: float) -> float:
    """Least t (to 10⁻⁹ relative, rounded up) with skellam_tail(t, x) ≤ probability."""
    lo, hi = 0.0, math.sqrt(x) * (1.0 + math.sqrt(2.0 * math.log(1.0 / probability)))
    while skellam_tail(hi, x) > probability:
        lo, hi = hi, 2.0 * hi
    while hi - lo > 1e-9 * hi:
        mid = 0.5 * (lo + hi)
        if skellam_tail(mid, x) > probability:
            lo = mid
        else:
            hi = mid
    return hi


CENTRAL_TAIL = 40.0
"""Step 12's bound on pmf(0) splits the integral for I_0 at θ₀ where x(1 − cos θ₀) ≈ this plus
log √(2πx): the far part then weighs about e⁻⁴⁰."""


def central_log_excess(x: float) -> float:
    """ℓ₀ ≥ log(pmf(0)·√(2πx)), pmf(0) = e^{−x}I_0(x): the symmetric Skellam law's mode against
    the Gaussian's density at 0 (Step 12 (dithered linear term)).

    e^{−x}I_0(x) = (1/π)∫₀^π e^{−x(1 − cos θ)} dθ (DLMF 10.32.1). On [0, θ₀],
    1 − cos θ ≥ θ²/2 − θ⁴/24 ≥ (θ²/2)(1 − θ₀²/12), so that part is at most
    (1 − θ₀²/12)^{−1/2}/√(2πx); on [θ₀, π] the integrand is at most e^{−x(1 − cos θ₀)}. Hence
    pmf(0)√(2πx) ≤ (1 − θ₀²/12)^{−1/2} + √(2πx)·e^{−x(1 − cos θ₀)}, for any θ₀ ≤ π (θ₀² < 12).
    """
    root = math.sqrt(2.0 * math.pi * x)
    theta0 = min(math.pi, math.sqrt(2.0 * (CENTRAL_TAIL + math.log(root)) / x))
    near = -0.5 * math.log1p(-theta0 * theta0 / 12.0)
    far = math.log(root) - 2.0 * x * math.sin(theta0 / 2.0) ** 2
    return max(near, far) + math.log1p(math.exp(min(near, far) - max(near, far)))


def dither_loss_slack(x: float, radius: float, shift: float, d: int) -> float:
    """η_L: log g(y)/g(y′) ≤ (‖y′‖² − ‖y‖²)/(2x) + η_L for the dithered Skellam density g in grid
    units, whenever every |y_c|, |y′_c| ≤ radius and ‖y′ − y‖ ≤ shift: Step 12 (dithered linear term).

    Per coordinate, with k, k′ the integers nearest y, y′ (|k − y| ≤ ½) and K = radius + ½:
    (k′² − k²) ≤ (y′² − y²) + |y| + |y′| + ¼, and Step 11's excess is at most
    |k′ − k|·max(1/(2x), K³/(6x³)) with |k′ − k| ≤ |y′_c − y_c| + 1; Σ_c |y′_c − y_c| ≤ √d·shift.
    """
    top = radius + 0.5
    return (d * (2.0 * radius + 0.25) / (2.0 * x)
            + (math.sqrt(d) * shift + d) * max(1.0 / (2.0 * x), top**3 / (6.0 * x**3)))


def dither_density_slack(x: float, radius: float, d: int) -> float:
    """η₀: g(y) ≤ e^{η₀}·φ_x(y) for every y with all |y_c| ≤ radius, φ_x the N(0, x·I_d) density
    (Step 12 (dithered linear term)).

    Per coordinate, with a = |k|: log pmf(k) ≤ log pmf(0) − a²/(2x) + a⁴/(24x³) (Step 11 from
    0 to a), log pmf(0) ≤ ℓ₀ − ½ log(2πx) (central_log_excess), and y² − a² ≤ |y| + ¾.
    """
    top = radius + 0.5
    return d * (central_log_excess(x) + (radius + 0.75) / (2.0 * x) + top**4 / (24.0 * x**3))
