"""A study: the public parameters every stakeholder agrees on before any record is sent.

Validated once here, then trusted. The calibration is a pure function of these parameters, so
contributors, aggregator and trainer each derive the same σ_u, σ_b and Δ_in from the study alone.
The studies-topic codec lives here too: the message every device reads to learn a study.

**Canonical text.** ``Study.canonical_text`` is the study's parameters plus the noise stds a
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
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_serializer,
    model_validator,
)

from ipdp.calibration import Calibration, Mode, RecordNormBounds, calibrate, record_norm_bounds
from ipdp.errors import CalibrationError, ConfigurationError, MalformedValue
from ipdp.fixed_point import FixedPoint
from ipdp.sample_size import schema_eta
from ipdp.schema import Schema
from ipdp.signing import SigningKey, TrustedKeys
from ipdp.topic_values import DEFAULT_MAX_VALUE_BYTES, invalid_fields, load_json_object
from ipdp.wire import study_hash

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

    from ipdp.two_server import TwoServerCalibration

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
#: Fields left out of the canonical text at their default, so that a study created before they
#: existed keeps its text and hash: name → default.
OPTIONAL_DEFAULTS = {"budget_epsilon": None, "budget_delta": None,
                     "require_credentials": False, "records_per_device": 1, "schema": None,
                     "two_server": None}
#: A budget is counted up to this many rounds (a few seconds of accounting); a budget that
#: would allow more closes the study here, which spends less than the budget, never more.
BUDGET_ROUNDS_COUNTED = 10_000


def feature_bounds(loss: str, x_bound: float | None, y_bound: float | None) -> dict[str, float]:
    """λ and P implied by ‖x‖ ≤ R and, for squared loss, |y| ≤ Y (the encodings in docs/privacy.md).

    squared: q = x, p = y·x  ⇒  λ = R², P = R·Y.   logistic: q = x/2, p = y·x/2, y = ±1
    ⇒  λ = R²/4, P = R/2. Returns {} when no bound is given, {"lam": …} when only R is given
    for squared loss (P then stays as given).
    """
    if x_bound is None:
        if y_bound is not None:
            raise ValueError("y_bound needs x_bound: P = R·Y bounds ‖y·x‖")
        return {}
    if not (math.isfinite(x_bound) and x_bound > 0.0):
        raise ValueError(f"x_bound={x_bound} must be a finite number > 0")
    if loss == "logistic":
        if y_bound is not None:
            raise ValueError("y_bound is for squared loss; logistic labels are ±1")
        return {"lam": x_bound**2 / 4.0, "p_bound": x_bound / 2.0}
    if y_bound is None:
        return {"lam": x_bound**2}
    if not (math.isfinite(y_bound) and y_bound > 0.0):
        raise ValueError(f"y_bound={y_bound} must be a finite number > 0")
    return {"lam": x_bound**2, "p_bound": x_bound * y_bound}


class StudyNoise(BaseModel):
    """The per-coordinate noise stds a device adds, as a study's canonical text carries them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    std_q: float
    std_p: float


#: The fields of a study's ``two_server`` block that its calibration sets (a device's encoding).
TWO_SERVER_ENCODING_FIELDS = ("fraction_bits", "clamp_log2", "linear_fraction_bits",
                              "poisson_mean")


class TwoServer(BaseModel):
    """A two-server study's helper and the fixed-point encoding its devices use
    (docs/wire-format.md, "Two-server records"; docs/privacy.md, "Two-server mode").

    The helper is named by ``helper_id`` and ``helper_url`` and holds the private half of
    ``helper_key`` (the ``.pub`` line of `ipdp keys generate --helper`): devices seal the
    helper's share of each record to it. The encoding fields are calibrate_two_server's for the
    study's parameters: left out, the study fills them in; given (a study read from its text),
    they must be exactly those.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    helper_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    helper_url: str = Field(max_length=2048)
    helper_key: str = Field(description="Standard base64 of the helper's raw X25519 public key.")
    fraction_bits: int | None = None
    """f: a value v is the ring element rint(2^f·v)."""
    clamp_log2: int | None = None
    """c: every entry is clamped to [−2^c, 2^c]."""
    linear_fraction_bits: int | None = None
    """f_b: p̂ lies on the grid 2^−f_b."""
    poisson_mean: float | None = None
    """μ: each device's linear noise is Poisson(μ) − Poisson(μ) per coordinate, times 2^−f_b."""

    @model_validator(mode="after")
    def _check_helper(self) -> TwoServer:
        parts = urlsplit(self.helper_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"helper_url {self.helper_url!r} is not an http(s):// URL with a "
                             "host")
        from ipdp.sealing import parse_helper_public_key

        try:
            parse_helper_public_key(self.helper_key)
        except ConfigurationError as exc:
            raise ValueError(f"helper_key: {exc}") from None
        return self

    @property
    def public_key(self) -> X25519PublicKey:
        """The helper's key the devices seal to."""
        from ipdp.sealing import parse_helper_public_key

        return parse_helper_public_key(self.helper_key)

    @property
    def key_id(self) -> str:
        """Hex SHA-256 of the raw public key, first 8 bytes (as a signing key's id)."""
        import base64

        from ipdp.signing import key_id

        return key_id(base64.b64decode(self.helper_key))


