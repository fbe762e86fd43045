"""Accuracy of input perturbation against non-private and centrally private baselines.

Reproduces the experiments of Fukuchi, Tran & Sakuma (2017): linear regression (test RMSE) and
logistic regression through its quadratic approximation (test accuracy), n = 2^7, 2^9, …, 2^21,
ε ∈ {0.1, 1}, δ = 0.01, n training rows and n/4 test rows per trial. Methods, all on the same rows
and seeds:

- NP: argmin_{‖w‖≤η} ½wᵀQᵀQw − (Σp)ᵀw, no privacy.
- IP-rigorous / IP-paper: every contributor sends q + u, p − r calibrated by
  ipdp.calibration.calibrate(mode=…); the trainer solves with Σ(q+u)(q+u)ᵀ + Δ_in I.
- ObjPert-Gauss, OutPert-Laplace, OutPert-Gauss: see bench.baselines for formulas and references.

Only sufficient statistics are formed. Per record the contributor noise is u = (σ_u/√n)·z with one
standard-normal row z per record, generated in chunks of 2^18 rows; QᵀQ, QᵀZ and ZᵀZ then give the
noisy Gram matrix exactly for any σ_u, so both calibration modes, both ε and every Δ_in share the
same z (common random numbers). Σr is drawn directly as N(0, σ_b²I), its exact distribution. The
training rows of one trial are nested prefixes (the 2^7 rows are the first rows of the 2^9 rows …),
so one pass gives every n.

Regularisation (Δ_in, Δ, Λ) is tuned per method and ε at the largest n only, on a 4:1 fit/validation
split of training rows, over a few repetitions, and reused for every smaller n, as in the paper.
The tuning itself is not charged to the privacy budget (nor is it in the paper).

Usage: python -m bench.accuracy [--trials 20|100] [--quick] [--out docs/] [--seed 0]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import math
import os
import platform
import re
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.accuracy_data import DataUnavailable, Flights, Synthetic
from bench.baselines import (
    gamma_sphere,
    gaussian_output_sigma,
    laplace_output_scale,
    objpert_gauss,
    project_ball,
)
from bench.markdown import markers, replace_block
from ipdp.calibration import Calibration, CalibrationError, calibrate
from ipdp.losses import clip, encode
from trainer.solver import solve_constrained

DELTA = 0.01
EPSILONS = (0.1, 1.0)
N_GRID = tuple(2**k for k in range(7, 22, 2))
QUICK_N_GRID = (2**7, 2**9, 2**11)
CHUNK = 2**18
TUNE_REPS = 5
QUICK_TUNE_REPS = 2
RIDGE_MULTIPLIERS = (1 / 16, 1 / 4, 1 / 2, 1.0, 2.0, 4.0)
"""Ridge candidates for IP and ObjPert as multiples of 2λ/ε, the ridge objective perturbation needs."""
OUTPUT_REGS = tuple(2.0**-k for k in (14, 12, 10, 8, 6, 4, 2))
"""Per-record Λ candidates for output perturbation (sum-form ridge nΛ)."""
METHODS = ("NP", "IP-rigorous", "IP-paper", "ObjPert-Gauss", "OutPert-Laplace", "OutPert-Gauss")
PRIVATE = METHODS[1:]
DOCS = Path(__file__).resolve().parent.parent / "docs"
BEGIN, END = markers("bench.accuracy")


@dataclass(frozen=True)
class Task:
    """A loss with its public bounds and the test metric reported for it."""

    name: str
    loss: str
    lam: float
    p_bound: float
    eta: float
    metric: str

    @property
    def zeta(self) -> float:
        """ζ = λη + P, the Lipschitz constant of the loss on the ball (docs/privacy.md)."""
        return self.lam * self.eta + self.p_bound

    @property
    def lower_is_better(self) -> bool:
        """RMSE is minimised, accuracy maximised."""
        return self.metric == "RMSE"

    def targets(self, y: np.ndarray) -> np.ndarray:
        """The regression target y itself, or the label sign(y) ∈ {−1, +1} (threshold 0)."""
        return y if self.loss == "squared" else np.where(y > 0.0, 1.0, -1.0)

    def score(self, pred: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Per column of pred = X·W: RMSE against t, or accuracy of sign(X·w) (sign 0 ↦ +1)."""
        if self.lower_is_better:
            return np.sqrt(np.mean((pred - t[:, None]) ** 2, axis=0))
        return np.mean(np.where(pred >= 0.0, 1.0, -1.0) == t[:, None], axis=0)

    def trivial(self, t: np.ndarray) -> float:
        """RMSE of predicting 0, or accuracy of the best constant label."""
        if self.lower_is_better:
            return float(np.sqrt(np.mean(t**2)))
        return float(max(np.mean(t > 0), np.mean(t < 0)))


