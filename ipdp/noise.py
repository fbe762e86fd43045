"""Where a device's Gaussian noise comes from: the OS's CSPRNG for real contributions.

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

__all__ = ["NoiseSource", "SystemNoise"]

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

    def standard_normal(self, count: int) -> np.ndarray:
        """``count`` independent N(0, 1) draws, shape (count,)."""
        pairs = (count + 1) // 2
        words = np.frombuffer(os.urandom(16 * pairs), dtype="<u8").reshape(pairs, 2) >> 11
        u1 = (words[:, 0] + 1).astype(np.float64) * _TWO_POW_MINUS_53
        u2 = words[:, 1].astype(np.float64) * _TWO_POW_MINUS_53
        radius = np.sqrt(-2.0 * np.log(u1))
        angle = 2.0 * math.pi * u2
        return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]

    def normal(self, loc: float = 0.0, scale: float = 1.0, size=None) -> np.ndarray:
        """N(loc, scale²) draws of shape ``size`` (numpy's signature; ``size=None``: one draw)."""
        shape = () if size is None else tuple(np.atleast_1d(size).tolist())
        z = self.standard_normal(math.prod(shape)).reshape(shape)
        return loc + scale * z
