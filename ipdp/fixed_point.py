"""The two-server mode's fixed-point encoding and additive shares (docs/wire-format.md,
"Two-server records"; the proof that covers the rounding is docs/privacy.md, "Two-server mode:
the proof for the fixed-point sums").

A record is the vector of L = d(d+3)/2 values

    v = (M₀₀, M₀₁, …, M₀,d−1, M₁₁, M₁₂, …, M_d−1,d−1,  p̂₀, …, p̂_d−1),   M = q̃q̃ᵀ,

the upper triangle of q̃q̃ᵀ in row-major order followed by the linear term p̂, each as a signed
integer rint(2^f·value) (round half to even) clamped to [−2^(c+f), 2^(c+f)] and stored in the
ring Z_2^64 (two's complement, uint64). B = 2^c is the public range of one entry and f the
fraction bits; f is the largest with n·2^(c+f) ≤ 2⁶³ − 1, so a sum of n clamped records never
leaves the signed range and decodes exactly (Step 13 (clamping and range)).

The device splits v into two additive shares: the helper's is uniform (bytes from the kernel's
CSPRNG, ``os.urandom``; a seeded generator's bytes in tests and simulations only) and the
leader's is v − helper mod 2⁶⁴. Either share alone is uniform and independent of v; the sum of
both, over any set of records, is the sum of their v.

Everything here is vectorised over a leading batch axis: a batch of k records is a (k, L) array.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

RING_BITS = 64
SIGNED_MAX = 2**63 - 1


def entries(d: int) -> int:
    """L = d(d+3)/2: the upper triangle of a d×d matrix plus d linear values."""
    return d * (d + 3) // 2


def triangle_indices(d: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) of the upper triangle in the record's order: row-major, diagonal first in
    each row ((0,0), (0,1), …, (0,d−1), (1,1), …)."""
    return np.triu_indices(d)


FRACTION_BITS_MAX = 62
"""A finer grid gains nothing: an entry is a double (53 significant bits), which a 2⁻⁶² grid
already carries exactly from |value| ≥ 2⁻⁹ on; only studies with a tiny range B reach the cap."""


