"""The n a study needs, before anyone contributes: its model's predicted error against the zero
model's, from public parameters only (docs/privacy.md, "The n a study needs").

The prediction is the one Step 8 minimises (ipdp.calibration.predicted_error, and
predicted_direction_error for a classifier): records whose curvature is isotropic at the largest
level the clipping allows, Σ qqᵀ = nμI with μ = λ/d, and a true model at the bound, ‖w*‖ = η.
In that model the zero model w = 0 has excess risk μη² and direction error 1, so the private
model's predicted error over the zero model's is R/(μη²) for squared loss and D for logistic
loss. A study is *predicted useful at margin m* when that ratio is at most 1 − m.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ipdp.calibration import (
    Calibration,
    CalibrationError,
    calibrate,
    predicted_direction_error,
    predicted_error,
)

DEFAULT_MARGIN = 0.5
"""By default a useful model is predicted to have at most half the zero model's error."""
N_SEARCH_MAX = 2**40
"""The search for the least useful n stops here (10¹² records): past it, no n is named."""
N_SEARCH_PRECISION = 0.01
"""The least useful n is found to within 1 % (the n named is one that is predicted useful)."""


def zero_model_error(cal: Calibration, loss: str) -> float:
    """The error of w = 0 in the prediction's model: excess risk μη² (squared), direction 1."""
    return 1.0 if loss == "logistic" else cal.lam / cal.d * cal.eta**2


def model_error(cal: Calibration, loss: str) -> float:
    """The private model's predicted error: R (squared loss) or D (logistic), for any mode."""
    error = predicted_direction_error if loss == "logistic" else predicted_error
    return error(sigma_u2=cal.sigma_u2, sigma_b2=cal.sigma_b2, delta_in=cal.delta_in, n=cal.n,
                 d=cal.d, lam=cal.lam, eta=cal.eta)


def relative_error(cal: Calibration, loss: str) -> float:
    """The private model's predicted error over the zero model's (1: no better than w = 0)."""
    return model_error(cal, loss) / zero_model_error(cal, loss)


@dataclass(frozen=True)
class SampleSize:
    """What a study's public parameters predict about its model, and the n it needs."""

    loss: str
    margin: float
    predicted_error: float
    """R (squared loss) or D (logistic loss) at the study's n."""
    zero_model_error: float
    relative_error: float
    """predicted_error / zero_model_error."""
    least_useful_n: int | None
    """The least n (to N_SEARCH_PRECISION) whose relative error is at most 1 − margin; None when
    no n up to N_SEARCH_MAX is."""

    @property
    def useful(self) -> bool:
        return self.relative_error <= 1.0 - self.margin


def sample_size(*, mode: str, epsilon: float, delta: float, n: int, d: int, lam: float,
                p_bound: float, eta: float, delta_in: float | None, loss: str = "squared",
                margin: float = DEFAULT_MARGIN) -> SampleSize:
    """The prediction at n and the least n predicted useful at `margin`, with the study's other
    parameters (Δ_in as the study gives it: None lets each n's calibration choose it)."""
    if not 0.0 <= margin < 1.0:
        raise CalibrationError(f"margin={margin} must lie in [0, 1)")

    def ratio(m: int) -> float:
        """Relative error at m records; infinite where no calibration exists."""
        try:
            cal = calibrate(mode=mode, epsilon=epsilon, delta=delta, n=m, d=d, lam=lam,
                            p_bound=p_bound, eta=eta, delta_in=delta_in, loss=loss)
        except CalibrationError:
            return float("inf")
        return relative_error(cal, loss)

    cal = calibrate(mode=mode, epsilon=epsilon, delta=delta, n=n, d=d, lam=lam, p_bound=p_bound,
                    eta=eta, delta_in=delta_in, loss=loss)
    here = relative_error(cal, loss)
    return SampleSize(loss=loss, margin=margin, predicted_error=model_error(cal, loss),
                      zero_model_error=zero_model_error(cal, loss), relative_error=here,
                      least_useful_n=_least_n(ratio, 1.0 - margin, n, here))


def _least_n(ratio, target: float, n: int, at_n: float) -> int | None:
    """The least m (to N_SEARCH_PRECISION) with ratio(m) ≤ target, the error falling with m.

    Bracketed by factors of 4 from n, then narrowed by regula falsi on log ratio against log m
    (the ratio is close to a power of m, so a few calibrations suffice), each step kept within
    the inner 80 % of the bracket so that it always shrinks; every m it names passes.
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
            return good
    else:
        bad, r_bad = n, math.log(at_n)
        good = 4 * n
        while (r_good := log_ratio(good)) > log_target:
            if good > N_SEARCH_MAX:
                return None
            bad, r_bad, good = good, r_good, 4 * good
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

def for_study(study, margin: float = DEFAULT_MARGIN) -> SampleSize:
    """`sample_size` with an ipdp.study.Study's parameters."""
    return sample_size(mode=study.mode, epsilon=study.epsilon, delta=study.delta, n=study.n,
                       d=study.d, lam=study.lam, p_bound=study.p_bound, eta=study.eta,
                       delta_in=study.resolved_delta_in, loss=study.loss, margin=margin)
