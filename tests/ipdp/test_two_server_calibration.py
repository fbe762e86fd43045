"""The two-server calibration (ipdp.two_server): every inequality of docs/privacy.md's Steps 9–14
at the returned numbers, the pointwise bounds of Step 12 against the exact Skellam law, and the
distance to the one-server noise."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import skellam

from ipdp import grid_noise, two_server
from ipdp.calibration import (
    CalibrationError,
    calibrate,
    eigenvalue_bound,
    linear_term_delta,
    noisy_norm_interval,
    noisy_smoothness,
)
from ipdp.fixed_point import SIGNED_MAX, FixedPoint, fraction_bits_for
from ipdp.grid_noise import (
    POISSON_MEAN_MAX,
    central_log_excess,
    dither_density_slack,
    dither_loss_slack,
    skellam_tail,
    skellam_tail_point,
)
from ipdp.losses import clip_rows
from ipdp.two_server import (
    BOX_SHARE,
    CLAMP_DELTA_SHARE,
    TwoServerCalibration,
    calibrate_two_server,
    dithered_linear_term,
    perturb_two_server,
)

REFERENCE = {"epsilon": 1.0, "delta": 0.01, "lam": 1.0, "p_bound": 1.0, "eta": 1.0}
CONFIGS = [
    {"n": 512, "d": 14},
    {"n": 10_000, "d": 14},
    {"n": 2**21, "d": 14},
    {"n": 10**8, "d": 14},
    {"n": 2**11, "d": 14, "epsilon": 0.1},
    {"n": 512, "d": 2, "epsilon": 2.0},
    {"n": 8192, "d": 2},
    {"n": 500, "d": 3, "delta_in": 0.5},
    {"n": 2**11, "d": 5, "lam": 0.25, "p_bound": 0.5, "eta": 2.0, "loss": "logistic"},
    {"n": 512, "d": 2, "delta_in": 10.0},  # a ridge that leaves q̃ without noise: σ_u = 0
]


def _calibrate(config: dict) -> TwoServerCalibration:
    return calibrate_two_server(**{**REFERENCE, **config})


def _term(cal: TwoServerCalibration, sigma_b: float):
    one = cal.one_server
    eps1 = cal.epsilon_split["log_det"] + cal.epsilon_split["rounding"]
    return dithered_linear_term(
        epsilon2=cal.epsilon - eps1, sigma_b=sigma_b, n=cal.n, d=cal.d,
        kappa=cal.lambda_prime * one.eta, p_bound=one.p_bound,
        shift_rounding=2.0 * cal.rounding * one.eta,
        fraction_bits=cal.encoding.fraction_bits, box_delta=cal.delta_split["box"])


def assert_every_inequality_of_the_two_server_proof(cal: TwoServerCalibration) -> None:
    """Steps 9–14 at the numbers a two-server calibration reports, each recomputed here from
    the formulas docs/privacy.md writes down."""
    one, n, d = cal.one_server, cal.n, cal.d
    lam, p_bound, eta = one.lam, one.p_bound, one.eta
    fp = cal.encoding
    h, h_b = fp.step, cal.linear_step
    gamma1, gamma2 = cal.delta_split["gamma_1"], cal.delta_split["gamma_2"]
    delta_k = one.delta_split["delta_k"]
    # Step 14: the budgets add up, and the clamp takes the norm check's share.
    assert set(cal.epsilon_split) == {"log_det", "rounding", "grid", "linear"}
    assert set(cal.delta_split) == {"linear", "box", "gamma_1", "gamma_2", "clamp_q", "clamp_p"}
    assert all(v >= 0.0 for v in cal.epsilon_split.values())
    assert sum(cal.epsilon_split.values()) == pytest.approx(cal.epsilon, rel=1e-12)
    assert (gamma1, gamma2) == (one.delta_split["gamma_1"], one.delta_split["gamma_2"])
    assert cal.delta_split["linear"] + cal.delta_split["box"] <= delta_k
    assert cal.delta_split["box"] == pytest.approx(BOX_SHARE * delta_k)
    clamp = cal.delta_split["clamp_q"] + cal.delta_split["clamp_p"]
    assert clamp <= CLAMP_DELTA_SHARE * cal.delta * (1 + 1e-12)
    assert delta_k + gamma1 + gamma2 <= one.mechanism_delta * (1 + 1e-12)
    assert sum(cal.delta_split.values()) <= cal.delta * (1 + 1e-12)
    # Step 13: the record bound, the range and the fraction bits.
    tau_q = CLAMP_DELTA_SHARE * cal.delta / 2.0 / (n + 1)
    assert cal.delta_split["clamp_q"] == pytest.approx((n + 1) * tau_q, rel=1e-12)
    # H_q: the norm check's bound at τ_q; without noise ‖q̃‖ = ‖q‖, a few ulps above √λ at most.
    high = noisy_norm_interval(one.noise_std_q, d, math.sqrt(lam), tau_q)[1]
    assert cal.record_bound == pytest.approx(high**2, rel=1e-12)
    _, bound_q, bound_p, clamp_tau_s = two_server.clamp_bounds(
        one=one, linear_bits=cal.linear_bits, poisson_mean=cal.poisson_mean)
    # B_q is the largest entry a record with ‖q̃‖ ≤ H_q can have: fl(H_q·H_q), of a record at H_q·e₁
    # (every other entry rounds to at most that, rounding being monotone).
    assert bound_q == high * high
    bound = 2.0**fp.clamp_log2
    assert bound_q + h / 2 <= bound
    tau_s = CLAMP_DELTA_SHARE * cal.delta / 2.0 / ((1.0 + math.exp(cal.epsilon)) * n)
    assert clamp_tau_s == pytest.approx(tau_s, rel=1e-12)
    assert cal.delta_split["clamp_p"] == pytest.approx((1.0 + math.exp(cal.epsilon)) * n * tau_s)
    # B_p = P + h_b(k + ½) with k the least tail point of a device's S at τ_S (within half a
    # grid unit either way: k is a real number found to 10⁻⁹).
    k = (bound_p - p_bound) / h_b - 0.5
    assert 2 * d * skellam_tail(k + 0.5, 2.0 * cal.poisson_mean) <= tau_s
    assert 2 * d * skellam_tail(min(k - 0.5, k * (1 - 2e-9)), 2.0 * cal.poisson_mean) > tau_s
    assert bound_p + h / 2 <= bound
    # B is the least power of two that holds both: at B/2 (and its finer grid) one does not fit.
    if fp.clamp_log2 > -62:
        half_step = 2.0 ** -fraction_bits_for(n, fp.clamp_log2 - 1) / 2
        assert max(bound_q, bound_p) + half_step > bound / 2
    assert fp.n == n and n * fp.limit <= SIGNED_MAX
    assert fp.fraction_bits == 62 or SIGNED_MAX < 2 * n * fp.limit  # the largest f that fits
    # Step 12's grid: numpy's precise range, the grid inside the encoding's, the variance.
    assert 0.0 < cal.poisson_mean <= POISSON_MEAN_MAX and cal.linear_bits <= fp.fraction_bits
    assert cal.sigma_b2 == pytest.approx(2 * n * cal.poisson_mean * h_b * h_b, rel=1e-12)
    x = cal.sigma_b2 / h_b**2
    assert cal.grid_variance == pytest.approx(x, rel=1e-12)
    # Step 3 unchanged; Step 10: the rounding slack and the rounded log-det bound.
    if one.sigma_u2 > 0.0:
        assert cal.lambda_prime == noisy_smoothness(sigma_u2=one.sigma_u2, n=n, d=d, lam=lam,
                                                    gamma1=gamma1)
        beta = one.delta_in + eigenvalue_bound(one.sigma_u2, n, d, gamma2)
    else:
        beta = one.delta_in
    e = d * (h / 2 + 2.0**-53 * cal.record_bound + 2.0**-1074)
    assert cal.rounding == pytest.approx(e, rel=1e-12, abs=0.0)
    beta2 = beta - (n - 1) * e
    assert cal.beta == pytest.approx(beta2, rel=1e-12) and e < beta2
    eps1 = math.log1p(cal.lambda_prime / beta2) + d * math.log((beta2 + e) / (beta2 - e))
    assert cal.epsilon_split["log_det"] == pytest.approx(math.log1p(cal.lambda_prime / beta),
                                                         rel=1e-12)
    assert eps1 == pytest.approx(cal.epsilon_split["log_det"] + cal.epsilon_split["rounding"],
                                 rel=1e-12)
    # Step 12: the box, the three slacks and the δ of the linear term.
    sigma_b = math.sqrt(cal.sigma_b2)
    p_eff = p_bound + h_b * math.sqrt(d) / 2
    kappa = cal.lambda_prime * eta
    xi = 2.0 * e * eta
    shift = kappa + 2 * p_eff + xi
    radius = cal.box_radius * math.sqrt(x)
    inner = radius - shift / h_b - 0.5  # |S_c| beyond this is the only way to leave the box
    assert 2 * d * skellam_tail(inner, x) <= cal.delta_split["box"] * (1 + 1e-9)
    # r is the least: half a grid unit less (or, far out, the tail point's 10⁻⁹) leaves the box.
    assert 2 * d * skellam_tail(min(inner - 0.5, inner * (1 - 2e-9)), x) > cal.delta_split["box"]
    top = radius + 0.5
    eta_loss = (d * (2 * radius + 0.25) / (2 * x)
                + (math.sqrt(d) * shift / h_b + d) * max(1 / (2 * x), top**3 / (6 * x**3)))
    eta_shift = (2 * math.sqrt(d) * radius * h_b * xi + 2 * (kappa + 2 * p_eff) * xi
                 + xi**2) / (2 * cal.sigma_b2)
    eta_density = d * (central_log_excess(x) + (radius + 0.75) / (2 * x) + top**4 / (24 * x**3))
    assert cal.slack["eta_loss"] == pytest.approx(eta_loss, rel=1e-9)
    assert cal.slack["eta_shift"] == pytest.approx(eta_shift, rel=1e-9, abs=1e-300)
    assert cal.slack["eta_density"] == pytest.approx(eta_density, rel=1e-9)
    assert cal.epsilon_split["grid"] == pytest.approx(eta_loss + eta_shift, rel=1e-9)
    eps2 = cal.epsilon - eps1 - eta_loss - eta_shift
    linear = math.exp(eta_density) * linear_term_delta(eps2, sigma_b, kappa, p_eff)
    assert linear + cal.delta_split["box"] <= delta_k * (1 + 1e-9)
    assert cal.proven


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_every_inequality_of_the_two_server_proof_holds_at_the_chosen_parameters(config):
    cal = _calibrate(config)
    assert_every_inequality_of_the_two_server_proof(cal)
    # Step 14 keeps the one-server calibration at the same parameters: its Δ_in (given or
    # chosen), its loss's criterion for the split, rigorous mode.
    assert cal.one_server == calibrate(mode="rigorous", **{"delta_in": None, **REFERENCE, **config})
    # σ_b is the least Step 12 admits (to 10⁻⁹): at 0.99 σ_b the linear term's δ is too large.
    smaller = _term(cal, 0.99 * math.sqrt(cal.sigma_b2))
    assert smaller is None or (smaller.linear_delta + smaller.box_delta
                               > cal.one_server.delta_split["delta_k"])


def test_the_inequality_check_fails_on_a_wrong_bound():
    cal = _calibrate(CONFIGS[1])
    # Half the rounding slack, the ridge of the wrong β, or a tenth less linear noise: each is
    # caught by the check above.
    for wrong in ({"rounding": cal.rounding / 2}, {"beta": cal.beta * 1.01},
                  {"sigma_b2": cal.sigma_b2 * 0.9, "poisson_mean": cal.poisson_mean * 0.9},
                  {"box_radius": cal.box_radius * 0.9}):
        with pytest.raises(AssertionError):
            assert_every_inequality_of_the_two_server_proof(cal.model_copy(update=wrong))


@pytest.mark.parametrize("config", CONFIGS[:3] + CONFIGS[5:7],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_the_two_server_noise_is_within_a_tenth_of_a_percent_of_the_one_server_noise(config):
    cal = _calibrate(config)
    one = cal.one_server
    assert cal.sigma_u2 == one.sigma_u2 and cal.delta_in == one.delta_in
    assert one.sigma_b2 < cal.sigma_b2 < 1.001 * one.sigma_b2


@pytest.mark.parametrize("x", [200.0, 5_000.0])
def test_the_dithered_loss_is_the_gaussian_loss_plus_at_most_eta_l_on_the_box(x):
    # Step 12's pointwise inequality against the exact Skellam log-pmf: random points of the box
    # and shifts up to the bound, in d = 3 grid units.
    rng = np.random.default_rng(int(x))
    d, radius, shift = 3, 5.0 * math.sqrt(x), 1.5 * math.sqrt(x)
    y = rng.uniform(-radius + shift, radius - shift, size=(20_000, d))
    direction = rng.normal(size=(20_000, d))
    step = direction / np.linalg.norm(direction, axis=1, keepdims=True)
    y2 = y + step * rng.uniform(0, shift, size=(20_000, 1))

    def log_g(points):
        k = np.ceil(points - 0.5)
        return skellam.logpmf(k, x / 2, x / 2).sum(axis=1)

    loss = log_g(y) - log_g(y2)
    gaussian = ((y2**2).sum(axis=1) - (y**2).sum(axis=1)) / (2 * x)
    slack = dither_loss_slack(x, radius, shift, d)
    assert np.all(loss <= gaussian + slack + 1e-9)
    assert np.max(loss - gaussian) > 0.2 * slack  # the slack is needed, and not far off
    # And the density against N(0, x·I) on the box (the change of measure of Step 12).
    log_phi = -0.5 * d * math.log(2 * math.pi * x) - (y**2).sum(axis=1) / (2 * x)
    assert np.all(log_g(y) - log_phi <= dither_density_slack(x, radius, d) + 1e-9)


def test_the_rounding_slack_stays_a_positive_bound_where_its_grid_and_product_terms_vanish():
    # Step 10: e = d·(h/2 + 2⁻⁵³H_q² + 2⁻¹⁰⁷⁴), the last term for products that round to a
    # subnormal. At h = 2⁻¹⁰⁷⁴ and H_q = 0 the first two are 0 in double precision, the last not.
    assert two_server.rounding_slack(1074, 3, 0.0) >= 3 * 2.0**-1074 > 0.0
    assert two_server.rounding_slack(40, 14, 2.0) == pytest.approx(
        14 * (2.0**-41 + 2.0**-53 * 2.0 + 2.0**-1074), rel=1e-15)


def test_the_rounded_log_det_bound_is_step_10s_formula():
    # ε₁′ = log(1 + λ′/β′) + d·log((β′ + e)/(β′ − e)), at a β′ below 1 and one above, where
    # e/β′ and e·β′ differ; no bound when e ≥ β′.
    for lambda_prime, beta, e, d in ((2.0, 0.5, 0.1, 3), (0.3, 40.0, 0.25, 14)):
        expected = math.log(1 + lambda_prime / beta) + d * math.log((beta + e) / (beta - e))
        assert two_server.rounded_log_det_epsilon(lambda_prime, beta, e, d) == pytest.approx(
            expected, rel=1e-13)
    assert two_server.rounded_log_det_epsilon(1.0, 0.5, 0.5, 2) == math.inf


def _small_term_inputs() -> dict:
    """dithered_linear_term's inputs at SMALL's calibration, but for epsilon2 and shift_rounding."""
    cal = _calibrate({"n": 512, "d": 2, "epsilon": 2.0})
    return {"sigma_b": math.sqrt(cal.sigma_b2), "n": cal.n, "d": cal.d,
            "kappa": cal.lambda_prime * cal.one_server.eta, "p_bound": cal.one_server.p_bound,
            "fraction_bits": cal.encoding.fraction_bits, "box_delta": cal.delta_split["box"]}


def test_the_rounding_in_the_shift_costs_step_12_b_eta_xi_at_any_size():
    # Step 12 (b): η_ξ = (2√d·rσ_b·ξ_m + 2(κ + ρ)ξ_m + ξ_m²)/(2σ_b²). The calibrated ξ_m is
    # about 10⁻¹⁷, where ξ_m² vanishes; at ξ_m = 0.5 (and 0.1) every term counts.
    inputs = _small_term_inputs()
    sigma_b, d, kappa = inputs["sigma_b"], inputs["d"], inputs["kappa"]
    for xi in (0.5, 0.1):
        term = dithered_linear_term(epsilon2=1e3, shift_rounding=xi, **inputs)
        h_b = math.ldexp(1.0, -term.linear_bits)
        rho = 2 * (inputs["p_bound"] + h_b * math.sqrt(d) / 2)
        radius = term.box_radius * math.sqrt(term.grid_variance) * h_b  # rσ_b
        expected = ((2 * math.sqrt(d) * radius * xi + 2 * (kappa + rho) * xi + xi**2)
                    / (2 * sigma_b**2))
        assert term.eta_shift == pytest.approx(expected, rel=1e-12)


def test_the_shift_bound_adds_the_rounding_in_the_box_and_the_loss_slack():
    # Step 12: Γ″ = κ + ρ + ξ_m bounds ‖g‖, the box's radius in grid units is
    # r√x = k + ½ + Γ″/h_b (k the Skellam tail point at box_delta/(2d)), and η_L is taken at the
    # shift Γ″/h_b. At ξ_m = 0.5 a Γ″ short of ξ_m (or without it) moves both.
    inputs = _small_term_inputs()
    d, kappa = inputs["d"], inputs["kappa"]
    for xi in (0.5, 0.1):
        term = dithered_linear_term(epsilon2=1e3, shift_rounding=xi, **inputs)
        h_b = math.ldexp(1.0, -term.linear_bits)
        x = term.grid_variance
        shift = kappa + 2 * (inputs["p_bound"] + h_b * math.sqrt(d) / 2) + xi
        radius_grid = skellam_tail_point(inputs["box_delta"] / (2 * d), x) + 0.5 + shift / h_b
        assert term.box_radius * math.sqrt(x) == pytest.approx(radius_grid, rel=1e-12)
        assert term.eta_loss == pytest.approx(
            dither_loss_slack(x, radius_grid, shift / h_b, d), rel=1e-12)


def test_an_epsilon_2_that_only_pays_the_slack_leaves_no_linear_term():
    # ε₂′ = ε₂ − η_L − η_ξ must be positive for Step 12 (e): at ε₂ = η_L + η_ξ exactly the term
    # is refused (None), just above it is evaluated. A coarse grid (f = 0, σ_b = 3) makes the
    # slack large and η_ξ = 0, so that the difference is exactly 0.
    inputs = {**_small_term_inputs(), "sigma_b": 3.0, "fraction_bits": 0, "shift_rounding": 0.0}
    slack = dithered_linear_term(epsilon2=1e3, **inputs)
    assert slack.eta_shift == 0.0 and slack.eta_loss > 1.0
    assert dithered_linear_term(epsilon2=slack.eta_loss, **inputs) is None
    assert dithered_linear_term(epsilon2=math.nextafter(slack.eta_loss, math.inf), **inputs)


def test_the_linear_terms_delta_is_at_most_1():
    # Step 12 (e)'s bound e^{η₀}·linear_term_delta(ε₂′, …) exceeds 1 when η₀ is large (here
    # x = 9 grid units²); δ is a probability, so the term reports 1.
    inputs = {**_small_term_inputs(), "sigma_b": 3.0, "fraction_bits": 0, "shift_rounding": 0.0}
    slack = dithered_linear_term(epsilon2=1e3, **inputs)
    epsilon2 = slack.eta_loss + 0.1
    term = dithered_linear_term(epsilon2=epsilon2, **inputs)
    p_eff = inputs["p_bound"] + math.sqrt(inputs["d"]) / 2  # h_b = 1
    bound = math.exp(term.eta_density) * linear_term_delta(
        epsilon2 - term.eta_loss - term.eta_shift, inputs["sigma_b"], inputs["kappa"], p_eff)
    assert term.linear_bits == 0 and bound > 1.0
    assert term.linear_delta == 1.0


def test_an_entry_bound_fits_the_range_exactly_when_it_and_half_a_step_are_within_b():
    # Step 13: no entry is clamped when its bound plus the rounding's h/2 is at most B = 2^c:
    # here B = 8, h = 1/4; 7.875 fits, 2⁻²⁰ more does not.
    fp = FixedPoint(d=1, n=2, fraction_bits=2, clamp_log2=3)
    assert two_server._fits(8.0 - 0.125, fp)
    assert not two_server._fits(8.0 - 0.125 + 2.0**-20, fp)
    assert two_server._fits(0.0, fp) and not two_server._fits(8.0, fp)


def test_the_noise_free_record_bound_holds_every_clipped_row_and_little_more():
    # σ_u = 0 (a large ridge): ‖q̃‖ = ‖q‖, and clip_rows leaves a row scaled to √λ a few ulps
    # above it. H_q² must hold every clipped row's ‖q‖², and exceed λ by no more than 10⁻⁸.
    cal = _calibrate(CONFIGS[-1])
    one = cal.one_server
    assert one.noise_std_q == 0.0
    for lam in (one.lam, 0.37):
        one_at = one.model_copy(update={"lam": lam})
        record_bound = two_server.clamp_bounds(one=one_at, linear_bits=cal.linear_bits,
                                               poisson_mean=cal.poisson_mean)[0]
        rows = np.random.default_rng(5).normal(size=(100_000, one.d)) * 10.0
        norms2 = np.sum(clip_rows(rows, math.sqrt(lam)) ** 2, axis=1)
        assert np.max(norms2) <= record_bound <= lam * (1 + 1e-8)
        assert np.max(norms2) > lam * (1 - 1e-12)  # clipping reaches √λ: the bound is needed


def test_a_study_whose_range_leaves_no_fraction_bit_calibrates_on_the_integers():
    # P = 10¹² puts every entry's range at B = 2⁴⁰, and n = 2²² + 1 records of that range fit in
    # 63 bits only with f = 0 (n·2⁴⁰ ≤ 2⁶³ − 1 < n·2⁴¹): the grid h = 1 is the encoding. A ridge
    # of 10⁹ pays for its rounding slack (e ≈ d/2 per record).
    n = 2**22 + 1
    assert n * 2**40 <= SIGNED_MAX < n * 2**41
    cal = calibrate_two_server(epsilon=1.0, delta=0.01, n=n, d=1, p_bound=1e12, delta_in=1e9)
    assert (cal.encoding.clamp_log2, cal.encoding.fraction_bits) == (40, 0)
    assert_every_inequality_of_the_two_server_proof(cal)


def test_a_two_server_device_draws_the_documented_noise():
    cal = _calibrate({"n": 512, "d": 2, "epsilon": 2.0})
    rng = np.random.default_rng(9)
    q = np.tile([0.6, 0.0], (50_000, 1))
    p = np.tile([0.3, -0.7], (50_000, 1))
    q_tilde, p_hat = perturb_two_server(q, p, cal, noise=rng, generator=rng)
    assert np.std(q_tilde - q) == pytest.approx(cal.noise_std_q, rel=0.02)
    units = np.ldexp(p_hat, cal.linear_bits)
    np.testing.assert_array_equal(units, np.rint(units))  # on the grid h_b
    noise = np.ldexp(p, cal.linear_bits).round() - units
    assert np.var(noise) == pytest.approx(2 * cal.poisson_mean, rel=0.03)
    assert np.mean(noise) == pytest.approx(0.0, abs=5 * math.sqrt(2 * cal.poisson_mean / 1e5))


def test_every_two_server_proof_step_named_in_a_docstring_is_in_docs_privacy():
    named = set()
    for module in (two_server, grid_noise):
        named |= set(re.findall(r"Step \d+ \([^)]+\)", Path(module.__file__).read_text()))
    assert {s.split(" (")[0] for s in named} >= {f"Step {i}" for i in range(9, 15)}
    docs = (Path(__file__).resolve().parents[2] / "docs" / "privacy.md").read_text()
    headings = set(re.findall(r"^#+ (Step \d+ \([^)]+\))", docs, flags=re.MULTILINE))
    assert named <= headings, named - headings


def test_the_clamp_probabilities_hold_for_honest_records_at_the_worst_clean_norms():
    # Step 13 at a share loose enough to count events: ‖q̃‖² > H_q² for a record at ‖q‖² = λ
    # (the worst clean norm) happens at rate τ_q, exactly (noncentral χ²); a device's Skellam
    # draw leaves [−k, k] in some coordinate at most at rate τ_S (Chernoff, so well below).
    cal = _calibrate({"n": 512, "d": 2, "epsilon": 2.0})
    one, n, d = cal.one_server, cal.n, cal.d
    share = 2.0 * 0.02 * (n + 1)
    record_bound, _, bound_p, tau_s = two_server.clamp_bounds(
        one=one, linear_bits=cal.linear_bits, poisson_mean=cal.poisson_mean, share=share)
    rng = np.random.default_rng(13)
    m = 200_000
    q = np.array([math.sqrt(one.lam), 0.0])
    p = np.array([one.p_bound, 0.0])
    q_tilde, p_hat = perturb_two_server(np.tile(q, (m, 1)), np.tile(p, (m, 1)), cal, noise=rng,
                                        generator=rng)
    rate_q = np.mean(np.sum(q_tilde**2, axis=1) > record_bound)
    assert abs(rate_q - 0.02) < 5 * math.sqrt(0.02 * 0.98 / m)
    assert np.mean(np.sum(q_tilde**2, axis=1) > 0.9 * record_bound) > 0.03  # the bound is tight
    rate_p = np.mean(np.any(np.abs(p_hat) > bound_p, axis=1))
    k = (bound_p - one.p_bound) / cal.linear_step - 0.5
    exact = 1 - (1 - 2 * skellam.sf(math.floor(k), cal.poisson_mean, cal.poisson_mean)) ** d
    assert rate_p <= tau_s and exact <= tau_s
    assert rate_p < 5 * exact + 10 / m  # the simulated device draws the law the bound is for


SMALL = {"epsilon": 2.0, "delta": 0.01, "n": 512, "d": 2}
"""Cheap parameters (CONFIGS[5]) for the tests that steer the calibration's searches."""


