"""The HTTP servers the gateway could run on: one bare Starlette endpoint
(:data:`bench.devices.bare_app`) served by uvicorn (httptools, uvloop) and by granian (the
gateway's server), under the device workload of `ipdp bench devices` (wrk, one 272-byte record
per request); prints a markdown table.

    python -m bench.servers [--seconds 15] [--repeat 3]

Each repetition runs uvicorn, granian, then uvicorn again on a fresh process, and reads
granian's rate against the mean of the two uvicorn runs around it. Neither server checks or
stores anything here: this measures what a server costs before any of the gateway's work, one
of the figures the choice of the gateway's server (docs/architecture.md, "The gateway's
server") rests on. uvicorn is a benchmark dependency only (the `dev` extra).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.devices import STUDY_ID, D, _stop, _wait_http, _wrk, wrk_script
from ipdp.embedded.children import free_port
from ipdp.study import Study


def start(server: str) -> tuple[subprocess.Popen, str]:
    """``bench.devices:bare_app`` on ``server``, one worker, on a free loopback port."""
    port = free_port()
    common = ["--host", "127.0.0.1", "--port", str(port), "--no-access-log",
              "--log-level", "warning"]
    if server == "uvicorn":
        cmd = [sys.executable, "-m", "uvicorn", *common, "--no-server-header",
               "bench.devices:bare_app"]
    else:
        cmd = [sys.executable, "-m", "granian", "--interface", "asgi", "--workers", "1",
               "--loop", "uvloop", *common, "bench.devices:bare_app"]
    proc = subprocess.Popen(cmd)
    try:
        _wait_http(f"http://127.0.0.1:{port}", proc, "/healthz")
    except BaseException:
        _stop(proc)
        raise
    return proc, f"http://127.0.0.1:{port}"


def measure(server: str, script: Path, seconds: float) -> dict:
    """One wrk run (after a 2 s warm-up) against a fresh ``server``."""
    proc, url = start(server)
    try:
        _wrk(url, script, 2, 64, 2)
        return _wrk(url, script, seconds, 64, 2)
    finally:
        _stop(proc)


def run(seconds: float, repeat: int) -> list[dict]:
    """Rows of the table: per repetition, uvicorn, granian, uvicorn."""
    study = Study(study_id=STUDY_ID, d=D, n=10**8, epsilon=1.0, delta=0.01)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "device.lua"
        script.write_text(wrk_script(study))
        for rep in range(1, repeat + 1):
            before = measure("uvicorn", script, seconds)
            granian = measure("granian", script, seconds)
            after = measure("uvicorn", script, seconds)
            reference = (before["requests_per_second"] + after["requests_per_second"]) / 2
            for server, f in (("uvicorn", before), ("granian", granian), ("uvicorn", after)):
                rows.append({"run": rep, "server": server, "rps": f["requests_per_second"],
                             "ratio": f["requests_per_second"] / reference,
                             "p99_ms": f["p99_us"] / 1000})
            print(f"run {rep}: granian {rows[-2]['ratio']:.2f} x uvicorn", file=sys.stderr,
                  flush=True)
    return rows


def table(rows: list[dict], seconds: float) -> str:
    lines = [f"### Bare Starlette endpoint, wrk -t2 -c64 -d{seconds:g}s, one worker",
             "", "| run | server | requests/s | × uvicorn (mean of the runs around) | p99 ms |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['server']} | {r['rps']:,.0f} | {r['ratio']:.2f} | "
              f"{r['p99_ms']:.2f} |" for r in rows]
    ratios = [r["ratio"] for r in rows if r["server"] == "granian"]
    lines += ["", f"granian / uvicorn, median of the runs: {statistics.median(ratios):.2f}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.servers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--seconds", type=float, default=15, help="wrk's duration per run.")
    parser.add_argument("--repeat", type=int, default=3, help="Repetitions (default 3).")
    args = parser.parse_args(argv)
    print(table(run(args.seconds, args.repeat), args.seconds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
