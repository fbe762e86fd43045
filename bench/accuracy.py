"""Accuracy of input perturbation against the non-private solution and every central peer.

Reproduces the experiments of Fukuchi, Tran & Sakuma (2017): linear regression (test RMSE) and
logistic regression through its quadratic approximation (test accuracy), n = 2^7, 2^9, …, 2^21,
ε ∈ {0.1, 1}, δ = 0.01, n training rows and n/4 test rows per trial, and adds a simplex variant
of both tasks (the model constrained to the L1 ball ‖w‖₁ ≤ η, the simplex of the 2d vertices
±η·eⱼ). Methods, all on the same rows and seeds:

- NP: argmin ½wᵀQᵀQw − (Σp)ᵀw over the task's domain, no privacy.
- IP-rigorous / IP-paper: every contributor sends q + u, p − r calibrated by
  ipdp.calibration.calibrate(mode=…); the trainer solves with Σ(q+u)(q+u)ᵀ + Δ_in I.
- Central peers (bench.baselines has every formula, its neighbouring relation and reference):
  ObjPert-Gauss (Kifer et al.'s constant), ObjPert-tight (ipdp's accounting, q in the clear),
  OutPert-Laplace, OutPert-Gauss, SSP, AdaSSP, OpenDP-SSP (QᵀQ and Σp with the scale of OpenDP's
  own accountant), diffprivlib (LinearRegression or LogisticRegression, on the raw rows),
  TukeyEM (linear regression only, on the raw rows: bench.tukey; a failed test releases no
  model, scored as the zero model and counted) and, on the simplex variant, PrivateFW.
- Kang et al. (2020) as published, at c = 1 and two larger c: **no proven guarantee** (its claim
  is refuted by `ipdp audit --mechanism kang2020`); not a central peer in the comparisons.

Only sufficient statistics are formed, except for diffprivlib and TukeyEM, which get the rows. Per record
the contributor noise is u = (σ_u/√n)·z with one standard-normal row z per record, generated in
chunks of 2^18 rows; QᵀQ, QᵀZ and ZᵀZ then give the noisy Gram matrix exactly for any σ_u, so
both calibration modes, both ε and every Δ_in share the same z (common random numbers). Σr is
drawn directly as N(0, σ_b²I), its exact distribution, from a standard vector that ObjPert's b
and SSP's linear noise share. The training rows of one trial are nested prefixes (the 2^7 rows
are the first rows of the 2^9 rows …), so one pass gives every n, and both variants of a loss
share it.

IP-rigorous uses the Δ_in its calibration chooses for the task's loss (docs/privacy.md, Step 8),
as a study that leaves Δ_in unset does. Every other regularisation (Δ_in, Δ, Λ, C, Frank–Wolfe steps, Kang's
strong convexity, TukeyEM's number of models) is tuned per method and ε at the largest n only, on a 4:1 fit/validation split of training rows, over a few repetitions, and reused for
every smaller n, as in the paper. The tuning itself is not charged to the privacy budget (nor is
it in the paper).

Usage: python -m bench.accuracy [--trials 20|100] [--quick] [--out DIR | --write-docs] [--seed 0]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import math
import os
import platform
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.accuracy_data import DataUnavailable, Flights, Synthetic
from bench.baselines import (
    KANG_STEPS,
    adassp,
    adassp_ridge,
    diffprivlib_linear,
    diffprivlib_logistic,
    gamma_sphere,
    gaussian_output_sigma,
    kang2020_descent,
    kang2020_sigma,
    laplace_output_scale,
    objpert_gauss,
    objpert_tight_sigma,
    opendp_ssp_sigma,
    pfw_score_width,
    pfw_step_epsilon,
    private_frank_wolfe,
    project_ball,
    solve_l1_ball,
    solve_trust_region,
    ssp_noise,
    symmetric_normal,
)
from bench.markdown import markers, replace_block
from bench.tukey import block_models, tukey_em
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
TIGHT_MULTIPLIERS = (1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4, 1.0, 5 / 4, 3 / 2, 2.0, 3.0)
"""ObjPert-tight ridges, multiples of 2λ/ε; those too small for its proof drop out."""
OUTPUT_REGS = tuple(2.0**-k for k in (14, 12, 10, 8, 6, 4, 2))
"""Per-record Λ candidates for output perturbation (sum-form ridge nΛ)."""
DIFFPRIVLIB_C = (1 / 64, 1 / 8, 1.0)
"""C of diffprivlib's LogisticRegression, whose objective is mean loss + ‖w‖²/(2Cn)."""
FW_STEPS = (8, 16, 32, 64, 128, 256)
"""Frank–Wolfe step counts T for PrivateFW."""
KANG_C = {"Kang2020 c=1 (unproven)": 1.0, "Kang2020 c=1e3 (unproven)": 1e3,
          "Kang2020 c=1e6 (unproven)": 1e6}
"""Kang et al. (2020)'s constant c: as published (1) and larger; none is proven."""
KANG_STRONG_CONVEXITY = (1e-4, 1e-3, 1e-2, 1e-1)
"""Δ candidates of the Kang baseline (mean-form ridge), multiples of λ."""
IP_METHODS = ("IP-rigorous", "IP-paper")
BALL_METHODS = ("NP", *IP_METHODS, "ObjPert-Gauss", "ObjPert-tight", "OutPert-Laplace",
                "OutPert-Gauss", "SSP", "AdaSSP", "OpenDP-SSP", "diffprivlib", "TukeyEM", *KANG_C)