def _one_server_at_small():
    """The one-server calibration calibrate_two_server starts from at SMALL."""
    return calibrate(mode="rigorous", lam=1.0, p_bound=1.0, eta=1.0, delta_in=None, **SMALL)


def test_a_linear_bound_just_past_a_power_of_two_gets_the_next_range():
    # At λ = 0.01, P = 0.280451 the clamp bounds at the one-server σ_b put B_p 1.5·10⁻⁶ below
    # 2⁻¹, so the range starts at 2⁻¹; at the two-server σ_b (slightly larger) B_p passes 2⁻¹
    # while B_q ≈ 0.06 still fits, and the range must grow to the next power of two, 2⁰.
    cal = calibrate_two_server(**SMALL, lam=0.01, p_bound=0.280451)
    bound_p = two_server.clamp_bounds(one=cal.one_server, linear_bits=cal.linear_bits,
                                      poisson_mean=cal.poisson_mean)[2]
    assert 0.5 < bound_p < 0.5 * (1 + 1e-5) and cal.record_bound < 0.25
    assert cal.encoding.clamp_log2 == 0
    assert_every_inequality_of_the_two_server_proof(cal)


def test_an_entry_bound_just_below_a_power_of_two_keeps_that_range():
    # σ_u = 0 (a large ridge) makes H_q² = λ(1 + 10⁻⁹)²; at λ = ½(1 − 2.7·10⁻⁹) that is
    # B_q = ½ − 1.75·10⁻¹⁰, and B_p ≈ 0.41: both fit B = 2⁻¹, so the range is 2⁻¹, not 2⁰
    # (and f one bit finer).
    cal = calibrate_two_server(epsilon=1.0, delta=0.01, n=512, d=2, lam=0.5 * (1 - 2.7e-9),
                               p_bound=0.01, delta_in=1e3)
    _, bound_q, bound_p, _ = two_server.clamp_bounds(one=cal.one_server,
                                                     linear_bits=cal.linear_bits,
                                                     poisson_mean=cal.poisson_mean)
    assert 0.5 * (1 - 2.0**-30) < bound_q < 0.5 and bound_p < 0.45
    assert cal.encoding.clamp_log2 == -1
    assert_every_inequality_of_the_two_server_proof(cal)


