"""A study: the public parameters every stakeholder agrees on before any record is sent.

Validated once here, then trusted. The calibration is a pure function of these parameters, so
contributors, aggregator and trainer each derive the same σ_u, σ_b and Δ_in from the study alone.
The studies-topic codec lives here too: the message every device reads to learn a study.
"""

from __future__ import annotations

import enum
import json
import math
from functools import cached_property
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ipdp.calibration import Calibration, Mode, calibrate
from ipdp.errors import CalibrationError, ConfigurationError
from ipdp.wire import study_hash

Loss = Literal["squared", "logistic"]


class StudyStatus(enum.StrEnum):
    """Whether a study accepts records."""

    OPEN = "open"
    CLOSED = "closed"

#: Δ_in used in paper mode when none is given: Algorithm 2 needs Δ > 2λ/ε strictly, so Δ_in > 0;
#: its size is a utility knob, and 1e-6 leaves the solution practically unregularised.
PAPER_DEFAULT_DELTA_IN = 1e-6


class Study(BaseModel):
    """Public parameters of one study (docs/privacy.md). Immutable once created."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    study_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    loss: Loss = "squared"
    d: int = Field(ge=1, le=4096, description="Dimension of x, q and p.")
    n: int = Field(ge=2, description="Records per round.")
    epsilon: float = Field(description="Central ε of each published model.")
    delta: float = Field(description="Central δ of each published model.")
    eta: float = Field(1.0, description="η: the model is constrained to ‖w‖ ≤ η.")
    lam: float = Field(1.0, description="λ: contributors clip ‖q‖² ≤ λ.")
    p_bound: float = Field(1.0, description="P: contributors clip ‖p‖ ≤ P.")
    delta_in: float | None = Field(
        None, description="Δ_in ≥ 0, the trainer's ridge; default 0 (rigorous), 1e-6 (paper)."
    )
    mode: Mode = "rigorous"
    max_rounds: int | None = Field(None, ge=1, description="Close the study after this many.")

    @model_validator(mode="after")
    def _check_bounds(self) -> Study:
        for name, value in (("epsilon", self.epsilon), ("eta", self.eta), ("lam", self.lam),
                            ("p_bound", self.p_bound)):
            if not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"{name}={value} must be a finite number > 0")
        if not (0.0 < self.delta < 1.0):
            raise ValueError(f"delta={self.delta} must lie in the open interval (0, 1)")
        if self.delta_in is not None and not (math.isfinite(self.delta_in) and self.delta_in >= 0):
            raise ValueError(f"delta_in={self.delta_in} must be a finite number ≥ 0")
        try:
            self.calibration  # noqa: B018 - computing it is the check
        except CalibrationError as exc:
            raise ValueError(str(exc)) from None
        return self

    @property
    def resolved_delta_in(self) -> float:
        """Δ_in after applying the mode's default."""
        if self.delta_in is not None:
            return self.delta_in
        return PAPER_DEFAULT_DELTA_IN if self.mode == "paper" else 0.0

    @cached_property
    def calibration(self) -> Calibration:
        """σ_u², σ_b², Δ_in and the guarantees for these parameters (ipdp.calibration)."""
        return calibrate(
            mode=self.mode, epsilon=self.epsilon, delta=self.delta, n=self.n, d=self.d,
            lam=self.lam, p_bound=self.p_bound, eta=self.eta, delta_in=self.resolved_delta_in,
        )

    @cached_property
    def hash(self) -> bytes:
        """The 16-byte study hash carried by every record on the wire."""
        return study_hash(self.study_id)

    def to_json(self) -> str:
        """Canonical JSON (the form stored in Redis and on the studies topic)."""
        return self.model_dump_json(exclude_none=False)


def study_message(study: Study, status: StudyStatus | str) -> bytes:
    """The studies-topic value: ``{"study": {...}, "status": ...}`` as UTF-8 JSON."""
    status = _status(status)
    return json.dumps({"study": study.model_dump(mode="json"), "status": status.value},
                      sort_keys=True, separators=(",", ":")).encode("utf-8")


def parse_study_message(value: bytes) -> tuple[Study, StudyStatus]:
    """Inverse of :func:`study_message`; raises ConfigurationError on a malformed value."""
    try:
        obj = json.loads(value)
        status = _status(obj["status"])
        study = Study.model_validate(obj["study"])
    except (ValueError, KeyError, TypeError, ValidationError, ConfigurationError) as exc:
        raise ConfigurationError(f"malformed studies-topic message: {exc}") from None
    return study, status


def _status(status: StudyStatus | str) -> StudyStatus:
    try:
        return StudyStatus(status)
    except ValueError:
        raise ConfigurationError(
            f"status must be one of {[s.value for s in StudyStatus]}, got {status!r}") from None
