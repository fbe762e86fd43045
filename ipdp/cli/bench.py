"""`ipdp bench accuracy|throughput|credentials|devices|flood|two-server`, `ipdp soak` and `ipdp audit`:
bench/, which prints tables."""

from __future__ import annotations

import argparse
import importlib

AUDIT_DESCRIPTION = (
    "Runs the mechanism as deployed (device noise, fold, constrained solve) on worst-case "
    "replace-one neighbours many times and prints a Clopper–Pearson lower bound ε̂ at δ. ε̂ > ε "
    "refutes the claim; ε̂ ≤ ε is what a correct calibration shows. --noise-scale 0.5 "
    "under-noises on purpose, to show the audit can fail; --exact-fold draws the fold from its "
    "exact law (any n); --two-server runs every record through the two-server encoding, "
    "shares and dither; --mechanism kang2020 audits Kang et al. (2020) as published "
    "(docs/privacy.md).")


def add_commands(sub: argparse._SubParsersAction, words: list[str] | None = None, *,
                 two_server_soak: bool = False) -> None:
    """Register `bench`, `soak` and `audit` (bench/ is installed with ipdp).

    A command's flags come from its bench module, which imports what the benchmark runs: only
    the command ``words`` names gets them (``None``: every command). ``two_server_soak``: the
    command line has `--two-server`, so `soak` takes bench.two_server_soak's flags, not
    bench.soak's."""

    def wanted(*path: str) -> bool:
        return words is None or words[:len(path)] == list(path)

    def flags(p: argparse.ArgumentParser, module: str, run: str, *path: str,
              docstring_is_description: bool = False) -> None:
        if not wanted(*path):
            return
        bench_module = importlib.import_module(f"bench.{module}")
        bench_module.add_arguments(p)
        if docstring_is_description:
            p.description = bench_module.__doc__
            p.formatter_class = argparse.RawDescriptionHelpFormatter
        p.set_defaults(func=getattr(bench_module, run))

    bench = sub.add_parser("bench", help="Benchmarks that print tables (docs/benchmarks.md).")
    kinds = bench.add_subparsers(dest="kind", required=True, metavar="KIND")
    p = kinds.add_parser("accuracy", help="The paper's Figures 1 and 2, and baselines.")
    flags(p, "accuracy", "run_from_args", "bench", "accuracy")
    p = kinds.add_parser("throughput", help="Fold path, end to end, trainer and memory.")
    flags(p, "throughput", "run", "bench", "throughput")
    p = kinds.add_parser("credentials", help="What device credentials cost at the gateway and "
                         "the aggregator.")
    flags(p, "credentials", "run", "bench", "credentials")
    p = kinds.add_parser(
        "devices", help="One record per request, driven by wrk: the gateway against a bare "
        "Starlette endpoint.")
    flags(p, "devices", "run", "bench", "devices", docstring_is_description=True)
    p = kinds.add_parser(
        "flood", help="Floods against a live gateway and aggregator: re-sent records and "
        "connections, with honest devices alongside.")
    flags(p, "flood", "run", "bench", "flood", docstring_is_description=True)
    p = kinds.add_parser(
        "two-server", help="Two-server mode: the device's cost, bytes on the wire, the leader's "
        "fold, the helper's rate, end to end, and accuracy against one-server.")
    flags(p, "two_server", "run", "bench", "two-server", docstring_is_description=True)
    p = sub.add_parser("soak", help="SIGKILL the aggregator hundreds of times (--two-server: "
                       "the aggregator, the helper, both Redis and the trainer); check "
                       "invariants.")
    p.add_argument("--two-server", dest="two_server", action="store_true",
                   help="Run the two-server soak (bench/two_server_soak.py) instead, with its "
                   "own flags (`ipdp soak --two-server --help`).")
    if two_server_soak:
        flags(p, "two_server_soak", "run", "soak", docstring_is_description=True)
    else:
        flags(p, "soak", "run", "soak")
    p = sub.add_parser(
        "audit", help="Empirical privacy audit: a lower bound on ε from the deployed mechanism.",
        description=AUDIT_DESCRIPTION)
    flags(p, "audit", "run", "audit")
