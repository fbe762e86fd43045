"""The n advice against measurement: does the promise `ipdp calibrate` and `ipdp study create`
print hold at the n they advise, on the accuracy benchmark's tables?

For each table (synthetic, flights), loss (linear and logistic regression, the ball domain of
bench.accuracy's tasks: the bounds a schema study has), ε ∈ {0.1, 0.3, 1} (δ = 0.01), and each
assumption about the target's spread (linear: the worst case its range allows, half the range,
and the table's own standard deviation given as `--target-sd` would give it), ipdp.sample_size
names the advised n and its promise:

- linear: test RMSE ≤ √(RMSE_NP² + τ²), τ = margin × s (default a tenth of s);
- logistic: test accuracy at most the margin (default 0.02) below NP's,

NP being the non-private fit of the same rows (the trainer's solve on the clean statistics).
Each trial then draws the advised n training rows and max(n/4, 4,096) test rows, folds them with
their contributor noise and trains IP-rigorous with the calibration a study gets (bench.accuracy's
statistics and fit, the trainer's solver) and NP, and checks the promise on the test rows. The
table says how often it held at the advised n, and at a quarter of it (how much the advice
asks beyond need). Where the advised n is more than the table's rows, it says so and runs nothing.

Usage: python -m bench.predicted [--trials 20] [--quick] [--seed 0] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass

import numpy as np

from bench.accuracy import (
    DELTA,
    TASKS,
    Config,
    DataUnavailable,
    Noise,
    collect_stats,
    fit,
    pieces,
    rngs,
    sources,
)
from ipdp.sample_size import DEFAULT_MARGIN, sample_size

BALL_TASKS = tuple(t for t in TASKS if t.domain == "ball")
EPSILONS = (0.1, 0.3, 1.0)
QUICK_EPSILONS = (1.0,)
TEST_ROWS_MIN = 4096
"""Test rows per trial at least (else n/4): the promise is checked on a test set, not on noise."""
TRIAL_KIND = 2
"""bench.accuracy.rngs' `kind` of these trials (its own trials and tuning use 0 and 1)."""
HOLDS = 0.8
"""The advice passes on a row when its promise held in at least this share of the trials."""
STRICT_MARGIN = 0.1
"""A linear study given its target's s is also advised for τ = s/10: where the honest answer is
"more than the table has", the table shows it."""
WORST, GIVEN = "worst case (half the range)", "the table's s, given"


@dataclass(frozen=True)
class Row:
    """One table × loss × ε × assumption: the advice, and how often its promise held."""

    table: str
    loss: str
    epsilon: float
    assumption: str
    target_sd: float | None
    margin: float
    tolerance: float
    advised_n: int | None
    rows_available: int | None
    trials: int
    held: int | None
    """Trials whose promise held at the advised n; None where the table lacks the rows."""
    held_at_quarter: int | None
    """The same promise at a quarter of the advised n (a trial whose calibration refuses that n
    counts as not held); None where the table lacks the rows."""

    @property
    def more_than_table(self) -> bool:
        return self.advised_n is None or (self.rows_available is not None
                                          and self.advised_n > self.rows_available)

    @property
    def passed(self) -> bool | None:
        """The promise held in ≥ HOLDS of the trials; None where nothing ran."""
        return None if self.held is None else self.held >= HOLDS * self.trials

    def as_json(self) -> dict:
        return {"table": self.table, "loss": self.loss, "epsilon": self.epsilon,
                "assumption": self.assumption, "target_sd": self.target_sd,
                "margin": self.margin, "tolerance": self.tolerance, "advised_n": self.advised_n,
                "rows_available": self.rows_available, "more_than_table": self.more_than_table,
                "trials": self.trials, "held": self.held, "held_at_quarter": self.held_at_quarter,
                "passed": self.passed}


def rows_available(source) -> int | None:
    """The largest n with n training rows and max(n/4, TEST_ROWS_MIN) test rows; None: unlimited."""
    if math.isinf(source.n_train_pool):
        return None
    return int(min(source.n_train_pool, 4 * source.n_test_pool))


def target_sd(source, seed: int) -> float:
    """The table's target standard deviation (encoded units): what a user who knows the spread
    passes as --target-sd."""
    if hasattr(source, "y_train"):
        return float(np.std(source.y_train))
    return float(np.std(source.sample(np.random.default_rng([seed, 99]), 2**18)[1]))


def promise_held(task, tolerance: float, st, e: float, noise: Noise, x: np.ndarray,
                 t: np.ndarray) -> bool | None:
    """Whether the private model trained on st keeps the promise on the test rows (x, t) against
    NP on the same statistics; None where the calibration refuses st.n."""
    w_np = fit("NP", st, task, e, 0.0, None)
    w = fit("IP-rigorous", st, task, e, 0.0, noise)
    if w is None:
        return None
    # (Wᵀ·Xᵀ)ᵀ rather than X·W: OpenBLAS is much slower on the tall-skinny product.
    pred = (np.vstack([w_np, w]) @ x.T).T
    if task.loss == "squared":
        mse_np, mse = np.mean((pred - t[:, None]) ** 2, axis=0)
        return bool(mse <= mse_np + tolerance**2)
    acc_np, acc = np.mean(np.where(pred >= 0.0, 1.0, -1.0) == t[:, None], axis=0)
    return bool(acc >= acc_np - tolerance)