def fraction_bits_for(n: int, clamp_log2: int) -> int:
    """The largest f ≤ FRACTION_BITS_MAX with n·2^(c+f) ≤ 2⁶³ − 1: a sum of n entries in
    [−2^(c+f), 2^(c+f)] stays in the signed 64-bit range (Step 13 (clamping and range))."""
    return min(FRACTION_BITS_MAX, (SIGNED_MAX // n).bit_length() - 1 - clamp_log2)


class FixedPoint(BaseModel):
    """The public encoding of a two-server study: dimension, fraction bits f, range B = 2^c."""

    model_config = ConfigDict(frozen=True)

    d: int = Field(ge=1, le=1024)
    n: int = Field(ge=1)
    """Records per round: the sum of n clamped records must not wrap."""
    fraction_bits: int = Field(ge=0, le=FRACTION_BITS_MAX)
    """f: a value v is stored as rint(2^f·v)."""
    clamp_log2: int = Field(ge=-62, le=62)
    """c: every entry is clamped to [−B, B], B = 2^c."""

    @model_validator(mode="after")
    def _sum_fits(self) -> FixedPoint:
        if self.fraction_bits + self.clamp_log2 < 0:
            raise ValueError(f"f + c = {self.fraction_bits + self.clamp_log2} must be ≥ 0")
        if self.n * self.limit > SIGNED_MAX:
            raise ValueError(
                f"n·B·2^f = {self.n}·2^{self.clamp_log2}·2^{self.fraction_bits} exceeds 2⁶³ − 1: "
                f"a sum of n records could wrap; use at most "
                f"f = {fraction_bits_for(self.n, self.clamp_log2)} fraction bits")
        return self

    @property
    def entries(self) -> int:
        return entries(self.d)

    @property
    def limit(self) -> int:
        """2^(c+f): the largest |integer| one entry may hold."""
        return 2 ** (self.clamp_log2 + self.fraction_bits)

    @property
    def step(self) -> float:
        """h = 2^−f: the grid of the encoding."""
        return math.ldexp(1.0, -self.fraction_bits)


def encode(q_tilde: np.ndarray, p_hat: np.ndarray, fp: FixedPoint) -> tuple[np.ndarray, int]:
    """(values, clamped): the records' ring elements, (k, L) uint64 (or (L,) for one record), and
    how many entries the clamp changed.

    Each matrix entry is rint(2^f·fl(q̃_i·q̃_j)): the product in double precision (relative error
    ≤ 2⁻⁵³), then round half to even. p̂ must lie on a grid 2^−f_b with f_b ≤ f (ipdp.grid_noise),
    so its entries are exact. Entries beyond ±2^(c+f) are clamped (Step 13).
    """
    q_tilde = np.asarray(q_tilde, dtype=np.float64)
    p_hat = np.asarray(p_hat, dtype=np.float64)
    if q_tilde.shape[-1] != fp.d or p_hat.shape != q_tilde.shape:
        raise ValueError(f"q̃ and p̂ must both have shape (…, {fp.d}), got {q_tilde.shape} and "
                         f"{p_hat.shape}")
    if not (np.isfinite(q_tilde).all() and np.isfinite(p_hat).all()):
        raise ValueError("q̃ and p̂ must be finite")
    rows, cols = triangle_indices(fp.d)
    products = q_tilde[..., rows] * q_tilde[..., cols]
    scaled = np.ldexp(np.concatenate([products, p_hat], axis=-1), fp.fraction_bits)
    rounded = np.rint(scaled)
    limit = float(fp.limit)
    clamped = int(np.count_nonzero(np.abs(rounded) > limit))
    values = np.clip(rounded, -limit, limit).astype(np.int64).view(np.uint64)
    return values, clamped


RandomBytes = Callable[[int], bytes]


def helper_share(shape: tuple[int, ...], random_bytes: RandomBytes = os.urandom) -> np.ndarray:
    """A uniform share: 8 little-endian bytes per entry from ``random_bytes`` (default the
    kernel's CSPRNG; a seeded generator's ``bytes`` in tests and simulations only)."""
    count = math.prod(shape)
    return np.frombuffer(random_bytes(8 * count), dtype="<u8").reshape(shape).astype(np.uint64)


def split(values: np.ndarray, random_bytes: RandomBytes = os.urandom) -> tuple[np.ndarray,
                                                                               np.ndarray]:
    """(leader, helper) shares of uint64 ring elements: helper uniform, leader = v − helper."""
    values = np.asarray(values, dtype=np.uint64)
    helper = helper_share(values.shape, random_bytes)
    return values - helper, helper


def fold(shares: np.ndarray, axis: int = 0) -> np.ndarray:
    """The sum mod 2⁶⁴ of shares along ``axis`` ((k, L) → (L,) by default): what each server
    keeps per round."""
    return np.add.reduce(np.asarray(shares, dtype=np.uint64), axis=axis, dtype=np.uint64)


def combine(leader_sum: np.ndarray, helper_sum: np.ndarray) -> np.ndarray:
    """The round's sum of records mod 2⁶⁴ from the two servers' sums."""
    return np.asarray(leader_sum, dtype=np.uint64) + np.asarray(helper_sum, dtype=np.uint64)


def decode(total: np.ndarray, fp: FixedPoint) -> tuple[np.ndarray, np.ndarray]:
    """(A, b) in float64 from a (…, L) sum: signed interpretation, times 2^−f, A symmetrised."""
    total = np.asarray(total, dtype=np.uint64)
    if total.shape[-1] != fp.entries:
        raise ValueError(f"a sum must have {fp.entries} entries at d={fp.d}, got {total.shape}")
    signed = np.ldexp(total.view(np.int64).astype(np.float64), -fp.fraction_bits)
    d = fp.d
    rows, cols = triangle_indices(d)
    tri = entries(d) - d
    a = np.zeros((*total.shape[:-1], d, d))
    a[..., rows, cols] = signed[..., :tri]
    a[..., cols, rows] = signed[..., :tri]
    return a, signed[..., tri:]
