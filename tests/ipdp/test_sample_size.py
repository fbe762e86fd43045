"""The n a study needs: its model's predicted error against the zero model's, from public
parameters only (ipdp.sample_size; docs/privacy.md, "The n a study needs")."""

from __future__ import annotations

import pytest

from ipdp.calibration import CalibrationError, calibrate
from ipdp.sample_size import for_study, relative_error, sample_size
from ipdp.study import Study

PARAMS = {"mode": "rigorous", "delta": 0.01, "d": 14, "lam": 1.0, "p_bound": 1.0, "eta": 1.0,
          "delta_in": None}


def ratio(n: int, epsilon: float, loss: str = "squared") -> float:
    cal = calibrate(n=n, epsilon=epsilon, loss=loss, **PARAMS)
    return relative_error(cal, loss)


@pytest.mark.parametrize(("epsilon", "loss", "margin"), [
    (1.0, "squared", 0.5), (0.1, "squared", 0.5), (1.0, "squared", 0.9),
    (1.0, "logistic", 0.5),
])
def test_the_least_useful_n_is_the_first_n_whose_predicted_error_clears_the_margin(
        epsilon, loss, margin):
    size = sample_size(n=2_000, epsilon=epsilon, loss=loss, margin=margin, **PARAMS)
    least = size.least_useful_n
    assert least is not None
    # Predicted useful at the n it names, and not 2 % below it (it is found to within 1 %).
    assert ratio(least, epsilon, loss) <= 1 - margin
    assert ratio(int(least / 1.02), epsilon, loss) > 1 - margin
    # A higher bar needs more records.
    if margin < 0.9:
        stricter = sample_size(n=2_000, epsilon=epsilon, loss=loss, margin=0.9, **PARAMS)
        assert stricter.least_useful_n > least


def test_the_zero_model_is_the_reference_squared_by_its_excess_risk_logistic_by_direction():
    squared = sample_size(n=10_000, epsilon=1.0, **PARAMS)
    assert squared.zero_model_error == pytest.approx(1.0 / 14)  # μη², μ = λ/d
    assert squared.relative_error == pytest.approx(squared.predicted_error * 14)
    assert squared.predicted_error == calibrate(n=10_000, epsilon=1.0, **PARAMS).predicted_error
    logistic = sample_size(n=10_000, epsilon=1.0, loss="logistic", **PARAMS)
    assert logistic.zero_model_error == 1.0
    assert logistic.relative_error == logistic.predicted_error


def test_a_study_below_the_least_useful_n_is_not_predicted_useful():
    # ε = 0.1, n = 2,000, d = 14: R = 0.123, above the zero model's 1/14.
    small = for_study(Study(study_id="small", d=14, n=2_000, epsilon=0.1, delta=0.01))
    assert small.relative_error > 1 and not small.useful
    assert small.least_useful_n > 2_000
    big = for_study(Study(study_id="big", d=14, n=small.least_useful_n, epsilon=0.1, delta=0.01))
    assert big.useful and big.least_useful_n == small.least_useful_n


def test_a_margin_outside_zero_to_one_is_refused():
    with pytest.raises(CalibrationError, match="margin"):
        sample_size(n=2_000, epsilon=1.0, margin=1.0, **PARAMS)