def run_row(source, task, e: float, assumption: str, sd: float | None, margin: float,
            trials: int, seed: int) -> Row:
    """The advice for one row, then `trials` trials at the advised n and at a quarter of it."""
    advice = sample_size(mode="rigorous", epsilon=e, delta=DELTA, n=2**13, d=source.d,
                         lam=task.lam, p_bound=task.p_bound, eta=task.eta, delta_in=None,
                         loss=task.loss, target_sd=sd, margin=margin)
    n = advice.advised_n
    available = rows_available(source)
    row = {"table": source.name, "loss": task.loss, "epsilon": e, "assumption": assumption,
           "target_sd": sd if sd is not None else advice.target_sd, "margin": advice.margin,
           "tolerance": advice.tolerance, "advised_n": n, "rows_available": available,
           "trials": trials}
    if n is None or (available is not None and n > available):
        return Row(**row, held=None, held_at_quarter=None)
    quarter = max(n // 4, 2)
    held, held_quarter = 0, 0
    for trial in range(trials):
        data_rng, test_rng, noise_rng, mech_rng, peer_rng = rngs(seed, source.name, task.loss,
                                                                 TRIAL_KIND, trial)
        stats = collect_stats(source.train_chunks(data_rng, pieces([quarter, n])), task,
                              noise_rng, [quarter, n], source.coord_bound)
        x, y = source.test_rows(test_rng, max(n // 4, TEST_ROWS_MIN))
        t = task.targets(y)
        noise = Noise.draw(mech_rng, peer_rng, source.d)
        held_quarter += bool(promise_held(task, advice.tolerance, stats[0], e, noise, x, t))
        held += bool(promise_held(task, advice.tolerance, stats[1], e, noise, x, t))
    return Row(**row, held=held, held_at_quarter=held_quarter)


def fmt_n(n: int | None) -> str:
    return "none up to 2^40" if n is None else f"{n:,}"


def promise_text(r: Row) -> str:
    if r.loss == "squared":
        return f"RMSE ≤ √(RMSE_NP² + {r.tolerance:.3g}²)"
    return f"accuracy ≥ NP's − {r.tolerance:g}"


def held_text(held: int | None, trials: int) -> str:
    return "—" if held is None else f"{held}/{trials}"


def report(rows: list[Row], command: str, wall: float) -> str:
    """The table and its verdict."""
    head = ("table", "loss", "ε", "s (target's SD) assumed", "margin", "advised n", "promise",
            "held at n", "held at n/4")
    lines = [(f"`{command}`, {wall:.0f} s; δ = {DELTA:g}; targets in encoded units "
              "(y ∈ [−1, 1]); NP is the non-private fit of the same rows:"), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        assumed = "—" if r.loss == "logistic" else f"{r.target_sd:.3g}: {r.assumption}"
        advised = fmt_n(r.advised_n)
        if r.more_than_table:
            advised += f": more than the table's {r.rows_available:,} rows" \
                if r.rows_available is not None else ""
        lines.append(f"| {r.table} | {'linear' if r.loss == 'squared' else 'logistic'} | "
                     f"{r.epsilon:g} | {assumed} | {r.margin:g} | {advised} | {promise_text(r)} | "
                     f"{held_text(r.held, r.trials)} | {held_text(r.held_at_quarter, r.trials)} |")
    ran = [r for r in rows if r.passed is not None]
    failed = [r for r in ran if not r.passed]
    lines += ["", f"At the advised n the promise held in ≥ {100 * HOLDS:.0f} % of the trials on "
              f"{len(ran) - len(failed)} of {len(ran)} rows that ran"
              + (f"; FAILED on {', '.join(f'{r.table} {r.loss} ε={r.epsilon:g}' for r in failed)}"
                 if failed else "") + f"; {len(rows) - len(ran)} row(s) need more rows than "
              "the table has."]
    return "\n".join(lines)


def plan(data, quick: bool, seed: int):
    """(source, task, ε, assumption, s given, margin) for every row of the table: each loss at
    its default margin, and a linear study given its table's s also at STRICT_MARGIN."""
    epsilons = QUICK_EPSILONS if quick else EPSILONS
    for source in data:
        sd = target_sd(source, seed)
        for task in BALL_TASKS:
            default = DEFAULT_MARGIN[task.loss]
            if task.loss == "logistic":
                cases = [("—", None, default)]
            elif quick:
                cases = [(WORST, None, default)]
            else:
                cases = [(WORST, None, default), (GIVEN, sd, default), (GIVEN, sd, STRICT_MARGIN)]
            for e in epsilons:
                for assumption, given, margin in cases:
                    yield source, task, e, assumption, given, margin


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench.predicted",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="Trials per row (default 20).")
    parser.add_argument("--quick", action="store_true",
                        help="Synthetic data, ε = 1, the worst-case spread only.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of every generator.")
    parser.add_argument("--json", action="store_true", help="Print one JSON object.")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    config = Config(trials=args.trials, seed=args.seed, quick=args.quick)
    start = time.perf_counter()
    try:
        data = sources(config)
    except (DataUnavailable, ImportError) as exc:
        print(f"bench.predicted: {exc}", file=sys.stderr)
        return 2
    rows = []
    for source, task, e, assumption, given, margin in plan(data, args.quick, args.seed):
        print(f"bench.predicted: {source.name} {task.loss} ε={e:g} {assumption}, margin "
              f"{margin:g} …", file=sys.stderr, flush=True)
        rows.append(run_row(source, task, e, assumption, given, margin, args.trials,
                            args.seed))
    command = "python -m bench.predicted" + (" --quick" if args.quick else "") + \
        f" --trials {args.trials}" + (f" --seed {args.seed}" if args.seed else "")
    wall = time.perf_counter() - start
    if args.json:
        print(json.dumps({"command": command, "seconds": round(wall, 1), "delta": DELTA,
                          "holds": HOLDS, "margins": DEFAULT_MARGIN,
                          "rows": [r.as_json() for r in rows]}, sort_keys=True))
    else:
        print(report(rows, command, wall))
    return 0


if __name__ == "__main__":
    sys.exit(main())
