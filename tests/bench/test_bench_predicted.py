"""`python -m bench.predicted --quick` runs to its end and prints both sides of every cell."""

from __future__ import annotations

import re

from bench.predicted import main


def test_predicted_quick_prints_predicted_and_measured_per_task_and_epsilon(capsys):
    assert main(["--quick", "--trials", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("`python -m bench.predicted --quick --trials 2`")
    header = next(line for line in out.splitlines() if line.startswith("| n |"))
    assert header.count("ε=") == 4  # linear and logistic, ε = 0.1 and 1
    rows = [line for line in out.splitlines() if line.startswith("| 2^")]
    assert [r.split(" | ")[0] for r in rows] == ["| 2^7", "| 2^9", "| 2^11"]
    # At 2^11, ε = 1 every task has a model: predicted / measured, both numbers.
    assert re.fullmatch(r"[0-9.e+-]+ / [0-9.e+-]+", rows[-1].split(" | ")[2])
    assert "Least useful n at margin 0.5" in out
