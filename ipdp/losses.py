"""Quadratic-loss encodings, public clipping and the contributor's perturbation.

ℓ(w; x, y) = ½ wᵀ q qᵀ w − pᵀ w + s (paper §3.1). Every function takes one example (x of shape
(d,)) or many (x of shape (k, d)) and is vectorised over the leading axis.
"""

from __future__ import annotations

import numpy as np

from ipdp.calibration import Calibration
from ipdp.noise import NoiseSource, SystemNoise


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

    ``noise`` defaults to the OS's CSPRNG (:class:`ipdp.noise.SystemNoise`); a seeded
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