TASKS = (
    Task("linear", "squared", lam=1.0, p_bound=1.0, eta=1.0, metric="RMSE"),
    Task("logistic", "logistic", lam=0.25, p_bound=0.5, eta=1.0, metric="accuracy"),
)
TASK_TITLES = {"linear": "linear regression", "logistic": "logistic regression (quadratic approx.)"}


@dataclass(frozen=True)
class Stats:
    """Sufficient statistics of the first n training records: QᵀQ, Σp, ZᵀZ and QᵀZ."""

    n: int
    qq: np.ndarray
    sp: np.ndarray
    zz: np.ndarray
    qz: np.ndarray

    def noisy_gram(self, s: float) -> np.ndarray:
        """Σ(qᵢ + s zᵢ)(qᵢ + s zᵢ)ᵀ = QᵀQ + s(QᵀZ + ZᵀQ) + s²ZᵀZ, the aggregator's A."""
        a = self.qq + s * (self.qz + self.qz.T) + s * s * self.zz
        return 0.5 * (a + a.T)


def pieces(boundaries: Sequence[int], chunk: int = CHUNK) -> list[int]:
    """Piece sizes ≤ chunk covering [0, max boundary) that end exactly at every boundary."""
    sizes, pos = [], 0
    for b in boundaries:
        while pos < b:
            sizes.append(min(chunk, b - pos))
            pos += sizes[-1]
    return sizes


def collect_stats(
    chunks: Iterable[tuple[np.ndarray, np.ndarray]], task: Task, noise_rng: np.random.Generator,
    boundaries: Sequence[int],
) -> list[Stats]:
    """Encode and clip each chunk (ipdp.losses), draw its noise rows z, snapshot at each boundary."""
    keep = set(boundaries)
    out: list[Stats] = []
    pos, acc = 0, None
    for x, y in chunks:
        q, p = clip(*encode(task.loss, x, task.targets(y)), task.lam, task.p_bound)
        z = noise_rng.standard_normal(q.shape)
        part = (q.T @ q, p.sum(axis=0), z.T @ z, q.T @ z)
        acc = part if acc is None else tuple(a + b for a, b in zip(acc, part, strict=True))
        pos += len(q)
        if pos in keep:
            qq, sp, zz, qz = (a.copy() for a in acc)
            out.append(Stats(pos, 0.5 * (qq + qq.T), sp, 0.5 * (zz + zz.T), qz))
    return out


@dataclass(frozen=True)
class Noise:
    """One draw of the mechanisms' standard noise, shared by the methods (common random numbers).

    xi ~ N(0, I): Σr = σ_b·xi for IP and b = σ·xi for ObjPert; g ~ N(0, I): direction of the
    Laplace-type output noise and the Gaussian output noise; gamma ~ Gamma(d, 1): radius.
    """

    xi: np.ndarray
    g: np.ndarray
    gamma: float

    @classmethod
    def draw(cls, rng: np.random.Generator, d: int) -> Noise:
        """Fresh standard draws for dimension d."""
        return cls(rng.standard_normal(d), rng.standard_normal(d), float(rng.gamma(d)))


