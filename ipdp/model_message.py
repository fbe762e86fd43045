"""The published model: one JSON message per (study, round) on the models topic.

It carries the weights and the privacy report, never A, b or any record, and the study's schema
when it has one (ipdp.schema): the weights are in the schema's encoded space, and the schema is
what maps them back to raw units (ipdp.model), so it is signed with them. Its Kafka key is
`{study_id}:{round}` so a consumer (and a compacted topic) can drop a repeat.

A trainer with a signing key (IPDP_TRAINER_SIGNING_KEY) publishes it inside a signed envelope,
``{"format": 2, "model": "<model JSON text>", "key_id": "…", "signature": "…"}``, the signature
(Ed25519, ipdp.signing) covering the UTF-8 of ``"ipdp-model-v2\n" + model_text``. Without a key
the value is the model JSON itself, which a subscriber that pins trainer keys refuses.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ipdp.accounting import Composed
from ipdp.calibration import Calibration
from ipdp.errors import MalformedValue, SignatureError
from ipdp.schema import Schema
from ipdp.signing import SigningKey, TrustedKeys
from ipdp.topic_values import DEFAULT_MAX_VALUE_BYTES, invalid_fields, load_json_object

if TYPE_CHECKING:
    from ipdp.two_server import TwoServerCalibration

MODEL_ENVELOPE_FORMAT = 2
MODEL_SIGNING_TAG = "ipdp-model-v2"

MESSAGE_VERSION = 1
UNIT = "one record of one device in one round (replace-one)"
GUARANTEE = ("privacy, not robustness: (epsilon, delta) bounds what this model reveals about any "
             "one record; it does not bound how far the round's accepted records, honest or "
             "crafted, moved it (docs/security.md, Bounded influence)")
TWO_SERVER_PROTECTS = (
    "either server alone (the leader or the helper) sees no record: each holds uniformly random "
    "shares and their sums; only a whole round's sum is reconstructed, by the trainer. The two "
    "colluding see every record as the one server of a one-server study does")
TWO_SERVER_NOT_CHECKED = [
    ("per-record norm bounds: no server reads a record, so robustness rests on device "
    "credentials (where the study requires them) and the checks of the round's sum"),
    ("validity proofs that each record's shares encode a well-formed record: the record format "
    "keeps room for one, none is carried yet"),
]


class PrivacyReport(BaseModel):
    """What the model guarantees and how the noise was calibrated (from ipdp.calibration)."""

    model_config = ConfigDict(frozen=True)

    mode: str
    proven: bool = Field(description="Whether docs/privacy.md proves (epsilon, delta) for mode.")
    neighbouring: str = Field(description="The neighbouring relation: replace one record.")
    epsilon: float
    delta: float
    epsilon_split: dict[str, float]
    linear_sensitivity: float
    sigma_u2: float
    sigma_b2: float
    delta_in: float
    eta: float
    lam: float
    p_bound: float
    lambda_prime: float | None
    zeta_prime: float | None
    delta_split: dict[str, float]
    local_epsilon: float | None = Field(description="ε of one record on its own, at local_delta.")
    local_delta: float
    unit: str = Field(UNIT, description="What (ε, δ) protects (docs/accounting.md).")
    guarantee: str = Field(GUARANTEE, description="What kind of guarantee (ε, δ) is: privacy, "
                           "not robustness against poisoned records.")
    composed_epsilon: float | None = Field(
        None, description="ε of rounds 1 … rounds_composed together, for a device that "
        "contributed one record to each; None: no finite ε at composed_delta.")
    composed_delta: float | None = Field(
        None, description="δ at which composed_epsilon holds: the study's budget δ if it has "
        "one, else δ for round 1 (the round's own guarantee) and (r + 1)·δ for r ≥ 2 rounds "
        "(r·δ is what the rounds' δ add up to; one δ more buys a smaller ε), at most 0.5 "
        "(docs/accounting.md).")
    rounds_composed: int | None = None
    composition: str | None = Field(None, description="The composition theorem applied.")
    servers: Literal["one-server", "two-server"] = Field(
        "one-server", description="Who folds the records: one server, or a leader and a helper "
        "that each fold an additive share (docs/privacy.md, \"Two-server mode\").")
    protects: str | None = Field(
        None, description="Two-server: what the split of each record protects against.")
    checked: list[str] | None = Field(
        None, description="Two-server: what the trainer checked of the round's sum before it "
        "solved (docs/privacy.md, Step 15).")
    not_checked: list[str] | None = Field(
        None, description="Two-server: what no server checks, since none reads a record.")

    @classmethod
    def from_calibration(cls, cal: Calibration, composed: Composed | None = None) -> PrivacyReport:
        """Copy the guarantee-bearing fields of a calibration, and the composed guarantee."""
        fields = cal.model_dump(include=set(cls.model_fields))
        if composed is not None:
            fields |= {"composed_epsilon": composed.epsilon, "composed_delta": composed.delta,
                       "rounds_composed": composed.rounds, "composition": composed.composition}
        return cls(**fields)

    @classmethod
    def from_two_server(cls, two: TwoServerCalibration, composed: Composed | None,
                        checked: list[str]) -> PrivacyReport:
        """A two-server model's report: the one-server calibration's σ_u², Δ_in, λ′ and local
        figures, which the two-server calibration keeps, with its linear noise, shift bound and
        (ε, δ) splits (Steps 12 and 14), and what the mode protects and checks."""
        report = cls.from_calibration(two.one_server, composed)
        # Γ″ = λ′η + 2P_b + 2eη: Step 12's bound on the shift, rounding included.
        shift = ((two.lambda_prime + 2.0 * two.rounding) * report.eta
                 + 2.0 * two.linear_p_bound)
        return report.model_copy(update={
            "servers": "two-server", "sigma_b2": two.sigma_b2, "linear_sensitivity": shift,
            "epsilon_split": dict(two.epsilon_split), "delta_split": dict(two.delta_split),
            "protects": TWO_SERVER_PROTECTS, "checked": list(checked),
            "not_checked": list(TWO_SERVER_NOT_CHECKED)})


class ModelMessage(BaseModel):
    """A model trained on exactly n records of one closed round."""

    # `schema_` because BaseModel has a `schema` method; its JSON name is "schema".
    model_config = ConfigDict(frozen=True, validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True)

    version: int = MESSAGE_VERSION
    study_id: str
    round: int = Field(ge=1)
    n: int
    d: int
    loss: str
    weights: list[float]
    constraint_active: bool = Field(description="True when ‖w‖ = η binds.")
    privacy: PrivacyReport
    schema_: Schema | None = Field(None, alias="schema", description="The study's schema: "
                                   "the weights' coordinates, and their map to raw units.")
    round_closed_ms: int
    published_ms: int

    @property
    def key(self) -> bytes:
        """The Kafka key, `{study_id}:{round}`."""
        return model_key(self.study_id, self.round)


def model_key(study_id: str, round_no: int) -> bytes:
    """Kafka key of the model for (study, round)."""
    return f"{study_id}:{round_no}".encode()


def model_value(message: ModelMessage, signing_key: SigningKey | None = None) -> bytes:
    """The models-topic value: the model JSON, inside a signed envelope when a key is given."""
    text = message.model_dump_json()
    if signing_key is None:
        return text.encode()
    kid, signature = signing_key.sign(f"{MODEL_SIGNING_TAG}\n{text}".encode())
    return json.dumps({"format": MODEL_ENVELOPE_FORMAT, "model": text, "key_id": kid,
                       "signature": signature}, sort_keys=True,
                      separators=(",", ":")).encode()


def parse_model_value(value: bytes, trusted: TrustedKeys | None = None,
                      max_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> ModelMessage:
    """Inverse of :func:`model_value`. With ``trusted`` keys an unsigned or wrongly signed value
    raises SignatureError, and the model text is parsed only once its signature verifies; a
    malformed value raises :class:`MalformedValue` (ipdp.topic_values)."""
    obj = load_json_object(value, "models-topic value", max_bytes)
    if obj.get("format") == MODEL_ENVELOPE_FORMAT and "model" in obj:
        text = obj["model"]
        if not isinstance(text, str):
            raise MalformedValue("invalid", "model envelope: 'model' is not a string")
        if trusted:
            kid, signature = obj.get("key_id", ""), obj.get("signature", "")
            trusted.verify(kid, signature if isinstance(signature, str) else "",
                           f"{MODEL_SIGNING_TAG}\n{text}".encode(), "model message")
        obj = load_json_object(text, "model text", max_bytes)
    elif trusted:
        raise SignatureError("model message has no signature, and trainer keys are pinned")
    try:
        return ModelMessage.model_validate(obj)
    except ValidationError as exc:
        raise invalid_fields("model message", exc) from None