TUKEY_ROWS_PER_MODEL = (2, 4, 8, 16, 32)
"""TukeyEM's candidate block sizes, in multiples of d rows per OLS model (m = n // (k·d))."""
REGRESSION_ONLY = ("TukeyEM",)
"""Methods of linear regression only (TukeyEM fits OLS models, not classifiers)."""
SIMPLEX_METHODS = ("NP", *IP_METHODS, "ObjPert-Gauss", "PrivateFW")
LOSSES = ("squared", "logistic")
DOCS = Path(__file__).resolve().parent.parent / "docs"
BEGIN, END = markers("bench.accuracy")


@dataclass(frozen=True)
class Task:
    """A loss and a domain for w, with the public bounds and the test metric reported for it."""

    name: str
    loss: str
    lam: float
    p_bound: float
    eta: float
    metric: str
    domain: str = "ball"
    """"ball": ‖w‖₂ ≤ η; "simplex": ‖w‖₁ ≤ η (inside the ball, so every calibration still holds)."""

    @property
    def methods(self) -> tuple[str, ...]:
        """NP first, then the private methods compared on this task."""
        if self.domain != "ball":
            return SIMPLEX_METHODS
        if self.loss == "squared":
            return BALL_METHODS
        return tuple(m for m in BALL_METHODS if m not in REGRESSION_ONLY)

    @property
    def private(self) -> tuple[str, ...]:
        """Every method but NP."""
        return self.methods[1:]

    @property
    def central(self) -> tuple[str, ...]:
        """The centrally private peers: every private method but input perturbation (ipdp's and
        Kang et al.'s, which has no proven guarantee)."""
        return tuple(m for m in self.private if m not in IP_METHODS and m not in KANG_C)

    @property
    def zeta(self) -> float:
        """ζ = λη + P, the Lipschitz constant of the loss on the ball (docs/privacy.md)."""
        return self.lam * self.eta + self.p_bound

    @property
    def q_scale(self) -> float:
        """q = x (squared loss) or x/2 (logistic): a per-feature bound on x times this bounds q."""
        return 1.0 if self.loss == "squared" else 0.5

    @property
    def lower_is_better(self) -> bool:
        """RMSE is minimised, accuracy maximised."""
        return self.metric == "RMSE"

    def solve(self, h: np.ndarray, lin: np.ndarray) -> np.ndarray:
        """argmin ½wᵀhw − linᵀw over the task's domain (h positive semi-definite)."""
        if self.domain == "ball":
            return solve_constrained(h, lin, self.eta).w
        return solve_l1_ball(h, lin, self.eta)

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
    Task("linear-simplex", "squared", lam=1.0, p_bound=1.0, eta=1.0, metric="RMSE",
         domain="simplex"),
    Task("logistic-simplex", "logistic", lam=0.25, p_bound=0.5, eta=1.0, metric="accuracy",
         domain="simplex"),
)
TASK_TITLES = {
    "linear": "linear regression", "logistic": "logistic regression (quadratic approx.)",
    "linear-simplex": "linear regression over the L1 ball (simplex variant)",
    "logistic-simplex":
        "logistic regression (quadratic approx.) over the L1 ball (simplex variant)",
}


@dataclass(frozen=True)
class Stats:
    """What the methods see of the first n training records.

    Sufficient statistics QᵀQ, Σp, ZᵀZ, QᵀZ, Σtz (targets times noise rows, for Kang et al.'s
    noisy features under clear labels); the public per-feature bound x_bound of the raw rows;
    and, for diffprivlib only, the raw rows x (n, d) and their targets t (n,).
    """

    n: int
    qq: np.ndarray
    sp: np.ndarray
    zz: np.ndarray
    qz: np.ndarray
    zt: np.ndarray
    x_bound: float
    x: np.ndarray | None = None
    t: np.ndarray | None = None

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
    boundaries: Sequence[int], x_bound: float = 1.0, keep_rows: bool = False,
) -> list[Stats]:
    """Encode and clip each chunk (ipdp.losses), draw its noise rows z, snapshot at each boundary.

    With keep_rows, every snapshot also holds its prefix of the raw rows and targets (views of
    one array per trial).
    """
    keep = set(boundaries)
    snapshots: list[tuple[int, tuple]] = []
    rows: list[tuple[np.ndarray, np.ndarray]] = []
    pos, acc = 0, None
    for x, y in chunks:
        t = task.targets(y)
        q, p = clip(*encode(task.loss, x, t), task.lam, task.p_bound)
        z = noise_rng.standard_normal(q.shape)
        part = (q.T @ q, p.sum(axis=0), z.T @ z, q.T @ z, z.T @ t)
        acc = part if acc is None else tuple(a + b for a, b in zip(acc, part, strict=True))
        if keep_rows:
            rows.append((x, t))
        pos += len(q)
        if pos in keep:
            snapshots.append((pos, tuple(a.copy() for a in acc)))
    x_all = np.concatenate([r[0] for r in rows]) if keep_rows else None
    t_all = np.concatenate([r[1] for r in rows]) if keep_rows else None
    out = []
    for n, (qq, sp, zz, qz, zt) in snapshots:
        out.append(Stats(n, 0.5 * (qq + qq.T), sp, 0.5 * (zz + zz.T), qz, zt, x_bound,
                         None if x_all is None else x_all[:n],
                         None if t_all is None else t_all[:n]))
    return out


