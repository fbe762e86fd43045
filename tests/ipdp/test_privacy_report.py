"""The δ a model reports is the deployed mechanism's: the calibration's δ plus what the
aggregator's norm check adds (docs/privacy.md, "The norm check and its false-rejection
probability")."""

from __future__ import annotations

import math

import pytest

from ipdp.calibration import record_norm_bounds
from ipdp.model_message import PrivacyReport
from ipdp.study import Study

STUDIES = [
    Study(study_id="r-squared", d=14, n=1_000, epsilon=1.0, delta=0.01),
    Study(study_id="r-logistic", loss="logistic", d=3, n=20_000, epsilon=0.1, delta=1e-6),
    Study(study_id="r-paper", d=4, n=5_000, epsilon=2.0, delta=1e-4, mode="paper"),
]


@pytest.mark.parametrize("study", STUDIES, ids=lambda s: s.study_id)
def test_the_reported_delta_covers_the_norm_checks_false_rejections(study):
    cal = study.calibration
    report = PrivacyReport.from_calibration(cal)
    # The check the aggregator applies rejects an honest record with probability at most π …
    pi = record_norm_bounds(cal).probability
    assert pi == cal.honest_rejection_probability > 0
    # … so the deployed mechanism is (ε, δ + (1 + e^ε)·n·π)-DP, which is what is reported.
    assert report.epsilon == study.epsilon
    assert report.delta == pytest.approx(study.delta + (1 + math.exp(study.epsilon)) * study.n * pi,
                                         rel=1e-12)
    assert report.delta > study.delta
    assert report.delta_split["norm_check"] == pytest.approx(report.delta - study.delta, rel=1e-9)
    # The split names every part of the reported δ.
    assert sum(report.delta_split.values()) == pytest.approx(report.delta, rel=1e-9)
