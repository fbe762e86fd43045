"""A study's schema: the named columns of a raw row, each with its public range.

The schema is a public parameter of the study, like ε or n: it is part of the study's canonical
text, hence of its hash and of the owner's signature. It fixes d (one coordinate per feature, plus
one for the intercept) and the encoding every device applies to its raw row before clipping and
noise (docs/privacy.md, "Encoding a raw row through the schema"):

    u_j = 2·(clip(v_j, min_j, max_j) − min_j) / (max_j − min_j) − 1       ∈ [−1, 1]
    x   = (1, u_1, …, u_k) / √d   with the intercept (d = k + 1), else (u_1, …, u_k) / √d

so ‖x‖ ≤ 1 = R by construction. A numeric target t maps the same way to y ∈ [−1, 1] (|y| ≤ 1 = Y);
a class target maps its first class to y = −1 and its second to y = +1. The map depends on the
public ranges only, never on the data, so the proof and the privacy report are unchanged: a
device clips an encoded row to the same λ and P as before. A raw value outside its range is
clipped to it and counted (:attr:`EncodedRows.clipped`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

__all__ = ["EncodedRows", "Feature", "Schema", "Target"]

#: A study's d is at most 4096 (ipdp.study.Study.d), intercept included.
MAX_FEATURES = 4096


def _check_range(name: str, lo: float, hi: float) -> None:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"{name!r}: min={lo} and max={hi} must be finite numbers")
    if not lo < hi:
        raise ValueError(f"{name!r}: max={hi} must be greater than min={lo}")


class Feature(BaseModel):
    """One named feature and its public range [min, max], in the raw row's units."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    min: float
    max: float

    @model_validator(mode="after")
    def _check(self) -> Feature:
        _check_range(self.name, self.min, self.max)
        return self