@dataclass(frozen=True)
class Noise:
    """One draw of the mechanisms' standard noise, shared by the methods (common random numbers).

    From the mechanism stream: xi ~ N(0, I), behind Σr (IP), b (ObjPert) and the noise on Σp
    (SSP, AdaSSP); g ~ N(0, I), direction of the Laplace-type output noise and the Gaussian output
    noise; gamma ~ Gamma(d, 1), its radius. From a separate peers stream, so that the draws above
    do not depend on which peers run: sym, a symmetric matrix with i.i.d. N(0, 1) entries on and
    above the diagonal (SSP, AdaSSP); eig ~ N(0, 1) (AdaSSP's λ_min); gumbel, standard Gumbel
    (max T, 2d) (PrivateFW); seed, an integer for diffprivlib's own generator.
    """

    xi: np.ndarray
    g: np.ndarray
    gamma: float
    sym: np.ndarray
    eig: float
    gumbel: np.ndarray
    seed: int

    @classmethod
    def draw(cls, rng: np.random.Generator, peer_rng: np.random.Generator, d: int) -> Noise:
        """Fresh standard draws for dimension d."""
        return cls(rng.standard_normal(d), rng.standard_normal(d), float(rng.gamma(d)),
                   symmetric_normal(peer_rng, d), float(peer_rng.standard_normal()),
                   peer_rng.gumbel(size=(max(FW_STEPS), 2 * d)),
                   int(peer_rng.integers(2**31 - 1)))


@functools.cache
def ip_calibration(
    mode: str, epsilon: float, n: int, d: int, task: Task, delta_in: float | None
) -> Calibration | None:
    """ipdp.calibration.calibrate for the task's bounds, or None where the mode proves nothing.

    delta_in None: the calibration chooses it (rigorous mode, Step 8)."""
    try:
        return calibrate(mode=mode, epsilon=epsilon, delta=DELTA, n=n, d=d, lam=task.lam,
                         p_bound=task.p_bound, eta=task.eta, delta_in=delta_in, loss=task.loss)
    except CalibrationError:
        return None


@functools.cache
def objpert_tight(epsilon: float, d: int, task: Task, ridge: float) -> float | None:
    """σ of ObjPert-tight's b at this ridge, or None where the ridge is too small for the proof."""
    return objpert_tight_sigma(epsilon=epsilon, delta=DELTA, lam=task.lam, p_bound=task.p_bound,
                               eta=task.eta, d=d, ridge=ridge)


def ip_ridge(method: str, reg: float) -> float | None:
    """The Δ_in an IP method is calibrated with: tuned (IP-paper) or chosen by Step 8 (None)."""
    return None if method == "IP-rigorous" else reg


def reg_grid(method: str, task: Task, epsilon: float) -> tuple[float, ...]:
    """Tuning candidates: Δ_in (IP-paper), Δ (ObjPert), both in sum form; Λ per record (OutPert);
    C (diffprivlib's LogisticRegression); the number of steps T (PrivateFW); the strong
    convexity Δ of the mean objective (Kang).

    IP-paper needs Δ_in > 0 (Algorithm 2). IP-rigorous has nothing to tune: its calibration
    chooses Δ_in from public parameters (Step 8), never so large that q needs no noise.
    ObjPert-Gauss needs Δ ≥ 2λ/ε (Kifer et al.). SSP, AdaSSP (adaptive ridge) and diffprivlib's
    LinearRegression have nothing to tune.
    """
    base = 2.0 * task.lam / epsilon
    if method == "IP-paper":
        return tuple(m * base for m in RIDGE_MULTIPLIERS)
    if method in KANG_C:
        return tuple(m * task.lam for m in KANG_STRONG_CONVEXITY)
    if method == "ObjPert-Gauss":
        return tuple((1.0 + m) * base for m in (0.0, *RIDGE_MULTIPLIERS))
    if method == "ObjPert-tight":
        return tuple(m * base for m in TIGHT_MULTIPLIERS)
    if method.startswith("OutPert"):
        return OUTPUT_REGS
    if method == "diffprivlib" and task.loss == "logistic":
        return DIFFPRIVLIB_C
    if method == "PrivateFW":
        return tuple(float(t) for t in FW_STEPS)
    if method == "TukeyEM":
        return tuple(float(k) for k in TUKEY_ROWS_PER_MODEL)
    return (0.0,)


