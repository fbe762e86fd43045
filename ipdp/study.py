"""A study: the public parameters every stakeholder agrees on before any record is sent.

Validated once here, then trusted. The calibration is a pure function of these parameters, so
contributors, aggregator and trainer each derive the same σ_u, σ_b and Δ_in from the study alone.
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ipdp.calibration import Calibration, CalibrationError, Mode, calibrate
from ipdp.wire import study_hash

Loss = Literal["squared", "logistic"]

#: Δ_in used in paper mode when none is given: Algorithm 2 needs Δ > 2λ/ε strictly, so Δ_in > 0;
#: its size is a utility knob, and 1e-6 leaves the solution practically unregularised.
PAPER_DEFAULT_DELTA_IN = 1e-6


class Study(BaseModel):
    """Public parameters of one study (DESIGN.md §1–3). Immutable once created."""

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
