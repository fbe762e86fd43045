#!/usr/bin/env python3
"""Mutation testing of the modules a guarantee rests on, one module at a time (docs/testing.md).

    python scripts/mutation.py                       # every module of [tool.mutmut] only_mutate
    python scripts/mutation.py producer/retry.py     # only these
    python scripts/mutation.py --survivors ipdp/losses.py   # its last survivors and timeouts

For each module it runs ``mutmut run`` on that module's mutants (mutmut runs, per mutant, only
the tests of ``pytest_add_cli_args_test_selection`` that called the mutated function), then
reads every mutant's status from ``mutmut results``, and prints the kill rate per module, how
many of its caught mutants only timed out, and every survivor with its change (``mutmut
show``). The table is also written as markdown and JSON (``--markdown``, ``--json``; under
mutants/ by default), with the modules of earlier runs kept from the JSON file, each with the
command its numbers come from. Survivors docs/testing.md names as
equivalent (its "Equivalent mutants" table) are counted apart: the kill rate is
killed / (mutants − equivalent).

The run is slow and CPU-bound: `make mutation` runs it with one worker at low priority.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTING_MD = REPO / "docs" / "testing.md"
MUTMUT = [sys.executable, "-m", "mutmut"]

#: mutmut's statuses (``mutmut results``) that count as a caught fault.
CAUGHT = {"killed", "timeout", "caught by type check"}


@dataclass
class ModuleResult:
    module: str
    mutants: int = 0
    killed: int = 0  # a test failed, or it timed out (``timeouts`` of them)
    timeouts: int | None = 0  # None: not recorded for the run the row comes from
    equivalent: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    survivors: dict[str, str] = field(default_factory=dict)  # name → status
    changes: dict[str, str] = field(default_factory=dict)  # name → the mutated lines

    @property
    def kill_rate(self) -> float:
        counted = self.mutants - self.equivalent
        return self.killed / counted if counted else 1.0


class RunFailed(Exception):
    """mutmut gave no verdict for some of a module's mutants."""


def configured_modules() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return list(config["tool"]["mutmut"]["only_mutate"])


def mutant_prefix(module: str) -> str:
    """mutmut's names of a module's mutants start with its dotted name."""
    return module.removesuffix(".py").replace("/", ".") + "."