def fit(
    method: str, st: Stats, task: Task, epsilon: float, reg: float, noise: Noise
) -> np.ndarray | None:
    """The model each method releases from the statistics st; None if its calibration refuses n."""
    d = len(st.sp)
    eye = np.eye(d)
    if method == "NP":
        return task.solve(st.qq, st.sp)
    if method in IP_METHODS:
        cal = ip_calibration(method.removeprefix("IP-"), epsilon, st.n, d, task, ip_ridge(
            method, reg))
        if cal is None:
            return None
        h = st.noisy_gram(cal.noise_std_q) + cal.delta_in * eye
        return task.solve(h, st.sp - math.sqrt(cal.sigma_b2) * noise.xi)
    if method == "ObjPert-Gauss":
        cal = objpert_gauss(epsilon=epsilon, delta=DELTA, lam=task.lam, zeta=task.zeta)
        return task.solve(st.qq + reg * eye, st.sp - cal.sigma * noise.xi)
    if method == "ObjPert-tight":
        sigma = objpert_tight(epsilon, d, task, reg)
        if sigma is None:
            return None
        return task.solve(st.qq + reg * eye, st.sp - sigma * noise.xi)
    if method == "SSP":
        ssp = ssp_noise(epsilon=epsilon, delta=DELTA, lam=task.lam, p_bound=task.p_bound)
        return solve_trust_region(st.qq + ssp.sigma_gram * noise.sym,
                                  st.sp + ssp.sigma_lin * noise.xi, task.eta)
    if method == "AdaSSP":
        ada = adassp(epsilon=epsilon, delta=DELTA, lam=task.lam, p_bound=task.p_bound, d=d)
        ridge = adassp_ridge(float(np.linalg.eigvalsh(st.qq)[0]), noise.eig, ada)
        return solve_trust_region(st.qq + ada.sigma_gram * noise.sym + ridge * eye,
                                  st.sp + ada.sigma_lin * noise.xi, task.eta)
    if method == "OpenDP-SSP":
        sigma = opendp_ssp_sigma(epsilon=epsilon, delta=DELTA, lam=task.lam,
                                 p_bound=task.p_bound, d=d)
        return solve_trust_region(st.qq + sigma * noise.sym, st.sp + sigma * noise.xi, task.eta)
    if method == "TukeyEM":
        # No model (too few rows for the blocks, or the test fails) is the zero model, w = 0,
        # which predicts 0: the outcome is part of TukeyEM's accuracy (run_trials counts it).
        m = st.n // (int(reg) * d)
        if m < 4:
            return np.zeros(d)
        w = tukey_em(block_models(st.x, st.t, m), epsilon=epsilon, delta=DELTA,
                     rng=np.random.default_rng([noise.seed, TUKEY_STREAM]))
        return np.zeros(d) if w is None else w
    if method == "diffprivlib":
        if task.loss == "squared":
            return diffprivlib_linear(st.x, st.t, epsilon=epsilon, coord_bound=st.x_bound,
                                      y_bound=1.0, seed=noise.seed)
        return diffprivlib_logistic(st.x, st.t, epsilon=epsilon, data_norm=1.0, c=reg,
                                    seed=noise.seed)
    if method in KANG_C:
        sigma = kang2020_sigma(c=KANG_C[method], lipschitz=task.zeta, steps=KANG_STEPS,
                               delta=DELTA, n=st.n, strong_convexity=reg, epsilon=epsilon)
        s = task.q_scale * sigma  # x̃ = x + σz, so q̃ = q + s·z and p̃ = t·q̃ = p + s·t·z
        return kang2020_descent(st.noisy_gram(s), st.sp + s * st.zt, n=st.n,
                                strong_convexity=reg, eta=task.eta, steps=KANG_STEPS)
    if method == "PrivateFW":
        steps = int(reg)
        width = pfw_score_width(coord_bound=task.q_scale * st.x_bound, eta=task.eta)
        beta = pfw_step_epsilon(epsilon=epsilon, delta=DELTA, steps=steps) / width
        return private_frank_wolfe(st.qq, st.sp, eta=task.eta, beta=beta,
                                   gumbel=noise.gumbel[:steps])
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
        # (Wᵀ·Xᵀ)ᵀ rather than X·W: OpenBLAS is ten times slower on the tall-skinny product.
        scores = task.score((np.vstack([fits[k] for k in ok]) @ x.T).T, t)
        out.update(zip(ok, scores.tolist(), strict=True))
    return out


SOURCE_IDS = {"synthetic": 0, "flights": 1}


def rngs(seed: int, source: str, loss: str, kind: int, index: int) -> list[np.random.Generator]:
    """Independent generators (data, test, contributor noise, mechanism noise, peers' noise)."""
    base = [seed, SOURCE_IDS[source], LOSSES.index(loss), kind, index]
    return [np.random.default_rng([*base, stream]) for stream in range(5)]


ROW_METHODS = ("diffprivlib", "TukeyEM")
"""The methods that read the raw rows rather than sufficient statistics."""
TUKEY_STREAM = 1
"""TukeyEM's generator is seeded by (the trial's peers' seed, this), apart from diffprivlib's."""


def needs_rows(tasks: Sequence[Task]) -> bool:
    """Whether a method of these tasks reads the raw rows (diffprivlib, TukeyEM)."""
    return any(m in task.methods for task in tasks for m in ROW_METHODS)


