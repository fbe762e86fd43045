"""The throughput benchmark runs and measures what it says (no timing is asserted)."""

from __future__ import annotations

from pathlib import Path

from bench import throughput
from bench.markdown import replace_block


def test_fold_path_and_memory_sections_report_positive_rates_and_flat_statistics_bytes():
    figures = {}
    rows = throughput.fold_path(2_000, figures)
    assert {r[0] for r in rows} == {"14", "100"}
    assert all(float(r[3].replace(",", "")) > 0 for r in rows)
    assert figures["fold_records_per_cpu_second_d14"] > 0
    memory = throughput.memory(quick=True, figures=figures)
    assert 0 < figures["replay_bytes_per_id"] <= 16
    # The open round's statistics are d×d + d floats whatever the record count.
    assert memory[0][1] == memory[1][1] == str((14 * 14 + 14) * 8)
    assert int(memory[1][4].replace(",", "")) > int(memory[0][4].replace(",", ""))


def test_replay_sections_measure_bytes_per_id_and_false_positives():
    rows = throughput.replay_memory([20_000], checks=20_000)
    assert [r[0] for r in rows] == ["64", "32"]
    real = rows[0]
    assert float(real[3]) <= 16 and real[7] == "0 of 20,000"
    assert [r[1] for r in throughput.replay_set(10_000)] == [
        "check + append, ids absent", "check + append, ids present"] * 2


def test_solve_times_cover_the_three_dimensions():
    assert [r[0] for r in throughput.solve_times()] == ["14", "100", "1000"]


def test_generated_block_replaces_only_the_text_between_its_markers(tmp_path: Path):
    md = tmp_path / "b.md"
    md.write_text("intro\n<!-- x:begin -->\nold\n<!-- x:end -->\noutro\n", encoding="utf-8")
    assert replace_block(md, "x", "new table\n")
    assert md.read_text(encoding="utf-8") == (
        "intro\n<!-- x:begin -->\nnew table\n<!-- x:end -->\noutro\n")
    assert not replace_block(md, "y", "anything")


def test_scale_out_folds_every_record_of_every_process_once_and_studies_never_conflict():
    rows = throughput.scale_out(2_000, batch=500, processes=(1, 2))
    assert [r[:3] for r in rows] == [[redis, studies, procs]
                                     for redis in ("one redis-server", "cluster, 3 primaries")
                                     for studies, procs in (("1", "1"), ("1", "2"), ("2", "2"))]
    assert [r[3] for r in rows] == ["2,000", "4,000", "4,000"] * 2
    # Processes folding different studies share no key a transaction watches.
    assert [r[5] for r in rows if r[1] == "2"] == ["0", "0"]


def test_the_gateway_figure_is_a_measured_positive_rate():
    assert throughput.gateway_e2e_records_per_second(2000) > 0
