"""Mistakes are cheap, on the real broker and Redis: a schema study checked against a sample CSV
before it exists, a study that never folded a record deleted (its id free again, its records
refused by an aggregator that knew it, forgotten by a running gateway), and a refused create
that warns about nothing."""

from __future__ import annotations

import json
import subprocess
import sys

from ipdp import state
from ipdp.cli.main import main
from ipdp.embedded import free_port
from ipdp.redis_io import redis_client
from ipdp.studies_topic import read_studies_topic
from producer.gateway_client import GatewayClient
from tests import proc_services as ps
from tests.pipeline import GROUP_JOIN_TIMEOUT_S, contribute, create, services, wait_for

SCHEMA = {"features": [{"name": "age", "min": 18, "max": 70},
                       {"name": "educ", "min": 0, "max": 20}],
          "target": {"name": "wage", "min": 0, "max": 100}, "intercept": True}
CREATE = ["study", "create", "--study-id", "wages", "--n", "2000", "--epsilon", "1",
          "--delta", "1e-5"]


def test_a_sample_with_text_in_a_numeric_column_creates_no_study(env_topics, redis_settings,
                                                                  tmp_path, capsys):
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "sample.csv").write_text("age,educ,wage\n25,12,30\n40,16,55.5\n75,,120\n"
                                         "33,14,12k\n")
    argv = [*CREATE, "--schema", str(tmp_path / "s.json"), "--check-csv",
            str(tmp_path / "sample.csv")]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "age   4 number(s), 1 outside [18, 70] (25.0 %, clipped on a device)" in err
    assert "educ  3 number(s), 0 outside [0, 20] (0.0 %, clipped on a device), 1 empty" in err
    assert "wage  3 number(s), 1 outside [0, 100] (33.3 %, clipped on a device), 1 not a " \
           "number" in err
    assert "no study was created:\n  column wage: 1 of 4 value(s) are not numbers ('12k')" in err
    assert "UNSIGNED" not in err
    assert state.load_study(redis_client(redis_settings), "wages") is None

    (tmp_path / "sample.csv").write_text("age,educ,wage\n25,12,30\n40,16,55.5\n")
    assert main(argv) == 0
    assert "created study wages" in capsys.readouterr().out


def test_a_sample_without_a_column_or_with_a_label_that_is_no_class_creates_no_study(
        env_topics, redis_settings, tmp_path, capsys):
    logistic = SCHEMA | {"target": {"name": "paid", "classes": ["low", "high"]}}
    (tmp_path / "s.json").write_text(json.dumps(logistic))
    (tmp_path / "labels.csv").write_text("age,educ,paid\n25,12,low\n40,16,High\n")
    (tmp_path / "short.csv").write_text("age,paid\n25,low\n")
    for sample, problem in (("labels.csv", ("column paid: 1 of 2 value(s) are not one of the "
                                           "target's classes ('High')")),
                            ("short.csv", "no column(s) educ that the schema names")):
        assert main([*CREATE, "--loss", "logistic", "--schema", str(tmp_path / "s.json"),
                     "--check-csv", str(tmp_path / sample)]) == 2
        assert problem in capsys.readouterr().err
    assert state.load_study(redis_client(redis_settings), "wages") is None


def test_check_csv_needs_a_schema(env_topics, tmp_path, capsys):
    (tmp_path / "x.csv").write_text("a\n1\n")
    assert main([*CREATE, "--d", "3", "--check-csv", str(tmp_path / "x.csv")]) == 2
    assert "--check-csv checks a sample against the study's schema" in capsys.readouterr().err


def test_a_refused_create_prints_no_unsigned_warning_and_a_created_one_prints_it_once(
        env_topics):
    def create_study(delta: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "ipdp.cli", "study", "create", "--study-id", "once", "--d",
             "3", "--n", "500", "--epsilon", "1", "--delta", delta],
            capture_output=True, text=True, timeout=120, check=False)

    created = create_study("0.01")
    assert created.returncode == 0, created.stderr
    assert (created.stdout + created.stderr).count("UNSIGNED") == 1
    refused = create_study("0.02")
    assert refused.returncode == 2
    assert "already exists with different parameters" in refused.stderr
    assert "UNSIGNED" not in refused.stdout + refused.stderr


