"""How far k accepted records move a round's model: the influence table of docs/security.md.

A round holds n records. The baseline model w₀ is trained on n honest records. Then k of them
are replaced — by k other honest records (the spread an honest round has anyway), or by k
records an attacker crafted to move the model as far as it can while passing the aggregator's
acceptance checks:

- ``crafted, q̃ ∥ w₀``: p̃ = −(largest accepted ‖p̃‖)·ŵ₀ and q̃ = (largest accepted ‖q̃‖)·ŵ₀.
  Each record's gradient q̃q̃ᵀw − p̃ then points along ŵ₀ on both terms while wᵀŵ₀ > 0: the
  largest push against w₀ one record can make.
- ``crafted, q̃ ⊥ w₀``: the same p̃, and q̃ of the smallest accepted norm orthogonal to ŵ₀ (in the
  direction where the honest curvature is largest, so it adds the least resistance): no
  curvature holds w back once it has crossed zero, which is what reverses a model.
- ``noise-free``: clean records at the clipping bounds sent without noise, q = √λ·e (e ⊥ ŵ₀),
  p = −P·ŵ₀: what a client that fills a round with unperturbed records can do.

Every record goes through the wire format and the aggregator's own stateless checks
(aggregator.validate.Validator: decoding, study, dimension, norm bounds, time window); a crafted
record the checks refuse is dead-lettered, and an honest record takes its place in the round.
The fold and the solve are computed in-process — A = Σ q̃q̃ᵀ and b = Σ p̃ over the round's accepted
records, exactly the sums the aggregator folds into Redis, and w = trainer.solver's minimiser
of ½wᵀ(A + Δ_in I)w − bᵀw over ‖w‖ ≤ η — so this measures the mathematics of the service, not
the service. Honest rows come from the load generator's synthetic data set
(producer.datasets.synthetic, squared loss) and the device code (ipdp.losses.prepare) with a
seeded generator.

Usage: python -m bench.influence [--n 1000] [--d 14] [--epsilon 1] [--delta 0.01]
       [--delta-in Δ] [--k 1 10 100] [--seeds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from aggregator.batch import Message, Polled
from aggregator.validate import Validator
from ipdp.calibration import Calibration, record_norm_bounds
from ipdp.influence import influence_bound
from ipdp.losses import prepare
from ipdp.study import Study
from ipdp.wire import encode_batch
from producer.contributor import new_record_ids
from producer.datasets import synthetic
from trainer.solver import solve_constrained

SCENARIOS = ("honest", "crafted, q̃ ∥ w₀", "crafted, q̃ ⊥ w₀", "noise-free")
INSIDE = 1.0 - 1e-9
"""Crafted norms are set this far inside an acceptance bound, so rounding never crosses it."""


@dataclass(frozen=True)
class Row:
    """One (scenario, k) over all seeds."""

    scenario: str
    k: int
    accepted: float
    """Mean number of the k replacing records the checks accepted."""
    move_mean: float
    """Mean ‖w − w₀‖ over the seeds."""
    move_max: float
    cos_mean: float
    """Mean cos(w, w₀)."""
    cos_min: float
    bound: float
    """influence_bound(k): the most any k accepted records can move w (w.p. ≥ 1 − δ)."""


def accepted_rows(study: Study, q: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Which of the records (q̃, p̃) pass aggregator.validate's checks (a boolean per row)."""
    now_ms = int(time.time() * 1000)
    values = encode_batch(study.hash, new_record_ids(len(q)),
                          np.full(len(q), now_ms, np.int64), q, p)
    validator = Validator(replay_window_s=3600, max_future_skew_s=60,
                          max_message_bytes=1 << 20)
    polled = Polled.of([Message(0, i, v) for i, v in enumerate(values)])
    _, valid = validator.validate(polled, validator.decode(polled), {study.hash: study}, {},
                                  now_ms)
    ok = np.zeros(len(q), bool)
    for rows in valid:
        ok[rows.row] = True
    return ok


