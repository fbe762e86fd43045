"""docs/operations.md's settings and metrics tables cannot drift from the code, nor the roles
that table says serve each metric from each role's registry."""

from __future__ import annotations

import re
from pathlib import Path

from scripts import ops_tables

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_operations_lists_every_setting_and_metric_exactly_as_the_code_defines_them():
    problems = ops_tables.check((DOCS / "operations.md").read_text(encoding="utf-8"))
    assert not problems, "docs/operations.md is out of date (python scripts/ops_tables.py " \
                         "prints the tables):\n  " + "\n  ".join(problems)


def test_the_check_notices_a_missing_a_wrong_and_an_unknown_row():
    text = (DOCS / "operations.md").read_text(encoding="utf-8")
    broken = text.replace("| `IPDP_KAFKA_CLIENT_ID` |", "| `IPDP_KAFKA_CLIENT_NAME` |")
    broken = re.sub(r"(\| `IPDP_AGGREGATOR_MAX_BATCH` \| integer \(≥ 1\) \| )`5000`",
                    r"\1`500`", broken)
    broken = broken.replace("| `ipdp_fold_seconds` | histogram |", "| `ipdp_fold_seconds` | "
                            "summary |")
    problems = "\n".join(ops_tables.check(broken))
    assert "IPDP_KAFKA_CLIENT_ID is missing" in problems
    assert "IPDP_KAFKA_CLIENT_NAME is documented but no settings model reads it" in problems
    assert "IPDP_AGGREGATOR_MAX_BATCH: default '`500`'" in problems
    assert "ipdp_fold_seconds: type 'summary'" in problems


def test_the_check_notices_a_role_serving_a_metric_the_table_does_not_name_for_it_and_back():
    text = (DOCS / "operations.md").read_text(encoding="utf-8")
    rows = {name: f"| `{name}` | {kind} | {labels} | " for name, kind, labels in (
        ("ipdp_backend_errors_total", "counter", "`backend`, `operation`"),
        ("ipdp_rounds_closed_total", "counter", "`study`"),
        ("ipdp_models_refused_total", "counter", "—"))}
    broken = text.replace(rows["ipdp_backend_errors_total"] + "Aggregator, trainer:",
                          rows["ipdp_backend_errors_total"] + "Aggregator:")
    broken = broken.replace(rows["ipdp_rounds_closed_total"] + "Aggregator:",
                            rows["ipdp_rounds_closed_total"] + "Aggregator and trainer:")
    broken = broken.replace(rows["ipdp_models_refused_total"] + "Model subscriber:",
                            rows["ipdp_models_refused_total"] + "Subscribers:")
    assert broken.count("Aggregator and trainer:") == broken.count("Subscribers:") == 1
    problems = "\n".join(ops_tables.check(broken))
    assert "ipdp_backend_errors_total: the trainer serves it, the table does not say so" in problems
    assert ("ipdp_rounds_closed_total: the table says the trainer serves it, its registry does "
            "not") in problems
    assert "ipdp_models_refused_total: its meaning must begin with the roles" in problems
    assert len(problems.splitlines()) == 3


def test_the_replay_window_section_keeps_its_place_and_docs_link_to_existing_pages():
    text = (DOCS / "operations.md").read_text(encoding="utf-8")
    assert text.count("## Replay window: cost and trade-off") == 1
    for page in ("architecture.md", "operations.md", "tutorial.md"):
        for target in re.findall(r"\]\(([\w.-]+\.md)(?:#[\w-]+)?\)", (DOCS / page).read_text()):
            assert (DOCS / target).exists(), f"{page} links to missing {target}"