def _encoding_of(two: TwoServerCalibration) -> dict:
    """What a two-server study's text carries of its calibration: a device's encoding."""
    return {"fraction_bits": two.encoding.fraction_bits, "clamp_log2": two.encoding.clamp_log2,
            "linear_fraction_bits": two.linear_bits, "poisson_mean": two.poisson_mean}


def _two_server_noise(two: TwoServerCalibration) -> StudyNoise:
    """A two-server device's noise stds: its linear noise is h_b·S, S ~ Skellam(μ), whose std
    is h_b·√(2μ)."""
    return StudyNoise(std_q=two.noise_std_q,
                      std_p=two.linear_step * math.sqrt(2.0 * two.poisson_mean))


class Study(BaseModel):
    """Public parameters of one study (docs/privacy.md). Immutable once created."""

    # The schema's field is `schema_` (BaseModel has a `schema` method); its JSON name is "schema".
    model_config = ConfigDict(frozen=True, extra="forbid", validate_by_name=True,
                              validate_by_alias=True, serialize_by_alias=True)

    study_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    loss: Loss = "squared"
    d: int = Field(ge=1, le=4096, description="Dimension of x, q and p.")
    n: int = Field(ge=2, description="Records per round.")
    epsilon: float = Field(description="Central ε of each published model.")
    delta: float = Field(description="Central δ of each published model.")
    eta: float = Field(1.0, description="η: the model is constrained to ‖w‖ ≤ η (default 1; "
                       "√d for a squared-loss schema study: ipdp.sample_size.schema_eta).")
    lam: float = Field(None, description="λ: contributors clip ‖q‖² ≤ λ (default 1, or from "
                                         "x_bound).")
    p_bound: float = Field(None, description="P: contributors clip ‖p‖ ≤ P (default 1, or from "
                                             "x_bound and y_bound).")
    x_bound: float | None = Field(None, description="R: the feature bound ‖x‖ ≤ R; sets λ and P.")
    y_bound: float | None = Field(None, description="Y: the label bound |y| ≤ Y (squared loss).")
    delta_in: float | None = Field(
        None, description="Δ_in ≥ 0, the trainer's ridge; default: chosen by Step 8 (rigorous), "
        "1e-6 (paper)."
    )
    mode: Mode = "rigorous"
    two_server: TwoServer | None = Field(
        None, description="The helper of a two-server study and its devices' fixed-point "
        "encoding (docs/wire-format.md, \"Two-server records\"); None: one server.")
    max_rounds: int | None = Field(None, ge=1, description="Close the study after this many.")
    budget_epsilon: float | None = Field(
        None, description="Total ε a device that contributes once per round may spend; with "
        "budget_delta, the study closes before a round that would exceed it (ipdp.accounting).")
    budget_delta: float | None = Field(None, description="Total δ of the budget.")
    require_credentials: bool = Field(
        False, description="Fold only records with a valid device credential (ipdp.credentials).")
    records_per_device: int = Field(
        1, ge=1, le=1024, description="Records one credential may contribute to the study "
        "(its slots); needs require_credentials.")
    schema_: Schema | None = Field(
        None, alias="schema", description="The named features and target of a raw row with "
        "their public ranges (ipdp.schema); sets d, and R = 1 (and Y = 1 for squared loss).")
    noise: StudyNoise | None = Field(
        None, description="The noise stds devices add. Given (a study read from its text), "
        "kept if proven for the parameters; else the calibration's choice (Step 8).")

    @model_validator(mode="before")
    @classmethod
    def _resolve_feature_bounds(cls, data):
        """λ and P from ‖x‖ ≤ R (and |y| ≤ Y) when given; a contradicting λ or P is refused."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        loss = data.get("loss", "squared")
        if data.get("schema") is not None:
            data = _resolve_schema(data, loss)
        derived = feature_bounds(loss, data.get("x_bound"), data.get("y_bound"))
        given_bounds = f"x_bound={data.get('x_bound')}, y_bound={data.get('y_bound')}"
        for name, value in derived.items():
            given = data.get(name)
            if given is not None and not math.isclose(float(given), value, rel_tol=1e-9):
                raise ValueError(
                    f"{name}={given} contradicts {given_bounds}, which give {name}={value:.6g} "
                    f"for {loss} loss; give the feature bounds or {name}, not both"
                )
            data[name] = value
        for name in ("lam", "p_bound"):
            if data.get(name) is None:
                data[name] = 1.0
        return data

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
        if (self.budget_epsilon is None) != (self.budget_delta is None):
            raise ValueError("budget_epsilon and budget_delta go together: give both or neither")
        if self.records_per_device != 1 and not self.require_credentials:
            raise ValueError("records_per_device is enforced per credential: it needs "
                             "require_credentials")
        if self.budget_epsilon is not None:
            if not (math.isfinite(self.budget_epsilon) and self.budget_epsilon >= self.epsilon):
                raise ValueError(f"budget_epsilon={self.budget_epsilon} must be finite and ≥ "
                                 f"epsilon={self.epsilon} (the budget of one round)")
            if not (self.delta <= self.budget_delta < 1.0):
                raise ValueError(f"budget_delta={self.budget_delta} must lie in [delta, 1)")
        if self.two_server is not None:
            if self._read_back():
                # Its calibration (scipy, and a search) is computed, and held to this text, when
                # first used (two_server_calibration): a study list or a follower never pays it.
                return self
            self._fill_two_server()
        try:
            cal = self.calibration
        except CalibrationError as exc:
            raise ValueError(str(exc)) from None
        if self.two_server is not None:
            object.__setattr__(self, "noise", _two_server_noise(self.two_server_calibration))
        if self.noise is None:
            # Filled in once, here, so that a study carries its noise like every other parameter
            # (and equals the same study read back from its text); the model is frozen after.
            object.__setattr__(self, "noise", StudyNoise(std_q=cal.noise_std_q,
                                                          std_p=cal.noise_std_p))
        return self

    def _read_back(self) -> bool:
        """A two-server study read from its text: every encoding field and the noise given. Only
        the encoding's own bound is checked here (n·B·2^f ≤ 2⁶³ − 1)."""
        given = self.two_server
        if self.noise is None or any(getattr(given, name) is None for name in
                                         TWO_SERVER_ENCODING_FIELDS):
            return False
        self._check_encoding_fits(given)
        return True

    def _check_encoding_fits(self, given: TwoServer) -> None:
        if given.fraction_bits is not None and given.clamp_log2 is not None:
            try:
                FixedPoint(d=self.d, n=self.n, fraction_bits=given.fraction_bits,
                           clamp_log2=given.clamp_log2)
            except ValidationError as exc:
                raise ValueError("two_server: " + "; ".join(
                    e["msg"].removeprefix("Value error, ") for e in exc.errors())) from None

    def _fill_two_server(self) -> None:
        """The two_server block's encoding from calibrate_two_server; a given one must match,
        and the encoding must not let a round's sum wrap (n·B·2^f ≤ 2⁶³ − 1)."""
        if self.mode != "rigorous":
            raise ValueError("a two-server study is proven in rigorous mode only "
                             "(docs/privacy.md, \"Two-server mode\")")
        given = self.two_server
        self._check_encoding_fits(given)
        try:
            two = self.two_server_calibration
        except CalibrationError as exc:
            raise ValueError(f"two_server: {exc}") from None
        object.__setattr__(self, "two_server", given.model_copy(update=_encoding_of(two)))

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler):
        # A study without a budget or credentials keeps the exact text it had before those
        # existed (devices and stored studies compare it), so they appear only when set.
        data = handler(self)
        for name, default in OPTIONAL_DEFAULTS.items():
            if name in data and data[name] == default and type(data[name]) is type(default):
                del data[name]
        return data

    @property
    def resolved_delta_in(self) -> float | None:
        """Δ_in after applying the mode's default; None lets the calibration choose it."""
        if self.delta_in is not None or self.mode != "paper":
            return self.delta_in
        return PAPER_DEFAULT_DELTA_IN

    @cached_property
    def two_server_calibration(self) -> TwoServerCalibration | None:
        """A two-server study's calibration (ipdp.two_server.calibrate_two_server: the noise,
        the encoding and the guarantee of what the servers sum); None for a one-server study."""
        if self.two_server is None:
            return None
        from ipdp.two_server import calibrate_two_server

        if self.mode != "rigorous":
            raise CalibrationError("a two-server study is proven in rigorous mode only")
        two = calibrate_two_server(
            epsilon=self.epsilon, delta=self.delta, n=self.n, d=self.d, lam=self.lam,
            p_bound=self.p_bound, eta=self.eta, delta_in=self.delta_in, loss=self.loss)
        given = self.two_server
        wrong = [f"{name}={getattr(given, name)!r}, not {value!r}"
                 for name, value in _encoding_of(two).items()
                 if getattr(given, name) is not None and getattr(given, name) != value]
        noise = _two_server_noise(two)
        if self.noise is not None and self.noise != noise:
            wrong.append(f"noise {self.noise}, not {noise}")
        if wrong:
            raise CalibrationError(f"study {self.study_id!r}: its two_server encoding is not the "
                                   f"calibration's for its parameters ({'; '.join(wrong)}): leave "
                                   "it out and it is filled in")
        return two

    @property
    def encoding(self) -> FixedPoint | None:
        """A two-server study's fixed-point encoding; None for a one-server study."""
        two = self.two_server_calibration
        return None if two is None else two.encoding

    @property
    def mode_text(self) -> str:
        """`one server`, or `two-server, helper NAME at URL, key id …`: what a report names."""
        t = self.two_server
        if t is None:
            return "one server"
        return f"two-server, helper {t.helper_id} at {t.helper_url}, key id {t.key_id}"

    @cached_property
    def calibration(self) -> Calibration:
        """σ_u², σ_b², Δ_in and the guarantees for these parameters (ipdp.calibration).

        A study given its noise (read from its text) keeps it if it is proven: studies created
        before a change of Step 8's rule keep their noise, hence their hash. A two-server study's
        is the one-server part its two_server_calibration keeps (σ_u, Δ_in, γ₁, γ₂); its linear
        noise, encoding and (ε, δ) split are two_server_calibration's.
        """
        if self.two_server_calibration is not None:
            return self.two_server_calibration.one_server
        return calibrate(
            mode=self.mode, epsilon=self.epsilon, delta=self.delta, n=self.n, d=self.d,
            lam=self.lam, p_bound=self.p_bound, eta=self.eta, delta_in=self.resolved_delta_in,
            loss=self.loss,
            noise_std=None if self.noise is None else (self.noise.std_q, self.noise.std_p),
        )

    @cached_property
    def norm_bounds(self) -> RecordNormBounds:
        """The two-sided bounds on ‖q̃‖ and ‖p̃‖ every record must meet (their ``failures``
        say which do not). The first study a process checks imports scipy.stats (about a
        second): a reader computes them when it learns the study, not when the first record
        arrives."""
        return record_norm_bounds(self.calibration)

    @cached_property
    def canonical_text(self) -> str:
        """The signed study JSON: every parameter plus the noise stds a device adds."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=True, allow_nan=False)

    @cached_property
    def round_limit(self) -> int | None:
        """The last round the study may close: max_rounds, or fewer if the budget says so."""
        if self.budget_epsilon is None:
            return self.max_rounds
        from ipdp.accounting import rounds_within_budget

        # Each round's δ is the deployed mechanism's, the norm check's share included.
        within = rounds_within_budget(self.epsilon, self.calibration.delta,
                                      self.budget_epsilon,
                                      self.budget_delta,
                                      limit=self.max_rounds or BUDGET_ROUNDS_COUNTED)
        return max(1, within)

    @cached_property
    def hash(self) -> bytes:
        """The 16-byte study hash carried by every record: SHA-256 of the canonical text."""
        return study_hash(self.canonical_text)

    def to_json(self) -> str:
        """Canonical JSON (the form stored in Redis and on the studies topic)."""
        return self.model_dump_json(exclude_none=False)


def _resolve_schema(data: dict, loss: str) -> dict:
    """d, R and Y from a study's schema (ipdp.schema); a contradicting d, R or Y is refused."""
    try:
        schema = Schema.model_validate(data["schema"])
    except ValidationError as exc:
        errors = exc.errors()
        # A bad feature also fails the length check of the list it was dropped from: say the
        # cause only.
        causes = [e for e in errors if not any(
            len(o["loc"]) > len(e["loc"]) and o["loc"][:len(e["loc"])] == e["loc"]
            for o in errors)]
        raise ValueError("; ".join(
            f"schema.{'.'.join(str(x) for x in e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
            .replace("schema.: ", "schema: ") for e in causes)) from None
    if loss == "logistic" and not schema.target.is_class:
        raise ValueError(f"a logistic study's target is a class label: give target "
                         f"{schema.target.name!r} its two classes, e.g. "
                         f'{{"name": "{schema.target.name}", "classes": ["no", "yes"]}}')
    if loss != "logistic" and schema.target.is_class:
        raise ValueError(f"target {schema.target.name!r} has classes: a class target needs "
                         "loss logistic (squared loss needs a numeric target with min and max)")
    # The schema's encoding puts ‖x‖ ≤ 1 and |y| ≤ 1 by construction (ipdp.schema).
    derived = {"d": schema.d, "x_bound": 1.0} | ({} if loss == "logistic" else {"y_bound": 1.0})
    for name, value in derived.items():
        given = data.get(name)
        if given is not None and given != value:
            raise ValueError(f"{name}={given} contradicts the schema, which gives {name}={value:g}"
                             " (its encoding; docs/privacy.md): leave it out")
    if loss != "logistic" and data.get("eta") is None:
        derived["eta"] = schema_eta(schema.d)
    return data | derived | {"schema": schema}