def tune(source, tasks: Sequence[Task], n_max: int, reps: int, seed: int, progress) -> dict:
    """Best regulariser per (task, ε, method) at n_max, by mean validation metric over `reps` draws.

    The tasks share one loss, hence one set of statistics per repetition. Each repetition draws
    n_max training rows, fits on the first n_max − n_max//5 and scores on the rest. Ties go to
    the earlier (smaller) candidate. Methods with a single candidate are not run.
    """
    n_val = n_max // 5
    n_fit = n_max - n_val
    scores = {(task.name, e, m): np.full((reps, len(reg_grid(m, task, e))), np.nan)
              for task in tasks for e in EPSILONS for m in task.private
              if len(reg_grid(m, task, e)) > 1}
    for r in range(reps):
        data_rng, _, noise_rng, mech_rng, peer_rng = rngs(seed, source.name, tasks[0].loss, 1, r)
        fit_sizes = pieces([n_fit])
        chunks = source.train_chunks(data_rng, [*fit_sizes, n_val])
        [st] = collect_stats(itertools.islice(chunks, len(fit_sizes)), tasks[0], noise_rng,
                             [n_fit], source.coord_bound, needs_rows(tasks))
        x_val, y_val = next(chunks)
        t_val = tasks[0].targets(y_val)
        for e in EPSILONS:
            noise = Noise.draw(mech_rng, peer_rng, source.d)
            for task in tasks:
                for m in task.private:
                    if (task.name, e, m) not in scores:
                        continue
                    grid = reg_grid(m, task, e)
                    fits = {str(i): fit(m, st, task, e, reg, noise) for i, reg in enumerate(grid)}
                    scores[task.name, e, m][r] = list(
                        score_methods(fits, task, x_val, t_val).values())
        progress.update(1)
    chosen = {task.name: {(e, m): reg_grid(m, task, e)[0] for e in EPSILONS for m in task.private}
              for task in tasks}
    for (name, e, m), s in scores.items():
        task = next(t for t in tasks if t.name == name)
        mean = s.mean(axis=0)
        mean = np.where(np.isnan(mean), np.inf if task.lower_is_better else -np.inf, mean)
        best = int(np.argmin(mean) if task.lower_is_better else np.argmax(mean))
        chosen[name][e, m] = reg_grid(m, task, e)[best]
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
    no_model: dict
    """no_model[ε] (trials, len n): 1 where TukeyEM released no model (scored as w = 0)."""


