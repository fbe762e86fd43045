"""TukeyEM (bench/tukey.py) on its own: depths it knows, the law it samples, and an exact audit
of its (ε, δ) on small instances."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from scipy import stats

from bench import tukey


def test_block_models_are_the_ols_fit_of_each_block():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((600, 3))
    w = np.array([0.5, -1.0, 2.0])
    models = tukey.block_models(x, x @ w, m=20)
    assert models.shape == (20, 3)
    np.testing.assert_allclose(models, np.tile(w, (20, 1)), atol=1e-10)
    with pytest.raises(ValueError, match="need"):
        tukey.block_models(x[:50], x[:50] @ w, m=20)


def test_depth_and_volumes_of_models_on_a_known_grid():
    # Coordinates 1 … 9 in the first axis and 10 … 90 in the second: depth s spans [s, 10 − s]
    # and [10s, 100 − 10s], so V_s = (10 − 2s)·(100 − 20s).
    models = np.array([[i, 10 * i] for i in range(1, 10)], dtype=float)
    coords = tukey.sorted_coordinates(models)
    np.testing.assert_allclose(np.exp(tukey.log_volumes(coords)),
                               [(10 - 2 * s) * (100 - 20 * s) for s in range(1, 5)])
    assert tukey.depth(coords, np.array([5.0, 50.0])) == 5
    assert tukey.depth(coords, np.array([2.5, 50.0])) == 2
    assert tukey.depth(coords, np.array([5.0, 85.0])) == 1
    assert tukey.depth(coords, np.array([0.0, 50.0])) == 0
    # A point drawn at depth s has depth s, for every s.
    rng = np.random.default_rng(1)
    for s in range(1, 5):
        for _ in range(200):
            assert tukey.depth(coords, tukey.sample_at_depth(coords, s, rng)) == s


def test_the_depth_is_drawn_with_the_exponential_mechanisms_weights():
    rng = np.random.default_rng(2)
    coords = tukey.sorted_coordinates(rng.standard_normal((40, 2)))
    log_v = tukey.log_volumes(coords)
    depths, log_mass = tukey.depth_weights(log_v, 0.5, t=10)
    p = np.exp(log_mass - log_mass.max())
    p /= p.sum()
    draws = 20_000
    counts = np.bincount([tukey._racing(log_mass, rng) for _ in range(draws)],
                         minlength=len(p))
    sd = np.sqrt(draws * p * (1 - p))
    assert np.all(np.abs(counts - draws * p) <= 5 * sd + 1)
    # The mass of depth s is (V_s − V_{s+1})·e^{ε_EM·s/2}.
    v = np.exp(log_v)
    expected = (v[9:] - np.append(v[10:], 0.0)) * np.exp(0.5 * depths / 2.0)
    np.testing.assert_allclose(p, expected / expected.sum(), rtol=1e-9)


def test_too_few_models_for_the_test_return_no_model():
    rng = np.random.default_rng(3)
    models = rng.standard_normal((6, 2))
    assert all(tukey.tukey_em(models, epsilon=1.0, delta=1e-5, rng=rng) is None
               for _ in range(50))


def release_law(models: np.ndarray, grids, epsilon: float, delta: float):
    """TukeyEM's exact output law on the cells of `grids` (the models' coordinates of both data
    sets, per axis): P(no model), and the probability of each cell (depth is constant on one).

    The law is read from the plan tukey_em draws from (its k̂, threshold, Laplace scale and
    depth masses); only the geometry, which cell has which depth and volume, is derived here,
    and test_the_release_draws_what_its_plan_says checks the draws against the plan."""
    plan = tukey.tukey_plan(models, epsilon=epsilon, delta=delta)
    passes = float(stats.laplace.sf(plan.threshold - plan.k_hat, scale=plan.laplace_scale))
    coords = plan.coords
    mids = [0.5 * (g[:-1] + g[1:]) for g in grids]
    depth = np.full([len(mid) for mid in mids], np.iinfo(int).max)
    volume = np.ones_like(depth, dtype=float)
    for j, mid in enumerate(mids):
        below = (coords[j][None, :] <= mid[:, None]).sum(axis=1)
        above = (coords[j][None, :] >= mid[:, None]).sum(axis=1)
        shape = [1] * len(mids)
        shape[j] = len(mid)
        depth = np.minimum(depth, np.minimum(below, above).reshape(shape))
        volume = volume * np.diff(grids[j]).reshape(shape)
    mass = np.exp(plan.log_mass - plan.log_mass.max())
    mass /= mass.sum()
    cells = np.zeros_like(volume)
    for s, p_s in zip(plan.depths, mass, strict=True):
        shell = depth == s
        if p_s > 0:
            assert volume[shell].sum() > 0, f"the plan puts mass on depth {s}, which is empty"
            cells[shell] = p_s * volume[shell] / volume[shell].sum()
    return 1.0 - passes, passes * cells


def hockey_stick(a: np.ndarray, b: np.ndarray, epsilon: float, delta: float,
                 audited: float) -> float:
    """sup_S P_a(S) − e^ε′·P_b(S) over every event of TukeyEM(ε, δ)'s release, exactly, at
    ε′ = `audited`."""
    grids = [np.unique(np.concatenate([a[:, j], b[:, j]])) for j in range(a.shape[1])]
    fail_a, cells_a = release_law(a, grids, epsilon, delta)
    fail_b, cells_b = release_law(b, grids, epsilon, delta)
    e = math.exp(audited)
    return max(0.0, fail_a - e * fail_b) + float(np.maximum(0.0, cells_a - e * cells_b).sum())


def neighbours(rng: np.random.Generator, m: int, d: int):
    """Model sets and their neighbours with one model replaced: by the median, a far outlier on
    each side, or a point just off the centre."""
    base = rng.standard_normal((m, d)) * rng.choice([0.1, 1.0, 10.0], size=d)
    median = np.median(base, axis=0)
    for index, new in itertools.product(range(0, m, max(1, m // 6)), (
            median, median + 1e-3, 3 * base.max(axis=0) + 1, 3 * base.min(axis=0) - 1)):
        other = base.copy()
        other[index] = new
        yield base, other
        yield other, base


@pytest.mark.parametrize(("d", "epsilon", "delta"), [(1, 1.0, 0.05), (1, 2.0, 0.05),
                                                     (1, 4.0, 0.1), (2, 2.0, 0.05),
                                                     (2, 4.0, 0.1)])
def test_the_release_respects_its_epsilon_and_delta_exactly_on_small_instances(
        d, epsilon, delta):
    """An audit with the exact law instead of samples: on every pair of neighbouring model sets
    tried (one model replaced, the only change one record makes), the hockey-stick divergence
    at ε is at most δ; and the audit has power: the same pairs break a tenth of ε (where the
    test passes, m ≥ 100, the restricted exponential mechanism alone is between ε/4 and ε/2).
    At ε = 1 a test noise of scale ε_PTR instead of 1/ε_PTR breaks δ; depth weights at twice
    ε_EM stay within ε, and test_the_plan_tests_at_half_the_budget… pins them."""
    rng = np.random.default_rng(10 * d + int(epsilon))
    worst, tenth = 0.0, 0.0
    for m in (12, 20, 46, 100, 160):
        for a, b in neighbours(rng, m, d):
            worst = max(worst, hockey_stick(a, b, epsilon, delta, epsilon))
            tenth = max(tenth, hockey_stick(a, b, epsilon, delta, epsilon / 10))
    assert worst <= delta
    assert tenth > delta


def test_the_release_draws_what_its_plan_says():
    """The sampling half of the audit: the test passes with the plan's Laplace tail, and a
    passing release has each depth with the plan's mass."""
    rng = np.random.default_rng(4)
    plan = tukey.tukey_plan(rng.standard_normal((40, 2)), epsilon=2.0, delta=0.05)
    draws = 20_000
    for k_hat, threshold, scale in ((2, 2.5, 1.0), (2, 2.5, 0.25), (3, 2.0, 2.0)):
        trial = dataclasses.replace(plan, k_hat=k_hat, threshold=threshold, laplace_scale=scale)
        expected = stats.laplace.sf(threshold - k_hat, scale=scale)
        passed = sum(trial.release(rng) is not None for _ in range(draws))
        assert abs(passed - draws * expected) <= 5 * math.sqrt(draws * expected * (1 - expected))
    always = dataclasses.replace(plan, k_hat=10**6, threshold=0.0)
    coords = plan.coords
    found = np.bincount([tukey.depth(coords, always.release(rng)) for _ in range(draws)],
                        minlength=plan.depths.max() + 1)[plan.depths]
    p = np.exp(plan.log_mass - plan.log_mass.max())
    p /= p.sum()
    assert np.all(np.abs(found - draws * p) <= 5 * np.sqrt(draws * p * (1 - p)) + 1)