@functools.cache
def ip_calibration(
    mode: str, epsilon: float, n: int, d: int, task: Task, delta_in: float
) -> Calibration | None:
    """ipdp.calibration.calibrate for the task's bounds, or None where the mode proves nothing."""
    try:
        return calibrate(mode=mode, epsilon=epsilon, delta=DELTA, n=n, d=d, lam=task.lam,
                         p_bound=task.p_bound, eta=task.eta, delta_in=delta_in)
    except CalibrationError:
        return None


def reg_grid(method: str, task: Task, epsilon: float) -> tuple[float, ...]:
    """Tuning candidates: Δ_in (IP), Δ (ObjPert), both in sum form; Λ per record (OutPert).

    IP-paper needs Δ_in > 0 (Algorithm 2). IP-rigorous stops below 2λ/ε: from there on the
    rigorous calibration needs no noise on q (σ_u = 0), which is objective perturbation with the
    records' q in the clear, not input perturbation. ObjPert needs Δ ≥ 2λ/ε (Kifer et al.).
    """
    base = 2.0 * task.lam / epsilon
    if method == "IP-paper":
        return tuple(m * base for m in RIDGE_MULTIPLIERS)
    if method == "IP-rigorous":
        return (0.0, *(m * base for m in RIDGE_MULTIPLIERS if m < 1.0))
    if method == "ObjPert-Gauss":
        return tuple((1.0 + m) * base for m in (0.0, *RIDGE_MULTIPLIERS))
    if method.startswith("OutPert"):
        return OUTPUT_REGS
    return (0.0,)


def fit(
    method: str, st: Stats, task: Task, epsilon: float, reg: float, noise: Noise
) -> np.ndarray | None:
    """The model each method releases from the statistics st; None if its calibration refuses n."""
    d = len(st.sp)
    eye = np.eye(d)
    if method == "NP":
        return solve_constrained(st.qq, st.sp, task.eta).w
    if method.startswith("IP-"):
        cal = ip_calibration(method.removeprefix("IP-"), epsilon, st.n, d, task, reg)
        if cal is None:
            return None
        h = st.noisy_gram(cal.noise_std_q) + reg * eye
        return solve_constrained(h, st.sp - math.sqrt(cal.sigma_b2) * noise.xi, task.eta).w
    if method == "ObjPert-Gauss":
        cal = objpert_gauss(epsilon=epsilon, delta=DELTA, lam=task.lam, zeta=task.zeta)
        return solve_constrained(st.qq + reg * eye, st.sp - cal.sigma * noise.xi, task.eta).w
    w = solve_constrained(st.qq + st.n * reg * eye, st.sp, task.eta).w
    if method == "OutPert-Laplace":
        scale = laplace_output_scale(n=st.n, reg=reg, zeta=task.zeta, epsilon=epsilon)
        v = gamma_sphere(noise.g, noise.gamma, scale)
    else:
        v = noise.g * gaussian_output_sigma(n=st.n, reg=reg, zeta=task.zeta, epsilon=epsilon,
                                            delta=DELTA)
    return project_ball(w + v, task.eta)


def score_methods(
    fits: dict[str, np.ndarray | None], task: Task, x: np.ndarray, t: np.ndarray
) -> dict[str, float]:
    """Test metric of every fitted model; NaN for a refused one."""
    ok = [k for k, w in fits.items() if w is not None]
    out = dict.fromkeys(fits, math.nan)
    if ok:
        scores = task.score(x @ np.column_stack([fits[k] for k in ok]), t)
        out.update(zip(ok, scores.tolist(), strict=True))
    return out


SOURCE_IDS = {"synthetic": 0, "flights": 1}


def rngs(seed: int, source: str, task: Task, kind: int, index: int) -> list[np.random.Generator]:
    """Independent generators (data, test, contributor noise, mechanism noise) for one repetition."""
    base = [seed, SOURCE_IDS[source], TASKS.index(task), kind, index]
    return [np.random.default_rng([*base, stream]) for stream in range(4)]


