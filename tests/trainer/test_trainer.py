"""What the trainer puts in every model's privacy report."""

from __future__ import annotations

import numpy as np

from ipdp.study import Study
from trainer.service import train_round


def _model(**params):
    study = Study(study_id="t", d=3, n=2000, epsilon=1.0, delta=0.01, **params)
    rng = np.random.default_rng(0)
    q = rng.normal(size=(study.n, 3)) / 3
    return train_round(study, q.T @ q, q.sum(axis=0), study.n, round_no=1, closed_ms=0)[0]


def test_a_rigorous_model_says_its_guarantee_is_proven_for_replace_one():
    privacy = _model().privacy
    assert privacy.proven is True and privacy.neighbouring == "replace-one"
    assert privacy.linear_sensitivity > 0 and sum(privacy.epsilon_split.values()) > 0


def test_a_paper_mode_model_says_its_guarantee_is_not_proven():
    assert _model(mode="paper").privacy.proven is False


def test_the_published_message_carries_no_solve_duration():
    message = _model()
    assert "solve_seconds" not in message.model_dump()


def test_a_one_round_model_reports_the_studys_delta_and_composes_nothing():
    privacy = _model().privacy
    assert (privacy.epsilon, privacy.delta) == (1.0, 0.01)
    assert (privacy.composed_epsilon, privacy.composed_delta, privacy.rounds_composed) == (
        1.0, 0.01, 1)
    assert "nothing composed" in privacy.composition
    assert sum(privacy.delta_split.values()) <= privacy.delta * (1 + 1e-12)
