"""`python -m bench.predicted --quick` runs the n advice for real and counts, trial by trial,
whether its promise held at the advised n (docs/benchmarks.md, "Predicted against measured
error")."""

from __future__ import annotations

import json

from bench.predicted import main


def test_predicted_quick_prints_the_advice_and_how_often_its_promise_held(capsys):
    assert main(["--quick", "--trials", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("`python -m bench.predicted --quick --trials 3`")
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| synthetic")]
    assert [(r[1], r[2]) for r in rows] == [("linear", "1"), ("logistic", "1")]
    for r in rows:
        held, of = r[-2].split("/")
        assert of == "3" and 0 <= int(held) <= 3
    assert "rows that ran" in out


def test_the_advice_keeps_its_promise_on_the_quick_case(capsys):
    """Fails when the advice stops being conservative: at the advised n the promise must hold
    in at least 80 % of the trials, and the count comes from the trials themselves."""
    assert main(["--quick", "--trials", "5", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["command"] == "python -m bench.predicted --quick --trials 5"
    assert {r["loss"] for r in result["rows"]} == {"squared", "logistic"}
    for row in result["rows"]:
        assert row["advised_n"] is not None and not row["more_than_table"]
        assert row["trials"] == 5 and row["held"] is not None
        assert row["passed"] == (row["held"] >= 0.8 * row["trials"])
        assert row["passed"], row
        # The advice is not vacuous: at a quarter of the advised n the promise fails more often.
        assert row["held_at_quarter"] < row["held"], row
