"""`ipdp bench accuracy|throughput` and `ipdp soak`: the benchmarks in bench/."""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register `bench` and `soak` (bench/ is installed with ipdp)."""
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