def test_the_plan_tests_at_half_the_budget_with_laplace_noise_of_scale_two_over_epsilon():
    """ε_PTR = ε_EM = ε/2 (Theorem 3.6): threshold log(1/(2δ))/ε_PTR, Laplace scale 1/ε_PTR,
    depth mass (V_s − V_{s+1})·e^{ε_EM·s/2}."""
    rng = np.random.default_rng(5)
    models = rng.standard_normal((40, 2))
    plan = tukey.tukey_plan(models, epsilon=4.0, delta=0.05)
    assert plan.laplace_scale == 0.5
    assert plan.threshold == math.log(10.0) / 2.0
    log_v = tukey.log_volumes(plan.coords)
    assert plan.k_hat == tukey.safe_distance(log_v, 2.0, 0.05, 10)
    depths, log_mass = tukey.depth_weights(log_v, 2.0, 10)
    np.testing.assert_array_equal(plan.depths, depths)
    np.testing.assert_allclose(plan.log_mass, log_mass)
    assert tukey.tukey_plan(models[:3], epsilon=4.0, delta=0.05) is None
    assert tukey.tukey_plan(models[:4], epsilon=4.0, delta=0.05).depths.tolist() == [1, 2]


def test_a_singular_block_gets_its_minimum_norm_least_squares_fit():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((40, 3))
    x[:10, 2] = 0.0  # the first block's Gram matrix is singular
    y = rng.standard_normal(40)
    models = tukey.block_models(x, y, m=4)
    np.testing.assert_allclose(models[0], np.linalg.lstsq(x[:10], y[:10], rcond=None)[0],
                               atol=1e-10)
    np.testing.assert_allclose(models[1], np.linalg.lstsq(x[10:20], y[10:20], rcond=None)[0],
                               atol=1e-10)
    with pytest.raises(ValueError) as refused:
        tukey.block_models(x[:11], y[:11], m=4)
    assert str(refused.value) == "4 models need 12 rows at d = 3, got 11"


