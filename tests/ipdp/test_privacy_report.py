"""The δ a model reports is the deployed mechanism's and the study's: the calibration's share
and the aggregator's norm check's share add up to at most the study's δ (docs/privacy.md, "The norm check and its false-rejection
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
def test_the_reported_delta_is_the_studys_and_covers_the_norm_checks_false_rejections(study):
    cal = study.calibration
    report = PrivacyReport.from_calibration(cal)
    # The check the aggregator applies rejects an honest record with probability at most π …
    pi = record_norm_bounds(cal).probability
    assert pi == cal.honest_rejection_probability > 0
    # … so the deployed mechanism is (ε, δ_M + (1 + e^ε)·n·π)-DP, δ_M what Steps 1–7 prove.
    check = (1 + math.exp(study.epsilon)) * study.n * pi
    assert report.delta_split["norm_check"] == pytest.approx(check, rel=1e-12)
    proof = sum(v for k, v in report.delta_split.items() if k != "norm_check")
    assert proof <= cal.mechanism_delta
    # Reported and spent: at most the study's (ε, δ), the check's share taken out of it.
    assert (report.epsilon, report.delta) == (study.epsilon, study.delta)
    assert proof + check <= study.delta
    assert proof + check == pytest.approx(study.delta, rel=1e-9)
    assert check == pytest.approx(1e-3 * study.delta, rel=1e-12)


@pytest.mark.parametrize("study", STUDIES[:1] + STUDIES[2:], ids=lambda s: s.study_id)
def test_the_noise_is_proven_at_the_mechanisms_share_of_delta_not_the_studys(study):
    """Steps 1–7 at δ_M = (1 − 10⁻³)·δ need a little more noise than at the whole δ: a
    calibration that spent the whole δ on the noise (the norm check on top) would need less."""
    from ipdp.calibration import linear_term_delta

    cal = study.calibration
    if cal.mode == "rigorous":
        # Step 6 at the chosen σ_b meets δ_K, with δ_K the mechanism's share less γ₁ + γ₂.
        split = cal.delta_split
        assert split["delta_k"] + split["gamma_1"] + split["gamma_2"] <= cal.mechanism_delta
        kappa = cal.lambda_prime * cal.eta
        assert linear_term_delta(cal.epsilon_split["linear"], math.sqrt(cal.sigma_b2), kappa,
                                 cal.p_bound) <= split["delta_k"]
    else:
        assert cal.delta_split["gamma"] + cal.delta_split["delta_prime"] <= cal.mechanism_delta
    assert cal.mechanism_delta < study.delta


@pytest.mark.parametrize(("epsilon", "n", "words"), [
    (0.1, 2_000, "well protected too"),        # local ε ≈ 0.61
    (1.0, 10_000, "only weakly protected"),    # local ε ≈ 2,900
])
def test_calibrate_words_a_records_local_protection_by_its_local_epsilon(epsilon, n, words):
    from ipdp.report import LOCAL_EPSILON_STRONG, calibration_table

    cal = Study(study_id="words", d=14, n=n, epsilon=epsilon, delta=0.01).calibration
    assert (cal.local_epsilon <= LOCAL_EPSILON_STRONG) == (words == "well protected too")
    line = next(li for li in calibration_table(cal).splitlines() if li.startswith("local"))
    assert words in line
    assert ("weakly" in line) == (words == "only weakly protected")


def test_every_band_of_local_protection_names_its_range():
    from ipdp.report import local_protection

    assert "≤ 1" in local_protection(0.5)
    assert "1 < local ε ≤ 10" in local_protection(5.0)
    assert "> 10" in local_protection(11.0) and "> 10" in local_protection(None)
