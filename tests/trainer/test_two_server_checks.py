"""The bounds the trainer holds a two-server sum to (docs/privacy.md, Step 15), and its dither
(Step 9): honest rounds pass them as often as the proof says, the eigenvalue bound could not be
raised by half, and V is the trainer's own U[−h_b/2, h_b/2)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

import trainer.two_server as trainer_two_server
from ipdp.fixed_point import decode, encode, fold
from ipdp.two_server import calibrate_two_server, perturb_two_server
from trainer.errors import RefusalReason, RoundRefused
from trainer.two_server import (
    check_sum,
    dithered_sum,
    smallest_eigenvalue_bound,
    sum_bounds,
)

N, D = 200, 3
TWO = calibrate_two_server(epsilon=1.0, delta=0.01, n=N, d=D)
LOOSE_GAMMA = 0.05
ROUNDS = 1_500


def honest_sums(q_clean: np.ndarray, p_clean: np.ndarray, rounds: int, seed: int):
    """(A, b̂) of ``rounds`` rounds of N devices at the given clean rows, through the deployed
    path: perturb_two_server, the fixed-point encoding and the decoding of the sum."""
    rng = np.random.default_rng(seed)
    q = np.broadcast_to(q_clean, (rounds, N, D))
    p = np.broadcast_to(p_clean, (rounds, N, D))
    q_tilde, p_hat = perturb_two_server(q, p, TWO, noise=rng, generator=rng)
    values, clamped = encode(q_tilde, p_hat, TWO.encoding)
    assert clamped == 0
    return decode(fold(values, axis=1), TWO.encoding)


def test_the_eigenvalue_bound_is_the_calibrations_beta_less_the_ridge_and_one_rounding():
    assert smallest_eigenvalue_bound(TWO) == pytest.approx(
        TWO.beta - TWO.delta_in - TWO.rounding, rel=1e-12)
    assert 0.0 < smallest_eigenvalue_bound(TWO) < TWO.beta - TWO.delta_in


@pytest.mark.parametrize("rows", ["zero", "one direction"])
def test_honest_rounds_fall_below_the_eigenvalue_bound_at_most_as_often_as_it_says(rows):
    """At a loosened γ the event can be counted: zero clean rows (only the noise lifts A) and
    every row on one axis at ‖q‖² = λ (two directions left to the noise). The bound holds at
    rate ≤ γ, and with zero rows half as much again would not: a bound, not a vacuous one."""
    q_clean = np.zeros(D) if rows == "zero" else np.eye(D)[0]
    a, _ = honest_sums(q_clean, np.zeros(D), ROUNDS, seed=15)
    smallest = np.linalg.eigvalsh(a)[:, 0]
    bound = smallest_eigenvalue_bound(TWO, LOOSE_GAMMA)
    assert np.mean(smallest < bound) <= LOOSE_GAMMA
    if rows == "zero":  # the case Step 4's projection argument is tight for
        assert np.mean(smallest < 1.5 * bound) > LOOSE_GAMMA


def test_honest_rounds_at_the_worst_clean_rows_pass_every_check():
    """Every record at ‖q‖² = λ and ‖p‖ = P, all aligned: the largest trace and ‖b‖ honest
    records reach."""
    bounds = sum_bounds(TWO)
    a, b_hat = honest_sums(np.eye(D)[0], np.eye(D)[0], 200, seed=16)
    for a_round, b_round in zip(a, b_hat, strict=True):
        check_sum(a_round, b_round, bounds, "honest")
    assert np.trace(a, axis1=1, axis2=2).max() < bounds.trace
    assert np.linalg.norm(b_hat, axis=1).max() < bounds.linear_norm
    # ‖b‖'s bound is n·P_b plus the noise's box: an honest sum is within the box of n·P.
    assert N * TWO.linear_p_bound < bounds.linear_norm < N * TWO.linear_p_bound + 20 * math.sqrt(
        D * TWO.sigma_b2)


@pytest.mark.parametrize(("shift", "reason"), [
    ("negative", RefusalReason.EIGENVALUE),
    ("trace", RefusalReason.TRACE),
    ("linear", RefusalReason.LINEAR_NORM),
])
def test_a_sum_outside_a_bound_is_refused_and_the_refusal_names_the_bound_not_the_value(
        shift, reason):
    bounds = sum_bounds(TWO)
    a, b = honest_sums(np.eye(D)[0] * 0.5, np.eye(D)[1] * 0.5, 1, seed=17)
    a, b = a[0].copy(), b[0].copy()
    if shift == "negative":
        a -= (np.linalg.eigvalsh(a)[0] - 0.5 * bounds.eigenvalue) * np.eye(D)
    elif shift == "trace":
        a += bounds.trace / D * np.eye(D)
    else:
        b[2] += bounds.linear_norm
    with pytest.raises(RoundRefused) as refused:
        check_sum(a, b, bounds, "study s round 1")
    assert refused.value.reason == reason
    text = str(refused.value)
    assert all(f"{v:.6g}" not in text for v in (*np.linalg.eigvalsh(a), np.trace(a),
                                                  np.linalg.norm(b)))


def test_the_dither_moves_b_by_at_most_half_a_linear_step_and_differs_between_runs():
    rng = np.random.default_rng(18)
    q_tilde, p_hat = perturb_two_server(rng.normal(0, 0.3, (N, D)), rng.normal(0, 0.3, (N, D)),
                                        TWO, noise=rng, generator=rng)
    total = fold(encode(q_tilde, p_hat, TWO.encoding)[0])
    a_plain, b_plain = decode(total, TWO.encoding)
    runs = [dithered_sum(total, TWO) for _ in range(3)]
    h_b = TWO.linear_step
    for a, b in runs:
        assert np.array_equal(a, a_plain)
        assert np.all(np.abs(b - b_plain) <= h_b / 2)
        assert np.all(b != b_plain)
    assert not np.array_equal(runs[0][1], runs[1][1])
    assert not np.array_equal(runs[1][1], runs[2][1])
    # b̂ lies on the grid h_b, b̂ + V does not: the dither is what gives b a density (Step 12).
    assert np.all(np.ldexp(b_plain, TWO.linear_bits) == np.rint(np.ldexp(b_plain,
                                                                          TWO.linear_bits)))


def test_every_proof_step_the_trainer_names_is_a_heading_of_docs_privacy():
    source = re.sub(r"\s+", " ", Path(trainer_two_server.__file__).read_text())
    named = set(re.findall(r"Step \d+ \([^)]+\)", source))
    assert {"Step 9 (the two-server mechanism)", "Step 15 (the trainer's checks of the sum)"} <= named
    docs = (Path(__file__).resolve().parents[2] / "docs" / "privacy.md").read_text()
    headings = set(re.findall(r"^#+ (Step \d+ \([^)]+\))", docs, flags=re.MULTILINE))
    assert named <= headings, named - headings
