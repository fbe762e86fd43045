"""A user's own CSV to a prediction, through the commands on the real broker and Redis: a
logistic study whose schema sits inside `--file`, loadgen reading the CSV by the schema's names,
`ipdp models --export`, and `load_model` predicting class probabilities in raw units."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys

import numpy as np

from ipdp import load_model
from ipdp.cli.main import main
from ipdp.subscriber import ModelSubscriber
from tests.pipeline import GROUP_JOIN_TIMEOUT_S, services, wait_for

LOANS = {"study_id": "loans", "loss": "logistic", "n": 1500, "epsilon": 1.0, "delta": 1e-5,
         "eta": 2.0,
         "schema": {"features": [{"name": "income", "min": 0, "max": 200},
                                 {"name": "debt", "min": 0, "max": 50}],
                    "target": {"name": "approved", "classes": ["no", "yes"]},
                    "intercept": True}}


def write_loans(path, rows: int) -> None:
    rng = np.random.default_rng(3)
    income = rng.uniform(10, 190, rows).round()
    debt = rng.uniform(0, 60, rows).round(1)  # some above the public range of 50
    approved = np.where(0.03 * income - 0.1 * debt + rng.normal(0, 0.5, rows) > 1, "yes", "no")
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["approved", "income", "debt", "branch"])
        out.writerows(zip(approved, income, debt, ["north"] * rows))


def test_a_logistic_schema_study_from_a_csv_exports_a_model_that_predicts_class_probabilities(
        kafka_settings, redis_settings, env_topics, tmp_path, capsys):
    topics = env_topics
    study_file, data, exported = (tmp_path / n for n in ("loans.json", "loans.csv",
                                                         "model.json"))
    study_file.write_text(json.dumps(LOANS))
    write_loans(data, LOANS["n"])
    assert main(["study", "create", "--file", str(study_file)]) == 0
    assert main(["study", "show", "loans"]) == 0
    assert re.search(r"^schema +income \[0, 200\], debt \[0, 50\] → approved \(no or yes\), "
                     r"with an intercept$", capsys.readouterr().out, re.MULTILINE)
    assert main(["loadgen", "--study", "loans", "--devices", str(LOANS["n"]), "--no-progress",
                 "--dataset", f"csv:{data}"]) == 0
    out = capsys.readouterr().out
    assert f"rows read     {LOANS['n']} (0 skipped" in out
    clipped = int(out.split("clipped       income 0, debt ")[1].split()[0])
    assert clipped > 0

    with services(kafka_settings, redis_settings, topics):
        wait_for(lambda: list(ModelSubscriber(kafka_settings, topics, study_id="loans",
                                              from_beginning=True)),
                 GROUP_JOIN_TIMEOUT_S, "the loans model")
    (published,) = ModelSubscriber(kafka_settings, topics, study_id="loans", from_beginning=True)
    assert main(["models", "--study", "loans", "--export", str(exported)]) == 0
    out, err = capsys.readouterr()
    assert "  log-odds of approved='yes' = " in out and " × income\n" in out
    assert f"exported loans round 1 to {exported}" in err
    # No trainer key pinned: the command says so once, not again for the file it wrote.
    again = subprocess.run([sys.executable, "-m", "ipdp.cli", "models", "--study", "loans",
                            "--export", str(tmp_path / "again.json")],
                           capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("UNVERIFIED") == 1, again.stderr

    m = load_model(exported)
    assert m.message.weights == published.weights and m.message.schema_ == published.schema_
    assert m.feature_names == ["income", "debt"] and m.classes == ("no", "yes")
    assert m.privacy.epsilon == 1.0
    rows = {"income": np.array([20.0, 100.0, 180.0]), "debt": np.array([45.0, 20.0, 5.0])}
    encoded = published.schema_.encode(rows | {"approved": ["no"] * 3}).x
    direct = 1.0 / (1.0 + np.exp(-(encoded @ np.array(published.weights))))
    np.testing.assert_allclose(m.predict_proba(rows)[:, 1], direct, rtol=1e-12)
    assert m.predict(rows).tolist() == np.where(direct >= 0.5, "yes", "no").tolist()


def test_loadgen_names_the_schema_columns_a_csv_lacks(kafka_settings, redis_settings, env_topics,
                                                       tmp_path, capsys):
    study_file, data = tmp_path / "loans.json", tmp_path / "short.csv"
    study_file.write_text(json.dumps(LOANS | {"study_id": "short"}))
    data.write_text("income,approved\n10,yes\n")
    assert main(["study", "create", "--file", str(study_file)]) == 0
    assert main(["loadgen", "--study", "short", "--devices", "1", "--no-progress",
                 "--dataset", f"csv:{data}"]) == 2
    assert "no column(s) debt that the study's schema names" in capsys.readouterr().err


def test_models_export_needs_one_study_and_no_follow(kafka_settings, env_topics, tmp_path,
                                                     capsys):
    for flags in ([], ["--study", "s", "--follow"]):
        assert main(["models", "--export", str(tmp_path / "m.json"), *flags]) == 2
        assert "--export writes one study's newest model: it needs --study" in \
            capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()


def test_loadgen_names_the_column_that_holds_text(kafka_settings, redis_settings, env_topics,
                                                   tmp_path, capsys):
    study_file, data = tmp_path / "loans.json", tmp_path / "text.csv"
    study_file.write_text(json.dumps(LOANS | {"study_id": "text"}))
    data.write_text("income,debt,approved\n10,n/a,yes\n20,n/a,no\n")
    assert main(["study", "create", "--file", str(study_file)]) == 0
    assert main(["loadgen", "--study", "text", "--devices", "2", "--no-progress",
                 "--dataset", f"csv:{data}"]) == 2
    assert ("no usable row (2 skipped): column debt: 2 of 2 value(s) are not numbers ('n/a')"
            in capsys.readouterr().err)


def test_loadgen_counts_the_values_clipped_among_the_rows_it_sends(
        kafka_settings, redis_settings, env_topics, tmp_path, capsys):
    study_file, data = tmp_path / "loans.json", tmp_path / "loans.csv"
    study_file.write_text(json.dumps(LOANS | {"study_id": "subset"}))
    rows = 10
    debt = [60.0] + [5.0] * (rows - 1)  # the first row's debt is above the range's 50
    with open(data, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["income", "debt", "approved"])
        out.writerows((100, v, "yes") for v in debt)
    assert main(["study", "create", "--file", str(study_file)]) == 0
    capsys.readouterr()
    # A seed that sends the outlier among 3 rows, and one that does not (loadgen's own draw).
    sent = {seed: 0 in np.random.default_rng(seed).permutation(rows)[:3] for seed in range(20)}
    for seed in (min(s for s, hit in sent.items() if hit), min(s for s, hit in sent.items()
                                                               if not hit)):
        assert main(["loadgen", "--study", "subset", "--devices", "3", "--no-progress",
                     "--seed", str(seed), "--dataset", f"csv:{data}"]) == 0
        out = capsys.readouterr().out
        assert f"rows read     {rows} (0 skipped: a missing or unusable value); 3 sent" in out
        assert f"clipped       income 0, debt {int(sent[seed])} (values outside their schema " \
               "range among the rows sent, per column)" in out
