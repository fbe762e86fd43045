"""`python -m bench.influence`, run as docs/benchmarks.md documents it, at a smoke size."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.influence import SCENARIOS


def test_bench_influence_prints_a_row_per_scenario_and_k_with_its_bound():
    out = subprocess.run([sys.executable, "-m", "bench.influence", "--seeds", "2", "--k", "1",
                          "10", "--json"], capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["bounds"]["p_low"] > 0 and result["bounds"]["p_high"] > result["bounds"]["p_low"]
    rows = {(r["scenario"], r["k"]): r for r in result["rows"]}
    assert set(rows) == {(s, k) for s in SCENARIOS for k in (1, 10)}
    for r in rows.values():
        assert 0.0 <= r["move_mean"] <= r["move_max"] <= 2.0
        assert -1.0 <= r["cos_min"] <= r["cos_mean"] <= 1.0
        assert r["bound"] > 0
    # Ten crafted records move the model further than ten honest replacements do.
    assert rows["crafted, q̃ ∥ w₀", 10]["move_mean"] > rows["honest", 10]["move_mean"]
