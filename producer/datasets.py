"""Example data for the device simulator: a synthetic generator and two CSV loaders.

A study with a schema reads its CSV through the schema (:func:`from_csv_schema`): each row is
encoded by the public ranges alone, as a real device encodes its own row. A study without one
gets :func:`from_csv`, the simulator's scaling computed from the whole file. Synthetic data and
:func:`from_csv` honour the public bounds of a default study (λ = P = η = 1): ‖x‖ ≤ 1, |y| ≤ 1 and, for
synthetic data, ‖w_true‖ ≤ 1. The contributor still clips; these just keep clipping inactive so
that a fit recovers the data's own model.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ipdp.schema import Schema

__all__ = ["Dataset", "from_csv", "from_csv_schema", "synthetic", "synthetic_batches",
           "train_test_split"]

#: Standard deviation of the additive noise on y (squared loss), in y's units.
SQUARED_NOISE = 0.05
#: Standard deviation of the latent noise behind the labels (logistic loss), relative to the
#: spread of xᵀw*: about 8% of labels disagree with sign(xᵀw*) (arctan(0.25)/π).
LOGISTIC_NOISE = 0.25


@dataclass
class Dataset:
    """Examples x (k, d), targets y (k,), and the generating model when known."""

    x: np.ndarray
    y: np.ndarray
    w_true: np.ndarray | None = None
    feature_names: list[str] | None = None
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.x.shape[0])

    @property
    def d(self) -> int:
        return int(self.x.shape[1])


def _check_loss(loss: str) -> None:
    if loss not in ("squared", "logistic"):
        raise ValueError(f"unknown loss {loss!r}; expected 'squared' or 'logistic'")


def true_model(d: int, rng: np.random.Generator) -> np.ndarray:
    """A random direction of norm 1 (= η): the generating model."""
    w = rng.standard_normal(d)
    return w / np.linalg.norm(w)


def _sample(n: int, w: np.ndarray, loss: str, rng: np.random.Generator) -> tuple[np.ndarray,
                                                                                   np.ndarray]:
    d = w.shape[0]
    # Rows ~ N(0, I/d): ‖x‖ ≈ 1, so xᵀw* has spread 1/√d; the few rows past 1 are scaled back.
    x = rng.standard_normal((n, d)) / np.sqrt(d)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    x /= np.maximum(norms, 1.0)
    s = x @ w
    if loss == "squared":
        y = np.clip(s + rng.normal(0.0, SQUARED_NOISE, n), -1.0, 1.0)
    else:
        latent = s + rng.normal(0.0, LOGISTIC_NOISE / np.sqrt(d), n)
        y = np.where(latent >= 0.0, 1.0, -1.0)
    return x, y


def synthetic(n: int, d: int, loss: str, seed: int | None = None,
              w_true: np.ndarray | None = None) -> Dataset:
    """n examples from a linear model w* (‖w*‖ = 1) with ‖x‖ ≤ 1 and |y| ≤ 1.

    x ~ N(0, I/d) with rows longer than 1 scaled to 1, so xᵀw* spreads over ≈ ±2/√d.
    squared:  y = clip(xᵀw* + N(0, 0.05²), −1, 1).
    logistic: y = sign(xᵀw* + N(0, (0.25/√d)²)) ∈ {−1, +1} (≈ 8% of labels disagree with w*).
    """
    _check_loss(loss)
    if n < 1 or d < 1:
        raise ValueError(f"n and d must be ≥ 1, got n={n}, d={d}")
    rng = np.random.default_rng(seed)
    w = true_model(d, rng) if w_true is None else np.asarray(w_true, dtype=np.float64)
    x, y = _sample(n, w, loss, rng)
    return Dataset(x=x, y=y, w_true=w, meta={"source": "synthetic", "loss": loss})


def synthetic_batches(n: int, d: int, loss: str, batch: int, seed: int | None = None,
                      ) -> tuple[np.ndarray, Iterator[tuple[np.ndarray, np.ndarray]]]:
    """(w*, iterator of (x, y) batches totalling n) — the synthetic model without holding all n
    rows in memory (the load generator's source for millions of devices)."""
    _check_loss(loss)
    rng = np.random.default_rng(seed)
    w = true_model(d, rng)

    def gen() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        left = n
        while left > 0:
            k = min(batch, left)
            yield _sample(k, w, loss, rng)
            left -= k

    return w, gen()


def _read_header(path: Path, delimiter: str) -> list[str]:
    with open(path, newline="", encoding="utf-8-sig") as f:
        row = next(csv.reader(f, delimiter=delimiter), None)
    if not row:
        raise ValueError(f"{path}: empty file, expected a header row")
    return [c.strip() for c in row]


def from_csv(path: str | Path, target: str, loss: str, *, features: list[str] | None = None,
             delimiter: str = ",", drop_nonfinite: bool = True) -> Dataset:
    """Load a numeric CSV (header row) and scale it into the public bounds.

    This is the *simulator's* preprocessing, computed from the whole file — a real deployment
    cannot do this (the bounds are public and each device clips on its own):
    - x: every row divided by the largest row norm in the file, so ‖x‖ ≤ 1;
    - y, squared loss: mapped affinely from [min, max] onto [−1, 1];
    - y, logistic loss: +1 above the median, −1 at or below it.
    Columns are ``features`` (default: every column but ``target``). Rows with a missing or
    non-numeric value are dropped (``drop_nonfinite``) or refused.
    """
    _check_loss(loss)
    path = Path(path)
    header = _read_header(path, delimiter)
    if target not in header:
        raise ValueError(f"{path}: no column {target!r}; columns: {', '.join(header)}")
    features = [c for c in header if c != target] if features is None else list(features)
    missing = [c for c in features if c not in header]
    if missing:
        raise ValueError(f"{path}: no column(s) {', '.join(missing)}")
    if not features:
        raise ValueError(f"{path}: no feature columns besides {target!r}")
    cols = [header.index(c) for c in features] + [header.index(target)]
    data = np.genfromtxt(path, delimiter=delimiter, skip_header=1, usecols=cols,
                         dtype=np.float64, encoding="utf-8", ndmin=2)
    finite = np.isfinite(data).all(axis=1)
    dropped = int((~finite).sum())
    if dropped and not drop_nonfinite:
        raise ValueError(f"{path}: {dropped} row(s) hold missing or non-numeric values")
    data = data[finite]
    if data.shape[0] < 2:
        raise ValueError(f"{path}: fewer than 2 usable rows")
    x, y_raw = data[:, :-1], data[:, -1]
    max_norm = float(np.linalg.norm(x, axis=1).max())
    x = x / max_norm if max_norm > 0 else x
    meta: dict = {"source": str(path), "loss": loss, "target": target, "x_scale": max_norm,
                  "rows_dropped": dropped}
    if loss == "squared":
        lo, hi = float(y_raw.min()), float(y_raw.max())
        y = 2.0 * (y_raw - lo) / (hi - lo) - 1.0 if hi > lo else np.zeros_like(y_raw)
        meta.update(y_min=lo, y_max=hi)
    else:
        med = float(np.median(y_raw))
        y = np.where(y_raw > med, 1.0, -1.0)
        meta.update(y_threshold=med)
    return Dataset(x=np.ascontiguousarray(x), y=y, feature_names=features, meta=meta)


def from_csv_schema(path: str | Path, schema: Schema, *, delimiter: str = ",") -> Dataset:
    """Read the schema's columns by name from a CSV with a header row, and encode each row
    through the schema's public ranges (ipdp.schema), as the row's own device would.

    A row whose feature or numeric target is empty or not a number, or whose class target is
    not one of its classes, is skipped; a file with no row left names the columns that hold
    text where the schema reads numbers, or labels that are not its classes. ``meta`` holds
    ``clipped`` (per column, the values outside their range, clipped to it), ``outside`` (per
    numeric column, which rows lie outside its range, for counting the rows actually sent) and
    ``rows_skipped``.
    """
    path = Path(path)
    header = _read_header(path, delimiter)
    names = [*schema.feature_names, schema.target.name]
    missing = [c for c in names if c not in header]
    if missing:
        raise ValueError(f"{path}: no column(s) {', '.join(missing)} that the study's schema "
                         f"names; columns: {', '.join(header)}")
    cols = [header.index(c) for c in names]
    numbers, labels, skipped = [], [], 0
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f, delimiter=delimiter)
        next(reader)
        for row in reader:
            if not row:
                continue
            try:
                cells = [row[i].strip() for i in cols]
                values = [float(v) for v in cells[:-1]]
                target = cells[-1] if schema.target.is_class else float(cells[-1])
            except (IndexError, ValueError):
                skipped += 1
                continue
            if not np.isfinite(values).all() or (
                    schema.target.is_class and target not in schema.target.classes) or (
                    not schema.target.is_class and not np.isfinite(target)):
                skipped += 1
                continue
            numbers.append(values)
            labels.append(target)
    if not numbers:
        from ipdp.schema_check import check_csv

        why = "; ".join(check_csv(path, schema, delimiter=delimiter).problems)
        raise ValueError(f"{path}: no usable row ({skipped} skipped)" + (f": {why}" if why else ""))
    raw = np.array(numbers, dtype=np.float64)
    columns: dict[str, object] = {n: raw[:, j] for j, n in enumerate(schema.feature_names)}
    columns[schema.target.name] = labels
    encoded = schema.encode(columns)
    lo, hi = (np.array([f.min for f in schema.features]), np.array([f.max for f in schema.features]))
    outside = {n: (raw[:, j] < lo[j]) | (raw[:, j] > hi[j])
               for j, n in enumerate(schema.feature_names)}
    if not schema.target.is_class:
        y_raw = np.array(labels, dtype=np.float64)
        outside[schema.target.name] = (y_raw < schema.target.min) | (y_raw > schema.target.max)
    return Dataset(x=encoded.x, y=encoded.y, feature_names=schema.feature_names,
                   meta={"source": str(path), "clipped": encoded.clipped, "outside": outside,
                         "rows_skipped": skipped})


def train_test_split(ds: Dataset, test_fraction: float = 0.2, seed: int | None = None,
                     ) -> tuple[Dataset, Dataset]:
    """A random (train, test) partition; the test part has round(test_fraction·k) rows."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    k = len(ds)
    n_test = round(test_fraction * k)
    if n_test < 1 or n_test >= k:
        raise ValueError(f"cannot split {k} rows with test_fraction={test_fraction}")
    perm = np.random.default_rng(seed).permutation(k)
    test_idx, train_idx = perm[:n_test], perm[n_test:]

    def part(idx: np.ndarray) -> Dataset:
        return Dataset(x=ds.x[idx], y=ds.y[idx], w_true=ds.w_true,
                       feature_names=ds.feature_names, meta=dict(ds.meta))

    return part(train_idx), part(test_idx)
