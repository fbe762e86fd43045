"""What a command costs before it does anything: the wall time of whole `ipdp` processes next to
`python -c "import numpy"` in the same run; prints a markdown table.

    python -m bench.startup [--runs 15]

Each command and the reference run in turn (A B A B …, after one warm-up each), so a drift of
the machine's speed reaches both; the table gives each command's median and the median of its
run-by-run ratio to the reference. `ipdp study list` talks to Redis: the embedded runtime is
started for it, and its time includes the command's round trip to Redis.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ipdp.embedded import EmbeddedRuntime

REFERENCE = [sys.executable, "-c", "import numpy"]


def commands() -> dict[str, list[str]]:
    """The commands timed, by the name the table gives them."""
    ipdp = str(Path(sys.executable).with_name("ipdp"))
    return {
        "ipdp --help": [ipdp, "--help"],
        "ipdp study list": [ipdp, "study", "list"],
        "ipdp calibrate --epsilon 1 --delta 0.01 --n 10000 --d 14": [
            ipdp, "calibrate", "--epsilon", "1", "--delta", "0.01", "--n", "10000", "--d", "14"],
    }


def wall_s(argv: list[str], env: dict[str, str]) -> float:
    """Seconds from starting ``argv`` to its exit (its output discarded)."""
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {done.returncode}")
    return seconds


def measure(runs: int, env: dict[str, str]) -> list[list[str]]:
    """One row per command: its median, the reference's, the median ratio, min–max ratio."""
    rows = []
    for name, argv in commands().items():
        wall_s(argv, env), wall_s(REFERENCE, env)  # warm-up: page cache, .pyc files
        pairs = [(wall_s(argv, env), wall_s(REFERENCE, env)) for _ in range(runs)]
        ratios = [a / b for a, b in pairs]
        rows.append([f"`{name}`", f"{statistics.median(a for a, _ in pairs) * 1000:.0f}",
                     f"{statistics.median(b for _, b in pairs) * 1000:.0f}",
                     f"{statistics.median(ratios):.2f}",
                     f"{min(ratios):.2f}–{max(ratios):.2f}"])
    return rows


def run(args: argparse.Namespace) -> int:
    """Print the table."""
    with EmbeddedRuntime() as rt:
        env = {k: v for k, v in os.environ.items() if not k.startswith("IPDP_")}
        env.update(rt.env())
        rows = measure(args.runs, env)
    head = ["command", "median ms", "`python -c \"import numpy\"` median ms",
            "ratio (median)", "ratio (min–max)"]
    print(f"{args.runs} runs of each command, alternating with the reference\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=int, default=15, help="Runs of each command (default 15).")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