def test_records_whose_sum_cannot_fit_in_64_bits_are_refused():
    # n = 2³⁰ records with entries up to B = 2³⁴ (P = 10¹⁰) need n·B = 2⁶⁴ > 2⁶³ − 1 even at f = 0.
    with pytest.raises(CalibrationError) as refused:
        calibrate_two_server(epsilon=1.0, delta=0.01, n=2**30, d=1, p_bound=1e10)
    assert str(refused.value) == "n=1073741824 records with entries up to 2^34 do not fit in 64 bits"


def test_an_epsilon_whose_clamp_tail_is_not_a_double_is_refused_at_step_13():
    # Step 13's τ_S/(2d) = 10⁻³δ/(4d(1 + e^ε)n) is 1.0·10⁻³⁰⁸ at ε = 699.5, δ = 0.99, n = 4,
    # d = 1, below the least normal double: its tail point cannot be found in double precision,
    # and a clamp cost written as (1 + e^ε)·n·τ_S for any other τ_S would not be what the clamp
    # spends. Refused by name. The one-server norm check's π = 4d·τ_S/(2d) = 4.0·10⁻³⁰⁸ is still
    # normal there, so it is Step 13 that refuses; at ε = 800 the one-server calibration refuses
    # first.
    with pytest.raises(CalibrationError) as refused:
        calibrate_two_server(epsilon=699.5, delta=0.99, n=4, d=1, delta_in=1e3)
    assert str(refused.value).startswith("ε=699.5 leaves the linear clamp's tail τ_S = ")
    assert "below double precision's normal range (Step 13)" in str(refused.value)
    with pytest.raises(CalibrationError, match="below double precision's normal range"):
        calibrate_two_server(epsilon=800.0, delta=0.99, n=4, d=1, delta_in=1e3)
    # Below, the clamp's δ is what its τ_S costs: (1 + e^ε)·n·τ_S = 10⁻³δ/2.
    cal = calibrate_two_server(epsilon=50.0, delta=0.99, n=4, d=1, delta_in=1e3)
    tau_s = two_server.clamp_bounds(one=cal.one_server, linear_bits=cal.linear_bits,
                                    poisson_mean=cal.poisson_mean)[3]
    assert tau_s == pytest.approx(CLAMP_DELTA_SHARE * 0.99 / 2 / ((1 + math.exp(50.0)) * 4),
                                  rel=1e-12)
    assert cal.delta_split["clamp_p"] == pytest.approx(CLAMP_DELTA_SHARE * 0.99 / 2, rel=1e-12)