def brute_safe_distance(log_v, epsilon_em, delta, t):
    """k̂ of step 3 straight from its definition, g by g."""
    top, threshold, best = len(log_v), math.log(delta / (8.0 * math.exp(epsilon_em))), -1
    for k in range(t):
        if not (t - k - 1 >= 1 and t + k + 2 <= top):
            break
        gaps = [log_v[t - k - 2] - log_v[t + k + g] - epsilon_em * g / 2.0
                for g in range(1, top - t - k)]
        if min(gaps) > threshold:
            break
        best = k
    return best


def test_the_safe_distance_is_the_definitions_on_random_instances():
    rng = np.random.default_rng(7)
    seen = set()
    for _ in range(400):
        m = int(rng.integers(4, 120))
        coords = tukey.sorted_coordinates(rng.standard_normal((m, int(rng.integers(1, 4))))
                                          * rng.uniform(0.1, 10.0))
        log_v = tukey.log_volumes(coords)
        epsilon, delta, t = float(rng.uniform(0.1, 40.0)), float(rng.uniform(1e-6, 0.2)), \
            (m // 2) // 2
        got = tukey.safe_distance(log_v, epsilon, delta, t)
        assert got == brute_safe_distance(log_v, epsilon, delta, t), (m, epsilon, delta)
        seen.add(got == -1)
    assert seen == {True, False}, "instances both with and without a safe distance"


def test_the_safe_distance_is_the_definitions_on_any_log_volumes_at_any_t():
    """The suffix minimum equals the minimum over g ≥ 1 for every sequence L and every t, as
    the docstring derives: on log volumes that fall by steps of every size (so the least g lies
    anywhere in the suffix), and on sequences that also rise, where a suffix taken from too
    early a depth would hold terms of g ≤ 0 (real volumes never rise, and on them such terms
    never reach the threshold). Each t from 1 to ⌊m/2⌋/2 + 1 meets no k to test, a first k that
    fails, a later one that fails, or every tested k holding (which needs t < ⌊m/2⌋ − t)."""
    rng = np.random.default_rng(39)
    outcomes = set()
    for rising in [False, True] * 400:
        top = int(rng.integers(4, 60))
        scale = rng.uniform(0.05, 5.0)
        steps = rng.normal(0.0, scale, size=top) if rising else rng.exponential(scale, size=top)
        log_v = -np.cumsum(steps)
        t = int(rng.integers(1, top // 2 + 2))
        epsilon, delta = float(rng.uniform(0.05, 5.0)), float(rng.uniform(1e-6, 0.2))
        got = tukey.safe_distance(log_v, epsilon, delta, t)
        assert got == brute_safe_distance(log_v, epsilon, delta, t), (log_v, epsilon, delta, t)
        last = min(t - 2, top - t - 2)  # the largest k whose condition is defined
        outcomes.add((rising, "no k" if last < 0 else "first fails" if got == -1
                      else "all hold" if got == last else "a later k fails"))
    assert outcomes == {(rising, outcome) for rising in (False, True)
                        for outcome in ("no k", "first fails", "a later k fails", "all hold")}


def test_a_point_drawn_at_the_deepest_depth_of_an_even_number_of_models_has_that_depth():
    models = np.array([[i, -3.0 * i] for i in range(1, 9)], dtype=float)
    coords = tukey.sorted_coordinates(models)
    rng = np.random.default_rng(8)
    for s in range(1, 5):
        assert all(tukey.depth(coords, tukey.sample_at_depth(coords, s, rng)) == s
                   for _ in range(200))


def test_racing_never_draws_an_index_of_weight_zero():
    rng = np.random.default_rng(9)
    draws = {tukey._racing(np.array([0.0, -np.inf, 0.0, -np.inf]), rng) for _ in range(500)}
    assert draws == {0, 2}


def test_many_models_at_a_large_epsilon_release_a_deep_model():
    rng = np.random.default_rng(10)
    models = rng.standard_normal((200, 2))
    coords = tukey.sorted_coordinates(models)
    released = [tukey.tukey_em(models, epsilon=20.0, delta=1e-3, rng=rng) for _ in range(20)]
    assert all(w is not None and w.shape == (2,) and tukey.depth(coords, w) >= 50
               for w in released)


def test_a_point_at_depth_s_is_uniform_on_the_ring_between_the_two_boxes():
    """Models (i, i³), i = 1 … 9: depth 2 is the box [2, 8]×[8, 512] less [3, 7]×[27, 343];
    the inner box takes a different share of each axis (4/6, 316/504), so a wrong share between
    the axes, or between the two sides of one, shows."""
    import warnings

    models = np.array([[i, i**3] for i in range(1, 10)], dtype=float)
    coords = tukey.sorted_coordinates(models)
    rng = np.random.default_rng(11)
    draws = 40_000
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # log(0) of an empty inner box is expected, not warned
        points = np.array([tukey.sample_at_depth(coords, 2, rng) for _ in range(draws)])
        assert tukey.depth(coords, tukey.sample_at_depth(coords, 4, rng)) == 4
    ring = 6 * 504 - 4 * 316
    x_out = (points[:, 0] < 3) | (points[:, 0] > 7)
    left = points[:, 0] < 3
    below = (points[:, 1] < 27) & ~x_out
    for hits, area in ((x_out, 2 * 504), (left, 1 * 504), (below, 4 * 19)):
        p = area / ring
        assert abs(hits.sum() - draws * p) <= 5 * math.sqrt(draws * p * (1 - p)), (area, hits.sum())
    assert points[:, 0].min() >= 2 and points[:, 0].max() <= 8
    assert points[:, 1].min() >= 8 and points[:, 1].max() <= 512


def test_too_few_models_for_any_depth_release_nothing():
    rng = np.random.default_rng(12)
    assert tukey.tukey_em(rng.standard_normal((3, 2)), epsilon=1.0, delta=1e-5, rng=rng) is None


def test_blocks_of_exactly_d_rows_are_fitted():
    rng = np.random.default_rng(13)
    x = rng.standard_normal((12, 3))
    w = np.array([1.0, -2.0, 0.5])
    np.testing.assert_allclose(tukey.block_models(x, x @ w, m=4), np.tile(w, (4, 1)), atol=1e-9)


def test_the_plan_is_the_same_at_any_scale_and_silent_on_empty_boxes():
    import warnings

    rng = np.random.default_rng(14)
    models = rng.standard_normal((40, 2))
    plan = tukey.tukey_plan(models, epsilon=2.0, delta=0.05)
    huge = tukey.tukey_plan(models * 1e150, epsilon=2.0, delta=0.05)
    np.testing.assert_allclose(huge.log_mass - huge.log_mass.max(),
                               plan.log_mass - plan.log_mass.max(), atol=1e-9)
    assert huge.k_hat == plan.k_hat
    flat = models.copy()
    flat[:, 1] = 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # log(0) of a box of width 0 is -inf, not a warning
        assert np.isneginf(tukey.log_volumes(tukey.sorted_coordinates(flat))).all()
        # Two depths of one volume: the shell between them is empty, its mass exp(-inf) = 0.
        depths, log_mass = tukey.depth_weights(np.log([8.0, 4.0, 4.0, 1.0]), 1.0, 1)
    assert depths.tolist() == [1, 2, 3, 4] and np.isneginf(log_mass[1])
    np.testing.assert_allclose(np.exp(log_mass[[0, 2, 3]]),
                               np.array([0.5, 0.375, 0.125]) * np.exp([0.5, 1.5, 2.0]))
