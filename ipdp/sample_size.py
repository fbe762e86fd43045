"""The n a study needs, before anyone contributes, told as a promise a user can check on fresh
rows: how far the private model's test error may lie from the non-private model's, in the
target's units (docs/privacy.md, "The n a study needs").

The reference is the non-private model: the trainer's own solve (same λ, P and ‖w‖ ≤ η) on the
clean records of the same round, which is what a user who holds the rows can refit. The excess
of the private model over it is bounded for *any* data within the clipping bounds, not for data
at the bounds: in the eigenbasis of the records' curvature Σ qqᵀ = n·Σ, a direction of curvature
s carries the ridge's bias and b's noise into predictions with weight s/(ns + ρ)², ρ = σ_u² + Δ_in,
and max over s of s/(ns + ρ)² = 1/(4nρ). Summed over d directions (b's noise), over ‖w‖ ≤ η (the
ridge's bias) and with the first-order fluctuation of Σ q̃q̃ᵀ (its cross terms move w by σ_u times
the prediction, whose mean square is at most Y² = P²/λ),

    B = (d·(σ_b² + σ_u²Y²) + ρ²η²)/(4nρ) + (5/4)(d + 1)σ_u²η²/n²      (`excess_bound`)

bounds the expected excess E (qᵀ(w − w_NP))² over a record's q, in the units of the target y that
q regresses (y for squared loss, the ±1 label for logistic loss). Step 8's R is the same
expression at the one curvature μ = λ/d; real tables have less, where R is optimistic.

- squared loss: the private model's test MSE is at most τ² = MODEL_SPREAD·B (times the schema's
  half-range squared, in raw units) above the non-private model's, so its RMSE is at most
  √(RMSE_NP² + τ²). The tolerance asked is τ = margin × s, s the target's standard deviation:
  the user's (`target_sd`) or the largest one the target's public range allows (half the range).
- logistic loss: the private classifier's test accuracy is at most LOGISTIC_ACCURACY_PER_EXCESS·B
  below the non-private one's; margin is that loss (0.02: two points).

B is an expectation and the promise is per trained model, hence MODEL_SPREAD: a centred
Gaussian quadratic form exceeds 1.64 times its mean with probability at most 0.2, as χ²₁ does
(Székely & Bakirov 2003); the bias makes the excess's form not centred, so this is a margin, not
a proof. `python -m bench.predicted` measures
how often it holds at the advised n on the accuracy benchmark's tables (docs/benchmarks.md,
"Predicted against measured error"; at least 80 % of trials is the bar). The accuracy factor is
an empirical one, calibrated there: classifiers whose scores crowd the boundary more than those
tables' lose more per unit of B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from ipdp.calibration import Calibration, CalibrationError, calibrate

DEFAULT_MARGIN = {"squared": 0.3, "logistic": 0.02}
"""Squared loss: τ = 0.3·s, an R² at most 0.09 below the non-private model's; logistic: two
accuracy points."""
PROMISE_QUANTILE = 0.8
"""The share of trained models the promise is meant for."""
MODEL_SPREAD = NormalDist().inv_cdf(0.5 + PROMISE_QUANTILE / 2.0) ** 2
"""χ²₁'s PROMISE_QUANTILE quantile over its mean (1.64): one model's excess against B."""
LOGISTIC_ACCURACY_PER_EXCESS = 10.0
"""Accuracy lost per unit of B, calibrated on the benchmark's tables (module docstring)."""
N_SEARCH_MAX = 2**40
"""The search for the advised n stops here (10¹² records): past it, no n is named."""
N_SEARCH_PRECISION = 0.01
"""The advised n is found to within 1 % (the n named is one whose promise meets the margin)."""


def excess_bound(cal: Calibration) -> float:
    """B: the private model's expected excess squared prediction error over the non-private
    model's, in the target's encoded units, for any records within the clipping bounds (module
    docstring). Infinite when nothing regularises the solve (ρ = 0)."""
    rho = cal.sigma_u2 + cal.delta_in
    d, n, eta = cal.d, cal.n, cal.eta
    y2 = cal.p_bound**2 / cal.lam
    if rho <= 0.0:
        return math.inf
    # max over the curvature s ∈ (0, λ] of s/(ns + ρ)²: 1/(4nρ) inside, at s = ρ/n.
    weight = 1.0 / (4.0 * n * rho) if rho / n <= cal.lam else cal.lam / (n * cal.lam + rho) ** 2
    fluctuation = 1.25 * (d + 1) * cal.sigma_u2 * eta * eta / (n * n)
    return weight * (d * (cal.sigma_b2 + cal.sigma_u2 * y2) + rho * rho * eta * eta) + fluctuation