def _share_for_tail(one, per_tail: float) -> float:
    """A clamp share whose τ_S/(2d) (Step 13) is per_tail exactly, in floating point."""
    share = per_tail * 2.0 * one.d * (1.0 + math.exp(one.epsilon)) * one.n * 2.0
    for _ in range(64):
        got = share / 2.0 / ((1.0 + math.exp(one.epsilon)) * one.n) / (2.0 * one.d)
        if got == per_tail:
            return share
        share = math.nextafter(share, math.inf if got < per_tail else 0.0)
    raise AssertionError("no share gives this tail")


def test_the_clamp_refuses_exactly_a_tail_below_the_least_normal_double_per_coordinate():
    # Step 13 refuses when τ_S/(2d), the tail of each of the 2d coordinates, is below the least
    # normal double, and only then: at d = 2 a bound on τ_S alone, or on τ_S/(3d), or a refusal
    # at equality, each moves the edge. Past e^ε's range (ε = 800) the refusal is the same.
    cal = _calibrate({"n": 512, "d": 2, "epsilon": 2.0})
    one = cal.one_server
    kw = {"one": one, "linear_bits": cal.linear_bits, "poisson_mean": cal.poisson_mean}
    least = sys.float_info.min
    for per_tail in (least, 1.2 * least):  # at the edge and just above: a tail point exists
        assert two_server.clamp_bounds(**kw, share=_share_for_tail(one, per_tail))[3] > 0.0
    share = _share_for_tail(one, 0.5 * least)
    tau_s = share / 2.0 / ((1.0 + math.exp(one.epsilon)) * one.n)
    with pytest.raises(CalibrationError) as refused:
        two_server.clamp_bounds(**kw, share=share)
    assert str(refused.value) == (
        f"ε=2 leaves the linear clamp's tail τ_S = {tau_s:.3g} per device below double "
        "precision's normal range (Step 13); such an ε protects nothing anyway")
    with pytest.raises(CalibrationError, match=r"^ε=800 leaves the linear clamp's tail τ_S = 0 "):
        two_server.clamp_bounds(**{**kw, "one": one.model_copy(update={"epsilon": 800.0})})


