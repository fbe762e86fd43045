"""`ipdp bench two-server --quick --json` as a user runs it: every section's table is printed and
its figures hang together (record sizes, records folded on both sides, models of n records,
accuracy cells at the calibrations' σ); no timing is asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from ipdp.two_server_wire import two_server_record_size
from ipdp.wire import HEADER_SIZE
from tests.conftest import _require_binaries

D = 14


def test_bench_two_server_quick_prints_each_section_and_its_counts_agree():
    _require_binaries()
    out = subprocess.run([sys.executable, "-m", "ipdp.cli", "bench", "two-server", "--quick",
                          "--json"], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    for title in ("**Device, one record per call", "**Leader's fold with a real helper",
                  "**End to end on the embedded runtime", "**Accuracy, two-server against"):
        assert title in out.stderr, title

    # The wire: a version-1 record is the header and 2d doubles; a version-3 one is 2,004 bytes.
    sizes = {"one-server": HEADER_SIZE + 16 * D, "two-server": two_server_record_size(D)}
    device = figures["device"]
    for mode, size in sizes.items():
        assert device[mode]["bytes_per_record"] == size
        assert device[mode]["records_per_cpu_second"] > 0
    # The browser SDK in Chromium and under Node, where producer/web is built; else why not.
    assert set(figures["web_device"]) == {"chromium", "node"}
    for web in figures["web_device"].values():
        if isinstance(web, dict):
            assert {m: v["bytes_per_record"] for m, v in web.items()} == sizes
        else:
            assert web.startswith("not run: ")

    # The fold: every timed record folded on the leader, and every full round on both sides.
    fold = figures["fold"]
    assert fold["folded"] == fold["records"] and fold["folded_in_redis"] == fold["sent"]
    assert fold["closed_rounds_leader"] == fold["full_rounds_helper"] == fold["sent"] // fold["n"]
    assert fold["helper_records_per_cpu_second"] > 0 and fold["leader_records_per_second"] > 0

    # End to end: one model of round 1 per mode, at the same n.
    e2e = figures["end_to_end"]
    assert set(e2e) == {"one-server", "two-server"}
    assert e2e["one-server"]["n"] == e2e["two-server"]["n"]
    for mode, size in sizes.items():
        assert e2e[mode]["round"] == 1 and e2e[mode]["bytes_per_record"] == size
        assert 0 < e2e[mode]["produce_s"] <= e2e[mode]["to_model_s"]

    # Accuracy: a cell per task at the quick n; σ_b² two-server never below one-server's.
    cells = figures["accuracy"]
    assert {(c["source"], c["task"]) for c in cells} == {("synthetic", "linear"),
                                                          ("synthetic", "logistic")}
    for c in cells:
        assert 0 < c["one_server"] < 1 and 0 < c["two_server"] < 1
        assert math.isclose(c["relative_difference"], c["two_server"] / c["one_server"] - 1)
        assert c["sigma_b2_ratio"] >= 1.0
    assert figures["accuracy_largest_relative_difference"] == max(
        abs(c["relative_difference"]) for c in cells)
    beyond = [c for c in cells if abs(c["relative_difference"]) > 0.01]
    assert figures["accuracy_cells_beyond_1_percent"] == len(beyond)
    assert "largest |relative difference|" in out.stderr
