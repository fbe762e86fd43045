"""The two-server mode's grid noise: the Skellam sampler, the dither, and the bounds on the
Skellam law that Steps 11 and 12 of docs/privacy.md rest on, checked against scipy and mpmath."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
from scipy.special import ive
from scipy.stats import chisquare, kstest, skellam

from ipdp.grid_noise import (
    POISSON_MEAN_MAX,
    central_log_excess,
    dither,
    dither_density_slack,
    dither_loss_slack,
    log_bessel_ratio_bounds,
    log_pmf_ratio_excess,
    log_pmf_ratio_gaussian,
    skellam_tail,
    skellam_tail_point,
    system_generator,
)
from ipdp.grid_noise import (
    skellam as draw_skellam,
)

# Moderate x and ν, against 60-digit Bessel functions (doubles underflow at ν ≫ x).
DOUBLE_GRID = [(nu, x) for x in (0.5, 1.0, 3.0, 10.0, 100.0, 1e3, 1e4)
               for nu in (0, 1, 2, 5, 10, 30, 100, 300)]


def _log_ratio(nu: int, x: float) -> float:
    """log(I_ν(x)/I_{ν+1}(x)) at 60 digits: doubles cannot resolve ½/x at large x."""
    with mpmath.workdps(60):
        return float(mpmath.log(mpmath.besseli(nu, x) / mpmath.besseli(nu + 1, x)))


def test_log_bessel_ratio_lies_between_the_amos_bounds():
    for nu, x in DOUBLE_GRID:
        value = _log_ratio(nu, x)
        low, high = log_bessel_ratio_bounds(nu, x)
        assert low <= value * (1 + 1e-12) and value <= high * (1 + 1e-12), (nu, x, low, value,
                                                                               high)


@pytest.mark.parametrize("x", [1e6, 1e9, 1e12])
def test_log_bessel_ratio_lies_between_the_amos_bounds_at_the_variances_the_mode_uses(x):
    # x = 2nμ is 10⁹–10¹⁷ in practice; ν up to several standard deviations √x.
    for nu in (0, 1, 10, int(math.sqrt(x)), int(6 * math.sqrt(x))):
        value = _log_ratio(nu, x)
        low, high = log_bessel_ratio_bounds(nu, x)
        # Relative to the width of the bracket, not to the value: the bracket is ½/x wide.
        width = float(high - low)
        assert value >= float(low) - 1e-6 * width and value <= float(high) + 1e-6 * width


def test_the_upper_bound_with_nu_over_x_would_be_wrong():
    # Replacing asinh((ν+1)/x) by asinh(ν/x) gives a bound the true ratio exceeds everywhere
    # tested: the test above would catch that mistake.
    broken = [(nu, x) for nu, x in DOUBLE_GRID if _log_ratio(nu, x) > math.asinh(nu / x) * 1.0001]
    assert len(broken) == len(DOUBLE_GRID)
    # And the lower bound cannot be raised to asinh((ν+1)/x) either.
    assert all(_log_ratio(nu, x) < math.asinh((nu + 1) / x) for nu, x in DOUBLE_GRID)


@pytest.mark.parametrize("x", [2.0, 50.0, 2_000.0, 1e5])
def test_the_skellam_log_pmf_ratio_is_the_gaussian_one_plus_at_most_the_excess(x):
    # Every pair (k, k′) of both signs within 8 standard deviations, against scipy's log-pmf.
    half = x / 2.0
    top = int(8 * math.sqrt(x)) + 3
    ks = np.unique(np.linspace(-top, top, 161).round().astype(int))
    k, k2 = np.meshgrid(ks, ks, indexing="ij")
    logpmf = skellam.logpmf(ks, half, half)
    exact = (logpmf[:, None] - logpmf[None, :]) - log_pmf_ratio_gaussian(k, k2, x)
    excess = log_pmf_ratio_excess(k, k2, x)
    tolerance = 1e-9 * (1.0 + np.abs(logpmf[:, None]) + np.abs(logpmf[None, :]))
    assert np.all(exact <= excess + tolerance)
    # The excess is needed: without it the bound fails on many pairs.
    assert np.count_nonzero(exact > tolerance) > 0.1 * exact.size


def test_the_excess_is_tight_up_to_the_half_step_and_the_cubic_term_it_gives_away():
    x = 2_000.0
    k = np.arange(0, 300)
    exact = (skellam.logpmf(k, x / 2, x / 2) - skellam.logpmf(k + 1, x / 2, x / 2)
             - log_pmf_ratio_gaussian(k, k + 1, x))
    excess = log_pmf_ratio_excess(k, k + 1, x)
    # asinh(t) ≤ t gives away at most ½/x against asinh((ν+½)/x) ≥ (ν+½)/x − ((ν+½)/x)³/6.
    assert np.all(excess - exact <= 0.5 / x + ((k + 0.5) / x) ** 3 / 6 + 1e-9)


@pytest.mark.parametrize("x", [0.5, 3.0, 40.0, 1e3, 1e5, 1e7])
def test_the_central_excess_bounds_the_mode_of_the_skellam_law(x):
    exact = math.log(ive(0, x) * math.sqrt(2 * math.pi * x))
    bound = central_log_excess(x)
    assert exact <= bound
    if x >= 1e3:
        assert bound < 10.0 / x  # the bound is tight where the mode uses it (x ≥ 10⁹)


@pytest.mark.parametrize("x", [10.0, 1e3, 1e6])
def test_the_chernoff_tail_bounds_the_skellam_tail(x):
    for z in (0.5, 1.0, 2.0, 4.0, 6.0):
        t = z * math.sqrt(x)
        exact = skellam.sf(math.ceil(t) - 1, x / 2, x / 2)  # P(S ≥ t)
        assert exact <= skellam_tail(t, x)
    point = skellam_tail_point(1e-9, x)
    assert skellam_tail(point, x) <= 1e-9 < skellam_tail(point * (1 - 1e-6), x)


@pytest.mark.parametrize("x", [1e9, 1e13, 1e17])
def test_the_chernoff_tail_keeps_its_precision_at_the_variances_the_mode_uses(x):
    # The exponent t·asinh(t/x) − x(√(1 + t²/x²) − 1) at 60 digits, against the double one.
    for z in (1.0, 5.0, 8.0):
        t = z * math.sqrt(x)
        with mpmath.workdps(60):
            u = mpmath.mpf(t) / x
            exact = float(mpmath.exp(-(t * mpmath.asinh(u) - x * (mpmath.sqrt(1 + u * u) - 1))))
        assert skellam_tail(t, x) == pytest.approx(exact, rel=1e-9)


def test_the_sampler_draws_the_skellam_law_and_sums_stay_skellam():
    rng = np.random.default_rng(11)
    mu, n = 40.0, 25
    draws = draw_skellam(mu, (20_000, n), rng)
    # One device's draw against Skellam(μ, μ), and the sum of n against Skellam(nμ, nμ).
    for values, m in ((draws[:, 0], mu), (draws.sum(axis=1), n * mu)):
        edges = np.arange(int(values.min()), int(values.max()) + 2)
        probs = skellam.pmf(edges[:-1], m, m)
        counts = np.histogram(values, bins=edges)[0]
        keep = probs * len(values) >= 5
        expected = probs[keep] / probs[keep].sum() * counts[keep].sum()
        assert chisquare(counts[keep], expected).pvalue > 1e-4
    assert draws.var() == pytest.approx(2 * mu, rel=0.05)


def test_a_wrong_poisson_mean_is_detected_by_the_same_check():
    rng = np.random.default_rng(12)
    values = draw_skellam(44.0, 20_000, rng)  # 10 % too much noise
    edges = np.arange(int(values.min()), int(values.max()) + 2)
    probs = skellam.pmf(edges[:-1], 40.0, 40.0)
    counts = np.histogram(values, bins=edges)[0]
    keep = probs * len(values) >= 5
    expected = probs[keep] / probs[keep].sum() * counts[keep].sum()
    assert chisquare(counts[keep], expected).pvalue < 1e-4


def test_the_sampler_refuses_a_mean_beyond_numpys_precise_range():
    with pytest.raises(ValueError, match="POISSON_MEAN_MAX"):
        draw_skellam(POISSON_MEAN_MAX * 2, 3, np.random.default_rng(0))
    with pytest.raises(ValueError, match="outside"):
        draw_skellam(float("nan"), 3, np.random.default_rng(0))
    assert draw_skellam(POISSON_MEAN_MAX, 3, np.random.default_rng(0)).dtype == np.int64


def test_system_generators_are_fresh_and_unseeded():
    a, b = system_generator(), system_generator()
    assert not np.array_equal(a.integers(0, 2**62, 8), b.integers(0, 2**62, 8))


def test_the_dither_is_uniform_on_the_half_open_cell():
    v = dither(200_000, 0.25, np.random.default_rng(3))
    assert v.min() >= -0.125 and v.max() < 0.125
    assert kstest(v, "uniform", args=(-0.125, 0.25)).pvalue > 1e-4


def test_the_amos_bracket_is_at_most_half_over_x_wide():
    """Step 11's bracket [asinh((ν+½)/x), asinh((ν+1)/x)]: asinh is 1-Lipschitz, so it is at
    most ½/x wide, which is what Step 12's slack η_L is built from; a looser bracket would still
    contain the ratio but cost ε."""
    for nu, x in DOUBLE_GRID:
        low, high = log_bessel_ratio_bounds(nu, x)
        assert 0.0 < high - low <= 0.5 / x * (1 + 1e-12), (nu, x)
        assert low <= _log_ratio(nu, x) * (1 + 1e-12)


@pytest.mark.parametrize(("k", "k_other", "x", "excess"), [
    (0, 3, 2.0, 3 / 4),  # a ≤ a′: (a′ − a)/(2x)
    (-2, 5, 10.0, 3 / 20),  # signs play no role
    (3, 1, 2.0, 80 / 192),  # a > a′: (a⁴ − a′⁴)/(24x³)
    (-4, 2, 3.0, 240 / 648),
    (5, -5, 7.0, 0.0),
])
def test_the_excess_is_step_11s_bound(k, k_other, x, excess):
    """η(k, k′) of docs/privacy.md, Step 11, at hand-computed points: the values Step 12's
    slack and the inequality check add up."""
    assert float(log_pmf_ratio_excess(k, k_other, x)) == pytest.approx(excess, rel=1e-12)


def test_the_log_ratios_of_integer_k_are_computed_in_floating_point_without_overflow():
    """k and k′ arrive as integers (Skellam draws are int64); their squares and fourth powers
    overflow int64 from |k| ≈ 3·10⁹ and 5.5·10⁴ on, so both functions work in float64."""
    k, k_other = np.array([2**33]), np.array([2**32])
    assert log_pmf_ratio_gaussian(k, k_other, 1.0)[0] == (2.0**64 - 2.0**66) / 2.0
    assert log_pmf_ratio_gaussian(k_other, k, 1.0)[0] == (2.0**66 - 2.0**64) / 2.0
    big, small = np.array([2**20]), np.array([2**19])
    assert log_pmf_ratio_excess(big, small, 1.0)[0] == (2.0**80 - 2.0**76) / 24.0
    assert log_pmf_ratio_excess(small, big, 1.0)[0] == 2.0**18


def test_the_sampler_takes_any_mean_from_zero_and_says_how_to_stay_in_range():
    assert np.all(draw_skellam(0.0, 5, np.random.default_rng(0)) == 0)
    assert draw_skellam(0.5, 1000, np.random.default_rng(0)).var() == pytest.approx(1.0, rel=0.2)
    with pytest.raises(ValueError, match=r"numpy's sampler loses precision in its acceptance "
                                         r"test \(POISSON_MEAN_MAX\); use a coarser linear grid "
                                         r"\(fewer linear_bits\)$"):
        draw_skellam(POISSON_MEAN_MAX * 2, 3, np.random.default_rng(0))


def test_a_system_generator_is_seeded_with_256_bits_from_the_kernel(monkeypatch):
    """Its seed is 32 bytes of os.urandom, read little-endian, through numpy's SeedSequence: the
    generator is the one those bytes name, and no other."""
    asked = []
    seed = bytes(range(1, 33))

    def urandom(count: int) -> bytes:
        asked.append(count)
        return seed[:count]

    monkeypatch.setattr("ipdp.grid_noise.os.urandom", urandom)
    drawn = system_generator().integers(0, 2**62, 8)
    expected = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
        int.from_bytes(seed, "little")))).integers(0, 2**62, 8)
    assert asked == [32]
    np.testing.assert_array_equal(drawn, expected)


@pytest.mark.parametrize(("probability", "x"), [(0.5, 0.01), (0.9, 1.0), (1e-3, 1e-4),
                                                (1e-9, 1.0)])
def test_the_tail_point_is_the_least_at_small_variances(probability, x):
    """At small variances the point may lie below 1 (the search starts from 0, not from a
    step), or far beyond the Gaussian guess (the Poisson tail is heavier): the bracket widens."""
    point = skellam_tail_point(probability, x)
    assert skellam_tail(point, x) <= probability < skellam_tail(point * (1 - 1e-6), x)


@pytest.mark.parametrize(("x", "radius", "shift", "d", "slack"), [
    # Far from the mode's variances the cubic term wins: K = 10.5, K³/(6x³) = 192.9375.
    (1.0, 10.0, 1.0, 2, 2 * 20.25 / 2 + (math.sqrt(2) + 2) * 10.5**3 / 6),
    # At a large variance the half step wins: 1/(2x) = 0.005 against 1.5³/(6·10⁶).
    (100.0, 1.0, 1.0, 1, 2.25 / 200 + 2 * 0.005),
    # The cubic term at x ≠ 1: K = 20.5, K³/(6·2³).
    (2.0, 20.0, 1.0, 1, 40.25 / 4 + 2 * 20.5**3 / 48),
])
def test_the_dither_loss_slack_is_step_12s_eta_l(x, radius, shift, d, slack):
    """η_L = d(2r + ¼)/(2x) + (√d·shift + d)·max(1/(2x), K³/(6x³)), K = r + ½ (docs/privacy.md,
    Step 12), at hand-computed points on both sides of the max."""
    assert dither_loss_slack(x, radius, shift, d) == pytest.approx(slack, rel=1e-12)


@pytest.mark.parametrize(("x", "radius", "d", "quartic"), [
    (1.0, 10.0, 3, 10.5**4 / 24),  # the quartic term dominates
    (1e4, 2.0, 1, 2.5**4 / 24e12),
])
def test_the_dither_density_slack_is_step_12s_eta_0(x, radius, d, quartic):
    """η₀ = d·(ℓ₀ + (r + ¾)/(2x) + K⁴/(24x³)), K = r + ½ (docs/privacy.md, Step 12)."""
    slack = d * (central_log_excess(x) + (radius + 0.75) / (2 * x) + quartic)
    assert dither_density_slack(x, radius, d) == pytest.approx(slack, rel=1e-12)


def test_the_chernoff_tail_is_one_at_and_below_zero_and_the_bound_below_one_step():
    assert skellam_tail(0.0, 2.0) == skellam_tail(-3.0, 2.0) == 1.0
    for t, x in ((0.5, 0.01), (0.25, 1.0), (1.0, 0.1)):
        with mpmath.workdps(60):
            u = mpmath.mpf(t) / x
            exact = float(mpmath.exp(-(t * mpmath.asinh(u) - x * (mpmath.sqrt(1 + u * u) - 1))))
        assert skellam_tail(t, x) == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize("x", [0.5, 3.0, 10.0, 1e4])
def test_the_central_excess_is_step_11s_bound_at_its_theta0(x):
    """ℓ₀ = log((1 − θ₀²/12)^{−½} + √(2πx)·e^{−x(1 − cos θ₀)}), θ₀ = min(π, √(2(40 + log√(2πx))/x))
    (docs/privacy.md, Step 11, "the mode"): at x = 0.5 and 3 θ₀ is π and the far part counts; at
    x = 10 θ₀ is below π and the far part still moves ℓ₀ by 10⁻⁸."""
    root = math.sqrt(2 * math.pi * x)
    theta0 = min(math.pi, math.sqrt(2 * (40 + math.log(root)) / x))
    bound = math.log((1 - theta0**2 / 12) ** -0.5 + root * math.exp(-x * (1 - math.cos(theta0))))
    assert central_log_excess(x) == pytest.approx(bound, rel=1e-9)
