"""`ipdp`: one entry point per role. Role modules are imported only by the command that runs them."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from pydantic import ValidationError

EXIT_USAGE = 2


class UsageError(Exception):
    """A bad parameter or file: printed without a traceback, exit status 2."""


def _study_flags(p: argparse.ArgumentParser, *, with_id: bool) -> None:
    if with_id:
        p.add_argument("--study-id", dest="study_id", help="Study id (letters, digits, . _ -).")
        p.add_argument("--loss", choices=["squared", "logistic"], default=None)
        p.add_argument("--max-rounds", dest="max_rounds", type=int, default=None)
    p.add_argument("--epsilon", type=float, help="Central ε of each model.")
    p.add_argument("--delta", type=float, help="Central δ of each model.")
    p.add_argument("--n", type=int, help="Records per round.")
    p.add_argument("--d", type=int, help="Dimension.")
    p.add_argument("--lam", type=float, default=None, help="λ: bound on ‖q‖² (default 1).")
    p.add_argument("--p-bound", dest="p_bound", type=float, default=None,
                   help="P: bound on ‖p‖ (default 1).")
    p.add_argument("--eta", type=float, default=None, help="η: bound on ‖w‖ (default 1).")
    p.add_argument("--mode", choices=["rigorous", "paper"], default=None)
    p.add_argument("--delta-in", dest="delta_in", type=float, default=None,
                   help="Δ_in ≥ 0, the trainer's ridge (paper mode: > 0).")


STUDY_FIELDS = ("study_id", "loss", "max_rounds", "epsilon", "delta", "n", "d", "lam", "p_bound",
                "eta", "mode", "delta_in")


def study_from_args(args: argparse.Namespace, base: dict | None = None):
    """Build a Study from flags (over an optional file's fields); errors become UsageError."""
    from ipdp.study import Study

    fields = dict(base or {})
    fields.update({k: getattr(args, k) for k in STUDY_FIELDS
                   if getattr(args, k, None) is not None})
    try:
        return Study(**fields)
    except ValidationError as exc:
        raise UsageError(format_validation_error(exc)) from None


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem: `parameter: message`, without pydantic's URLs."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "study"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}")
    return "invalid study parameters:\n  " + "\n  ".join(lines)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ipdp.report import calibration_table

    args.study_id = "calibrate"
    study = study_from_args(args)
    cal = study.calibration
    if args.json:
        print(json.dumps(cal.model_dump(), sort_keys=True))
    else:
        print(calibration_table(cal))
    return 0


def _lazy(module: str, func: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        import importlib

        return getattr(importlib.import_module(module), func)(args)

    return run


def build_parser() -> argparse.ArgumentParser:
    """The whole command tree; `ipdp COMMAND --help` documents each one."""
    parser = argparse.ArgumentParser(
        prog="ipdp",
        description="Differentially private model training by input perturbation, streamed "
        "through Kafka with sufficient statistics in Redis.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("calibrate", help="Noise and guarantees for a set of study parameters.")
    _study_flags(p, with_id=False)
    p.add_argument("--json", action="store_true", help="Print one JSON object.")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("up", help="Start the embedded Kafka-protocol broker and redis-server.")
    p.set_defaults(func=_lazy("ipdp.runtime", "cmd_up"))

    for role, text in (("aggregator", "Fold records into sufficient statistics in Redis."),
                       ("trainer", "Solve closed rounds and publish models.")):
        p = sub.add_parser(role, help=text)
        run = p.add_subparsers(dest="action", required=True, metavar="ACTION").add_parser(
            "run", help=text + " Settings come from IPDP_* environment variables.")
        run.add_argument("--idle-exit", dest="idle_exit", type=float, default=None,
                         help="Exit after this many seconds without work (default: never).")
        run.set_defaults(func=_lazy(f"{role}.service", "cmd_run"))

    from ipdp import ops_cli
    from producer import cli as producer_cli
    from producer import demo

    ops_cli.add_commands(sub)
    producer_cli.add_commands(sub)
    demo.add_commands(sub)
    _bench_commands(sub)
    return parser


def _bench_commands(sub: argparse._SubParsersAction) -> None:
    """`ipdp bench accuracy|throughput` and `ipdp soak` (bench/, installed with ipdp)."""
    from bench import accuracy, soak, throughput

    bench = sub.add_parser("bench", help="Benchmarks that print tables (docs/benchmarks.md).")
    kinds = bench.add_subparsers(dest="kind", required=True, metavar="KIND")
    p = kinds.add_parser("accuracy", help="The paper's Figures 1 and 2, and baselines.")
    accuracy.add_arguments(p)
    p.set_defaults(func=accuracy.run_from_args)
    p = kinds.add_parser("throughput", help="Fold path, end to end, trainer and memory.")
    throughput.add_arguments(p)
    p.set_defaults(func=throughput.run)
    p = sub.add_parser("soak", help="SIGKILL the aggregator hundreds of times; check invariants.")
    soak.add_arguments(p)
    p.set_defaults(func=soak.run)


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from ipdp.process import setup_logging

    setup_logging()
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"ipdp {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RuntimeError as exc:
        from ipdp.clients import RedisAuthError  # only imported on this error path

        if not isinstance(exc, RedisAuthError):
            raise
        print(f"ipdp {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # `python -m ipdp.cli` runs this file as __main__; commands raise ipdp.cli's UsageError, so
    # run the imported module's main, whose except clauses name the same classes.
    from ipdp.cli import main as imported_main

    sys.exit(imported_main())