def test_a_study_without_records_is_deleted_and_its_id_reused_while_a_folding_one_is_kept(
        kafka_settings, redis_settings, env_topics, capsys):
    r = redis_client(redis_settings)
    old = create(kafka_settings, redis_settings, env_topics, study_id="reused", d=3, n=200,
                 epsilon=1.0, delta=0.01)
    kept = create(kafka_settings, redis_settings, env_topics, study_id="kept", d=3, n=200,
                  epsilon=1.0, delta=0.01)
    with services(kafka_settings, redis_settings, env_topics, trainer=False) as (aggregator,):
        # The aggregator knows the study (as after a record of it that it refused).
        assert aggregator.folder.studies.resolve([old.hash]) == {old.hash: old}
        contribute(kept, kafka_settings, env_topics, 3, seed=1)
        wait_for(lambda: r.hget(state.StudyKeys("kept").counts, "folded") == b"3",
                 GROUP_JOIN_TIMEOUT_S, "kept's 3 records folded")

        assert main(["study", "delete", "kept"]) == 2
        assert ("study 'kept' has folded 3 record(s) and published 0 model(s): it can no longer "
                "be deleted, only closed (`ipdp study close kept`)") in capsys.readouterr().err
        assert state.load_study(r, "kept") is not None

        assert main(["study", "delete", "reused"]) == 0
        assert capsys.readouterr().out == "deleted study reused\n"
        assert list(r.scan_iter(match="ipdp:{reused}:*")) == []
        assert r.hget(state.STUDY_HASHES, old.hash) is None
        assert "reused" not in read_studies_topic(kafka_settings, env_topics)  # the tombstone
        again = subprocess.run([sys.executable, "-m", "ipdp.cli", "study", "delete", "reused"],
                               capture_output=True, text=True, timeout=120, check=False)
        assert again.returncode == 2
        assert again.stderr == "ipdp study: unknown study 'reused'\n"

        # The id is free: another study takes it. Records made for the deleted one are refused
        # (unknown_study) by the aggregator that knew it, alone in a batch (the fold reads the
        # id's current hash) or next to the new study's (one id, two hashes); the new study's
        # are folded.
        new = create(kafka_settings, redis_settings, env_topics, study_id="reused", d=3, n=300,
                     epsilon=1.0, delta=0.01)
        counts, group = state.StudyKeys("reused").counts, f"agg-{env_topics.records}"

        def refused() -> int:
            return state.rejected_counts(r, group, env_topics.records).get("unknown_study", 0)

        contribute(old, kafka_settings, env_topics, 4, seed=2)
        wait_for(lambda: refused() == 4, GROUP_JOIN_TIMEOUT_S, "the old study's 4 refused")
        aggregator.folder.studies._studies[old.hash] = old  # known again, as before the delete
        contribute(old, kafka_settings, env_topics, 2, seed=3)
        contribute(new, kafka_settings, env_topics, 5, seed=4)
        wait_for(lambda: r.hget(counts, "folded") == b"5" and refused() == 6,
                 GROUP_JOIN_TIMEOUT_S, "the new study's 5 records folded, the old one's 2 refused")
    assert int(r.hget(state.StudyKeys("reused").open, "count")) == 5


def test_a_running_gateway_forgets_a_deleted_study(runtime, kafka_settings, redis_settings,
                                                   env_topics, tmp_path):
    port = free_port()
    gateway = ps.start(["gateway"], ps.service_env(runtime, env_topics,
                                                   IPDP_GATEWAY_PORT=str(port)),
                       tmp_path, "gateway")
    try:
        with GatewayClient(f"http://127.0.0.1:{port}", timeout_s=5) as client:
            client.wait_ready(60, alive=lambda: gateway.proc.poll() is None)
            study = create(kafka_settings, redis_settings, env_topics, study_id="served",
                           d=3, n=200, epsilon=1.0, delta=0.01)
            wait_for(lambda: client.study("served") is not None, 30, "the gateway to serve it")
            assert client.study("served")[0].hash == study.hash
            assert main(["study", "delete", "served"]) == 0
            wait_for(lambda: client.study("served") is None, 30, "the gateway to forget it")
    finally:
        ps.stop(gateway)
