"""The benchmark commands of README's table, run as a user runs them, at smoke sizes.

They print tables; the assertions check that the tables are there and their figures are sane
numbers, never how fast anything was (tests do not time anything).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

from tests.conftest import _require_binaries
from tests.tooling import require_tool


def ipdp(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ipdp.cli", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_bench_accuracy_quick_prints_its_tables():
    out = ipdp("bench", "accuracy", "--quick")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "IP-rigorous" in out.stdout and "ObjPert-Gauss" in out.stdout
    assert re.search(r"2\^11", out.stdout)


def test_bench_throughput_quick_prints_positive_rates_and_writes_where_told(tmp_path):
    _require_binaries()
    # Tables on stderr, JSON on stdout, and both in the file --out names.
    out = ipdp("bench", "throughput", "--quick", "--json", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    written = (tmp_path / "throughput.md").read_text(encoding="utf-8")
    assert written.startswith("Command: `ipdp bench throughput --quick --json`")
    assert "### End to end on the embedded broker" in written
    rates = [float(x.replace(",", "")) for x in re.findall(r"\| ([\d,]{4,}) \|", out.stderr)]
    assert rates and min(rates) > 0
    figures = json.loads(out.stdout)
    for key in ("gateway_e2e_records_per_second", "direct_e2e_records_per_second",
                "e2e_aggregator_over_bare_consumer", "fold_records_per_cpu_second_d14",
                "replay_bytes_per_id", "e2e_library_parser_aggregator_over_bare_consumer"):
        assert figures[key] > 0, key


def test_soak_with_a_few_kills_holds_every_invariant(tmp_path):
    _require_binaries()
    out = ipdp("soak", "--kills", "3", "--n", "300", "--rate", "400", "--dir", str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"^kills \(SIGKILL\) +3$", out.stdout, re.MULTILINE)
    honest = int(re.search(r"\(([\d,]+) honest", out.stdout)[1].replace(",", ""))
    assert re.search(rf"^folded +{honest:,}$", out.stdout, re.MULTILINE)  # every honest record, once
    assert out.stdout.rstrip().endswith("all invariants held")


def test_ipdp_audit_json_reports_a_lower_bound_below_the_claim():
    out = ipdp("audit", "--epsilon", "2", "--d", "2", "--n", "512", "--trials", "20000",
               "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"claimed_epsilon", "epsilon_lower_bound", "delta", "trials"} <= result.keys()
    assert result["claimed_epsilon"] == 2 and result["trials"] == 20000
    assert 0 <= result["epsilon_lower_bound"] <= 2


def test_bench_credentials_prints_the_gateway_and_aggregator_costs():
    _require_binaries()
    require_tool("wrk", "ipdp bench credentials --http")
    out = ipdp("bench", "credentials", "--requests", "50", "--records", "200", "--http", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    for title in ("#### Gateway: µs per request", "#### Aggregator: µs per record",
                  "#### Over HTTP"):
        assert title in out.stdout
    in_process = out.stdout.split("#### Over HTTP")[0]
    figures = [float(x) for x in re.findall(r"\| ([\d.]+) \|$", in_process, re.MULTILINE)]
    assert len(figures) == 9 + 9 and min(figures) > 0
    # 200 devices: one batch of height 8, so 4 + 158 + 32 × 8 bytes per device with version 2.
    assert "125 bytes per device with version-1 tokens, 418 with version-2" in in_process
    rows = re.findall(r"^\| 1 \| ([^|]+) \| ([\d,]+) \| ([\d.]*) \|", out.stdout, re.MULTILINE)
    # The bare endpoint before and after each of the three gateway rows, the yardstick of each.
    assert [name.startswith("bare") for name, _, _ in rows] == [True, False] * 3 + [True]
    rates = [int(r.replace(",", "")) for _, r, _ in rows]
    assert min(rates) > 0
    for i in (1, 3, 5):
        # (the printed requests/s are rounded: the ratio may differ in its last digit)
        assert abs(float(rows[i][2]) - rates[i] / ((rates[i - 1] + rates[i + 1]) / 2)) < 0.011
    assert "requests answered 202" in out.stdout
    # Each request is a device of its own: nothing reused, so nothing dead-lettered.
    assert "dead letters: none" in out.stdout


def test_bench_flood_folds_then_refuses_every_resent_record_once():
    _require_binaries()
    out = ipdp("bench", "flood", "--records", "2000", "--per-request", "500", "--repeat", "1",
               "--quiet-seconds", "1", "--json")  # tables on stderr, JSON on stdout
    assert out.returncode == 0, out.stderr[-3000:]
    assert "IPDP_GATEWAY_RELAY_ADDRESSES=127.0.0.1" in out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["folded"] == figures["replayed"] == 2000
    (run,) = figures["runs"]
    assert run["fold"]["seconds"] > 0 and run["refusal"]["seconds"] > 0
    assert figures["attacked"]["honest_records"] > 0


def test_bench_flood_connections_floods_the_edge_from_each_layout_and_probes_through_it():
    _require_binaries()
    require_tool("nginx", "ipdp bench flood --attack connections (the shipped edge)")
    require_tool("wrk", "ipdp bench flood --attack connections (the devices)")
    out = ipdp("bench", "flood", "--attack", "connections", "--probes", "2",
               "--device-seconds", "1", "--repeat", "1", "--json")
    # 1: a target missed on this machine (figures are never asserted); anything else: a failure.
    assert out.returncode in (0, 1), out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    runs = {r["layout"]: r for r in figures["runs"]}
    assert list(runs) == ["none", "one /24", "16 /24s"]
    assert runs["none"]["opened"] == 0
    for layout in ("one /24", "16 /24s"):
        # Every one of the 16 × 256 silent connections was opened at least once.
        assert runs[layout]["opened"] >= 16 * 256
    for r in runs.values():
        assert 0 <= r["answered"] <= r["probes"] == 2
        assert r["device_rps"] > 0
    assert [s["layout"] for s in figures["summary"]] == list(runs)


def test_bench_record_path_traces_both_ways_and_times_each_stage():
    _require_binaries()
    out = subprocess.run([sys.executable, "-m", "bench.record_path", "--records", "5"],
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    counts = re.findall(r"^(\d+) files, (\d+) distinct functions$", out.stdout, re.MULTILINE)
    assert len(counts) == 2 and all(int(f) > 0 and int(n) > 0 for f, n in counts), out.stdout
    # Only the HTTP way passes through the device's gateway transport.
    kafka_way, http_way = out.stdout.split("\nHTTP: ", 1)
    assert "| producer/gateway_client.py |" in http_way
    assert "| producer/gateway_client.py |" not in kafka_way
    stages = re.findall(r"^\| (Kafka|HTTP) \| (device|delivery|fold|total) \| ([\d.]+) \|",
                        out.stdout, re.MULTILINE)
    assert len(stages) == 8 and all(float(ms) > 0 for *_, ms in stages), out.stdout