def promised_loss(cal: Calibration, loss: str) -> float:
    """What the study's n promises, in encoded units: the excess test MSE over the non-private
    model (squared loss), or the accuracy it may lose against it (logistic loss)."""
    b = excess_bound(cal)
    return LOGISTIC_ACCURACY_PER_EXCESS * b if loss == "logistic" else MODEL_SPREAD * b


@dataclass(frozen=True)
class SampleSize:
    """What a study's public parameters promise about its model, and the n the margin needs.

    Squared loss: `tolerance` and `bought` are excesses of RMSE in quadrature, τ with
    RMSE ≤ √(RMSE_NP² + τ²), in the target's units (raw units for a schema study). Logistic
    loss: they are accuracy lost against the non-private classifier (a fraction)."""

    loss: str
    margin: float
    """Squared: τ over the target's standard deviation s; logistic: the accuracy loss asked."""
    target_sd: float | None
    """s in the target's units (squared loss); None for a classifier."""
    target_sd_given: bool
    """Whether s is the user's; else the largest the target's public range allows."""
    target_unit: float
    """Target units per encoded unit: half the schema's range, else 1."""
    target_name: str
    """The schema's target column, else "y"."""
    target_range: tuple[float, float]
    """The target's public range: the schema's, else [−Y, Y] (Y = P/√λ)."""
    tolerance: float
    """The margin in the promise's units: τ = margin·s, or the accuracy loss."""
    bought: float
    """What the study's n promises, in the same units (math.inf where nothing is promised)."""
    n: int
    advised_n: int | None
    """The least n (to N_SEARCH_PRECISION) whose promise meets the tolerance; None when no n up
    to N_SEARCH_MAX does."""

    @property
    def enough(self) -> bool:
        """Whether the study's n meets the tolerance."""
        return self.bought <= self.tolerance


def largest_target_sd(*, lam: float, p_bound: float, target_unit: float) -> float:
    """The largest standard deviation the target's public bound allows: half its range, Y = P/√λ
    in encoded units (a target at ±Y with equal odds), times the units per encoded unit."""
    return p_bound / math.sqrt(lam) * target_unit


def _bought(cal: Calibration, loss: str, target_unit: float) -> float:
    promised = promised_loss(cal, loss)
    return promised if loss == "logistic" else math.sqrt(promised) * target_unit


def sample_size(*, mode: str, epsilon: float, delta: float, n: int, d: int, lam: float,
                p_bound: float, eta: float, delta_in: float | None, loss: str = "squared",
                margin: float | None = None, target_sd: float | None = None,
                target_unit: float = 1.0, target_name: str = "y",
                target_range: tuple[float, float] | None = None) -> SampleSize:
    """The promise at n and the least n whose promise meets `margin` (DEFAULT_MARGIN by loss),
    with the study's other parameters (Δ_in as the study gives it: None lets each n's calibration
    choose it). `target_sd` is s in the target's units (squared loss), `target_unit` the target's
    units per encoded unit."""
    margin = DEFAULT_MARGIN[loss] if margin is None else margin
    if not 0.0 < margin < 1.0:
        raise CalibrationError(f"margin={margin} must lie in (0, 1)")
    if target_sd is not None and loss == "logistic":
        raise CalibrationError("target_sd is the spread of a numeric target: a logistic study's "
                               "promise is in accuracy")
    if target_sd is not None and not (math.isfinite(target_sd) and target_sd > 0.0):
        raise CalibrationError(f"target_sd={target_sd} must be a finite number > 0")
    sd = None
    if loss != "logistic":
        sd = target_sd if target_sd is not None else largest_target_sd(
            lam=lam, p_bound=p_bound, target_unit=target_unit)
    tolerance = margin if loss == "logistic" else margin * sd

    def ratio(m: int) -> float:
        """What m records promise over the tolerance; infinite where no calibration exists."""
        try:
            cal = calibrate(mode=mode, epsilon=epsilon, delta=delta, n=m, d=d, lam=lam,
                            p_bound=p_bound, eta=eta, delta_in=delta_in, loss=loss)
        except CalibrationError:
            return math.inf
        return _bought(cal, loss, target_unit) / tolerance

    cal = calibrate(mode=mode, epsilon=epsilon, delta=delta, n=n, d=d, lam=lam, p_bound=p_bound,
                    eta=eta, delta_in=delta_in, loss=loss)
    bought = _bought(cal, loss, target_unit)
    y_bound = p_bound / math.sqrt(lam)
    return SampleSize(loss=loss, margin=margin, target_sd=sd,
                      target_sd_given=target_sd is not None, target_unit=target_unit,
                      target_name=target_name,
                      target_range=target_range or (-y_bound, y_bound),
                      tolerance=tolerance, bought=bought, n=n,
                      advised_n=_least_n(ratio, 1.0, n, bought / tolerance))


