"""`ipdp models` on the real broker and Redis: a filling round's progress, an unknown study, and
a model whose norm constraint binds."""

from __future__ import annotations

import io
import re
import time

from ipdp import state
from ipdp.cli import models as models_cli
from ipdp.cli.main import main
from ipdp.cli.models import model_line
from ipdp.model_message import ModelMessage, PrivacyReport
from ipdp.redis_io import redis_client
from ipdp.study import Study
from tests.pipeline import GROUP_JOIN_TIMEOUT_S, contribute, create, services, wait_for


def test_models_for_a_filling_round_prints_its_progress(kafka_settings, redis_settings,
                                                          env_topics, capsys):
    study = create(kafka_settings, redis_settings, env_topics, study_id="filling", d=3, n=200,
                   epsilon=1.0, delta=0.01)
    r = redis_client(redis_settings)
    with services(kafka_settings, redis_settings, env_topics, trainer=False):
        contribute(study, kafka_settings, env_topics, 7, seed=1)
        wait_for(lambda: r.hget(state.StudyKeys("filling").open, "count") == b"7",
                 GROUP_JOIN_TIMEOUT_S, "7 records folded")
    capsys.readouterr()
    assert main(["models", "--study", "filling"]) == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert "0 model(s); 0 duplicate(s) dropped\nstudy filling: round 1: 7/200 records folded\n" \
        in err

    # --wait shows the progress while it waits (a line at once off a terminal), and says it
    # again when it gives up.
    assert main(["models", "--study", "filling", "--wait", "1", "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert "waiting: study filling: round 1: 7/200 records folded\n" in err
    assert err.rstrip().endswith("ipdp models: saw 0 of 1 model(s) within 2 s; study filling: "
                                 "round 1: 7/200 records folded")


def test_models_for_a_study_without_records_says_none_is_folded(kafka_settings, redis_settings,
                                                                  env_topics, capsys, tmp_path):
    create(kafka_settings, redis_settings, env_topics, study_id="empty", d=3, n=200,
           epsilon=1.0, delta=0.01)
    assert main(["models", "--study", "empty"]) == 0
    assert "study empty: round 1: 0/200 records folded" in capsys.readouterr().err
    assert main(["models", "--study", "empty", "--export", str(tmp_path / "m.json")]) == 2
    assert "study 'empty' has no published model to export" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()


def test_models_for_an_unknown_study_is_an_error(kafka_settings, env_topics, capsys):
    for flags in ([], ["--wait", "1", "--timeout", "2"]):
        assert main(["models", "--study", "no-such-study", *flags]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err == "ipdp models: unknown study 'no-such-study'\n"


def _message(constraint_active: bool) -> ModelMessage:
    study = Study(study_id="bound", d=3, n=100, epsilon=1.0, delta=0.01, eta=0.5)
    return ModelMessage(study_id="bound", round=1, n=100, d=3, loss="squared",
                        weights=[0.3, 0.4, 0.0], constraint_active=constraint_active,
                        privacy=PrivacyReport.from_calibration(study.calibration),
                        round_closed_ms=0, published_ms=0)


def test_a_model_whose_norm_constraint_binds_says_so_and_what_to_do():
    line = model_line(_message(constraint_active=True))
    assert re.search(r"^  norm constraint binds: ‖w‖ = η = 0\.5, so the fit stopped at the "
                     r"bound\. A new study with a larger --eta may fit better, at more noise per "
                     r"record: `ipdp calibrate --eta 1 …`", line, re.MULTILINE)
    assert "norm constraint" not in model_line(_message(constraint_active=False))


def test_on_a_terminal_the_progress_is_one_line_redrawn_in_place(monkeypatch):
    import os
    import pty
    import select

    monkeypatch.setattr(models_cli, "PROGRESS_TTY_EVERY_S", 0.05)
    master, slave = pty.openpty()
    counts = iter(range(1000))
    with os.fdopen(slave, "w") as terminal:
        with models_cli.ProgressLine(lambda: f"round 1: {next(counts)}/10", terminal):
            time.sleep(0.5)
        shown = b""
        while select.select([master], [], [], 0.5)[0]:  # everything written, in pieces
            shown += os.read(master, 65536)
    os.close(master)
    shown = shown.decode()
    assert shown.startswith("\r\x1b[Kwaiting: round 1: 0/10\r\x1b[Kwaiting: round 1: 1/10")
    assert shown.count("\r\x1b[Kwaiting") >= 3  # redrawn every 0.05 s
    assert "\n" not in shown and shown.endswith("\r\x1b[K")  # cleared for what comes next


def test_off_a_terminal_the_progress_is_a_line_now_and_then(monkeypatch):
    monkeypatch.setattr(models_cli, "PROGRESS_LOG_EVERY_S", 0.2)
    log = io.StringIO()
    counts = iter(range(1000))
    with models_cli.ProgressLine(lambda: f"round 1: {next(counts)}/10", log):
        time.sleep(0.3)
    lines = log.getvalue().splitlines()
    assert 1 <= len(lines) <= 2  # one at once, the next 0.2 s later
    assert lines == [f"waiting: round 1: {k}/10" for k in range(len(lines))]