def crafted(scenario: str, k: int, cal: Calibration, w0: np.ndarray,
            a_honest: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """k copies of the scenario's record, aimed against w₀."""
    bounds = record_norm_bounds(cal)
    toward = w0 / np.linalg.norm(w0)
    # Across: the direction ⊥ ŵ₀ with the most honest curvature (extra curvature there costs
    # the attacker least).
    proj = np.eye(len(w0)) - np.outer(toward, toward)
    across = np.linalg.eigh(proj @ a_honest @ proj)[1][:, -1]
    if scenario == "crafted, q̃ ∥ w₀":
        q, p = INSIDE * bounds.q_high * toward, -INSIDE * bounds.p_high * toward
    elif scenario == "crafted, q̃ ⊥ w₀":
        q, p = bounds.q_low / INSIDE * across, -INSIDE * bounds.p_high * toward
    else:
        q, p = np.sqrt(cal.lam) * across, -cal.p_bound * toward
    return np.tile(q, (k, 1)), np.tile(p, (k, 1))


def model(cal: Calibration, q: np.ndarray, p: np.ndarray) -> np.ndarray:
    """The trainer's w for a round whose accepted records are (q̃, p̃)."""
    a = q.T @ q + cal.delta_in * np.eye(q.shape[1])
    return solve_constrained(a, p.sum(axis=0), cal.eta).w


def measure(study: Study, ks: list[int], seeds: int) -> list[Row]:
    """The influence table: every scenario at every k, `seeds` rounds each."""
    cal, n, d = study.calibration, study.n, study.d
    spare = 2 * max(ks)
    found: dict[tuple[str, int], list[tuple[int, float, float]]] = {}
    for seed in range(seeds):
        data = synthetic(n + spare, d, "squared", seed=seed)
        q, p = prepare("squared", data.x, data.y, cal, np.random.default_rng(10_000 + seed))
        q0, p0 = q[:n], p[:n]
        w0 = model(cal, q0, p0)
        for k in ks:
            keep_q, keep_p = q0[k:], p0[k:]
            for scenario in SCENARIOS:
                if scenario == "honest":
                    new_q, new_p = q[n:n + k], p[n:n + k]
                else:
                    new_q, new_p = crafted(scenario, k, cal, w0, keep_q.T @ keep_q)
                ok = accepted_rows(study, new_q, new_p)
                fill = k - int(ok.sum())  # refused records: later honest ones fill the round
                rq = np.concatenate([keep_q, new_q[ok], q[n + k:n + k + fill]])
                rp = np.concatenate([keep_p, new_p[ok], p[n + k:n + k + fill]])
                w = model(cal, rq, rp)
                cos = float(w @ w0 / (np.linalg.norm(w) * np.linalg.norm(w0)))
                found.setdefault((scenario, k), []).append(
                    (int(ok.sum()), float(np.linalg.norm(w - w0)), cos))
    rows = []
    for (scenario, k), runs in found.items():
        acc, move, cos = (np.array(c) for c in zip(*runs, strict=True))
        rows.append(Row(scenario, k, float(acc.mean()), float(move.mean()), float(move.max()),
                        float(cos.mean()), float(cos.min()), influence_bound(cal, k)))
    return sorted(rows, key=lambda r: (r.k, SCENARIOS.index(r.scenario)))


def table(study: Study, rows: list[Row], seeds: int) -> str:
    """Markdown table of the rows, headed by the acceptance bounds in force."""
    cal = study.calibration
    b = record_norm_bounds(cal)
    head = (f"n = {study.n}, d = {study.d}, ε = {cal.epsilon:g}, δ = {cal.delta:g}, "
            f"λ = {cal.lam:g}, P = {cal.p_bound:g}, η = {cal.eta:g}, Δ_in = {cal.delta_in:g}; "
            f"accepted ‖q̃‖ ∈ [{b.q_low:.4g}, {b.q_high:.4g}], ‖p̃‖ ∈ [{b.p_low:.4g}, "
            f"{b.p_high:.4g}]; {seeds} seeds; bound: the largest move k accepted records can "
            f"cause (docs/security.md), ≥ 2η = {2 * cal.eta:g} says nothing\n\n")
    lines = [("| k | records | accepted | ‖w − w₀‖ mean | ‖w − w₀‖ max | cos(w, w₀) mean | "
              "cos(w, w₀) min | bound |"),
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r.k} | {r.scenario} | {r.accepted:g} of {r.k} | {r.move_mean:.3f} | "
              f"{r.move_max:.3f} | {r.cos_mean:.3f} | {r.cos_min:.3f} | {r.bound:.3g} |"
              for r in rows]
    return head + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench.influence",
                                     description=__doc__.split("\n", 1)[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--d", type=int, default=14)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=0.01)
    parser.add_argument("--delta-in", dest="delta_in", type=float, default=None,
                        help="Δ_in, the trainer's ridge (default: the study's, which Step 8 "
                             "chooses); 0 for no ridge")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="One JSON object instead of a table.")
    args = parser.parse_args(argv)
    if min(args.k) < 1 or max(args.k) >= args.n or args.seeds < 1:
        parser.error("need 1 ≤ k < n and --seeds ≥ 1")
    study = Study(study_id="influence", d=args.d, n=args.n, epsilon=args.epsilon,
                  delta=args.delta, delta_in=args.delta_in)
    rows = measure(study, args.k, args.seeds)
    if args.json:
        json.dump({"n": args.n, "d": args.d, "epsilon": args.epsilon, "delta": args.delta,
                   "delta_in": study.calibration.delta_in, "seeds": args.seeds,
                   "bounds": asdict(record_norm_bounds(study.calibration)),
                   "rows": [asdict(r) for r in rows]}, sys.stdout, ensure_ascii=False)
        print()
    else:
        print(table(study, rows, args.seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