def _least_n(ratio, target: float, n: int, at_n: float) -> int | None:
    """The least m ≥ 2 (to N_SEARCH_PRECISION) with ratio(m) ≤ target, the ratio falling with
    m, at_n being ratio(n); None when not even ratio(N_SEARCH_MAX) is.

    Bracketed by factors of 4 from n (up to N_SEARCH_MAX), then narrowed by regula falsi on
    log ratio against log m (the ratio is close to a power of m, so a few calibrations
    suffice), each step kept within the inner 80 % of the bracket so that it always shrinks;
    every m it names passes.
    """
    log_target = math.log(target) if target > 0.0 else -math.inf

    def log_ratio(m: int) -> float:
        r = ratio(m)
        return math.log(r) if r > 0.0 else -math.inf

    if at_n <= target:
        good, bad = n, n // 4
        r_good = math.log(at_n) if at_n > 0.0 else -math.inf
        while bad >= 2 and (r_bad := log_ratio(bad)) <= log_target:
            good, r_good, bad = bad, r_bad, bad // 4
        if bad < 2:
            # No study has fewer than 2 records: 1 stands for a count that fails, and the
            # search below narrows the bracket down to 2 like any other.
            bad, r_bad = 1, math.inf
    else:
        bad, r_bad = n, math.log(at_n)
        good = min(4 * n, N_SEARCH_MAX)
        while (r_good := log_ratio(good)) > log_target:
            if good == N_SEARCH_MAX:
                return None
            bad, r_bad, good = good, r_good, min(4 * good, N_SEARCH_MAX)
    while good - bad > max(1, N_SEARCH_PRECISION * bad):
        lo, hi = math.log(bad), math.log(good)
        if math.isfinite(r_bad) and math.isfinite(r_good) and r_bad > r_good:
            guess = lo + (r_bad - log_target) / (r_bad - r_good) * (hi - lo)
        else:
            guess = 0.5 * (lo + hi)
        guess = min(max(guess, lo + 0.1 * (hi - lo)), hi - 0.1 * (hi - lo))
        mid = min(max(int(math.exp(guess)), bad + 1), good - 1)
        r_mid = log_ratio(mid)
        if r_mid <= log_target:
            good, r_good = mid, r_mid
        else:
            bad, r_bad = mid, r_mid
    return good


def schema_eta(d: int) -> float:
    """√d: the least η that leaves unconstrained every linear model whose predictions stay
    within the target's range over the box of the features' ranges (docs/privacy.md, "The n a
    study needs"): such a model is ŷ = a₀ + Σ aⱼuⱼ with Σ|aⱼ| ≤ 1 in encoded units, and its
    w = √d·a has ‖w‖ ≤ √d·‖a‖₁ ≤ √d."""
    return math.sqrt(d)


def for_study(study, margin: float | None = None, target_sd: float | None = None) -> SampleSize:
    """`sample_size` with an ipdp.study.Study's parameters; a schema study's promise is in the
    target's raw units."""
    target = {}
    schema = study.schema_
    if schema is not None and not schema.target.is_class:
        t = schema.target
        target = {"target_unit": schema.target_map()[1], "target_name": t.name,
                  "target_range": (t.min, t.max)}
    return sample_size(mode=study.mode, epsilon=study.epsilon, delta=study.delta, n=study.n,
                       d=study.d, lam=study.lam, p_bound=study.p_bound, eta=study.eta,
                       delta_in=study.resolved_delta_in, loss=study.loss, margin=margin,
                       target_sd=target_sd, **target)


def eta_advice(study) -> str | None:
    """How a schema study's η was chosen, in one line: against the schema's rule (`schema_eta`)
    for a numeric target; None for a study without a schema."""
    schema = study.schema_
    if schema is None:
        return None
    if schema.target.is_class:
        # The constrained solution is (H + νI)⁻¹b for some ν ≥ 0: a binding bound is a ridge.
        return (f"{study.eta:g}: a classifier predicts with the sign of xᵀw, and a binding "
                "‖w‖ ≤ η acts on w as a ridge, not a cap on its predictions")
    rule = schema_eta(study.d)
    why = (f"√d = {rule:.3g}, the least η that leaves unconstrained every linear model whose "
           f"predictions stay within {schema.target.name}'s range over the features' ranges")
    if math.isclose(study.eta, rule, rel_tol=1e-9):
        return f"{why} (a schema study's default)"
    if study.eta < rule:
        return (f"{study.eta:g}, below {why}: a model that needs more is shrunk (leave --eta out "
                "for √d)")
    return f"{study.eta:g}, above {why}: a larger η costs noise (leave --eta out for √d)"