def equivalent_mutants(text: str) -> set[str]:
    """The mutant names in the first column of docs/testing.md's "Equivalent mutants" table."""
    section = text.split("## Equivalent mutants", 1)
    if len(section) < 2:
        return set()
    body = section[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([\w.ǁ]+__mutmut_\d+)` \|", body, flags=re.MULTILINE))


def statuses() -> dict[str, str]:
    """Every mutant's status, as ``mutmut results --all true`` prints it."""
    out = subprocess.run([*MUTMUT, "results", "--all", "true"], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    return dict(re.findall(r"^\s+(\S+): (.+)$", out, flags=re.MULTILINE))


def change(name: str) -> str:
    """The lines a mutant changes (the - and + lines of ``mutmut show``)."""
    out = subprocess.run([*MUTMUT, "show", name], cwd=REPO, check=True, capture_output=True,
                         text=True).stdout
    lines = [line for line in out.splitlines()
             if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    return " / ".join(" ".join(line.split()) for line in lines)


def run_module(module: str, workers: int, equivalent: set[str],
               survivors_only: bool = False) -> ModuleResult:
    prefix = mutant_prefix(module)
    names = [prefix + "*"]
    if survivors_only:
        # mutmut keeps every mutant's last status: the survivors run again, and so do the
        # timeouts, which a loaded machine can cause without a fault being found, and the
        # mutants of a function changed since (mutmut has reset them to "not checked").
        names = [name for name, status in statuses().items()
                 if name.startswith(prefix)
                 and (status in ("timeout", "not checked")
                      or (status not in CAUGHT and name not in equivalent))]
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    if names:
        run = subprocess.run([*MUTMUT, "run", "--max-children", str(workers), *names], cwd=REPO,
                             check=False)
        if run.returncode != 0:  # e.g. the tests fail without a mutant: no verdict is known
            raise RunFailed(f"mutmut run exited with {run.returncode} on {module}")
    wall = time.monotonic() - start
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = ModuleResult(module, wall_s=wall,
                          cpu_s=(cpu_after.ru_utime - cpu_before.ru_utime)
                          + (cpu_after.ru_stime - cpu_before.ru_stime))
    for name, status in statuses().items():
        if not name.startswith(prefix):
            continue
        if status == "not checked":  # the run was stopped before this mutant
            raise RunFailed(f"{module}: {name} and maybe others were not run")
        result.mutants += 1
        if status in CAUGHT:
            result.killed += 1
            result.timeouts += status == "timeout"
        elif name in equivalent:
            result.equivalent += 1
        else:
            result.survivors[name] = status
    result.changes = {name: change(name) for name in result.survivors}
    return result


def markdown(rows: list[tuple[ModuleResult, str]]) -> str:
    """The kill-rate table, each module with the command its numbers come from, then every
    survivor."""
    header = ("| module | mutants | killed | of which timed out | equivalent | survived | "
              "kill rate | wall | CPU | command |")
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r, command in rows:
        timeouts = "–" if r.timeouts is None else r.timeouts
        lines.append(f"| `{r.module}` | {r.mutants} | {r.killed} | {timeouts} | {r.equivalent} | "
                     f"{len(r.survivors)} | {100 * r.kill_rate:.1f} % | {r.wall_s:.0f} s | "
                     f"{r.cpu_s:.0f} s | `{command}` |")
    survivors = [(name, status, r.changes.get(name, ""))
                 for r, _ in rows for name, status in r.survivors.items()]
    if survivors:
        lines += ["", "| survivor | status | change |", "|---|---|---|"]
        lines += [f"| `{name}` | {status} | `{text.replace('|', '¦')}` |"
                  for name, status, text in survivors]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help="paths from [tool.mutmut] only_mutate")
    parser.add_argument("--workers", type=int, default=1, help="mutmut's --max-children")
    parser.add_argument("--survivors", action="store_true",
                        help="run again only the mutants the last run did not kill by a failing "
                             "test, its survivors and its timeouts (after adding tests); the "
                             "time is then that of this run")
    parser.add_argument("--markdown", type=Path, default=REPO / "mutants" / "mutation.md")
    parser.add_argument("--json", type=Path, default=REPO / "mutants" / "mutation.json")
    args = parser.parse_args(argv)
    known = configured_modules()
    unknown = [m for m in args.modules if m not in known]
    if unknown:
        parser.error(f"not in [tool.mutmut] only_mutate: {', '.join(unknown)}")
    # The smallest first: their numbers are there early in a run that takes hours.
    modules = args.modules or sorted(known, key=lambda m: len((REPO / m).read_bytes()))
    equivalent = equivalent_mutants(TESTING_MD.read_text(encoding="utf-8")
                                    if TESTING_MD.exists() else "")
    command = " ".join(["python scripts/mutation.py", *(["--survivors"] if args.survivors
                                                         else []), *args.modules]) \
        if args.modules or args.survivors else "make mutation"
    results = []
    for module in modules:
        try:
            results.append(run_module(module, args.workers, equivalent, args.survivors))
        except RunFailed as failed:
            # Its row would count mutants that never ran as survivors: none is written.
            print(f"{failed}; no row written for it (mutmut's output is above)", file=sys.stderr)
            return 1
        r = results[-1]
        print(f"{module}: {r.killed}/{r.mutants - r.equivalent} killed "
              f"({100 * r.kill_rate:.1f} %; {r.timeouts} of them timed out), "
              f"{r.equivalent} equivalent, "
              f"{r.wall_s:.0f} s", flush=True)
        # Written after each module, so an interrupted run leaves the modules it finished.
        write(results, command.strip(), args.markdown, args.json)
    print(args.markdown.read_text(encoding="utf-8"))
    print(f"wrote {args.markdown} and {args.json}")
    return 0


def write(results: list[ModuleResult], command: str, md_path: Path, json_path: Path) -> None:
    """The table of every module's latest run: this run's modules, and from ``json_path`` the
    modules an earlier run left there."""
    latest = {}
    if json_path.exists():
        for row in json.loads(json_path.read_text(encoding="utf-8")):
            row.pop("kill_rate", None)
            earlier = row.pop("command", "make mutation")
            row.setdefault("timeouts", None)
            latest[row["module"]] = (ModuleResult(**row), earlier)
    latest |= {r.module: (r, command) for r in results}
    order = configured_modules()
    rows = sorted(latest.values(), key=lambda rc: order.index(rc[0].module)
                  if rc[0].module in order else len(order))
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(markdown(rows), encoding="utf-8")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps([asdict(r) | {"kill_rate": r.kill_rate, "command": c}
                                     for r, c in rows], indent=2, ensure_ascii=False),
                         encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(main())