def tune(source, task: Task, n_max: int, reps: int, seed: int, progress) -> dict:
    """Best regulariser per (ε, method) at n_max, by mean validation metric over `reps` draws.

    Each repetition draws n_max training rows, fits on the first n_max − n_max//5 and scores on
    the rest. Ties go to the earlier (smaller) candidate.
    """
    n_val = n_max // 5
    n_fit = n_max - n_val
    scores = {(e, m): np.full((reps, len(reg_grid(m, task, e))), np.nan)
              for e in EPSILONS for m in PRIVATE}
    for r in range(reps):
        data_rng, _, noise_rng, mech_rng = rngs(seed, source.name, task, 1, r)
        fit_sizes = pieces([n_fit])
        chunks = source.train_chunks(data_rng, [*fit_sizes, n_val])
        [st] = collect_stats(itertools.islice(chunks, len(fit_sizes)), task, noise_rng, [n_fit])
        x_val, y_val = next(chunks)
        t_val = task.targets(y_val)
        for e in EPSILONS:
            noise = Noise.draw(mech_rng, source.d)
            for m in PRIVATE:
                grid = reg_grid(m, task, e)
                fits = {str(i): fit(m, st, task, e, reg, noise) for i, reg in enumerate(grid)}
                scores[e, m][r] = list(score_methods(fits, task, x_val, t_val).values())
        progress.update(1)
    chosen = {}
    for (e, m), s in scores.items():
        mean = s.mean(axis=0)
        mean = np.where(np.isnan(mean), np.inf if task.lower_is_better else -np.inf, mean)
        best = int(np.argmin(mean) if task.lower_is_better else np.argmax(mean))
        chosen[e, m] = reg_grid(m, task, e)[best]
    return chosen


@dataclass
class Outcome:
    """Every trial's metric for one (data set, task): scores[ε, method] has shape (trials, len n)."""

    source: str
    d: int
    task: Task
    n_grid: tuple[int, ...]
    regs: dict
    scores: dict
    trivial: np.ndarray


