"""`ipdp bench devices --quick --json` as a user runs it: wrk against the bare endpoint and the
gateway; the figures' keys are there and every record is folded exactly once (no timing is
asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import _require_binaries
from tests.tooling import require_tool


def test_bench_devices_quick_folds_every_acknowledged_record_exactly_once():
    _require_binaries()
    require_tool("wrk", "`ipdp bench devices` (Debian's wrk package)")
    out = subprocess.run([sys.executable, "-m", "ipdp.cli", "bench", "devices", "--quick",
                          "--json"], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("device_requests_per_second", "device_over_bare_starlette", "device_p99_ms",
                "bare_starlette_requests_per_second", "gateway_cpu_us_per_request",
                "aggregator_cpu_us_per_record", "refused_requests_per_second",
                "gateway_cpu_us_per_refused_request"):
        assert figures[key] > 0, key
    assert figures["exactly_once"] is True
    assert figures["folded"] == figures["on_topic"]
    assert 0 < figures["accepted"] <= figures["on_topic"]
    assert "| `ipdp gateway` | 1 |" in out.stderr and "bare Starlette + uvicorn" in out.stderr
    # The run of another study's records: every request refused, none of them on the topic.
    assert figures["all_refused"] is True
    assert "| `ipdp gateway`, every record another study's | 1 |" in out.stderr
    assert "Records of another study: every request refused" in out.stderr