class Target(BaseModel):
    """The target column: a number in [min, max] (squared loss) or one of two named classes
    (logistic loss; the first class is y = −1, the second y = +1)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    min: float | None = None
    max: float | None = None
    classes: tuple[str, str] | None = None

    @model_validator(mode="after")
    def _check(self) -> Target:
        numeric = self.min is not None or self.max is not None
        if numeric == (self.classes is not None):
            raise ValueError(f"target {self.name!r}: give either min and max (a number) or "
                             "classes (two class names), not both and not neither")
        if numeric:
            if self.min is None or self.max is None:
                raise ValueError(f"target {self.name!r}: a numeric target needs both min and max")
            _check_range(self.name, self.min, self.max)
        elif self.classes[0] == self.classes[1] or not all(
                c and c == c.strip() for c in self.classes):
            # A device compares its label with the names after stripping its spaces.
            raise ValueError(f"target {self.name!r}: its two classes must be distinct, "
                             f"non-empty names without surrounding spaces, got "
                             f"{list(self.classes)}")
        return self

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):
        # One form or the other appears in the study text, never nulls for the unused one.
        return {k: v for k, v in handler(self).items() if v is not None}

    @property
    def is_class(self) -> bool:
        return self.classes is not None


@dataclass(frozen=True)
class EncodedRows:
    """k raw rows encoded for a study: x (k, d) with ‖x‖ ≤ 1, y (k,), and per column the number
    of values that lay outside their range and were clipped to it."""

    x: np.ndarray
    y: np.ndarray
    clipped: dict[str, int]


class Schema(BaseModel):
    """The features and target of a study's raw rows, with their public ranges."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    features: tuple[Feature, ...] = Field(min_length=1)
    target: Target
    intercept: bool = Field(True, description="Add a constant coordinate: the model gets an "
                            "intercept.")

    @model_validator(mode="after")
    def _check(self) -> Schema:
        names = [f.name for f in self.features]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"feature names must be unique; repeated: {', '.join(repeated)}")
        if self.target.name in names:
            raise ValueError(f"target {self.target.name!r} is also a feature")
        if self.d > MAX_FEATURES:
            raise ValueError(f"{len(names)} features give d={self.d} > {MAX_FEATURES}")
        return self

    @property
    def d(self) -> int:
        """The study's dimension: one coordinate per feature, plus one for the intercept."""
        return len(self.features) + int(self.intercept)

    @property
    def feature_names(self) -> list[str]:
        return [f.name for f in self.features]

    def feature_map(self) -> tuple[np.ndarray, np.ndarray]:
        """(a, c), each (k,): a feature value v in range maps to x_j = a_j·v + c_j (intercept
        coordinate not included), i.e. u_j / √d of the module docstring."""
        lo = np.array([f.min for f in self.features])
        hi = np.array([f.max for f in self.features])
        root_d = math.sqrt(self.d)
        return 2.0 / ((hi - lo) * root_d), -(hi + lo) / ((hi - lo) * root_d)

    def encode(self, columns: Mapping[str, object]) -> EncodedRows:
        """Encode raw rows given as column name → 1-D values (a scalar is one row).

        Feature and numeric target values must be finite numbers; a class target's values must
        be its class names. Raises ValueError naming the first column that is missing or holds
        an unusable value.
        """
        missing = [n for n in (*self.feature_names, self.target.name) if n not in columns]
        if missing:
            raise ValueError(f"row has no column(s) {', '.join(map(repr, missing))}; the "
                             f"schema names {', '.join(map(repr, self.feature_names))} and "
                             f"target {self.target.name!r}")
        clipped: dict[str, int] = {}
        raw = np.column_stack([self._numbers(f.name, columns[f.name]) for f in self.features])
        lo = np.array([f.min for f in self.features])
        hi = np.array([f.max for f in self.features])
        for j, f in enumerate(self.features):
            clipped[f.name] = int(((raw[:, j] < lo[j]) | (raw[:, j] > hi[j])).sum())
        a, c = self.feature_map()
        x = a * np.clip(raw, lo, hi) + c
        if self.intercept:
            x = np.column_stack([np.full(x.shape[0], 1.0 / math.sqrt(self.d)), x])
        y = self._encode_target(columns[self.target.name], clipped)
        if y.shape[0] != x.shape[0]:
            raise ValueError(f"target {self.target.name!r} has {y.shape[0]} value(s) for "
                             f"{x.shape[0]} row(s)")
        return EncodedRows(x=np.ascontiguousarray(x), y=y, clipped=clipped)

    def _encode_target(self, values, clipped: dict[str, int]) -> np.ndarray:
        t = self.target
        if t.is_class:
            labels = np.atleast_1d(np.asarray(values, dtype=object))
            text = np.array([str(v).strip() for v in labels], dtype=object)
            unknown = sorted({v for v in text if v not in t.classes})
            if unknown:
                raise ValueError(f"target {t.name!r}: {unknown[:3]} not among its classes "
                                 f"{list(t.classes)}")
            return np.where(text == t.classes[1], 1.0, -1.0)
        y = self._numbers(t.name, values)
        clipped[t.name] = int(((y < t.min) | (y > t.max)).sum())
        return 2.0 * (np.clip(y, t.min, t.max) - t.min) / (t.max - t.min) - 1.0

    @staticmethod
    def _numbers(name: str, values) -> np.ndarray:
        try:
            v = np.atleast_1d(np.asarray(values, dtype=np.float64))
        except (TypeError, ValueError):
            raise ValueError(f"column {name!r} holds a value that is not a number") from None
        if v.ndim != 1:
            raise ValueError(f"column {name!r} must be 1-D, got shape {v.shape}")
        if not np.isfinite(v).all():
            raise ValueError(f"column {name!r} holds a missing or non-finite value")
        return v

    def target_map(self) -> tuple[float, float]:
        """(mid, half) of a numeric target: a model's encoded prediction ŷ is mid + half·ŷ in the
        target's units."""
        t = self.target
        return (t.max + t.min) / 2.0, (t.max - t.min) / 2.0
