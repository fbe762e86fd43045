"""Privacy across rounds and across one device's records (docs/accounting.md).

The unit of privacy is one record of one device in one round: each published model is (ε, δ)-DP
with respect to replacing one such record (ipdp.calibration). Two things follow.

* **Across rounds** a device that contributes one record to each of r rounds is protected by the
  composition of r (ε, δ)-DP mechanisms (adaptive: a later round may depend on earlier models).
  :func:`composed_epsilon` computes it with Google's dp-accounting privacy-loss-distribution
  (PLD) accountant, which represents an (ε, δ)-DP mechanism by its worst-case privacy loss and
  composes it numerically; for identical (ε, δ) mechanisms that is the optimal composition
  theorem (Kairouz, Oh & Viswanath 2015, Thm 3.3; Murtagh & Vadhan 2016), evaluated with a
  pessimistic discretisation, so the ε returned is an upper bound.
* **Within a round** a device that puts k records into one round is protected only by group
  privacy (Dwork & Roth 2014, Thm 2.2 and its (ε, δ) form, Vadhan 2017 Lemma 2.2): an
  (ε, δ)-DP mechanism is (kε, k·e^{(k−1)ε}·δ)-DP for datasets differing in k records.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

COMPOSITION = ("optimal composition of (ε, δ)-DP rounds (Kairouz, Oh & Viswanath 2015, Thm 3.3), "
               "by dp-accounting's PLD accountant")
ONE_ROUND = "one round: its own (ε, δ), nothing composed"
GROUP_PRIVACY = "group privacy: k records cost (kε, k·e^{(k−1)ε}·δ) (Dwork & Roth 2014, Thm 2.2)"

#: Bin width of the privacy-loss discretisation: rounding is pessimistic, so ε only grows.
PLD_DISCRETISATION = 1e-3


class Composed(BaseModel):
    """The guarantee of r rounds for a device that contributes once per round."""

    model_config = ConfigDict(frozen=True)

    epsilon: float | None
    """None when no finite ε reaches `delta` (δ of the rounds alone, 1 − (1 − δ)^r, exceeds it)."""
    delta: float
    rounds: int
    composition: str = COMPOSITION


class GroupPrivacy(BaseModel):
    """The per-round guarantee of a device that puts `records` records into one round."""

    model_config = ConfigDict(frozen=True)

    records: int
    epsilon: float
    delta: float
    theorem: str = GROUP_PRIVACY


def default_composed_delta(delta: float, rounds: int) -> float:
    """δ at which an unbudgeted study's composed ε is reported: δ for one round (its own
    guarantee), else (r + 1)·δ, capped at 0.5.

    r·δ is what the rounds' own δ can add up to; one more δ buys a much smaller ε than r·ε.
    """
    return delta if rounds == 1 else min((rounds + 1) * delta, 0.5)


def composed_epsilon(epsilon: float, delta: float, rounds: int, target_delta: float) -> float | None:
    """ε such that `rounds` adaptive compositions of an (ε, δ)-DP mechanism are
    (ε, target_delta)-DP; None when no ε is finite (target_delta ≤ 1 − (1 − δ)^rounds)."""
    if rounds < 1:
        raise ValueError(f"rounds must be ≥ 1, got {rounds}")
    if target_delta <= -math.expm1(rounds * math.log1p(-delta)):
        return None
    from dp_accounting.pld import common, privacy_loss_distribution

    pld = privacy_loss_distribution.from_privacy_parameters(
        common.DifferentialPrivacyParameters(epsilon, delta),
        value_discretization_interval=PLD_DISCRETISATION)
    if rounds > 1:
        pld = pld.self_compose(rounds)
    return float(pld.get_epsilon_for_delta(target_delta))


def preload() -> None:
    """Import dp-accounting now. It takes about a second and is otherwise imported on the first
    composition; a service that composes on its hot path (the trainer) calls this at start-up."""
    from dp_accounting.pld import common, privacy_loss_distribution  # noqa: F401


def compose(epsilon: float, delta: float, rounds: int,
            target_delta: float | None = None) -> Composed:
    """The composed guarantee after `rounds` rounds (at `target_delta`, else the default)."""
    target = default_composed_delta(delta, rounds) if target_delta is None else target_delta
    if rounds == 1 and target == delta:
        # One round composes nothing: its guarantee is the round's own, exactly.
        return Composed(epsilon=epsilon, delta=delta, rounds=1, composition=ONE_ROUND)
    return Composed(epsilon=composed_epsilon(epsilon, delta, rounds, target), delta=target,
                    rounds=rounds)


def rounds_within_budget(epsilon: float, delta: float, budget_epsilon: float,
                         budget_delta: float, limit: int = 1_000_000) -> int:
    """The most rounds whose composed ε at `budget_delta` stays ≤ `budget_epsilon` (0 if none).

    The composed ε grows with the rounds, so doubling then bisection finds the last one.
    """
    def fits(r: int) -> bool:
        e = composed_epsilon(epsilon, delta, r, budget_delta)
        return e is not None and e <= budget_epsilon

    if not fits(1):
        return 0
    good, bad = 1, 2
    while bad <= limit and fits(bad):
        good, bad = bad, bad * 2
    if bad > limit:
        return limit if fits(limit) else _bisect(fits, good, limit)
    return _bisect(fits, good, bad)


def _bisect(fits, good: int, bad: int) -> int:
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def group_privacy(epsilon: float, delta: float, records: int) -> GroupPrivacy:
    """(kε, k·e^{(k−1)ε}·δ) for k = `records` records of one device in one round."""
    if records < 1:
        raise ValueError(f"records must be ≥ 1, got {records}")
    k = records
    return GroupPrivacy(records=k, epsilon=k * epsilon,
                        delta=min(1.0, k * math.exp((k - 1) * epsilon) * delta))