def signed_bytes(status: StudyStatus | str, study_text: str) -> bytes:
    """What the study owner signs: the domain tag, the status and the canonical study text."""
    return f"{STUDY_SIGNING_TAG}\n{_status(status).value}\n{study_text}".encode()


def study_message(study: Study, status: StudyStatus | str,
                  signing_key: SigningKey | None = None) -> bytes:
    """The studies-topic value (format 2); unsigned (empty key id and signature) without a key."""
    status = _status(status)
    text = study.canonical_text
    kid, signature = ("", "") if signing_key is None else signing_key.sign(
        signed_bytes(status, text))
    return json.dumps({"format": STUDY_MESSAGE_FORMAT, "study": text, "status": status.value,
                       "key_id": kid, "signature": signature},
                      separators=(",", ":")).encode("utf-8")


def parse_study_message(value: bytes, trusted: TrustedKeys | None = None,
                        max_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> tuple[Study, StudyStatus]:
    """Inverse of :func:`study_message`, verified against ``trusted`` when it holds any key.

    Raises :class:`SignatureError` when keys are pinned and the value is unsigned, signed by
    another key, or altered; :class:`MalformedValue` (a ConfigurationError) when it is malformed
    (ipdp.topic_values: over ``max_bytes``, not UTF-8 JSON, too deep, not an object, invalid
    fields), when its noise is not proven for its parameters, or when its text is not exactly the
    canonical text of what it holds. Only the envelope is parsed before the signature verifies;
    the study text is parsed after. Without pinned keys the signature is not checked: the caller
    must say so.
    """
    env = load_json_object(value, "studies-topic value", max_bytes)
    if env.get("format") != STUDY_MESSAGE_FORMAT:
        raise MalformedValue("invalid", f"studies-topic value: format is not "
                             f"{STUDY_MESSAGE_FORMAT}")
    text, status, kid, signature = (env.get(k) for k in ("study", "status", "key_id",
                                                         "signature"))
    if not isinstance(text, str) or status not in [s.value for s in StudyStatus]:
        raise MalformedValue("invalid", "studies-topic value: 'study' is not a string or "
                             "'status' is not open/closed")
    status = StudyStatus(status)
    if trusted:
        trusted.verify(kid or "", signature if isinstance(signature, str) else "",
                       signed_bytes(status, text), f"study message for status {status.value}")
    fields = load_json_object(text, "study text", max_bytes)
    try:
        study = Study.model_validate(fields)
    except ValidationError as exc:
        raise invalid_fields("study text", exc) from None
    except (TypeError, ValueError, ArithmeticError) as exc:  # raised inside a validator
        raise MalformedValue("invalid", f"study text: {type(exc).__name__}") from None
    if study.canonical_text != text:
        raise MalformedValue(
            "invalid", f"study {study.study_id!r}: its text is not the canonical text of its "
            "parameters (not the form this version writes)")
    return study, status


def _status(status: StudyStatus | str) -> StudyStatus:
    try:
        return StudyStatus(status)
    except ValueError:
        raise ConfigurationError(
            f"status must be one of {[s.value for s in StudyStatus]}, got {status!r}") from None
