"""A study: the public parameters every stakeholder agrees on before any record is sent.

Validated once here, then trusted. The calibration is a pure function of these parameters, so
contributors, aggregator and trainer each derive the same σ_u, σ_b and Δ_in from the study alone.
The studies-topic codec lives here too: the message every device reads to learn a study.

**Canonical text.** ``Study.canonical_text()`` is the study's parameters plus the noise stds a
device adds (``noise: {std_q, std_p}``), as ``json.dumps(sort_keys=True, separators=(",", ":"),
ensure_ascii=True, allow_nan=False)``. Its SHA-256 (first 16 bytes) is the study hash every record
carries, so a record names every parameter it was perturbed under, not just the study id.

**Studies-topic value, format 2** (UTF-8 JSON)::

    {"format": 2, "study": "<canonical text>", "status": "open" | "closed",
     "key_id": "<hex SHA-256(raw public key)[:8]>", "signature": "<base64 Ed25519 signature>"}

The signed bytes are ``"ipdp-study-v2\n" + status + "\n" + study_text`` (UTF-8). An unsigned
study has ``key_id`` and ``signature`` both ``""``; a reader that pins keys refuses it.
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
from ipdp.signing import SigningKey, TrustedKeys
from ipdp.wire import study_hash

#: Format of the studies-topic value; the domain tag of its signed bytes.
STUDY_MESSAGE_FORMAT = 2
STUDY_SIGNING_TAG = "ipdp-study-v2"

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

    def canonical_text(self) -> str:
        """The signed study JSON: every parameter plus the noise stds a device adds."""
        return self._canonical_text

    @cached_property
    def _canonical_text(self) -> str:
        obj = self.model_dump(mode="json")
        cal = self.calibration
        obj["noise"] = {"std_q": cal.noise_std_q, "std_p": cal.noise_std_p}
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                          allow_nan=False)

    @cached_property
    def hash(self) -> bytes:
        """The 16-byte study hash carried by every record: SHA-256 of the canonical text."""
        return study_hash(self.canonical_text())

    def to_json(self) -> str:
        """Canonical JSON (the form stored in Redis and on the studies topic)."""
        return self.model_dump_json(exclude_none=False)


def signed_bytes(status: StudyStatus | str, study_text: str) -> bytes:
    """What the study owner signs: the domain tag, the status and the canonical study text."""
    return f"{STUDY_SIGNING_TAG}\n{_status(status).value}\n{study_text}".encode()


def study_message(study: Study, status: StudyStatus | str,
                  signing_key: SigningKey | None = None) -> bytes:
    """The studies-topic value (format 2); unsigned (empty key id and signature) without a key."""
    status = _status(status)
    text = study.canonical_text()
    kid, signature = ("", "") if signing_key is None else signing_key.sign(
        signed_bytes(status, text))
    return json.dumps({"format": STUDY_MESSAGE_FORMAT, "study": text, "status": status.value,
                       "key_id": kid, "signature": signature},
                      separators=(",", ":")).encode("utf-8")


def parse_study_message(value: bytes, trusted: TrustedKeys | None = None,
                        ) -> tuple[Study, StudyStatus]:
    """Inverse of :func:`study_message`, verified against ``trusted`` when it holds any key.

    Raises :class:`SignatureError` when keys are pinned and the value is unsigned, signed by
    another key, or altered; :class:`ConfigurationError` when it is malformed, or when its study
    text is not exactly the canonical text of the parameters it holds (noise stds that are not
    the calibration's). Without pinned keys the signature is not checked: the caller must say so.
    """
    try:
        env = json.loads(value)
        if env.get("format") != STUDY_MESSAGE_FORMAT:
            raise ValueError(f"format {env.get('format')!r}, supported: {STUDY_MESSAGE_FORMAT}")
        text, status = env["study"], _status(env["status"])
        if not isinstance(text, str):
            raise TypeError("study is not a string")
    except (ValueError, KeyError, TypeError, AttributeError, ConfigurationError) as exc:
        raise ConfigurationError(f"malformed studies-topic message: {exc}") from None
    if trusted:
        trusted.verify(env.get("key_id", ""), env.get("signature", ""),
                       signed_bytes(status, text), f"study message for status {status.value}")
    try:
        fields = json.loads(text)
        fields.pop("noise", None)
        study = Study.model_validate(fields)
    except (ValueError, TypeError, AttributeError, ValidationError) as exc:
        raise ConfigurationError(f"malformed study text: {exc}") from None
    if study.canonical_text() != text:
        raise ConfigurationError(
            f"study {study.study_id!r}: its text is not the canonical text of its parameters "
            "(noise stds differ from this version's calibration)")
    return study, status


def _status(status: StudyStatus | str) -> StudyStatus:
    try:
        return StudyStatus(status)
    except ValueError:
        raise ConfigurationError(
            f"status must be one of {[s.value for s in StudyStatus]}, got {status!r}") from None