def run_trials(source, tasks: Sequence[Task], n_grid: tuple[int, ...], regs: dict, trials: int,
               seed: int, progress) -> list[Outcome]:
    """`trials` repetitions: one pass over nested training prefixes, then every n, ε, task and
    method."""
    scores = {task.name: {(e, m): np.full((trials, len(n_grid)), np.nan)
                          for e in EPSILONS for m in task.methods} for task in tasks}
    trivial = np.full((trials, len(n_grid)), np.nan)
    no_model = {task.name: {e: np.zeros((trials, len(n_grid))) for e in EPSILONS}
                for task in tasks}
    for t in range(trials):
        data_rng, test_rng, noise_rng, mech_rng, peer_rng = rngs(seed, source.name, tasks[0].loss,
                                                                 0, t)
        stats = collect_stats(source.train_chunks(data_rng, pieces(n_grid)), tasks[0], noise_rng,
                              n_grid, source.coord_bound, needs_rows(tasks))
        x_test, y_test = source.test_rows(test_rng, n_grid[-1] // 4)
        t_test = tasks[0].targets(y_test)
        for j, st in enumerate(stats):
            x, tt = x_test[: st.n // 4], t_test[: st.n // 4]
            trivial[t, j] = tasks[0].trivial(tt)
            for e in EPSILONS:
                noise = Noise.draw(mech_rng, peer_rng, source.d)
                for task in tasks:
                    fits = {m: fit(m, st, task, e, regs[task.name].get((e, m), 0.0), noise)
                            for m in task.methods}
                    for m, value in score_methods(fits, task, x, tt).items():
                        scores[task.name][e, m][t, j] = value
                    if "TukeyEM" in fits:
                        no_model[task.name][e][t, j] = not fits["TukeyEM"].any()
        progress.update(1)
    return [Outcome(source.name, source.d, task, n_grid, regs[task.name], scores[task.name],
                    trivial, no_model[task.name]) for task in tasks]


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
    """Tune at the largest n, then run every trial, for each data set and loss (both domains)."""
    plan = [(s, [t for t in TASKS if t.loss == loss], n_grid_for(s, config))
            for s in sources(config) for loss in LOSSES]
    bar = progress_bar(len(plan) * (config.tune_reps + config.trials))
    outcomes = []
    try:
        for source, tasks, grid in plan:
            bar.set_description(f"{source.name}/{tasks[0].loss} tuning")
            regs = tune(source, tasks, grid[-1], config.tune_reps, config.seed, bar)
            bar.set_description(f"{source.name}/{tasks[0].loss} trials")
            outcomes += run_trials(source, tasks, grid, regs, config.trials, config.seed, bar)
    finally:
        bar.close()
    return outcomes


# ---------------------------------------------------------------------------------------------
# Report: markdown tables, paired gaps of IP-rigorous against the paper's calibration and against
# the best central peer, the noise used, plots.


def log2_label(n: int) -> str:
    """2^k for a power of two."""
    return f"2^{n.bit_length() - 1}"


def fmt_metric(task: Task, values: np.ndarray) -> str:
    """mean ± std over trials, or n/a when the method's calibration refused this n."""
    if np.isnan(values).all():
        return "n/a"
    mean, std = np.mean(values), np.std(values, ddof=1)
    if abs(mean) >= 10.0:
        return f"{mean:.3g} ± {std:.2g}"
    digits = 4 if task.lower_is_better else 3
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def results_table(o: Outcome, e: float) -> str:
    """One row per n, one column per method, plus the trivial predictor and, where TukeyEM
    runs, the share of trials in which it released no model (its column scores them as w = 0)."""
    tukey = "TukeyEM" in o.task.methods
    head = ["n", *o.task.methods, "trivial", *(["TukeyEM: no model"] if tukey else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for j, n in enumerate(o.n_grid):
        cells = [fmt_metric(o.task, o.scores[e, m][:, j]) for m in o.task.methods]
        cells.append(fmt_metric(o.task, o.trivial[:, j]))
        if tukey:
            cells.append(f"{100 * float(np.mean(o.no_model[e][:, j])):.0f} %")
        lines.append(f"| {log2_label(n)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def best_central(o: Outcome, e: float, j: int) -> str | None:
    """The central peer with the best mean test metric at n index j (chosen on the test scores)."""
    means = {m: float(np.mean(o.scores[e, m][:, j])) for m in o.task.central
             if not np.isnan(o.scores[e, m][:, j]).any()}
    if not means:
        return None
    pick = min if o.task.lower_is_better else max
    return pick(means, key=means.__getitem__)


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


def relative_gap(o: Outcome, e: float, a: str, b: str, j: int) -> float | None:
    """Mean gap of a over b at n index j: fraction of b's RMSE, or accuracy points."""
    gap = paired_gap(o, e, a, b, j)
    if gap is None:
        return None
    return gap[0] / np.mean(o.scores[e, b][:, j]) if o.task.lower_is_better else gap[0]


def fmt_gap(o: Outcome, e: float, a: str, b: str | None, j: int) -> str:
    """'+0.0123 (+12%)*' for RMSE, '+1.2 pp*' for accuracy; * marks |mean| > 2 standard errors."""
    gap = None if b is None else paired_gap(o, e, a, b, j)
    if gap is None:
        return "n/a"
    mean, se = gap
    star = "*" if abs(mean) > 2.0 * se else ""
    if o.task.lower_is_better:
        return f"{mean:+.4f} ({100 * relative_gap(o, e, a, b, j):+.1f}%){star}"
    return f"{mean:+.1f} pp{star}" if abs(mean) >= 0.1 else f"{mean:+.2f} pp{star}"


def gap_table(o: Outcome) -> str:
    """IP-rigorous against IP-paper and against the best central peer, per n and ε."""
    head = ["n"]
    for e in EPSILONS:
        head += [f"IP-rigorous − IP-paper, ε={e:g}", f"IP-rigorous − best central, ε={e:g}",
                 f"best central, ε={e:g}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for j, n in enumerate(o.n_grid):
        cells = []
        for e in EPSILONS:
            best = best_central(o, e, j)
            cells += [fmt_gap(o, e, "IP-rigorous", "IP-paper", j),
                      fmt_gap(o, e, "IP-rigorous", best, j), best or "n/a"]
        lines.append(f"| {log2_label(n)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


GOALS = ((1.0, 2**13, None, 0.05), (0.1, 2**15, 2**15, 0.10), (0.1, 2**17, None, 0.05))
"""The accuracy issue's goals (ε, from n, to n or None, largest RMSE gap to the best central)."""


def unit(task: Task, size: float) -> str:
    """A relative RMSE gap in %, or an accuracy gap in points."""
    if task.lower_is_better:
        return f"{100 * size:+.1f}% RMSE" if abs(size) >= 0.001 else f"{100 * size:+.2f}% RMSE"
    return f"{-size:+.1f} pp accuracy" if abs(size) >= 0.1 else f"{-size:+.2f} pp accuracy"


def paper_verdict(o: Outcome, e: float) -> str:
    """Where IP-rigorous is worse than IP-paper beyond 2 standard errors, where the paper gives a
    model."""
    worse, rigorous_na, paper_na = [], [], []
    for j, n in enumerate(o.n_grid):
        if np.isnan(o.scores[e, "IP-paper"][:, j]).any():
            paper_na.append(log2_label(n))
            continue
        gap = paired_gap(o, e, "IP-rigorous", "IP-paper", j)
        if gap is None:
            rigorous_na.append(log2_label(n))
        elif gap[0] > 2.0 * gap[1]:
            size = relative_gap(o, e, "IP-rigorous", "IP-paper", j)
            worse.append(f"{log2_label(n)} ({unit(o.task, size)})")
    text = ("IP-rigorous vs IP-paper: " + (f"**worse** at n = {', '.join(worse)}" if worse else
                                           "never worse beyond 2 standard errors"))
    if rigorous_na:
        text += f"; **no rigorous model** at n = {', '.join(rigorous_na)}"
    if paper_na:
        text += f" (the paper's calibration gives none at n = {', '.join(paper_na)})"
    return text


def central_verdict(o: Outcome, e: float) -> str:
    """Where IP-rigorous is worse than the best central peer, and the largest gap over each of
    the goals' ranges of n at this ε."""
    worse, gaps = [], {}
    for j, n in enumerate(o.n_grid):
        best = best_central(o, e, j)
        gap = None if best is None else paired_gap(o, e, "IP-rigorous", best, j)
        if gap is None:
            continue
        if gap[0] > 2.0 * gap[1]:
            worse.append(log2_label(n))
        gaps[n] = (relative_gap(o, e, "IP-rigorous", best, j), best)
    text = "vs the best central peer: " + (f"worse at n = {', '.join(worse)}" if worse else
                                           "never worse beyond 2 standard errors")
    for goal_e, low, high, bound in GOALS:
        span = [n for n in gaps if goal_e == e and n >= low and (high is None or n <= high)]
        if not span:
            continue
        n = max(span, key=lambda k: gaps[k][0])
        size, best = gaps[n]
        where = f"at n = {log2_label(low)}" if high == low else f"from n = {log2_label(low)}"
        text += f"; {where} the largest gap is {unit(o.task, size)} ({best}, n = {log2_label(n)})"
        if o.task.lower_is_better:
            text += (f", **within {bound:.0%}**" if size <= bound
                     else f", **not within {bound:.0%}**")
    return text


def noise_table(o: Outcome) -> str:
    """σ_u² and σ_b² of both IP modes and σ² of both ObjPerts at the tuned regularisers."""
    head = ["n"] + [f"{c}, ε={e:g}" for e in EPSILONS
                    for c in ("σ_u² paper / rigorous", "σ_b² paper / rigorous",
                              "ObjPert σ² Kifer / tight")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in o.n_grid:
        cells = []
        for e in EPSILONS:
            paper = ip_calibration("paper", e, n, o.d, o.task, o.regs[e, "IP-paper"])
            rig = ip_calibration("rigorous", e, n, o.d, o.task, None)
            obj = objpert_gauss(epsilon=e, delta=DELTA, lam=o.task.lam, zeta=o.task.zeta)
            tight = (objpert_tight(e, o.d, o.task, o.regs[e, "ObjPert-tight"])
                     if "ObjPert-tight" in o.task.methods else None)
            cells += [f"{paper.sigma_u2:.3g} / {f'{rig.sigma_u2:.3g}' if rig else 'n/a'}",
                      f"{paper.sigma_b2:.4g} / {f'{rig.sigma_b2:.4g}' if rig else 'n/a'}",
                      f"{obj.sigma**2:.4g} / {f'{tight**2:.4g}' if tight else 'n/a'}"]
        lines.append(f"| {log2_label(n)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def peer_noise_line(o: Outcome) -> str:
    """SSP's and AdaSSP's noise (independent of n) and PrivateFW's per-step ε₀, per ε."""
    parts = []
    for e in EPSILONS:
        if "SSP" in o.task.methods:
            ssp = ssp_noise(epsilon=e, delta=DELTA, lam=o.task.lam, p_bound=o.task.p_bound)
            ada = adassp(epsilon=e, delta=DELTA, lam=o.task.lam, p_bound=o.task.p_bound, d=o.d)
            od = opendp_ssp_sigma(epsilon=e, delta=DELTA, lam=o.task.lam,
                                  p_bound=o.task.p_bound, d=o.d)
            parts.append(f"ε = {e:g}: SSP σ_gram = {ssp.sigma_gram:.3g}, σ_lin = "
                         f"{ssp.sigma_lin:.3g}; AdaSSP σ_eig = {ada.sigma_eig:.3g}, σ_gram = "
                         f"{ada.sigma_gram:.3g}, σ_lin = {ada.sigma_lin:.3g}, ridge target "
                         f"{ada.ridge_target:.3g}; OpenDP-SSP σ = {od:.3g}")
        if "PrivateFW" in o.task.methods:
            steps = int(o.regs[e, "PrivateFW"])
            parts.append(f"ε = {e:g}: PrivateFW T = {steps}, ε₀ = "
                         f"{pfw_step_epsilon(epsilon=e, delta=DELTA, steps=steps):.3g} per step")
    return "; ".join(parts) + "."


def fmt_reg(method: str, value: float, task: Task, e: float) -> str:
    """A tuned value, with its multiple of 2λ/ε for the ridge methods."""
    if method.startswith("OutPert"):
        return f"Λ = 2^{round(math.log2(value))}"
    if method == "diffprivlib":
        return f"C = 2^{round(math.log2(value))}" if task.loss == "logistic" else "—"
    if method == "PrivateFW":
        return f"T = {int(value)}"
    if method in ("SSP", "AdaSSP", "OpenDP-SSP"):
        return "adaptive" if method == "AdaSSP" else "—"
    if method == "TukeyEM":
        return f"m = n/({value:g}·d)"
    if method == "IP-rigorous":
        return "Δ_in by Step 8"
    if method in KANG_C:
        return f"Δ = {value / task.lam:g}·λ"
    name = "Δ_in" if method in IP_METHODS else "Δ"
    return f"{name} = {value:.4g} ({value / (2 * task.lam / e):.3g}·2λ/ε)"


def regs_table(outcomes: list[Outcome], domain: str) -> str:
    """The regulariser each method was tuned to, per data set, task and ε, for one domain."""
    picked = [o for o in outcomes if o.task.domain == domain]
    methods = picked[0].task.private
    head = ["data", "task", "ε", *methods]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for o in picked:
        for e in EPSILONS:
            cells = [fmt_reg(m, o.regs[e, m], o.task, e) if (e, m) in o.regs else "—"
                     for m in methods]
            lines.append(f"| {o.source} | {o.task.name} | {e:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


STYLE = {
    "NP": ("black", "o", "-"), "IP-rigorous": ("tab:red", "s", "-"),
    "IP-paper": ("tab:orange", "D", "-"), "ObjPert-Gauss": ("tab:blue", "^", "-"),
    "ObjPert-tight": ("tab:cyan", "v", "--"), "OutPert-Laplace": ("tab:green", "<", ":"),
    "OutPert-Gauss": ("tab:olive", ">", ":"), "SSP": ("tab:purple", "P", "--"),
    "AdaSSP": ("tab:pink", "X", "-"), "diffprivlib": ("tab:brown", "*", "-."),
    "PrivateFW": ("tab:gray", "h", "-."), "OpenDP-SSP": ("indigo", "p", "--"),
    "TukeyEM": ("teal", "d", "-."), "Kang2020 c=1 (unproven)": ("gray", "1", ":"),
    "Kang2020 c=1e3 (unproven)": ("silver", "2", ":"),
    "Kang2020 c=1e6 (unproven)": ("darkgray", "3", ":"),
}


def plot(o: Outcome, path: Path) -> None:
    """One panel per ε: mean metric against log₂ n, one line per method (the tables give the std;
    with eleven methods, bands would hide the lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.log2(np.array(o.n_grid))
    fig, axes = plt.subplots(1, len(EPSILONS), figsize=(12, 4.8), sharey=True)
    for ax, e in zip(axes, EPSILONS, strict=True):
        for m in o.task.methods:
            s = o.scores[e, m]
            ok = ~np.isnan(s).all(axis=0)
            color, marker, style = STYLE[m]
            ax.plot(x[ok], np.nanmean(s[:, ok], axis=0), color=color, marker=marker, ls=style,
                    label=m, lw=1.5, ms=5)
        ax.plot(x, o.trivial.mean(axis=0), color="gray", ls="--", lw=1,
                label="trivial (predict 0)" if o.task.lower_is_better else "trivial (majority)")
        ax.set_title(f"ε = {e:g}, δ = {DELTA:g}")
        ax.set_xlabel("log₂ n")
        ax.set_xticks(x)
        ax.grid(alpha=0.3)
        if o.task.lower_is_better:
            ax.set_yscale("log")
            floor = float(np.nanmin(o.scores[e, "NP"].mean(axis=0)))
            ax.set_ylim(0.8 * floor, 3.0 * float(np.nanmax(o.trivial.mean(axis=0))))
        else:
            ax.set_ylim(0.35, 1.0)
    axes[0].set_ylabel(f"test {o.task.metric}")
    axes[-1].legend(loc="best", fontsize=7, ncol=2)
    fig.suptitle(f"{o.source}: {TASK_TITLES[o.task.name]} (d = {o.d}, "
                 f"{o.scores[EPSILONS[0], 'NP'].shape[0]} trials)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
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
        regs_table(outcomes, "ball"),
        "",
        regs_table(outcomes, "simplex"),
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
        out += [("Paired differences (mean over trials; positive = IP-rigorous worse; RMSE in "
                 "absolute units and % of the other method; accuracy in percentage points; "
                 "\\* = more than 2 standard errors from 0). The best central peer is picked per "
                 "cell by its mean test metric, which slightly favours it:"),
                "", gap_table(o), ""]
        for e in EPSILONS:
            out.append(f"- ε = {e:g}: {paper_verdict(o, e)}; {central_verdict(o, e)}.")
        if o.task.domain == "ball":
            out += ["", ("Noise actually used (σ_u² is n times the per-coordinate variance of u; "
                         "σ_b² likewise for r; ObjPert's b has variance σ² per coordinate):"), "",
                    noise_table(o)]
        out += ["", peer_noise_line(o)]
    return "\n".join(out) + "\n"


#: Where the tables go under --out (or docs/ with --write-docs): a page of their own, beside
#: the plots, linked from benchmarks.md, whose Accuracy section says what they measure.
TABLES_PAGE = Path("benchmarks") / "accuracy.md"
#: Where a run writes unless told otherwise: never the repository's docs/, which only
#: --write-docs regenerates.
DEFAULT_OUT = Path("bench-out")

SKELETON = """# Accuracy: every table

{block}"""


def write_section(md: Path, generated: str) -> None:
    """Put `generated` between the `bench.accuracy` markers of `md`, leaving the rest untouched
    (a new page if `md` does not exist)."""
    if replace_block(md, "bench.accuracy", generated):
        return
    text = md.read_text(encoding="utf-8").rstrip("\n") + "\n\n" if md.exists() else ""
    block = f"{BEGIN}\n{generated}{END}\n"
    md.write_text(text + block if text else SKELETON.format(block=block), encoding="utf-8")


def command_line(args: argparse.Namespace, trials: int) -> str:
    """The canonical command that reproduces a run."""
    parts = ["python -m bench.accuracy"]
    if args.quick:
        parts.append("--quick")
    parts.append(f"--trials {trials}")
    if args.seed:
        parts.append(f"--seed {args.seed}")
    if args.write_docs:
        parts.append("--write-docs")
    elif args.out is not None:
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
                             "prints the tables and writes nothing unless --out or --write-docs "
                             "is given.")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=None,
                       help=f"Directory for benchmarks/accuracy.md (the block between its "
                            f"bench.accuracy markers) and benchmarks/*.png (default: "
                            f"{DEFAULT_OUT}/ in the current directory).")
    where.add_argument("--write-docs", dest="write_docs", action="store_true",
                       help="Write them into the repository's docs/ instead: regenerate the "
                            "published page and plots.")
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
    except (DataUnavailable, ImportError) as exc:
        print(f"bench.accuracy: {exc} (the dev extra has every package the study needs)",
              file=sys.stderr)
        return 2
    wall = time.perf_counter() - start
    if args.write_docs:
        out_dir = DOCS
    else:
        out_dir = args.out if args.out is not None else (None if args.quick else DEFAULT_OUT)
    figures: dict[str, str] = {}
    if out_dir is not None and not args.quick:
        (out_dir / TABLES_PAGE.parent).mkdir(parents=True, exist_ok=True)
        for o in outcomes:
            # Named relative to the tables page, which sits beside the plots.
            name = f"accuracy-{o.source}-{o.task.name}.png"
            plot(o, out_dir / TABLES_PAGE.parent / name)
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
        (out_dir / TABLES_PAGE.parent).mkdir(parents=True, exist_ok=True)
        write_section(out_dir / TABLES_PAGE, report)
        print(f"bench.accuracy: wrote {out_dir / TABLES_PAGE} ({meta['wall']})",
              file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m bench.accuracy`."""
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench.accuracy",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