def test_a_device_perturbs_with_the_systems_noise_by_default():
    # Without a seeded source, q̃ takes the OS's Gaussian noise and p̂ the system generator's
    # Skellam noise: q̃ moves off q, and p̂ lies on the grid h_b·ℤ.
    cal = _calibrate({"n": 512, "d": 2, "epsilon": 2.0})
    q = np.full((3, 2), 0.25)
    p = np.full((3, 2), 0.125)
    q_tilde, p_hat = perturb_two_server(q, p, cal)
    assert q_tilde.shape == q.shape and p_hat.shape == p.shape
    assert np.all(q_tilde != q)
    grid = p_hat / cal.linear_step
    assert np.array_equal(grid, np.rint(grid))


def test_a_rounding_that_takes_all_of_epsilon_is_refused_at_step_10(monkeypatch):
    # ε₁ = ε leaves ε₂ = 0 for the linear term: refused for the rounding, by name, before any
    # σ_b is tried (real parameters reach ε₁ = ε only by a floating-point coincidence).
    tried = []
    monkeypatch.setattr(two_server, "rounded_log_det_epsilon", lambda *args: SMALL["epsilon"])
    monkeypatch.setattr(two_server, "dithered_linear_term", lambda **kw: tried.append(kw))
    with pytest.raises(CalibrationError) as refused:
        calibrate_two_server(**SMALL)
    assert re.fullmatch(r"the rounding of q̃q̃ᵀ at f=\d+ \(n=512\) leaves no ε for the linear "
                        r"term: ε₁ = 2 ≥ ε \(Step 10\)", str(refused.value))
    assert tried == []


