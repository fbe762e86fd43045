"""OpenDP-SSP's noise comes from OpenDP's own accountant, and OpenDP's scikit-learn-style
LinearRegression cannot be the peer itself (bench.baselines.opendp_ssp_sigma)."""

from __future__ import annotations

import math

import pytest

from bench.baselines import gram_sensitivity, linear_sensitivity, opendp_ssp_sigma

dp = pytest.importorskip("opendp.prelude")


def _release(d: int, scale: float, delta: float):
    dp.enable_features("contrib")
    space = (dp.vector_domain(dp.atom_domain(T=float, nan=False), size=d * (d + 1) // 2 + d),
             dp.l2_distance(T=float))
    gaussian = dp.m.make_gaussian(*space, scale=scale)
    return dp.c.make_fix_delta(dp.c.make_zCDP_to_approxDP(gaussian), delta=delta)


@pytest.mark.parametrize("epsilon", [0.1, 1.0])
def test_the_scale_is_the_least_opendps_map_proves_epsilon_delta_for(epsilon):
    sigma = opendp_ssp_sigma(epsilon=epsilon, delta=0.01, lam=1.0, p_bound=1.0, d=14)
    sensitivity = math.hypot(gram_sensitivity(1.0), linear_sensitivity(1.0))
    assert sensitivity == pytest.approx(math.sqrt(6.0))  # √(2λ² + 4P²)
    eps, delta = _release(14, sigma, 0.01).map(sensitivity)
    assert eps <= epsilon * (1 + 1e-9) and delta == 0.01
    assert _release(14, 0.99 * sigma, 0.01).map(sensitivity)[0] > epsilon


def test_opendps_linear_regression_fits_one_feature_only():
    pytest.importorskip("sklearn")
    dp.enable_features("contrib")
    with pytest.raises(Exception, match="single tuple"):
        dp.sklearn.linear_model.LinearRegression(
            dp.max_divergence(), x_bounds=[(-1.0, 1.0), (-1.0, 1.0)], y_bounds=(-1.0, 1.0),
            scale=1.0)
