"""Empirical privacy audit: a statistical lower bound ε̂ on the ε the deployed mechanism leaks.

The mechanism runs as deployed, vectorised over trials instead of through Kafka: every
contributor clips nothing new (the records below are already at the bounds) and adds its own
noise with ipdp.losses.perturb, the fold forms A = Σ q̃q̃ᵀ and b = Σ p̃, and the trainer's
constrained solve (trainer.solver.solve_constrained_batch) releases w. Two data sets D and D′ that
differ by replacing one record (docs/privacy.md, Step 1) are each run `trials` times.

Estimator. The first half of the runs chooses a scenario, a direction v (the mean difference of
w between D and D′) and a rejection region {vᵀw > t} or {vᵀw < t} that maximises the estimate
of ε on that half. On the second half, fresh runs give Clopper–Pearson bounds at confidence
1 − α/2 each: a lower bound p₁ on P_D(region) and an upper bound p₀ on P_D′(region). If the
mechanism were (ε, δ)-DP, p₁ − δ ≤ e^ε p₀, so with confidence ≥ 1 − α,

    ε ≥ ε̂ = log((p₁ − δ)/p₀).

ε̂ ≤ ε is what a correct calibration must show; ε̂ > ε refutes the claimed guarantee.

Usage: python -m bench.audit [--epsilon 1] [--delta 0.01] [--d 2] [--n 512] [--trials 200000]
       [--noise-scale 1] [--mode rigorous] [--seed 0] [--json]
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

from ipdp.calibration import NEIGHBOURING, Calibration, CalibrationError, calibrate
from ipdp.losses import perturb
from trainer.solver import solve_constrained_batch

CHUNK_RECORDS = 2**21
"""Records generated at once (trials per chunk = CHUNK_RECORDS // n)."""
ALPHA = 0.05
"""1 − confidence of ε̂ (split evenly between the two Clopper–Pearson bounds)."""


@dataclass(frozen=True)
class Neighbours:
    """Two data sets of n records, identical except for the last one (replace-one)."""

    name: str
    q: np.ndarray
    """(n, d) clean rows of D; D′ differs in row n−1 only."""
    p: np.ndarray
    q_other: np.ndarray
    """(d,) the replacing record's q."""
    p_other: np.ndarray

    def rows(self, replaced: bool) -> tuple[np.ndarray, np.ndarray]:
        """(q, p) of D (replaced=False) or D′ (replaced=True)."""
        if not replaced:
            return self.q, self.p
        q, p = self.q.copy(), self.p.copy()
        q[-1], p[-1] = self.q_other, self.p_other
        return q, p


def worst_case_neighbours(n: int, d: int, lam: float, p_bound: float, eta: float) -> list[Neighbours]:
    """Data sets that push the replace-one gradient shift towards its bound λη + 2P.

    - "axes": the other records sit on the first two axes; those on e₁ carry p = −0.8·(P/√λ)·q,
      which pins w near −0.8·η·e₁ inside the ball, those on e₂ carry p = 0 so every direction
      is well conditioned. The differing record is q = √λ·e₁, p = P·e₁; its replacement is
      q′ = 0, p′ = −P·e₁: the shift (qqᵀ − q′q′ᵀ)w + p′ − p points along e₁ with norm
      ≈ 0.8λη + 2P, and w moves linearly with it.
    - "zero": the other records are zero, so only the noise lifts the Hessian; the differing
      record is q = √λ·e₁, p = P·e₁ against q′ = √λ·e₁, p′ = −P·e₁ (a label flip at the bound).
    """
    root = math.sqrt(lam)
    e1 = np.zeros(d)
    e1[0] = 1.0
    e2 = np.zeros(d)
    e2[min(1, d - 1)] = 1.0
    half = (n - 1) // 2
    q = np.zeros((n, d))
    p = np.zeros((n, d))
    q[:half] = root * e1
    p[:half] = -0.8 * p_bound * e1 * min(1.0, eta * lam / p_bound)
    q[half:-1] = root * e2
    q[-1], p[-1] = root * e1, p_bound * e1
    axes = Neighbours("axes", q, p, np.zeros(d), -p_bound * e1)
    q0 = np.zeros((n, d))
    p0 = np.zeros((n, d))
    q0[-1], p0[-1] = root * e1, p_bound * e1
    zero = Neighbours("zero", q0, p0, root * e1, -p_bound * e1)
    return [axes, zero]


def release(cal: Calibration, q: np.ndarray, p: np.ndarray, trials: int,
            rng: np.random.Generator, noise_scale: float = 1.0,
            progress: tqdm | None = None) -> np.ndarray:
    """w of `trials` independent runs of the deployed mechanism on the rows (q, p): (trials, d).

    Each run: every record is perturbed by its contributor (ipdp.losses.perturb, with every
    noise multiplied by `noise_scale`), the fold sums q̃q̃ᵀ and p̃, the trainer solves
    argmin_{‖w‖≤η} ½wᵀ(A + Δ_in I)w − bᵀw.
    """
    n, d = q.shape
    scaled = cal.model_copy(update={"sigma_u2": cal.sigma_u2 * noise_scale**2,
                                    "sigma_b2": cal.sigma_b2 * noise_scale**2})
    per_chunk = max(1, CHUNK_RECORDS // n)
    out = np.empty((trials, d))
    ridge = cal.delta_in * np.eye(d)
    for start in range(0, trials, per_chunk):
        k = min(per_chunk, trials - start)
        q_noisy, p_noisy = perturb(np.broadcast_to(q, (k, n, d)), np.broadcast_to(p, (k, n, d)),
                                   scaled, rng)
        a = np.einsum("tni,tnj->tij", q_noisy, q_noisy) + ridge
        out[start:start + k] = solve_constrained_batch(a, p_noisy.sum(axis=1), cal.eta)
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
    mode: str
    noise_scale: float
    neighbouring: str
    scenario: str
    confidence: float
    hits_d: int
    hits_d_other: int
    evaluation_trials: int
    seconds: float


def audit(*, epsilon: float, delta: float, d: int, n: int, trials: int, noise_scale: float = 1.0,
          mode: str = "rigorous", seed: int = 0, lam: float = 1.0, p_bound: float = 1.0,
          eta: float = 1.0, delta_in: float | None = None, alpha: float = ALPHA,
          show_progress: bool = False) -> AuditResult:
    """Run the audit; `trials` runs on each of D and D′, half to choose, half to measure."""
    if trials < 200:
        raise ValueError(f"trials={trials} is too few for an audit (need ≥ 200)")
    delta_in = (1e-6 if mode == "paper" else 0.0) if delta_in is None else delta_in
    cal = calibrate(mode=mode, epsilon=epsilon, delta=delta, n=n, d=d, lam=lam,
                    p_bound=p_bound, eta=eta, delta_in=delta_in)
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    scenarios = worst_case_neighbours(n, d, lam, p_bound, eta)
    choose = trials // 2 // len(scenarios)
    measure = trials - choose * len(scenarios)
    with tqdm(total=2 * trials, desc="audit runs", unit="run", file=sys.stderr,
              disable=not show_progress) as bar:
        picks = []
        for sc in scenarios:
            w_d = release(cal, *sc.rows(False), choose, rng, noise_scale, bar)
            w_o = release(cal, *sc.rows(True), choose, rng, noise_scale, bar)
            region, eps_first = choose_region(w_d, w_o, delta, alpha / 2.0)
            picks.append((eps_first, sc, region))
        _, sc, region = max(picks, key=lambda pick: pick[0])
        hits_d = region.hits(release(cal, *sc.rows(region.sign < 0), measure, rng, noise_scale,
                                     bar))
        hits_o = region.hits(release(cal, *sc.rows(region.sign > 0), measure, rng, noise_scale,
                                     bar))
    eps_hat = epsilon_from_counts(hits_d, hits_o, measure, delta, alpha / 2.0)
    return AuditResult(
        claimed_epsilon=epsilon, epsilon_lower_bound=eps_hat, delta=delta, trials=trials, n=n,
        d=d, mode=mode, noise_scale=noise_scale, neighbouring=NEIGHBOURING, scenario=sc.name,
        confidence=1.0 - alpha, hits_d=hits_d, hits_d_other=hits_o, evaluation_trials=measure,
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
    parser.add_argument("--mode", choices=("rigorous", "paper"), default="rigorous")
    parser.add_argument("--delta-in", type=float, default=None, help="Trainer ridge Δ_in.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the noise generator.")
    parser.add_argument("--json", action="store_true", help="Print one JSON line.")


def run(args: argparse.Namespace) -> int:
    """Run the audit the parsed flags describe; print a table or one JSON line."""
    try:
        result = audit(epsilon=args.epsilon, delta=args.delta, d=args.d, n=args.n,
                       trials=args.trials, noise_scale=args.noise_scale, mode=args.mode,
                       seed=args.seed, delta_in=args.delta_in, show_progress=True)
    except (CalibrationError, ValueError) as exc:
        print(f"audit: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(asdict(result)))
        return 0
    verdict = ("consistent with the claim" if result.epsilon_lower_bound <= result.claimed_epsilon
               else "REFUTES the claimed ε")
    rows = [
        ("mechanism", f"{result.mode}, n={result.n}, d={result.d}, noise × {result.noise_scale:g}"),
        ("neighbouring", f"{result.neighbouring} (scenario: {result.scenario})"),
        ("claimed (ε, δ)", f"({result.claimed_epsilon:g}, {result.delta:g})"),
        ("runs per data set", f"{result.trials} ({result.evaluation_trials} measured)"),
        ("region hits D / D′", f"{result.hits_d} / {result.hits_d_other}"),
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
    parser = argparse.ArgumentParser(prog="python -m bench.audit",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
