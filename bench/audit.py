"""Empirical privacy audit: a statistical lower bound ε̂ on the ε the deployed mechanism leaks.

The mechanism runs as deployed, vectorised over trials instead of through Kafka: every
contributor clips nothing new (the records below are already at the bounds) and adds its own
noise with ipdp.losses.perturb, the fold forms A = Σ q̃q̃ᵀ and b = Σ p̃, and the trainer's
constrained solve (trainer.solver.solve_constrained_batch) releases w. Two data sets D and D′ that
differ by replacing one record (docs/privacy.md, Step 1) are each run `trials` times. With
--exact-fold, A and b are drawn from their exact law instead of from n noisy records
(`exact_fold`); --mechanism kang2020 audits Kang et al. (2020) as published. With --two-server
every record goes through the two-server mode as implemented (`two_server_fold`): the device's
Gaussian q-noise and Skellam p-noise on the grid (ipdp.two_server.perturb_two_server), the
fixed-point encoding and the split into two shares (ipdp.fixed_point), each server's sum mod 2⁶⁴,
the combination and decoding, and the trainer's dither (trainer.two_server.dithered_sum); its
claim is calibrate_two_server's.

Estimator. The first half of the runs (the calibration runs) chooses a pair, a direction v (the mean difference of
w between D and D′) and a rejection region {vᵀw > t} or {vᵀw < t} that maximises the estimate
of ε on that half. On the second half, fresh runs give Clopper–Pearson bounds at confidence
1 − α/2 each: a lower bound p₁ on P_D(region) and an upper bound p₀ on P_D′(region). If the
mechanism were (ε, δ)-DP, p₁ − δ ≤ e^ε p₀, so with confidence ≥ 1 − α,

    ε ≥ ε̂ = log((p₁ − δ)/p₀).

ε̂ ≤ ε is what a correct calibration must show; ε̂ > ε refutes the claimed guarantee.

Usage: python -m bench.audit [--epsilon 1] [--delta 0.01] [--d 2] [--n 512] [--trials 200000]
       [--noise-scale 1] [--mode rigorous] [--exact-fold | --two-server]
       [--mechanism ipdp|kang2020] [--c 1] [--seed 0] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
from tqdm import tqdm

from bench.baselines import KANG_STEPS, kang2020_descent, kang2020_proof_c, kang2020_sigma
from ipdp.calibration import NEIGHBOURING, CalibrationError, calibrate
from ipdp.fixed_point import combine, encode, fold, split
from ipdp.losses import perturb
from ipdp.two_server import TwoServerCalibration, calibrate_two_server, perturb_two_server
from trainer.solver import solve_constrained_batch
from trainer.two_server import dithered_sum

CHUNK_RECORDS = 2**21
"""Records generated at once (trials per chunk = CHUNK_RECORDS // n)."""
EXACT_CHUNK = 2**16
TWO_SERVER_CHUNK_RECORDS = 2**19
"""Records encoded and shared at once with --two-server (three uint64 arrays of L per record)."""
"""Runs drawn at once with --exact-fold."""
KANG_STRONG_CONVEXITY = 0.01
"""Δ of the audited Kang et al. mechanism (mean-form ridge)."""
ALPHA = 0.05
"""1 − confidence of ε̂ (split evenly between the two Clopper–Pearson bounds)."""


@dataclass(frozen=True)
class Neighbours:
    """Two data sets of n records, identical except for the last one (replace-one).

    Each record is (q, p) with p = t·q for a label t where the mechanism needs labels (Kang et
    al. fold t·x̃); `t` holds them (0 where p is not a multiple of q).
    """

    name: str
    q: np.ndarray
    """(n, d) clean rows of D; D′ differs in row n−1 only."""
    p: np.ndarray
    q_other: np.ndarray
    """(d,) the replacing record's q."""
    p_other: np.ndarray
    t: np.ndarray
    """(n,) labels of D; t_other is the replacing record's."""
    t_other: float

    def rows(self, replaced: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q, p, t) of D (replaced=False) or D′ (replaced=True)."""
        if not replaced:
            return self.q, self.p, self.t
        q, p, t = self.q.copy(), self.p.copy(), self.t.copy()
        q[-1], p[-1], t[-1] = self.q_other, self.p_other, self.t_other
        return q, p, t

    def describe(self) -> dict:
        """The pair in words and numbers, for --json: the differing record and the others."""
        others, counts = np.unique(np.column_stack([self.q[:-1], self.p[:-1]]), axis=0,
                                   return_counts=True)
        d = self.q.shape[1]
        return {"name": self.name, "record": {"q": self.q[-1].tolist(), "p": self.p[-1].tolist()},
                "replacement": {"q": self.q_other.tolist(), "p": self.p_other.tolist()},
                "others": [{"count": int(k), "q": row[:d].tolist(), "p": row[d:].tolist()}
                           for row, k in zip(others, counts, strict=True)]}


PINS = {"axes": 0.8, "edge": 0.98}
"""Where the "axes" and "edge" pairs pin w along −e₁, as a fraction of η."""


def worst_case_neighbours(n: int, d: int, lam: float, p_bound: float, eta: float) -> list[Neighbours]:
    """Data sets that push the replace-one gradient shift towards its bound λη + 2P.

    - "axes" and "edge": the other records sit on the first two axes; those on e₁ carry
      p = −pin·(P/√λ)·q, which pins w near −pin·η·e₁ inside the ball (pin = 0.8, 0.98), those on
      e₂ carry p = 0 so every direction is well conditioned. The differing record is
      q = √λ·e₁, p = P·e₁; its replacement is q′ = 0, p′ = −P·e₁: the shift
      (qqᵀ − q′q′ᵀ)w + p′ − p points along e₁ with norm ≈ pin·λη + 2P, and w moves with it.
    - "zero": the other records are zero, so only the noise lifts the Hessian; the differing
      record is q = √λ·e₁, p = P·e₁ against q′ = √λ·e₁, p′ = −P·e₁ (a label flip at the bound).
    """
    root = math.sqrt(lam)
    e1 = np.zeros(d)
    e1[0] = 1.0
    e2 = np.zeros(d)
    e2[min(1, d - 1)] = 1.0
    half = (n - 1) // 2
    pairs = []
    for name, pin in PINS.items():
        q = np.zeros((n, d))
        p = np.zeros((n, d))
        q[:half] = root * e1
        p[:half] = -pin * p_bound * e1 * min(1.0, eta * lam / p_bound)
        q[half:-1] = root * e2
        q[-1], p[-1] = root * e1, p_bound * e1
        pairs.append(Neighbours(name, q, p, np.zeros(d), -p_bound * e1, np.zeros(n), 0.0))
    q0 = np.zeros((n, d))
    p0 = np.zeros((n, d))
    q0[-1], p0[-1] = root * e1, p_bound * e1
    pairs.append(Neighbours("zero", q0, p0, root * e1, -p_bound * e1, np.zeros(n), 0.0))
    return pairs


def label_flip_neighbours(n: int, d: int, lam: float) -> list[Neighbours]:
    """Kang et al.'s pair: the other records on the first two axes with label 0, the differing
    record x = √λ·e₁ with label +1 against the same x with label −1 (p = t·x)."""
    root = math.sqrt(lam)
    q = np.zeros((n, d))
    half = (n - 1) // 2
    q[:half, 0] = root
    q[half:, min(1, d - 1)] = root
    q[-1] = 0.0
    q[-1, 0] = root
    t = np.zeros(n)
    t[-1] = 1.0
    p = t[:, None] * q
    return [Neighbours("label-flip", q, p, q[-1].copy(), -q[-1], t, -1.0)]


@dataclass(frozen=True)
class Mechanism:
    """What one run does with a data set: the device noise, the fold and the release.

    - "ipdp": q̃ = q + u, u ~ N(0, s_q²I), p̃ = p − r, r ~ N(0, s_p²I) per record; A = Σ q̃q̃ᵀ,
      b = Σ p̃; w = argmin_{‖w‖≤η} ½wᵀ(A + Δ_in I)w − bᵀw (trainer.solver).
    - "kang2020": x̃ = x + σz per record, labels in the clear; A = Σ x̃x̃ᵀ, b = Σ t·x̃; T projected
      gradient steps (bench.baselines.kang2020_descent).
    """

    name: str
    std_q: float
    std_p: float
    eta: float
    delta_in: float = 0.0
    strong_convexity: float = 0.0
    two_server: TwoServerCalibration | None = None
    """The two-server calibration (noise already scaled) when the runs go through that mode."""

    def solve(self, a: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
        d = b.shape[-1]
        if self.name == "kang2020":
            return kang2020_descent(a, b, n=n, strong_convexity=self.strong_convexity,
                                    eta=self.eta, steps=KANG_STEPS)
        return solve_constrained_batch(a + self.delta_in * np.eye(d), b, self.eta)


def wishart(rng: np.random.Generator, dof: int, d: int, k: int) -> np.ndarray:
    """k draws of a d×d Wishart(dof, I) matrix (Bartlett decomposition): (k, d, d)."""
    lower = np.zeros((k, d, d))
    rows, cols = np.tril_indices(d, -1)
    lower[:, rows, cols] = rng.standard_normal((k, len(rows)))
    diag = np.arange(d)
    lower[:, diag, diag] = np.sqrt(rng.chisquare(dof - diag, size=(k, d)))
    return lower @ lower.transpose(0, 2, 1)


def exact_fold(mech: Mechanism, q: np.ndarray, p: np.ndarray, t: np.ndarray, k: int,
               rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """k draws of (A, b) from their exact distribution, without drawing n noise rows each.

    Records with the same (q, p) form a group j of m_j records at c_j. Within it
    Σ(c_j + uᵢ)(c_j + uᵢ)ᵀ = y_j y_jᵀ + Σ(uᵢ − ū)(uᵢ − ū)ᵀ with y_j = √m_j (c_j + ū) ~ N(√m_j c_j,
    s²I) and the scatter s²·Wishart(m_j − 1, I) independent of ū (Cochran), so
    A = Σ_j y_j y_jᵀ + s²·W, W ~ Wishart(Σ_j (m_j − 1), I). For ipdp b = Σp − R with
    R ~ N(0, n·s_p²I); for Kang et al. b = Σ_j t_j √m_j y_j (docs/privacy.md, "The privacy audit").
    """
    n, d = q.shape
    groups, counts = np.unique(np.column_stack([q, p, t]), axis=0, return_counts=True)
    centres = groups[:, :d]
    scale = np.sqrt(counts)[:, None]
    y = scale * centres + mech.std_q * rng.standard_normal((k, len(groups), d))
    a = np.einsum("kgi,kgj->kij", y, y)
    if n > len(groups):
        a += mech.std_q**2 * wishart(rng, n - len(groups), d, k)
    if mech.name == "kang2020":
        b = np.einsum("g,kgi->ki", groups[:, -1] * np.sqrt(counts), y)
    else:
        b = p.sum(axis=0) - math.sqrt(n) * mech.std_p * rng.standard_normal((k, d))
    return a, b


def record_fold(mech: Mechanism, q: np.ndarray, p: np.ndarray, t: np.ndarray, k: int,
                rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """k draws of (A, b) with every record perturbed as a device does (ipdp.losses.perturb)."""
    n, d = q.shape
    if mech.name == "kang2020":
        x = q + mech.std_q * rng.standard_normal((k, n, d))
        return np.einsum("kni,knj->kij", x, x), np.einsum("n,kni->ki", t, x)
    q_noisy, p_noisy = perturb(np.broadcast_to(q, (k, n, d)), np.broadcast_to(p, (k, n, d)),
                               _Noise(mech.std_q, mech.std_p), rng)
    return np.einsum("tni,tnj->tij", q_noisy, q_noisy), p_noisy.sum(axis=1)


def two_server_fold(mech: Mechanism, q: np.ndarray, p: np.ndarray, t: np.ndarray, k: int,
                    rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """k draws of (A, b) through the two-server mode: every record perturbed, encoded and split
    as a device does, each server's shares summed mod 2⁶⁴, the sums combined and decoded, and b
    dithered by the trainer's own code (trainer.two_server.dithered_sum; docs/privacy.md, Step 9
    (the two-server mechanism))."""
    cal = mech.two_server
    n, d = q.shape
    q_tilde, p_hat = perturb_two_server(np.broadcast_to(q, (k, n, d)),
                                        np.broadcast_to(p, (k, n, d)), cal, noise=rng,
                                        generator=rng)
    values, _ = encode(q_tilde, p_hat, cal.encoding)
    leader, helper = split(values, rng.bytes)
    return dithered_sum(combine(fold(leader, axis=1), fold(helper, axis=1)), cal, rng)


@dataclass(frozen=True)
class _Noise:
    """The two stds ipdp.losses.perturb reads from a calibration."""

    noise_std_q: float
    noise_std_p: float


def release(mech: Mechanism, rows: tuple[np.ndarray, np.ndarray, np.ndarray], trials: int,
            rng: np.random.Generator, exact: bool = False,
            progress: tqdm | None = None) -> np.ndarray:
    """w of `trials` independent runs of the mechanism on the rows (q, p, t): (trials, d)."""
    q, p, t = rows
    n, d = q.shape
    if mech.two_server is not None:
        fold, per_chunk = two_server_fold, max(1, TWO_SERVER_CHUNK_RECORDS // n)
    else:
        fold = exact_fold if exact else record_fold
        per_chunk = EXACT_CHUNK if exact else max(1, CHUNK_RECORDS // n)
    out = np.empty((trials, d))
    for start in range(0, trials, per_chunk):
        k = min(per_chunk, trials - start)
        a, b = fold(mech, q, p, t, k, rng)
        out[start:start + k] = mech.solve(a, b, n)
        if progress is not None:
            progress.update(k)
    return out


def clopper_pearson(successes: int, trials: int, alpha: float) -> tuple[float, float]:
    """One-sided Clopper–Pearson bounds, each holding with probability ≥ 1 − alpha."""
    from scipy.stats import beta  # here, not at the top: every `ipdp` command imports this module

    lower = 0.0 if successes == 0 else float(beta.ppf(alpha, successes, trials - successes + 1))
    upper = 1.0 if successes == trials else float(
        beta.ppf(1.0 - alpha, successes + 1, trials - successes))
    return lower, upper


def epsilon_from_counts(hits_d: int, hits_d_other: int, trials: int, delta: float,
                        alpha: float) -> float:
    """ε̂ = log((p₁ − δ)/p₀) from Clopper–Pearson bounds (−inf when p₁ ≤ δ)."""
    p1, _ = clopper_pearson(hits_d, trials, alpha)
    _, p0 = clopper_pearson(hits_d_other, trials, alpha)
    return math.log((p1 - delta) / p0) if p1 > delta else -math.inf


@dataclass(frozen=True)
class Region:
    """{sign·vᵀw > t}: the rejection region chosen on the first half."""

    direction: np.ndarray
    sign: float
    threshold: float

    def hits(self, w: np.ndarray) -> int:
        return int(np.count_nonzero(self.sign * (w @ self.direction) > self.threshold))


def choose_region(w_d: np.ndarray, w_other: np.ndarray, delta: float,
                  alpha: float) -> tuple[Region, float]:
    """Direction, side and threshold maximising ε̂ on these (first-half) runs."""
    direction = w_d.mean(axis=0) - w_other.mean(axis=0)
    direction /= max(float(np.linalg.norm(direction)), 1e-300)
    best = (Region(direction, 1.0, math.inf), -math.inf)
    for sign, (first, second) in ((1.0, (w_d, w_other)), (-1.0, (w_other, w_d))):
        # sign = −1 swaps the roles: the region {vᵀw < −t} is more likely under D′.
        s1 = np.sort(sign * (first @ direction))
        s0 = np.sort(sign * (second @ direction))
        m = len(s1)
        for frac in np.geomspace(0.3, max(2.0 / m, 1e-4), 60):
            t = float(np.quantile(s1, 1.0 - frac))
            h1 = m - int(np.searchsorted(s1, t, side="right"))
            h0 = len(s0) - int(np.searchsorted(s0, t, side="right"))
            eps_hat = epsilon_from_counts(h1, h0, m, delta, alpha)
            if eps_hat > best[1]:
                best = (Region(direction, sign, t), eps_hat)
    return best


@dataclass(frozen=True)
class AuditResult:
    """What `ipdp audit` prints."""

    claimed_epsilon: float
    epsilon_lower_bound: float
    delta: float
    trials: int
    n: int
    d: int
    mechanism: str
    mode: str
    exact_fold: bool
    two_server: bool
    noise_scale: float
    std_q: float
    std_p: float
    neighbouring: str
    scenario: str
    pair: dict
    """The neighbouring pair the measured runs used (chosen on the calibration runs)."""
    region: dict
    """The test {sign·vᵀw > threshold}, fixed before the measured runs."""
    confidence: float
    hits_d: int
    hits_d_other: int
    evaluation_trials: int
    interval: dict
    """Clopper–Pearson bounds: p1_lower on P_D(region), p0_upper on P_D′(region)."""
    kang_c: float | None
    kang_proof_c: float | None
    """Kang et al.: the c, and the least c the label-flip pair allows at (ε, δ)."""
    seconds: float


def mechanism_for(*, mechanism: str, epsilon: float, delta: float, d: int, n: int,
                  noise_scale: float, mode: str, lam: float, p_bound: float, eta: float,
                  delta_in: float | None, c: float, strong_convexity: float,
                  two_server: bool = False) -> Mechanism:
    """The audited mechanism with its claimed calibration, every noise times `noise_scale` (in
    two-server mode σ_u times S and the Poisson mean times S², so σ_b is times S too)."""
    if mechanism == "kang2020":
        sigma = kang2020_sigma(c=c, lipschitz=lam * eta + p_bound, steps=KANG_STEPS, delta=delta,
                               n=n, strong_convexity=strong_convexity, epsilon=epsilon)
        return Mechanism("kang2020", noise_scale * sigma, 0.0, eta,
                         strong_convexity=strong_convexity)
    if two_server:
        if mode != "rigorous":
            raise ValueError("--two-server is proven for rigorous mode only")
        cal2 = calibrate_two_server(epsilon=epsilon, delta=delta, n=n, d=d, lam=lam,
                                    p_bound=p_bound, eta=eta, delta_in=delta_in)
        scaled = cal2.model_copy(update={
            "noise_std_q": noise_scale * cal2.noise_std_q,
            "poisson_mean": noise_scale**2 * cal2.poisson_mean})
        return Mechanism("ipdp", scaled.noise_std_q,
                         noise_scale * math.sqrt(cal2.sigma_b2 / n), eta,
                         delta_in=cal2.delta_in, two_server=scaled)
    if mode == "paper" and delta_in is None:
        delta_in = 1e-6
    cal = calibrate(mode=mode, epsilon=epsilon, delta=delta, n=n, d=d, lam=lam,
                    p_bound=p_bound, eta=eta, delta_in=delta_in)
    return Mechanism("ipdp", noise_scale * cal.noise_std_q, noise_scale * cal.noise_std_p, eta,
                     delta_in=cal.delta_in)


def audit(*, epsilon: float, delta: float, d: int, n: int, trials: int, noise_scale: float = 1.0,
          mode: str = "rigorous", seed: int = 0, lam: float = 1.0, p_bound: float = 1.0,
          eta: float = 1.0, delta_in: float | None = None, alpha: float = ALPHA,
          mechanism: str = "ipdp", exact_fold: bool = False, c: float = 1.0,
          strong_convexity: float = KANG_STRONG_CONVEXITY, two_server: bool = False,
          show_progress: bool = False) -> AuditResult:
    """Run the audit; `trials` runs on each of D and D′: the first half (the calibration runs,
    split between the pairs) chooses the pair, the direction and the threshold; the second
    half, fresh, measures ε̂ with them fixed."""
    if trials < 200:
        raise ValueError(f"trials={trials} is too few for an audit (need ≥ 200)")
    if two_server and (exact_fold or mechanism != "ipdp"):
        raise ValueError("--two-server runs ipdp's records one by one: it excludes --exact-fold "
                         "and --mechanism kang2020")
    mech = mechanism_for(mechanism=mechanism, epsilon=epsilon, delta=delta, d=d, n=n,
                         noise_scale=noise_scale, mode=mode, lam=lam, p_bound=p_bound, eta=eta,
                         delta_in=delta_in, c=c, strong_convexity=strong_convexity,
                         two_server=two_server)
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    scenarios = (label_flip_neighbours(n, d, lam) if mechanism == "kang2020"
                 else worst_case_neighbours(n, d, lam, p_bound, eta))
    choose = trials // 2 // len(scenarios)
    measure = trials - choose * len(scenarios)
    with tqdm(total=2 * trials, desc="audit runs", unit="run", file=sys.stderr,
              disable=not show_progress) as bar:
        picks = []
        for sc in scenarios:
            w_d = release(mech, sc.rows(False), choose, rng, exact_fold, bar)
            w_o = release(mech, sc.rows(True), choose, rng, exact_fold, bar)
            region, eps_first = choose_region(w_d, w_o, delta, alpha / 2.0)
            picks.append((eps_first, sc, region))
        _, sc, region = max(picks, key=lambda pick: pick[0])
        hits_d = region.hits(release(mech, sc.rows(region.sign < 0), measure, rng, exact_fold,
                                     bar))
        hits_o = region.hits(release(mech, sc.rows(region.sign > 0), measure, rng, exact_fold,
                                     bar))
    p1, _ = clopper_pearson(hits_d, measure, alpha / 2.0)
    _, p0 = clopper_pearson(hits_o, measure, alpha / 2.0)
    kang = mechanism == "kang2020"
    return AuditResult(
        claimed_epsilon=epsilon, epsilon_lower_bound=epsilon_from_counts(
            hits_d, hits_o, measure, delta, alpha / 2.0), delta=delta, trials=trials, n=n, d=d,
        mechanism=mechanism, mode="kang2020" if kang else mode, exact_fold=exact_fold,
        two_server=two_server, noise_scale=noise_scale, std_q=mech.std_q, std_p=mech.std_p, neighbouring=NEIGHBOURING,
        scenario=sc.name, pair=sc.describe(),
        region={"direction": region.direction.tolist(), "sign": region.sign,
                "threshold": region.threshold},
        confidence=1.0 - alpha, hits_d=hits_d, hits_d_other=hits_o, evaluation_trials=measure,
        interval={"p1_lower": p1, "p0_upper": p0, "confidence_each": 1.0 - alpha / 2.0},
        kang_c=c if kang else None,
        kang_proof_c=kang2020_proof_c(lam=lam, lipschitz=lam * eta + p_bound, steps=KANG_STEPS,
                                      delta=delta, n=n, strong_convexity=strong_convexity,
                                      epsilon=epsilon) if kang else None,
        seconds=time.perf_counter() - started,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `python -m bench.audit` (and of `ipdp audit`)."""
    parser.add_argument("--epsilon", type=float, default=1.0, help="Claimed central ε.")
    parser.add_argument("--delta", type=float, default=0.01, help="Claimed central δ.")
    parser.add_argument("--d", type=int, default=2, help="Dimension.")
    parser.add_argument("--n", type=int, default=512, help="Records per round.")
    parser.add_argument("--trials", type=int, default=200_000,
                        help="Runs of the mechanism on each of the two neighbouring data sets.")
    parser.add_argument("--noise-scale", type=float, default=1.0,
                        help="Multiply every noise by S (S < 1 under-noises: the audit should "
                             "then refute the claim).")
    parser.add_argument("--mode", choices=("rigorous", "paper"), default="rigorous",
                        help="The calibration audited (default rigorous).")
    parser.add_argument("--delta-in", type=float, default=None,
                        help="Trainer ridge Δ_in (default: the calibration's choice).")
    parser.add_argument("--exact-fold", action="store_true",
                        help="Draw A = Σ q̃q̃ᵀ and b = Σ p̃ from their exact distribution instead "
                             "of n noisy records per run (cost independent of n).")
    parser.add_argument("--two-server", action="store_true",
                        help="Run every record through the two-server mode: fixed-point "
                             "encoding, Skellam noise on the grid, two additive shares summed "
                             "mod 2^64, decoding and the trainer's dither (claim: "
                             "calibrate_two_server's).")
    parser.add_argument("--mechanism", choices=("ipdp", "kang2020"), default="ipdp",
                        help="ipdp's input perturbation, or Kang et al. (2020) as published.")
    parser.add_argument("--c", type=float, default=1.0, help="Kang et al.'s constant c.")
    parser.add_argument("--strong-convexity", type=float, default=KANG_STRONG_CONVEXITY,
                        help="Kang et al.'s Δ, the ridge of the mean objective (default "
                             f"{KANG_STRONG_CONVEXITY:g}).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the noise generator.")
    parser.add_argument("--json", action="store_true", help="Print one JSON line.")


