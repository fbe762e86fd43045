"""A published model of a study with a schema, loaded to predict in raw units.

``ipdp models --study S --export model.json`` writes the newest verified model message (its
weights, its schema and its privacy report) as JSON; :func:`load_model` reads it back::

    from ipdp import load_model
    m = load_model("model.json")
    m.predict({"age": [25, 31], "income": [41_000, 58_000]})   # in the target's units

The weights w live in the schema's encoded space (ipdp.schema): x_j = a_j·v_j + c_j, plus the
intercept coordinate 1/√d, and a numeric target is t = mid + half·ŷ with ŷ = wᵀx. Substituting
gives a linear model in raw units,

    t̂ = intercept_ + Σ_j coef_j·v_j,   coef_j = half·w_j·a_j,
    intercept_ = mid + half·(w_0/√d + Σ_j w_j·c_j)        (w_0 = 0 without an intercept),

and for a logistic study the same with mid = 0, half = 1 gives the log-odds of the second class.
Prediction does not clip: a value outside its range is extrapolated along the same line.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from ipdp.errors import ConfigurationError
from ipdp.model_message import ModelMessage, PrivacyReport, parse_model_value
from ipdp.schema import Schema
from ipdp.signing import TrustedKeys, parse_trusted_keys

__all__ = ["Model", "load_model"]


class Model:
    """A linear model in raw units, from a published model message of a study with a schema.

    ``coef_`` (k,) and ``intercept_`` are in the target's units per feature unit (log-odds of
    the second class for a logistic study); ``feature_names`` are the schema's, in order.
    """

    def __init__(self, message: ModelMessage) -> None:
        schema = message.schema_
        if schema is None:
            raise ConfigurationError(
                f"the model of study {message.study_id!r} round {message.round} has no schema: "
                "its weights are in the encoded space the devices used, with no map back to raw "
                "units (create the study with --schema)")
        self.message = message
        self.schema: Schema = schema
        self.feature_names: list[str] = schema.feature_names
        self.target_name: str = schema.target.name
        self.classes: tuple[str, str] | None = schema.target.classes
        w = np.asarray(message.weights, dtype=np.float64)
        a, c = schema.feature_map()
        w0, wf = (w[0], w[1:]) if schema.intercept else (0.0, w)
        mid, half = (0.0, 1.0) if schema.target.is_class else schema.target_map()
        self.coef_: np.ndarray = half * wf * a
        self.intercept_: float = float(mid + half * (w0 / math.sqrt(schema.d) + wf @ c))

    @property
    def privacy(self) -> PrivacyReport:
        """What the model guarantees (central ε, δ, the calibration): ipdp.model_message."""
        return self.message.privacy

    @property
    def constraint_active(self) -> bool:
        """True when the trainer's solution lies on ‖w‖ = η: the constraint held the fit back,
        and a study with a larger η may fit better, at more noise per record
        (docs/operations.md, "A binding norm constraint")."""
        return self.message.constraint_active

    @property
    def study_id(self) -> str:
        return self.message.study_id

    @property
    def round(self) -> int:
        return self.message.round

    def _matrix(self, X) -> np.ndarray:
        """(k, features) from a 2-D array in schema order or a mapping column name → 1-D."""
        if isinstance(X, Mapping) or hasattr(X, "keys"):  # a dict, or a pandas DataFrame
            missing = [n for n in self.feature_names if n not in X]
            if missing:
                raise KeyError(f"no column(s) {', '.join(map(repr, missing))}; the model "
                               f"needs {', '.join(map(repr, self.feature_names))}")
            return np.column_stack([np.asarray(X[n], dtype=np.float64).reshape(-1)
                                    for n in self.feature_names])
        m = np.asarray(X, dtype=np.float64)
        if m.ndim != 2 or m.shape[1] != len(self.feature_names):
            raise ValueError(f"X must have shape (k, {len(self.feature_names)}) with columns "
                             f"{self.feature_names}, got {m.shape}")
        return m

    def decision_function(self, X) -> np.ndarray:
        """intercept_ + X·coef_, (k,): the prediction of a numeric target, the log-odds of the
        second class of a class target."""
        return self._matrix(X) @ self.coef_ + self.intercept_

    def predict(self, X) -> np.ndarray:
        """The target in its raw units (k,); for a class target, the more likely class name."""
        score = self.decision_function(X)
        if self.classes is None:
            return score
        return np.where(score >= 0.0, self.classes[1], self.classes[0])

    def predict_proba(self, X) -> np.ndarray:
        """(k, 2): the probability of each class, in the order of ``classes`` (class target
        only): σ(score) for the second class."""
        if self.classes is None:
            raise AttributeError(f"target {self.target_name!r} is a number: predict_proba is "
                                 "for a class target (a logistic study)")
        p1 = 1.0 / (1.0 + np.exp(-self.decision_function(X)))
        return np.column_stack([1.0 - p1, p1])

    def __repr__(self) -> str:
        return (f"Model(study={self.study_id!r}, round={self.round}, "
                f"features={self.feature_names}, target={self.target_name!r})")


def load_model(path: str | os.PathLike,
               trusted_keys: TrustedKeys | str | Iterable[str] | None = None) -> Model:
    """The model ``ipdp models --export PATH`` wrote: a :class:`Model` in raw units.

    The file is the models-topic value, the trainer's signed envelope when it signs.
    ``trusted_keys`` (trainer public keys: ``.pub`` paths or base64 lines) verifies the signature
    again and raises :class:`ipdp.errors.SignatureError` unless one of them signed it; without
    keys the file is believed as it is.
    """
    try:
        value = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigurationError(f"cannot read model {str(path)!r}: {exc}") from None
    if trusted_keys is not None and not isinstance(trusted_keys, TrustedKeys):
        trusted_keys = parse_trusted_keys(trusted_keys)
    return Model(parse_model_value(value, trusted_keys))