def run_trials(source, task: Task, n_grid: tuple[int, ...], regs: dict, trials: int, seed: int,
               progress) -> Outcome:
    """`trials` repetitions: one pass over nested training prefixes, then every n, ε and method."""
    scores = {(e, m): np.full((trials, len(n_grid)), np.nan) for e in EPSILONS for m in METHODS}
    trivial = np.full((trials, len(n_grid)), np.nan)
    for t in range(trials):
        data_rng, test_rng, noise_rng, mech_rng = rngs(seed, source.name, task, 0, t)
        sizes = pieces(n_grid)
        stats = collect_stats(source.train_chunks(data_rng, sizes), task, noise_rng, n_grid)
        x_test, y_test = source.test_rows(test_rng, n_grid[-1] // 4)
        t_test = task.targets(y_test)
        for j, st in enumerate(stats):
            x, tt = x_test[: st.n // 4], t_test[: st.n // 4]
            trivial[t, j] = task.trivial(tt)
            for e in EPSILONS:
                noise = Noise.draw(mech_rng, source.d)
                fits = {m: fit(m, st, task, e, regs.get((e, m), 0.0), noise) for m in METHODS}
                for m, value in score_methods(fits, task, x, tt).items():
                    scores[e, m][t, j] = value
        progress.update(1)
    return Outcome(source.name, source.d, task, n_grid, regs, scores, trivial)


class _Counter:
    """Fallback progress display on stderr when tqdm is not installed."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.desc = total, 0, ""

    def set_description(self, desc: str) -> None:
        self.desc = desc

    def update(self, k: int) -> None:
        self.done += k
        print(f"\r[{self.done}/{self.total}] {self.desc}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(file=sys.stderr)


def progress_bar(total: int):
    """tqdm on stderr if it is installed, else a plain counter."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _Counter(total)
    return tqdm(total=total, unit="rep", file=sys.stderr)


@dataclass(frozen=True)
class Config:
    """What one benchmark run covers."""

    trials: int
    seed: int
    quick: bool

    @property
    def tune_reps(self) -> int:
        """Tuning repetitions at the largest n."""
        return QUICK_TUNE_REPS if self.quick else TUNE_REPS


def sources(config: Config) -> list:
    """The data sets of a run: synthetic only in quick mode, else synthetic and flights."""
    if config.quick:
        return [Synthetic()]
    return [Synthetic(), Flights.load(split_seed=config.seed)]


def n_grid_for(source, config: Config) -> tuple[int, ...]:
    """The n of the grid for which the source has n training and n/4 test rows."""
    grid = QUICK_N_GRID if config.quick else N_GRID
    return tuple(n for n in grid if n <= source.n_train_pool and n // 4 <= source.n_test_pool)


def run(config: Config) -> list[Outcome]:
    """Tune at the largest n, then run every trial, for each data set and task."""
    plan = [(s, task, n_grid_for(s, config)) for s in sources(config) for task in TASKS]
    bar = progress_bar(len(plan) * (config.tune_reps + config.trials))
    outcomes = []
    try:
        for source, task, grid in plan:
            bar.set_description(f"{source.name}/{task.name} tuning")
            regs = tune(source, task, grid[-1], config.tune_reps, config.seed, bar)
            bar.set_description(f"{source.name}/{task.name} trials")
            outcomes.append(run_trials(source, task, grid, regs, config.trials, config.seed, bar))
    finally:
        bar.close()
    return outcomes


# ---------------------------------------------------------------------------------------------
# Report: markdown tables, a paired comparison of IP against ObjPert, the noise used, plots.


def log2_label(n: int) -> str:
    """2^k for a power of two."""
    return f"2^{n.bit_length() - 1}"


def fmt_metric(task: Task, values: np.ndarray) -> str:
    """mean ± std over trials, or n/a when the method's calibration refused this n."""
    if np.isnan(values).all():
        return "n/a"
    digits = 4 if task.lower_is_better else 3
    return f"{np.mean(values):.{digits}f} ± {np.std(values, ddof=1):.{digits}f}"


def results_table(o: Outcome, e: float) -> str:
    """One row per n, one column per method, plus the trivial predictor."""
    head = ["n", *METHODS, "trivial"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for j, n in enumerate(o.n_grid):
        cells = [fmt_metric(o.task, o.scores[e, m][:, j]) for m in METHODS]
        lines.append(f"| {log2_label(n)} | " + " | ".join(cells)
                     + f" | {fmt_metric(o.task, o.trivial[:, j])} |")
    return "\n".join(lines)


def paired_gap(o: Outcome, e: float, a: str, b: str, j: int) -> tuple[float, float] | None:
    """Mean and standard error over trials of (a − b) at n index j, in 'worse' units.

    Positive means a is worse than b: higher RMSE, or lower accuracy (in percentage points).
    """
    diff = o.scores[e, a][:, j] - o.scores[e, b][:, j]
    if np.isnan(diff).any():
        return None
    sign = 1.0 if o.task.lower_is_better else -100.0
    diff = sign * diff
    return float(diff.mean()), float(diff.std(ddof=1) / math.sqrt(len(diff)))


def fmt_gap(o: Outcome, e: float, a: str, b: str, j: int) -> str:
    """'+0.0123 (+12%)*' for RMSE, '+1.2 pp*' for accuracy; * marks |mean| > 2 standard errors."""
    gap = paired_gap(o, e, a, b, j)
    if gap is None:
        return "n/a"
    mean, se = gap
    star = "*" if abs(mean) > 2.0 * se else ""
    if o.task.lower_is_better:
        rel = 100.0 * mean / np.mean(o.scores[e, b][:, j])
        return f"{mean:+.4f} ({rel:+.0f}%){star}"
    return f"{mean:+.1f} pp{star}"


GAPS = (("IP-rigorous", "ObjPert-Gauss"), ("IP-paper", "ObjPert-Gauss"), ("IP-rigorous", "IP-paper"))


def gap_table(o: Outcome) -> str:
    """How much worse IP is than ObjPert, and rigorous than paper, per n and ε."""
    head = ["n"] + [f"{a} − {b}, ε={e:g}" for e in EPSILONS for a, b in GAPS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for j, n in enumerate(o.n_grid):
        cells = [fmt_gap(o, e, a, b, j) for e in EPSILONS for a, b in GAPS]
        lines.append(f"| {log2_label(n)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


MATERIAL_RMSE, MATERIAL_PP = 0.01, 0.5
"""A gap counts as a loss in the summaries from 1% of RMSE or 0.5 accuracy points on."""


def gap_summary(o: Outcome, e: float, a: str, b: str) -> str:
    """One sentence: at which n a is worse than b (material and > 2 s.e.), and the largest gap."""
    worse, refused, best = [], [], None
    for j, n in enumerate(o.n_grid):
        gap = paired_gap(o, e, a, b, j)
        if gap is None:
            refused.append(log2_label(n))
            continue
        mean, se = gap
        size = mean / np.mean(o.scores[e, b][:, j]) if o.task.lower_is_better else mean
        material = MATERIAL_RMSE if o.task.lower_is_better else MATERIAL_PP
        if mean > 2.0 * se and size >= material:
            worse.append(log2_label(n))
            if best is None or size > best[0]:
                best = (size, n)
    unit = (lambda s: f"{100 * s:+.0f}% RMSE") if o.task.lower_is_better else (
        lambda s: f"{s:+.1f} pp accuracy")
    text = f"{a} vs {b}: "
    text += (f"worse at n = {', '.join(worse)} (largest gap {unit(best[0])} at "
             f"{log2_label(best[1])})" if worse else "never materially worse")
    if refused:
        text += f"; {a} has no guarantee (n/a) at n = {', '.join(refused)}"
    return text


def noise_table(o: Outcome) -> str:
    """σ_u² and σ_b² of both IP modes and σ² of ObjPert at the tuned regularisers."""
    head = ["n"] + [f"{c}, ε={e:g}" for e in EPSILONS
                    for c in ("σ_u² paper / rigorous", "σ_b² paper / rigorous / ObjPert σ²")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in o.n_grid:
        cells = []
        for e in EPSILONS:
            paper = ip_calibration("paper", e, n, o.d, o.task, o.regs[e, "IP-paper"])
            rig = ip_calibration("rigorous", e, n, o.d, o.task, o.regs[e, "IP-rigorous"])
            obj = objpert_gauss(epsilon=e, delta=DELTA, lam=o.task.lam, zeta=o.task.zeta)
            rig_u = f"{rig.sigma_u2:.3g}" if rig else "n/a"
            rig_b = f"{rig.sigma_b2:.4g}" if rig else "n/a"
            cells += [f"{paper.sigma_u2:.3g} / {rig_u}",
                      f"{paper.sigma_b2:.4g} / {rig_b} / {obj.sigma**2:.4g}"]
        lines.append(f"| {log2_label(n)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fmt_reg(method: str, value: float, task: Task, e: float) -> str:
    """A tuned value, with its multiple of 2λ/ε for the ridge methods."""
    if method.startswith("OutPert"):
        return f"Λ = 2^{round(math.log2(value))}"
    name = "Δ" if method == "ObjPert-Gauss" else "Δ_in"
    return f"{name} = {value:.4g} ({value / (2 * task.lam / e):.3g}·2λ/ε)"


def regs_table(outcomes: list[Outcome]) -> str:
    """The regulariser each method was tuned to, per data set, task and ε."""
    head = ["data", "task", "ε", *PRIVATE]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for o in outcomes:
        for e in EPSILONS:
            cells = [fmt_reg(m, o.regs[e, m], o.task, e) for m in PRIVATE]
            lines.append(f"| {o.source} | {o.task.name} | {e:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


STYLE = {
    "NP": ("black", "o"), "IP-rigorous": ("tab:red", "s"), "IP-paper": ("tab:orange", "D"),
    "ObjPert-Gauss": ("tab:blue", "^"), "OutPert-Laplace": ("tab:green", "v"),
    "OutPert-Gauss": ("tab:purple", "P"),
}


def plot(o: Outcome, path: Path) -> None:
    """One panel per ε: metric against log₂ n, one line per method (mean, band ± std)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.log2(np.array(o.n_grid))
    fig, axes = plt.subplots(1, len(EPSILONS), figsize=(11, 4.3), sharey=True)
    for ax, e in zip(axes, EPSILONS, strict=True):
        for m in METHODS:
            s = o.scores[e, m]
            ok = ~np.isnan(s).all(axis=0)
            mean, std = np.nanmean(s[:, ok], axis=0), np.nanstd(s[:, ok], axis=0, ddof=1)
            color, marker = STYLE[m]
            ax.plot(x[ok], mean, color=color, marker=marker, label=m, lw=1.6, ms=5)
            ax.fill_between(x[ok], mean - std, mean + std, color=color, alpha=0.12, lw=0)
        ax.plot(x, o.trivial.mean(axis=0), color="gray", ls="--", lw=1,
                label="trivial (predict 0)" if o.task.lower_is_better else "trivial (majority)")
        ax.set_title(f"ε = {e:g}, δ = {DELTA:g}")
        ax.set_xlabel("log₂ n")
        ax.set_xticks(x)
        ax.grid(alpha=0.3)
        if o.task.lower_is_better:
            ax.set_yscale("log")
    axes[0].set_ylabel(f"test {o.task.metric}")
    axes[-1].legend(loc="best", fontsize=8)
    fig.suptitle(f"{o.source}: {TASK_TITLES[o.task.name]} (d = {o.d}, "
                 f"{o.scores[EPSILONS[0], 'NP'].shape[0]} trials)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(outcomes: list[Outcome], meta: dict, figures: dict[str, str]) -> str:
    """The generated part of the Accuracy section."""
    out = [
        (f"Generated by `{meta['command']}` on {meta['date']}: wall time **{meta['wall']}** on "
         f"{meta['machine']}; {meta['trials']} trials per point, {meta['tune_reps']} tuning "
         f"repetitions at the largest n, seed {meta['seed']}."),
        "",
        "#### Tuned regularisers (at the largest n, reused for all n)",
        "",
        regs_table(outcomes),
    ]
    for o in outcomes:
        title = f"{o.source}: {TASK_TITLES[o.task.name]}, d = {o.d}"
        out += ["", f"#### {title}", ""]
        if o.source + o.task.name in figures:
            out += [f"![{title}]({figures[o.source + o.task.name]})", ""]
        for e in EPSILONS:
            better = "lower" if o.task.lower_is_better else "higher"
            out += [f"Test {o.task.metric} ({better} is better), ε = {e:g}:", "",
                    results_table(o, e), ""]
        out += [("Paired differences (mean over trials; positive = first method worse; "
                 "RMSE in absolute units and % of the second; accuracy in percentage points; "
                 "\\* = more than 2 standard errors from 0). The bullets under the table count "
                 "a loss only from 1% of RMSE or 0.5 accuracy points on, beyond 2 standard "
                 "errors:"),
                "", gap_table(o), ""]
        for e in EPSILONS:
            out += [f"- ε = {e:g}: " + "; ".join(gap_summary(o, e, a, b) for a, b in GAPS[:2])
                    + "; " + gap_summary(o, e, *GAPS[2]) + "."]
        out += ["", ("Noise actually used (σ_u² is n times the per-coordinate variance of u; "
                     "σ_b² likewise for r; ObjPert's b has variance σ² per coordinate):"), "",
                noise_table(o)]
    return "\n".join(out) + "\n"


SKELETON = """# Benchmarks

## Accuracy

{block}
## Throughput and cost

Filled in by the throughput benchmark.
"""


def write_section(md: Path, generated: str) -> None:
    """Put `generated` between the markers of the Accuracy section, leaving the rest untouched."""
    block = f"{BEGIN}\n{generated}{END}\n"
    if not md.exists():
        md.write_text(SKELETON.format(block=block), encoding="utf-8")
        return
    if replace_block(md, "bench.accuracy", generated):
        return
    text = md.read_text(encoding="utf-8")
    if "## Accuracy" in text:
        head, rest = text.split("## Accuracy", 1)
        nxt = re.search(r"^## ", rest, flags=re.MULTILINE)
        cut = nxt.start() if nxt else len(rest)
        text = head + "## Accuracy" + rest[:cut].rstrip("\n") + "\n\n" + block + "\n" + rest[cut:]
    else:
        text = text.rstrip("\n") + "\n\n## Accuracy\n\n" + block
    md.write_text(text, encoding="utf-8")


def command_line(args: argparse.Namespace, trials: int) -> str:
    """The canonical command that reproduces a run."""
    parts = ["python -m bench.accuracy"]
    if args.quick:
        parts.append("--quick")
    parts.append(f"--trials {trials}")
    if args.seed:
        parts.append(f"--seed {args.seed}")
    if args.out is not None:
        parts.append(f"--out {args.out}")
    return " ".join(parts)


def machine() -> str:
    """Cores and numpy version, for the record next to the wall time."""
    return f"{os.cpu_count()} cores ({platform.machine()}), Python {platform.python_version()}, " \
           f"numpy {np.__version__}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `python -m bench.accuracy` (and of `ipdp bench accuracy`)."""
    parser.add_argument("--trials", type=int, default=None,
                        help="Trials per point (default 20; 2 with --quick); use 100 for the "
                             "paper's setting.")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke run: synthetic data, n ∈ {2^7, 2^9, 2^11}, 2 trials, no plots; "
                             "prints the tables and writes nothing unless --out is given.")
    parser.add_argument("--out", type=Path, default=None,
                        help="Directory for benchmarks.md (its '## Accuracy' section) and "
                             "benchmarks/*.png (default: the repository's docs/).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of every generator (default 0).")


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed flags describe; write or print the report."""
    trials = args.trials if args.trials is not None else (2 if args.quick else 20)
    if trials < 2:
        print("bench.accuracy: --trials must be at least 2 (the tables report a std)",
              file=sys.stderr)
        return 2
    config = Config(trials=trials, seed=args.seed, quick=args.quick)
    start = time.perf_counter()
    try:
        outcomes = run(config)
    except DataUnavailable as exc:
        print(f"bench.accuracy: {exc}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - start
    out_dir = args.out if args.out is not None else (None if args.quick else DOCS)
    figures: dict[str, str] = {}
    if out_dir is not None and not args.quick:
        (out_dir / "benchmarks").mkdir(parents=True, exist_ok=True)
        for o in outcomes:
            name = f"benchmarks/accuracy-{o.source}-{o.task.name}.png"
            plot(o, out_dir / name)
            figures[o.source + o.task.name] = name
    meta = {
        "command": command_line(args, trials), "wall": f"{wall // 60:.0f} min {wall % 60:.0f} s",
        "date": datetime.date.today().isoformat(), "machine": machine(), "trials": trials,
        "tune_reps": config.tune_reps, "seed": args.seed,
    }
    report = render(outcomes, meta, figures)
    if out_dir is None:
        print(report)
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_section(out_dir / "benchmarks.md", report)
        print(f"bench.accuracy: wrote {out_dir / 'benchmarks.md'} ({meta['wall']})",
              file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m bench.accuracy`."""
    parser = argparse.ArgumentParser(prog="python -m bench.accuracy",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
