"""`ipdp bench accuracy|throughput|credentials|devices|flood`, `ipdp soak` and `ipdp audit`: bench/,
which prints tables."""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register `bench`, `soak` and `audit` (bench/ is installed with ipdp)."""
    from bench import accuracy, audit, credentials, devices, flood, soak, throughput

    bench = sub.add_parser("bench", help="Benchmarks that print tables (docs/benchmarks.md).")
    kinds = bench.add_subparsers(dest="kind", required=True, metavar="KIND")
    p = kinds.add_parser("accuracy", help="The paper's Figures 1 and 2, and baselines.")
    accuracy.add_arguments(p)
    p.set_defaults(func=accuracy.run_from_args)
    p = kinds.add_parser("throughput", help="Fold path, end to end, trainer and memory.")
    throughput.add_arguments(p)
    p.set_defaults(func=throughput.run)
    p = kinds.add_parser("credentials", help="What device credentials cost at the gateway and "
                         "the aggregator.")
    credentials.add_arguments(p)
    p.set_defaults(func=credentials.run)
    p = kinds.add_parser(
        "devices", help="One record per request, driven by wrk: the gateway against a bare "
        "Starlette endpoint.", description=devices.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    devices.add_arguments(p)
    p.set_defaults(func=devices.run)
    p = kinds.add_parser(
        "flood", help="Floods against a live gateway and aggregator: re-sent records and "
        "connections, with honest devices alongside.", description=flood.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    flood.add_arguments(p)
    p.set_defaults(func=flood.run)
    p = sub.add_parser("soak", help="SIGKILL the aggregator hundreds of times; check invariants.")
    soak.add_arguments(p)
    p.set_defaults(func=soak.run)
    p = sub.add_parser(
        "audit", help="Empirical privacy audit: a lower bound on ε from the deployed mechanism.",
        description="Runs the mechanism as deployed (device noise, fold, constrained solve) on "
        "worst-case replace-one neighbours many times and prints a Clopper–Pearson lower bound "
        "ε̂ at δ. ε̂ > ε refutes the claim; ε̂ ≤ ε is what a correct calibration shows. "
        "--noise-scale 0.5 under-noises on purpose, to show the audit can fail; --exact-fold "
        "draws the fold from its exact law (any n); --mechanism kang2020 audits Kang et al. "
        "(2020) as published (docs/privacy.md).")
    audit.add_arguments(p)
    p.set_defaults(func=audit.run)