@pytest.mark.parametrize("study", [
    {"n": 512, "d": 2, "p_bound": 1e6},
    # σ_b ≈ 10⁻¹¹ asks for a grid finer than 2⁻⁶², and B_p at 2⁻⁶² lies 5·10⁻¹⁹ above 2⁻³⁹
    # (at 2⁻⁶³ as far below): the first range is 2⁻³⁸, f = 51. The ridge leaves σ_u = 0.
    {"n": 10**15, "d": 1, "p_bound": 1.8189851446844325e-12, "delta_in": 0.1},
], ids=["P=1e6", "sigma_b-below-the-finest-grid"])
def test_a_rounding_refusal_names_the_f_of_the_least_range_over_the_first_bounds(study):
    # The first range tried is the least power of two over B_q and B_p (Step 13) at the
    # one-server σ_b, on Step 9's finest linear grid with μ ≤ 2³⁰ (f_b ≤ f ≤ 62); at λ = 10⁻¹²
    # Step 10 refuses there, and names that range's f. B_q ≈ 10⁻¹² < B_p.
    kw = {"epsilon": 1.0, "delta": 0.01, "lam": 1e-12, "delta_in": None, **study}
    n, d, p_bound = kw["n"], kw["d"], kw["p_bound"]
    one = calibrate(mode="rigorous", eta=1.0, **kw)
    sigma_b = math.sqrt(one.sigma_b2)
    linear_bits = min(62, math.floor(math.log2(math.sqrt(2 * n * POISSON_MEAN_MAX) / sigma_b)))
    h_b = 2.0**-linear_bits
    mu = one.sigma_b2 / (2 * n * h_b**2)
    tau_s = CLAMP_DELTA_SHARE * 0.01 / 2 / ((1 + math.exp(1.0)) * n)
    bound_p = p_bound + h_b * (grid_noise.skellam_tail_point(tau_s / (2 * d), 2 * mu) + 0.5)
    fraction_bits = fraction_bits_for(n, math.ceil(math.log2(bound_p)))
    with pytest.raises(CalibrationError) as refused:
        calibrate_two_server(**kw)
    assert str(refused.value).startswith(
        f"the rounding of q̃q̃ᵀ at f={fraction_bits} (n={n}) leaves no ε for the linear term")


