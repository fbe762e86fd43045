"""`python -m bench.servers` as a user runs it, at a smoke size: both servers answer the device
workload and the table has a row per run (no timing is asserted)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.tooling import require_tool


def test_bench_servers_measures_uvicorn_and_granian_around_each_other():
    require_tool("wrk", "`python -m bench.servers` (Debian's wrk package)")
    out = subprocess.run([sys.executable, "-m", "bench.servers", "--seconds", "1", "--repeat",
                          "1"], capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"^\| 1 \| (uvicorn|granian) \| ([0-9,]+) \|", out.stdout, re.MULTILINE)
    assert [server for server, _ in rows] == ["uvicorn", "granian", "uvicorn"]
    assert all(int(rps.replace(",", "")) > 0 for _, rps in rows)
    assert re.search(r"^granian / uvicorn, median of the runs: [0-9.]+$", out.stdout, re.MULTILINE)
