"""Quadratic-loss encodings, public clipping and the contributor's perturbation, with the noise
it draws.

ℓ(w; x, y) = ½ wᵀ q qᵀ w − pᵀ w + s (paper §3.1). Every function takes one example (x of shape
(d,)) or many (x of shape (k, d)) and is vectorised over the leading axis.

A noise source is anything with numpy's ``normal(loc, scale, size)``. Two kinds exist, on purpose
in separate code paths:

* :class:`SystemNoise` — the contributor SDK's default. Standard normals by Box–Muller on 53-bit
  uniforms from ``os.urandom`` (the kernel's CSPRNG), vectorised with numpy: the same method as
  the browser SDK's ``crypto.getRandomValues`` draw (producer/web/README.md, "The noise"). Whoever
  can predict a device's noise can subtract it, so a device's noise must be unpredictable, not
  merely well distributed; PCG64's state is recoverable from its output.
* ``numpy.random.Generator`` (PCG64) — the simulator's (load generator, benchmarks, tests): fast
  and seedable, for simulated devices only.
"""

from __future__ import annotations

import math
import os
from typing import Protocol

import numpy as np

from ipdp.calibration import Calibration

_TWO_POW_MINUS_53 = 2.0**-53


class NoiseSource(Protocol):
    """numpy's ``Generator.normal`` signature: N(loc, scale²) draws of shape ``size``."""

    def normal(self, loc: float = 0.0, scale: float = 1.0, size=None) -> np.ndarray: ...


class SystemNoise:
    """Gaussian draws from the operating system's CSPRNG (``os.urandom``), Box–Muller.

    Each pair of normals takes two 64-bit words; each word's top 53 bits k give
    U₁ = (k₁ + 1)/2⁵³ ∈ (0, 1] (never 0, so the log is finite) and U₂ = k₂/2⁵³ ∈ [0, 1).
    Z₁ = √(−2 ln U₁)·cos 2πU₂ and Z₂ = √(−2 ln U₁)·sin 2πU₂ are independent N(0, 1); the 2⁻⁵³
    grid bounds |Z| by √(106 ln 2) ≈ 8.57 (the tail beyond has probability below 10⁻¹⁷).
    No state, nothing to seed: every call reads fresh bytes from the kernel.
    """

    def normal(self, loc: float = 0.0, scale: float = 1.0, size=None) -> np.ndarray:
        """N(loc, scale²) draws of shape ``size`` (numpy's signature; ``size=None``: one draw)."""
        shape = () if size is None else tuple(np.atleast_1d(size).tolist())
        count = math.prod(shape)
        pairs = (count + 1) // 2
        words = np.frombuffer(os.urandom(16 * pairs), dtype="<u8").reshape(pairs, 2) >> 11
        u1 = (words[:, 0] + 1).astype(np.float64) * _TWO_POW_MINUS_53
        u2 = words[:, 1].astype(np.float64) * _TWO_POW_MINUS_53
        radius = np.sqrt(-2.0 * np.log(u1))
        angle = 2.0 * math.pi * u2
        z = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]
        return loc + scale * z.reshape(shape)


def encode(loss: str, x: np.ndarray, y: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
    """(q, p) for one or many examples.

    squared:  q = x,   p = y·x          (linear regression)
    logistic: q = x/2, p = y·x/2        (second-order Taylor expansion at w = 0, y ∈ {−1, +1})
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.ndim not in (1, 2):
        raise ValueError(f"x must have shape (d,) or (k, d), got {x.shape}")
    if y.shape != x.shape[:-1]:
        raise ValueError(f"y must have shape {x.shape[:-1]}, got {y.shape}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("x and y must be finite")
    if loss == "squared":
        return x.copy(), y[..., None] * x
    if loss == "logistic":
        if not np.isin(y, (-1.0, 1.0)).all():
            raise ValueError("logistic loss needs labels y ∈ {−1, +1}")
        return x / 2.0, y[..., None] * x / 2.0
    raise ValueError(f"unknown loss {loss!r}; expected 'squared' or 'logistic'")


def clip_rows(v: np.ndarray, bound: float) -> np.ndarray:
    """Scale each row down to ‖row‖ ≤ bound; rows inside the ball are returned unchanged."""
    norms = np.linalg.norm(v, axis=-1, keepdims=True)
    scale = np.minimum(1.0, bound / np.maximum(norms, np.finfo(np.float64).tiny))
    return v * scale


def clip(q: np.ndarray, p: np.ndarray, lam: float, p_bound: float) -> tuple[np.ndarray, np.ndarray]:
    """Public, data-independent clipping to ‖q‖² ≤ λ and ‖p‖ ≤ P (the bounds behind ζ = λη + P)."""
    return clip_rows(q, np.sqrt(lam)), clip_rows(p, p_bound)


def perturb(
    q: np.ndarray, p: np.ndarray, cal: Calibration, noise: NoiseSource | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """q̃ = q + u, p̃ = p − r with u ~ N(0, σ_u²/n·I), r ~ N(0, σ_b²/n·I) (Algorithm 1, lines 3–5).

    ``noise`` defaults to the OS's CSPRNG (:class:`SystemNoise`); a seeded
    ``numpy.random.Generator`` is for simulated devices and tests only.
    """
    noise = SystemNoise() if noise is None else noise
    u = noise.normal(0.0, cal.noise_std_q, size=q.shape)
    r = noise.normal(0.0, cal.noise_std_p, size=p.shape)
    return q + u, p - r


def prepare(
    loss: str, x: np.ndarray, y: np.ndarray | float, cal: Calibration,
    noise: NoiseSource | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """encode → clip → perturb: everything a device does before a record leaves it."""
    q, p = encode(loss, x, y)
    q, p = clip(q, p, cal.lam, cal.p_bound)
    return perturb(q, p, cal, noise)