def test_a_linear_term_that_spends_exactly_delta_k_is_admitted(monkeypatch):
    # Step 14 needs linear + box ≤ δ_K: equality is enough. Step 12's δ is made exactly
    # δ_K − box at every σ_b, so the search keeps the first σ_b it tries, the one-server one.
    delta_k = _one_server_at_small().delta_split["delta_k"]
    real_term = two_server.dithered_linear_term

    def spends_delta_k(**kw):
        term = real_term(**kw)
        assert term.box_delta == BOX_SHARE * delta_k
        spent = delta_k - term.box_delta
        while spent + term.box_delta > delta_k:
            spent = math.nextafter(spent, 0.0)
        assert spent + term.box_delta == delta_k
        return term.model_copy(update={"linear_delta": spent})

    monkeypatch.setattr(two_server, "dithered_linear_term", spends_delta_k)
    cal = calibrate_two_server(**SMALL)
    assert cal.delta_split["linear"] + cal.delta_split["box"] == delta_k
    assert cal.sigma_b2 == pytest.approx(cal.one_server.sigma_b2, rel=1e-12)


def _linear_term_from(threshold: float, monkeypatch) -> list[float]:
    """Make Step 12 hold only from σ_b ≥ threshold·(one-server σ_b) on; returns the σ_b tried."""
    sigma_one = math.sqrt(_one_server_at_small().sigma_b2)
    real_term = two_server.dithered_linear_term
    tried = []

    def holds_from_threshold(**kw):
        tried.append(kw["sigma_b"] / sigma_one)
        return real_term(**kw) if kw["sigma_b"] >= threshold * sigma_one else None

    monkeypatch.setattr(two_server, "dithered_linear_term", holds_from_threshold)
    return tried


