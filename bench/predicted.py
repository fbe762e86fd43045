"""Predicted against measured error of IP-rigorous over n and ε, on the accuracy benchmark's tasks.

What `ipdp calibrate` and `ipdp study create` print before anyone contributes (ipdp.sample_size,
the prediction Step 8 minimises) next to what the benchmark measures on the same rows, noise
and seeds as `python -m bench.accuracy` (its data, statistics and fit are reused):

- linear regression: predicted R against the measured excess test MSE of IP-rigorous over the
  non-private fit NP, MSE(IP) − MSE(NP); the zero model's predicted μη² against its measured
  excess, MSE(0) − MSE(NP).
- logistic regression: predicted D (the squared error of w's direction relative to the zero
  model's 1) against the measured ‖w/‖w‖ − w_NP/‖w_NP‖‖² (the turn only: D also counts the part of
  b's noise along w, a 1/d share).

Each cell is predicted / measured (mean over trials); "least useful n" is the least n the
prediction names for the margin (ipdp.sample_size) and the least n of the grid at which the
measured error is at most 1 − margin of the zero model's measured error.

Usage: python -m bench.predicted [--trials 10] [--quick] [--margin 0.5] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from bench.accuracy import (
    DELTA,
    EPSILONS,
    TASKS,
    Config,
    DataUnavailable,
    Noise,
    collect_stats,
    fit,
    ip_calibration,
    log2_label,
    n_grid_for,
    pieces,
    rngs,
    sources,
)
from ipdp.sample_size import DEFAULT_MARGIN, model_error, sample_size

BALL_TASKS = tuple(t for t in TASKS if t.domain == "ball")


def measure(source, task, n_grid, trials: int, seed: int) -> dict:
    """Per ε: the measured error of IP-rigorous and of the zero model, (trials, len n) arrays
    (NaN where the calibration refuses n), on the accuracy benchmark's trial rows and noise."""
    private = {e: np.full((trials, len(n_grid)), np.nan) for e in EPSILONS}
    zero = np.full((trials, len(n_grid)), np.nan)
    for t in range(trials):
        data_rng, test_rng, noise_rng, mech_rng, peer_rng = rngs(seed, source.name, task.loss, 0,
                                                                 t)
        stats = collect_stats(source.train_chunks(data_rng, pieces(n_grid)), task, noise_rng,
                              n_grid, source.coord_bound)
        x_test, y_test = source.test_rows(test_rng, n_grid[-1] // 4)
        t_test = task.targets(y_test)
        for j, st in enumerate(stats):
            x, tt = x_test[: st.n // 4], t_test[: st.n // 4]
            w_np = fit("NP", st, task, EPSILONS[0], 0.0, None)
            mse_np = float(np.mean((x @ w_np - tt) ** 2))
            zero[t, j] = float(np.mean(tt**2)) - mse_np
            for e in EPSILONS:
                noise = Noise.draw(mech_rng, peer_rng, source.d)
                w = fit("IP-rigorous", st, task, e, 0.0, noise)
                if w is None:
                    continue
                if task.loss == "squared":
                    private[e][t, j] = float(np.mean((x @ w - tt) ** 2)) - mse_np
                else:
                    private[e][t, j] = float(np.sum((unit(w) - unit(w_np)) ** 2))
    return {"private": private, "zero": zero}


def unit(w: np.ndarray) -> np.ndarray:
    """w/‖w‖, or 0 for w = 0 (a zero model has no direction: its error counts as 1)."""
    norm = float(np.linalg.norm(w))
    return w / norm if norm > 0.0 else w


def predicted(task, e: float, n: int, d: int) -> float | None:
    """R or D of the calibration a study with these parameters gets; None where it refuses n."""
    cal = ip_calibration("rigorous", e, n, d, task, None)
    return None if cal is None else model_error(cal, task.loss)


def least_measured_n(task, n_grid, private: np.ndarray, zero: np.ndarray,
                     margin: float) -> str:
    """The least n of the grid whose mean measured error is at most 1 − margin of the zero
    model's (1 for a direction), else '> largest n'."""
    for j, n in enumerate(n_grid):
        column = private[:, j]
        if np.isnan(column).any():
            continue
        reference = 1.0 if task.loss == "logistic" else float(np.mean(zero[:, j]))
        if float(np.mean(column)) <= (1.0 - margin) * reference:
            return log2_label(n)
    return f"> {log2_label(n_grid[-1])}"


def fmt(value: float | None) -> str:
    return "n/a" if value is None or np.isnan(value) else f"{value:.3g}"


def report(source, results: dict, n_grid, margin: float) -> str:
    """One table per data set: rows n, a predicted / measured cell per task and ε."""
    cols = [(task, e) for task in BALL_TASKS for e in EPSILONS]
    head = ["n", *(f"{task.name} ε={e:g}" for task, e in cols),
            "zero model (linear): μη² / measured"]
    title = (f"{source.name}, d = {source.d}, δ = {DELTA:g}; each cell predicted / measured "
             "(R and excess test MSE for linear, D and direction error for logistic):")
    lines = [title, "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    linear = next(t for t in BALL_TASKS if t.loss == "squared")
    for j, n in enumerate(n_grid):
        cells = []
        for task, e in cols:
            measured = results[task.name]["private"][e][:, j]
            value = None if np.isnan(measured).any() else float(np.mean(measured))
            cells.append(f"{fmt(predicted(task, e, n, source.d))} / {fmt(value)}")
        zero_pred = linear.lam / source.d * linear.eta**2
        zero_meas = float(np.mean(results[linear.name]["zero"][:, j]))
        cells.append(f"{fmt(zero_pred)} / {fmt(zero_meas)}")
        lines.append(f"| {log2_label(n)} | " + " | ".join(cells) + " |")
    lines += ["", f"Least useful n at margin {margin:g} (predicted / measured on the grid): "
              + "; ".join(
                  f"{task.name} ε={e:g}: {least_predicted(task, e, source.d, margin):,} / "
                  + least_measured_n(task, n_grid, results[task.name]["private"][e],
                                     results[task.name]["zero"], margin)
                  for task, e in cols) + "."]
    return "\n".join(lines)


def least_predicted(task, e: float, d: int, margin: float) -> int:
    """ipdp.sample_size's least useful n for a study with the task's bounds."""
    size = sample_size(mode="rigorous", epsilon=e, delta=DELTA, n=2**13, d=d, lam=task.lam,
                       p_bound=task.p_bound, eta=task.eta, delta_in=None, loss=task.loss,
                       margin=margin)
    return size.least_useful_n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench.predicted",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10, help="Trials per point (default 10).")
    parser.add_argument("--quick", action="store_true",
                        help="Synthetic data, n ∈ {2^7, 2^9, 2^11} only.")
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                        help=f"Margin over the zero model (default {DEFAULT_MARGIN}).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of every generator.")
    args = parser.parse_args(argv)
    config = Config(trials=args.trials, seed=args.seed, quick=args.quick)
    start = time.perf_counter()
    try:
        data = sources(config)
    except (DataUnavailable, ImportError) as exc:
        print(f"bench.predicted: {exc}", file=sys.stderr)
        return 2
    out = []
    for source in data:
        grid = n_grid_for(source, config)
        results = {task.name: measure(source, task, grid, args.trials, args.seed)
                   for task in BALL_TASKS}
        out.append(report(source, results, grid, args.margin))
    command = "python -m bench.predicted" + (" --quick" if args.quick else "") + \
        f" --trials {args.trials}" + (f" --seed {args.seed}" if args.seed else "") + \
        (f" --margin {args.margin:g}" if args.margin != DEFAULT_MARGIN else "")
    wall = time.perf_counter() - start
    print(f"`{command}`, {wall:.0f} s:\n\n" + "\n\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