def run(args: argparse.Namespace) -> int:
    """Run the audit the parsed flags describe; print a table or one JSON line."""
    try:
        result = audit(epsilon=args.epsilon, delta=args.delta, d=args.d, n=args.n,
                       trials=args.trials, noise_scale=args.noise_scale, mode=args.mode,
                       seed=args.seed, delta_in=args.delta_in, mechanism=args.mechanism,
                       exact_fold=args.exact_fold, two_server=args.two_server, c=args.c,
                       strong_convexity=args.strong_convexity, show_progress=True)
    except (CalibrationError, ValueError) as exc:
        print(f"audit: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(asdict(result)))
        return 0
    verdict = ("consistent with the claim" if result.epsilon_lower_bound <= result.claimed_epsilon
               else "REFUTES the claimed ε")
    kang = (f", c = {result.kang_c:g} (the pair needs c ≥ {result.kang_proof_c:.3g})"
            if result.kang_c is not None else "")
    fold = ("two-server records" if result.two_server
            else "exact" if result.exact_fold else "records")
    sign = "+" if result.region["sign"] > 0 else "−"
    direction = ", ".join(f"{x:.3g}" for x in result.region["direction"])
    interval = result.interval
    what = f"{result.mode}{kang}, n={result.n}, d={result.d}, noise × {result.noise_scale:g}"
    rows = [
        ("mechanism", f"{what}, fold: {fold}"),
        ("neighbouring", f"{result.neighbouring} (pair: {result.scenario})"),
        ("claimed (ε, δ)", f"({result.claimed_epsilon:g}, {result.delta:g})"),
        ("runs per data set", f"{result.trials} ({result.evaluation_trials} measured)"),
        ("test", f"{sign}vᵀw > {result.region['threshold']:.4g}, v = ({direction})"),
        ("region hits D / D′", f"{result.hits_d} / {result.hits_d_other}"),
        ("P_D lower / P_D′ upper", f"{interval['p1_lower']:.4g} / {interval['p0_upper']:.4g}"),
        (f"ε̂ ({result.confidence:.0%} lower bound)", f"{result.epsilon_lower_bound:.4g}"),
        ("verdict", verdict),
        ("wall time", f"{result.seconds:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(["ipdp privacy audit", "------------------"]
                    + [f"{k.ljust(width)}  {v}" for k, v in rows]))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m bench.audit`."""
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench.audit",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
