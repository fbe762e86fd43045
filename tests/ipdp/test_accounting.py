"""Composition across rounds and group privacy, checked against the theorems' own formulas.

The accountant (dp-accounting's PLD) is checked against the exact optimal composition of k
(ε, δ)-DP mechanisms (Kairouz, Oh & Viswanath 2015, Thm 3.3; Murtagh & Vadhan 2016): the
worst case is k independent copies of the pair "privacy loss +ε w.p. e^ε/(1+e^ε)·(1−δ), −ε
w.p. (1−δ)/(1+e^ε), +∞ w.p. δ", whose hockey-stick divergence at e^{ε'} is the smallest δ'
for which the composition is (ε', δ')-DP:

    δ'(ε') = 1 − (1−δ)^k + (1−δ)^k Σ_j C(k, j) q^j (1−q)^{k−j} max(0, 1 − e^{ε' − (2j − k)ε}),

with q = e^ε/(1 + e^ε). Computed here in a few lines, independently of the accountant.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ipdp.accounting import compose, composed_epsilon, group_privacy, rounds_within_budget
from ipdp.errors import TooManyRecords
from ipdp.study import Study
from producer.contributor import Contributor

STUDY = {"study_id": "acc", "d": 3, "n": 2000, "epsilon": 1.0, "delta": 0.01}


def optimal_delta(epsilon: float, delta: float, k: int, eps_total: float) -> float:
    """δ' of the exact optimal k-fold composition of (ε, δ)-DP at ε' = eps_total."""
    q = math.exp(epsilon) / (1 + math.exp(epsilon))
    pure = sum(math.comb(k, j) * q**j * (1 - q) ** (k - j)
               * max(0.0, 1 - math.exp(eps_total - (2 * j - k) * epsilon)) for j in range(k + 1))
    return 1 - (1 - delta) ** k + (1 - delta) ** k * pure


@pytest.mark.parametrize(("epsilon", "delta", "k", "target"), [
    (1.0, 0.01, 1, 0.02), (1.0, 0.01, 2, 0.05), (1.0, 0.01, 3, 0.05), (0.5, 1e-5, 10, 1e-3),
    (0.1, 1e-6, 50, 1e-4), (1.0, 1e-4, 30, 0.01)])
def test_composed_epsilon_is_the_optimal_composition_theorem(epsilon, delta, k, target):
    eps = composed_epsilon(epsilon, delta, k, target)
    assert eps is not None
    # Valid: the exact composition is (eps, target)-DP ...
    assert optimal_delta(epsilon, delta, k, eps) <= target * (1 + 1e-9)
    # ... and tight to the accountant's discretisation: a visibly smaller ε is not.
    assert optimal_delta(epsilon, delta, k, eps - 0.01) > target
    assert eps <= k * epsilon + 1e-9  # never worse than basic composition (k ε, k δ)


def test_no_finite_epsilon_below_the_rounds_own_delta():
    assert composed_epsilon(1.0, 0.01, 3, 1 - 0.99**3) is None
    report = compose(1.0, 0.01, 4)
    assert (report.rounds, report.delta) == (4, 0.05)
    assert "Kairouz" in report.composition


def test_one_round_reports_its_own_guarantee_not_a_composition():
    report = compose(1.0, 0.01, 1)
    assert (report.epsilon, report.delta, report.rounds) == (1.0, 0.01, 1)
    assert "nothing composed" in report.composition
    # Against a budget's δ, one round is still put through the accountant.
    budgeted = compose(1.0, 0.01, 1, target_delta=0.05)
    assert budgeted.delta == 0.05 and budgeted.epsilon < 1.0
    assert "Kairouz" in budgeted.composition


def test_a_budget_allows_the_last_round_whose_composed_epsilon_fits():
    # By the formula above: 2 rounds of (1, 0.01) are (1.94…, 0.05)-DP, 3 need ε ≈ 2.945.
    assert optimal_delta(1.0, 0.01, 2, 2.0) <= 0.05 < optimal_delta(1.0, 0.01, 3, 2.0)
    assert rounds_within_budget(1.0, 0.01, 2.0, 0.05) == 2
    assert Study(**STUDY, budget_epsilon=2.0, budget_delta=0.05).round_limit == 2
    assert Study(**STUDY, budget_epsilon=2.0, budget_delta=0.05, max_rounds=1).round_limit == 1
    assert Study(**STUDY).round_limit is None
    n_basic = rounds_within_budget(0.1, 1e-6, 2.0, 1e-4)
    assert n_basic > 20  # better than basic composition's 20 rounds
    assert optimal_delta(0.1, 1e-6, n_basic, 2.0) <= 1e-4 < optimal_delta(
        0.1, 1e-6, n_basic + 1, 2.0)


@pytest.mark.parametrize("bad", [{"budget_epsilon": 2.0},
                                 {"budget_epsilon": 0.5, "budget_delta": 0.05},
                                 {"budget_epsilon": 2.0, "budget_delta": 0.001}])
def test_a_budget_needs_both_parts_and_room_for_one_round(bad):
    with pytest.raises(ValueError, match="budget"):
        Study(**STUDY, **bad)


def test_group_privacy_is_k_epsilon_and_k_e_to_the_k_minus_one_epsilon_delta():
    g = group_privacy(1.0, 1e-5, 3)
    assert (g.records, g.epsilon) == (3, 3.0)
    assert g.delta == pytest.approx(3 * math.exp(2.0) * 1e-5)
    assert group_privacy(0.5, 1e-3, 1).model_dump(include={"epsilon", "delta"}) == {
        "epsilon": 0.5, "delta": 1e-3}


def test_a_device_may_send_one_record_per_round_unless_allowed_more():
    study = Study(**STUDY)
    c = Contributor(study, producer=None, topic="unused", noise=np.random.default_rng(1))
    # The deployed mechanism's δ is the study's: the norm check's 10⁻⁵ is taken out of it.
    assert (c.privacy.epsilon, c.privacy.delta) == (1.0, 0.01)
    c.encode_many(np.zeros((1, 3)), np.zeros(1))
    with pytest.raises(TooManyRecords, match="group privacy"):
        c.encode_many(np.zeros((1, 3)), np.zeros(1))
    with pytest.raises(TooManyRecords, match="records_per_device=k"):
        Contributor(study, producer=None, topic="unused").encode_many(np.zeros((2, 3)),
                                                                     np.zeros(2))
    allowed = Contributor(study, producer=None, topic="unused", records_per_device=2)
    allowed.encode_many(np.zeros((2, 3)), np.zeros(2))
    assert allowed.privacy.epsilon == 2.0
    assert allowed.privacy.delta == pytest.approx(2 * math.e * 0.01)
    assert "group privacy" in allowed.privacy.theorem


def test_the_browser_sdk_reports_the_same_norm_check_share_of_delta():
    # The browser's privacy report computes the published δ itself (producer/web/src/report.ts).
    import re
    from pathlib import Path

    from ipdp.calibration import REJECTION_DELTA_SHARE

    source = (Path(__file__).resolve().parents[2] / "producer" / "web" / "src" / "report.ts")
    share = re.search(r"NORM_CHECK_DELTA_SHARE = ([0-9.e-]+);", source.read_text())
    assert share is not None and float(share[1]) == REJECTION_DELTA_SHARE