def test_sigma_b_is_searched_up_to_a_million_times_the_one_server_sigma_b(monkeypatch):
    tried = _linear_term_from(9e5, monkeypatch)
    cal = calibrate_two_server(**SMALL)
    assert math.sqrt(cal.sigma_b2 / cal.one_server.sigma_b2) == pytest.approx(9e5, rel=2e-9)
    assert max(tried) <= 1e6


def test_no_sigma_b_up_to_a_million_times_the_one_server_one_is_refused_by_name(monkeypatch):
    tried = _linear_term_from(1.01e6, monkeypatch)
    with pytest.raises(CalibrationError) as refused:
        calibrate_two_server(**SMALL)
    assert str(refused.value) == "no σ_b meets Step 12 at these parameters"
    assert 1e6 / 1.01 < max(tried) <= 1e6


TABLE_HEADER = ("| ε | d | n | σ_b² one-server | σ_b² two-server | difference | f | f_b | μ | B "
                "| ε rounding | ε grid |")


def _table_figures(cal: TwoServerCalibration) -> list[str]:
    """The figures `python -m ipdp.two_server` prints for a calibration after its ε, d and n."""
    one = cal.one_server
    return [f"{one.sigma_b2:.6g}", f"{cal.sigma_b2:.6g}",
            f"{100 * (cal.sigma_b2 / one.sigma_b2 - 1):+.4f} %",
            str(cal.encoding.fraction_bits), str(cal.linear_bits), f"{cal.poisson_mean:.3g}",
            f"2^{cal.encoding.clamp_log2}", f"{cal.epsilon_split['rounding']:.2g}",
            f"{cal.epsilon_split['grid']:.2g}"]


def test_the_comparison_table_prints_each_calibration_and_names_each_refusal(capsys):
    # `python -m ipdp.two_server` (docs/privacy.md quotes its rows): one row per (ε, d, n) that
    # calibrates, with the figures of that calibration, and one line per refused one.
    assert two_server.main(["--epsilon", "1", "0.5", "--n", "2", "512", "--d", "14"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split(" | ")[0] == "| ε" and out[1] == "|" + "---|" * 12
    rows = [line.strip("| ").split(" | ") for line in out[2:] if line.startswith("| ")]
    assert [(r[0], r[1], r[2]) for r in rows] == [("1", "14", "512"), ("0.5", "14", "512")]
    for row, epsilon in zip(rows, (1.0, 0.5), strict=True):
        cal = calibrate_two_server(epsilon=epsilon, delta=0.01, n=512, d=14)
        assert row[3:] == _table_figures(cal)
        assert cal.sigma_b2 > cal.one_server.sigma_b2
    refused = [line for line in out if "refused" in line]
    assert len(refused) == 2 and refused[0].startswith("ε=1, d=14, n=2: refused: n=2 is too small")
    assert refused[1].startswith("ε=0.5, d=14, n=2: refused:")


def test_the_comparison_table_fails_when_nothing_calibrates(capsys):
    assert two_server.main(["--n", "2", "3", "--d", "14"]) == 2
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert out.count("refused") == 2 and [line for line in lines if line.startswith("|")] == lines[:2]


def test_the_comparison_table_by_default_is_epsilon_1_delta_0_01_d_14_at_three_sizes(capsys):
    # The defaults docs/privacy.md's table starts from: ε = 1, δ = 0.01, d = 14 and
    # n ∈ {512, 10,000, 2²¹}, the header with its twelve column names, and no refusal.
    assert two_server.main([]) == 0
    out = capsys.readouterr().out
    rows = []
    for n in (512, 10_000, 2**21):
        cal = calibrate_two_server(epsilon=1.0, delta=0.01, n=n, d=14)
        rows.append("| " + " | ".join(["1", "14", f"{n:,}", *_table_figures(cal)]) + " |")
    assert out == "\n".join([TABLE_HEADER, "|" + "---|" * 12, *rows]) + "\n\n"
    docs = (Path(__file__).resolve().parents[2] / "docs" / "privacy.md").read_text()
    assert TABLE_HEADER in docs.splitlines()


def test_the_comparison_table_reads_delta_as_a_number(capsys):
    assert two_server.main(["--delta", "0.05", "--n", "512"]) == 0
    out = capsys.readouterr().out.splitlines()
    cal = calibrate_two_server(epsilon=1.0, delta=0.05, n=512, d=14)
    assert out[2] == "| " + " | ".join(["1", "14", "512", *_table_figures(cal)]) + " |"


def test_the_comparison_tables_help_names_the_command_and_what_it_prints(capsys):
    with pytest.raises(SystemExit) as exit_:
        two_server.main(["--help"])
    assert exit_.value.code == 0
    # argparse wraps usage and description to the terminal's width, at spaces and after hyphens.
    out = "".join(capsys.readouterr().out.split())
    assert out.startswith("usage:python-mipdp.two_server[-h]")
    description = "``python -m ipdp.two_server``: the two-server calibration next to the one-server one."
    assert "".join(description.split()) in out


def test_the_comparison_table_refuses_an_abbreviated_option(capsys):
    # `--eps` is not read as `--epsilon`: an option is spelt out, as docs/privacy.md spells it.
    with pytest.raises(SystemExit) as exit_:
        two_server.main(["--eps", "1", "--n", "512"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --eps" in capsys.readouterr().err
