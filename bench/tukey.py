"""TukeyEM: the exponential mechanism over the approximate Tukey depth of m non-private models.

Amin, Joseph, Ribero & Vassilvitskii, "Easy Differentially Private Linear Regression", ICLR 2023
(arXiv 2208.07353), Algorithm 1, implemented from the paper; each step names its section:

1. **m disjoint OLS models** (§3, Algorithm 1, line 1): the rows are split into m blocks of equal
   size and ordinary least squares is fitted on each. Replacing one record changes one model.
2. **Approximate Tukey depth** (§3.1, Definition 3.1): the depth of y among the models along the
   d coordinate axes only, T(y) = min_j min(#{i: β_ij ≤ y_j}, #{i: β_ij ≥ y_j}). Its region of
   depth ≥ s is a box, ∏_j [β_(s),j, β_(m−s+1),j] with β_(k),j the k-th smallest j-th coordinate,
   so its volume V_s is a product of widths (§3.2, "volumes").
3. **Propose-test-release** (§3.3, Lemma 3.5, after Brown et al. 2021): k̂ is the largest k < t
   such that some g ≥ 1 has V_{t−k−1}·e^{−ε_EM·g/2} / V_{t+k+g+1} ≤ δ/(8·e^{ε_EM}), so every
   data set within k replacements is "safe" for the restricted mechanism; t = ⌊⌊m/2⌋/2⌋. The
   test passes when k̂ + Lap(1/ε_PTR) > log(1/(2δ))/ε_PTR; otherwise TukeyEM returns **no
   model**.
4. **Restricted exponential mechanism** (§3.2, §3.3): a depth s ∈ [t, ⌊m/2⌋] with probability
   ∝ (V_s − V_{s+1})·exp(ε_EM·s/2), then a point uniform on the region of depth exactly s (the
   box of depth s less the box of depth s + 1, split by the first coordinate that leaves the
   inner box).

The budget is split ε_PTR = ε_EM = ε/2 (§3.3, Theorem 3.6: (ε, δ)-DP). Two choices where the
authors' released code (google-research/dp_regression) reads differently, both towards more
noise:
- the density is exp(ε_EM·T/2), the exponential mechanism for a utility of sensitivity 1 (one
  model moves every depth by at most 1), the density whose mass the safety condition's
  e^{−ε_EM·g/2} compares; the code samples exp(ε_EM·T), which by the textbook argument can
  move probabilities by e^{2ε_EM} = e^ε on its own, before the test's ε/2;
- the test's Laplace noise has scale 1/ε_PTR: the threshold log(1/(2δ))/ε_PTR is exceeded by
  Lap(1/ε_PTR) with probability exactly δ, which is what the test's privacy rests on; the code
  draws scale ε_PTR (0.5 at ε = 1, against 2).
`tests/bench/test_tukey.py` audits the whole release (the test's outcome and the sampled
point) exactly on small one- and two-dimensional instances, from the :class:`TukeyPlan` that
:func:`tukey_em` draws from, and checks by sampling that the draws follow the plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def block_models(x: np.ndarray, y: np.ndarray, m: int) -> np.ndarray:
    """(m, d): OLS on each of m disjoint consecutive blocks of ⌊n/m⌋ rows (step 1).

    The benchmark's rows are i.i.d. in order, so consecutive blocks are a random partition.
    """
    n, d = x.shape
    size = n // m
    if size < d:
        raise ValueError(f"{m} models need {m * d} rows at d = {d}, got {n}")
    xb = x[: m * size].reshape(m, size, d)
    yb = y[: m * size].reshape(m, size)
    gram = np.einsum("mbi,mbj->mij", xb, xb)
    lin = np.einsum("mbi,mb->mi", xb, yb)
    try:
        return np.linalg.solve(gram, lin[..., None])[..., 0]
    except np.linalg.LinAlgError:
        # A block whose Gram matrix is singular: each block's minimum-norm least squares.
        return np.stack([np.linalg.lstsq(g, v, rcond=None)[0]
                         for g, v in zip(gram, lin, strict=True)])


def sorted_coordinates(models: np.ndarray) -> np.ndarray:
    """(d, m): each coordinate of the models, sorted increasingly (step 2)."""
    return np.sort(models.T, axis=1)


def depth(coords: np.ndarray, y: np.ndarray) -> int:
    """Approximate Tukey depth of y among the models whose sorted coordinates are `coords`."""
    below = (coords <= y[:, None]).sum(axis=1)
    above = (coords >= y[:, None]).sum(axis=1)
    return int(np.minimum(below, above).min())


def log_volumes(coords: np.ndarray) -> np.ndarray:
    """log V_s for s = 1 … ⌊m/2⌋, V_s the volume of the box of depth ≥ s (−inf when empty)."""
    m = coords.shape[1]
    top = m // 2
    widths = coords[:, ::-1][:, :top] - coords[:, :top]  # β_(m−s+1) − β_(s), s = 1 … top
    with np.errstate(divide="ignore"):
        return np.log(np.maximum(widths, 0.0)).sum(axis=0)


def safe_distance(log_v: np.ndarray, epsilon_em: float, delta: float, t: int) -> int:
    """k̂ of step 3: the largest k ∈ {0, …, t − 1} such that the safety condition holds for
    every k′ ≤ k, else −1.

    With L_s = log V_s, the condition at k is min_{g ≥ 1} L_{t−k−1} − L_{t+k+g+1} − ε_EM·g/2 ≤
    log(δ/(8e^{ε_EM})); writing s = t + k + g + 1, the minimum over g is
    ε_EM·(t + k + 1)/2 + min_{s ≥ t+k+2} (−L_s − ε_EM·s/2), a suffix minimum computed once, so
    every k costs O(1) (m is up to 10⁵ models in the benchmark).
    """
    top = len(log_v)
    threshold = math.log(delta / (8.0 * math.exp(epsilon_em)))
    s = np.arange(1, top + 1)
    suffix = np.minimum.accumulate((-log_v - epsilon_em * s / 2.0)[::-1])[::-1]
    k = np.arange(t)
    ok = (t - k - 1 >= 1) & (t + k + 2 <= top)
    k = k[ok]
    if len(k) == 0:
        return -1
    lhs = (log_v[t - k - 2] + epsilon_em * (t + k + 1) / 2.0 + suffix[t + k + 1])
    holds = lhs <= threshold
    if holds.all():
        return int(k[-1])
    first_failure = int(np.argmin(holds))
    return int(k[first_failure - 1]) if first_failure > 0 else -1


def depth_weights(log_v: np.ndarray, epsilon_em: float, t: int) -> tuple[np.ndarray, np.ndarray]:
    """Depths s = t … ⌊m/2⌋ and their log mass log((V_s − V_{s+1})·exp(ε_EM·s/2)) (step 4)."""
    v = np.exp(log_v - np.max(log_v[t - 1:]))  # rescaled: only ratios matter
    shell = v[t - 1:] - np.append(v[t:], 0.0)
    depths = np.arange(t, len(log_v) + 1)
    with np.errstate(divide="ignore"):
        return depths, np.log(np.maximum(shell, 0.0)) + epsilon_em * depths / 2.0


def sample_at_depth(coords: np.ndarray, s: int, rng: np.random.Generator) -> np.ndarray:
    """A point uniform on the region of depth exactly s: the box of depth ≥ s less the box of
    depth ≥ s + 1, each point placed by the first coordinate j at which it leaves the inner box
    (coordinates before j inside the inner interval, j outside it, after j anywhere in the
    outer one)."""
    d, m = coords.shape
    lo_out, hi_out = coords[:, s - 1], coords[:, m - s]
    if 2 * (s + 1) <= m + 1:
        lo_in, hi_in = coords[:, s], coords[:, m - s - 1]
    else:  # no depth s + 1: the inner box is empty
        lo_in = hi_in = np.full(d, np.nan)
    outer = hi_out - lo_out
    inner = np.where(np.isnan(lo_in), 0.0, hi_in - lo_in)
    ring = outer - inner
    with np.errstate(divide="ignore"):
        log_in, log_out, log_ring = np.log(inner), np.log(outer), np.log(ring)
    before = np.concatenate([[0.0], np.cumsum(log_in)[:-1]])
    after = np.concatenate([np.cumsum(log_out[::-1])[::-1][1:], [0.0]])
    j = _racing(before + log_ring + after, rng)
    y = np.empty(d)
    y[:j] = rng.uniform(lo_in[:j], hi_in[:j])
    y[j + 1:] = rng.uniform(lo_out[j + 1:], hi_out[j + 1:])
    left, right = lo_in[j] - lo_out[j], hi_out[j] - hi_in[j]
    if np.isnan(left):
        y[j] = rng.uniform(lo_out[j], hi_out[j])
    elif rng.uniform() * (left + right) < left:
        y[j] = rng.uniform(lo_out[j], lo_in[j])
    else:
        y[j] = rng.uniform(hi_in[j], hi_out[j])
    return y


def _racing(log_weights: np.ndarray, rng: np.random.Generator) -> int:
    """An index drawn with probability ∝ exp(log_weights) (Gumbel-max; −inf never drawn)."""
    return int(np.argmax(log_weights + rng.gumbel(size=len(log_weights))))


@dataclass(frozen=True)
class TukeyPlan:
    """Everything TukeyEM settles before its first draw: the test's k̂, threshold and Laplace
    scale (step 3), the depths and their log mass (step 4). The exact audit
    (tests/bench/test_tukey.py) reads the law of the release from this, the object
    :func:`tukey_em` draws from."""

    coords: np.ndarray
    k_hat: int
    threshold: float
    """log(1/(2δ))/ε_PTR: the test passes when k̂ + Lap(laplace_scale) exceeds it."""
    laplace_scale: float
    depths: np.ndarray
    log_mass: np.ndarray

    def release(self, rng: np.random.Generator) -> np.ndarray | None:
        """One run of the test, then of the restricted exponential mechanism if it passes."""
        if self.k_hat + rng.laplace(scale=self.laplace_scale) <= self.threshold:
            return None
        return sample_at_depth(self.coords, int(self.depths[_racing(self.log_mass, rng)]), rng)


def tukey_plan(models: np.ndarray, *, epsilon: float, delta: float) -> TukeyPlan | None:
    """Steps 2–4 up to the draws, with ε_PTR = ε_EM = ε/2; None when m < 4 leaves no depth
    t ≥ 1 to test."""
    m = len(models)
    coords = sorted_coordinates(models)
    log_v = log_volumes(coords)
    t = (m // 2) // 2
    eps_ptr = eps_em = epsilon / 2.0
    if t < 1:
        return None
    depths, log_mass = depth_weights(log_v, eps_em, t)
    return TukeyPlan(coords, k_hat=safe_distance(log_v, eps_em, delta, t),
                     threshold=math.log(1.0 / (2.0 * delta)) / eps_ptr,
                     laplace_scale=1.0 / eps_ptr, depths=depths, log_mass=log_mass)


def tukey_em(models: np.ndarray, *, epsilon: float, delta: float,
             rng: np.random.Generator) -> np.ndarray | None:
    """Algorithm 1 on the m models: a model, or None when the propose-test-release check fails.

    (ε, δ)-DP for replacing one record, which changes one model (§3.3, Theorem 3.6).
    """
    plan = tukey_plan(models, epsilon=epsilon, delta=delta)
    return None if plan is None else plan.release(rng)
