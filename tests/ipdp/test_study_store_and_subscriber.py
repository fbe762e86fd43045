"""Studies in Redis and on the compacted topic, the contributor against a real broker, the model
subscriber's de-duplication, and the operator CLI (`study ...`, `models`)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest

from ipdp.cli.common import UsageError
from ipdp.errors import IpdpError, RedisAuthError, StudyClosed, StudyExists, UnknownStudy
from ipdp.kafka_io import kafka_producer
from ipdp.losses import clip, encode, prepare
from ipdp.model_message import ModelMessage, PrivacyReport
from ipdp.redis_io import redis_client
from ipdp.state import (
    STUDY_HASHES,
    StudyKeys,
    close_study,
    create_study,
    list_studies,
    load_study,
    register_study,
    study_by_hash,
)
from ipdp.studies_topic import read_studies_topic
from ipdp.study import Study, StudyStatus
from ipdp.subscriber import ModelSubscriber
from ipdp.wire import decode_record
from producer.contributor import Contributor
from tests.pipeline import read_records

OPEN, CLOSED = StudyStatus.OPEN, StudyStatus.CLOSED

pytestmark = pytest.mark.integration

PARAMS = {"d": 4, "n": 10_000, "epsilon": 1.0, "delta": 0.01}


@pytest.fixture
def r(redis_settings):
    client = redis_client(redis_settings)
    yield client
    client.close()


@pytest.fixture
def producer(kafka_settings):
    p = kafka_producer(kafka_settings)
    yield p
    p.close()


# --------------------------------------------------------------------------- study store


def test_study_round_trip_in_redis_and_on_topic(r, producer, kafka_settings, topics):
    study = Study(study_id="reg-1", **PARAMS)
    assert create_study(r, producer, topics, study) is True
    assert load_study(r, "reg-1") == (study, OPEN)
    assert study_by_hash(r, study.hash) == (study, OPEN)
    assert r.hget(STUDY_HASHES, study.hash) == b"reg-1"
    assert int(r.hget(StudyKeys("reg-1").study, "created_ms")) > 0
    assert read_studies_topic(kafka_settings, topics) == {"reg-1": (study, OPEN)}

    other = Study(study_id="reg-2", loss="logistic", **PARAMS)
    create_study(r, producer, topics, other)
    assert [s.study_id for s, _ in list_studies(r)] == ["reg-1", "reg-2"]

    assert close_study(r, producer, topics, "reg-1") == study
    assert load_study(r, "reg-1") == (study, CLOSED)
    on_topic = read_studies_topic(kafka_settings, topics)
    assert on_topic == {"reg-1": (study, CLOSED), "reg-2": (other, OPEN)}
    assert load_study(r, "nope") is None and study_by_hash(r, b"\0" * 16) is None
    with pytest.raises(UnknownStudy):
        close_study(r, producer, topics, "nope")


def test_create_is_idempotent_and_refuses_changes(r, producer, kafka_settings, topics):
    study = Study(study_id="reg-idem", **PARAMS)
    assert create_study(r, producer, topics, study) is True
    created_ms = r.hget(StudyKeys("reg-idem").study, "created_ms")
    assert create_study(r, producer, topics, Study(study_id="reg-idem", **PARAMS)) is False
    assert r.hget(StudyKeys("reg-idem").study, "created_ms") == created_ms
    with pytest.raises(StudyExists, match="different parameters"):
        create_study(r, producer, topics, Study(study_id="reg-idem", **{**PARAMS, "n": 20_000}))
    assert load_study(r, "reg-idem") == (study, OPEN)
    assert read_studies_topic(kafka_settings, topics) == {"reg-idem": (study, OPEN)}


# --------------------------------------------------------------------------- contributor


def test_submit_publishes_a_perturbed_record(r, producer, kafka_settings, topics):
    study = Study(study_id="contrib", **PARAMS)
    create_study(r, producer, topics, study)
    with Contributor.connect("contrib", kafka_settings, topics) as c:
        assert c.study == study
        x, y = np.array([0.5, -0.2, 0.1, 0.3]), 0.7
        rid = c.submit(x, y)
        c.flush()
        assert c.delivered == 1 and c.failed == 0
    assert isinstance(rid, bytes) and len(rid) == 16
    (msg,) = read_records(kafka_settings, topics.records, 1)
    assert msg.key == rid
    rec = decode_record(msg.value)
    assert rec.study_hash == study.hash and rec.record_id == rid
    assert abs(rec.created_ms - time.time() * 1000) < 60_000
    assert np.isfinite(rec.q).all() and np.isfinite(rec.p).all()
    q, p = clip(*encode("squared", x, y), study.lam, study.p_bound)
    assert not np.allclose(rec.q, q) and not np.allclose(rec.p, p)  # noise was added
    assert len(msg.value) == 48 + 16 * 4  # (q̃, p̃) and a header: nothing else


def test_submit_many_with_seeded_rng_matches_prepare(r, producer, kafka_settings, topics):
    study = Study(study_id="contrib-many", loss="logistic", **PARAMS)
    create_study(r, producer, topics, study)
    rng = np.random.default_rng(42)
    x = rng.uniform(-0.5, 0.5, (200, 4))
    y = np.where(rng.uniform(size=200) > 0.5, 1.0, -1.0)
    c = Contributor(study, producer, topics.records, noise=np.random.default_rng(7),
                    records_per_device=200)
    ids = c.submit_many(x, y)
    c.flush()
    assert ids.shape == (200, 16) and len({i.tobytes() for i in ids}) == 200
    msgs = read_records(kafka_settings, topics.records, 200)
    got = {m.key: decode_record(m.value) for m in msgs}
    assert len(got) == 200
    q_exp, p_exp = prepare("logistic", x, y, study.calibration, np.random.default_rng(7))
    q = np.array([got[i.tobytes()].q for i in ids])
    p = np.array([got[i.tobytes()].p for i in ids])
    assert np.array_equal(q, q_exp) and np.array_equal(p, p_exp)


def test_closed_or_unknown_study_cannot_be_connected(r, producer, kafka_settings, topics):
    create_study(r, producer, topics, Study(study_id="to-close", **PARAMS))
    close_study(r, producer, topics, "to-close")
    with pytest.raises(StudyClosed, match="'to-close' is closed"):
        Contributor.connect("to-close", kafka_settings, topics)
    with pytest.raises(match="'ghost'"):
        Contributor.connect("ghost", kafka_settings, topics)


# --------------------------------------------------------------------------- subscriber


def _model(study: Study, round_no: int, w=(0.3, 0.4, 0.0, 0.0)) -> ModelMessage:
    return ModelMessage(
        study_id=study.study_id, round=round_no, n=study.n, d=study.d, loss=study.loss,
        weights=list(w), constraint_active=False,
        privacy=PrivacyReport.from_calibration(study.calibration),
        round_closed_ms=1, published_ms=2)


def _publish_models(producer, topics, msgs):
    for m in msgs:
        producer.send(topics.models, key=m.key, value=m.model_dump_json().encode())
    producer.flush()


def test_subscriber_drops_repeated_rounds(producer, kafka_settings, topics):
    a = Study(study_id="sub-a", **PARAMS)
    b = Study(study_id="sub-b", **PARAMS)
    _publish_models(producer, topics, [_model(a, 1), _model(a, 1), _model(b, 1), _model(a, 2)])
    producer.send(topics.models, key=b"junk", value=b"not json")
    _publish_models(producer, topics, [_model(a, 2)])

    sub = ModelSubscriber(kafka_settings, topics)
    got = [(m.study_id, m.round) for m in sub]
    assert got == [("sub-a", 1), ("sub-b", 1), ("sub-a", 2)]
    assert sub.duplicates_dropped == 2 and sub.invalid == 1

    only_a = ModelSubscriber(kafka_settings, topics, study_id="sub-a")
    assert [m.round for m in only_a] == [1, 2]
    assert only_a.duplicates_dropped == 2

    assert list(ModelSubscriber(kafka_settings, topics, from_beginning=False)) == []


def test_subscriber_reads_past_a_short_end_offset(producer, kafka_settings, topics):
    """50 models in one produce batch: tansu reports the end as the batch's base offset + 1."""
    study = Study(study_id="burst", **PARAMS)
    _publish_models(producer, topics, [_model(study, i) for i in range(1, 51)])
    assert [m.round for m in ModelSubscriber(kafka_settings, topics)] == list(range(1, 51))


def test_subscriber_follow_sees_new_models(producer, kafka_settings, topics):
    import threading

    study = Study(study_id="follow", **PARAMS)
    _publish_models(producer, topics, [_model(study, 1)])
    sub = ModelSubscriber(kafka_settings, topics, follow=True, poll_timeout_ms=100)
    seen = []

    def run():
        for m in sub:
            seen.append(m.round)
            if len(seen) == 2:
                sub.stop()

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)
    _publish_models(producer, topics, [_model(study, 1), _model(study, 2)])
    t.join(timeout=15)
    assert not t.is_alive()
    assert seen == [1, 2] and sub.duplicates_dropped == 1


# --------------------------------------------------------------------------- operator CLI


def _parser():
    from ipdp.cli.main import build_parser

    return build_parser()


def _run(argv):
    args = _parser().parse_args(argv)
    return args.func(args)


def test_study_cli_round_trip(env_topics, kafka_settings, r, capsys, tmp_path):
    assert _run(["study", "create", "--study-id", "cli-1", "--d", "4", "--n", "10000",
                 "--epsilon", "1", "--delta", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "created study cli-1" in out and "σ_u²" in out
    assert load_study(r, "cli-1")[1] == OPEN

    # Same parameters again: nothing changes. Different ones: refused.
    assert _run(["study", "create", "--study-id", "cli-1", "--d", "4", "--n", "10000",
                 "--epsilon", "1", "--delta", "0.01"]) == 0
    assert "nothing changed" in capsys.readouterr().out
    with pytest.raises(StudyExists, match="different parameters"):
        _run(["study", "create", "--study-id", "cli-1", "--d", "5", "--n", "10000",
              "--epsilon", "1", "--delta", "0.01"])
    with pytest.raises(UsageError, match=r"invalid study parameters:\n  .*delta=2.0 must lie"):
        _run(["study", "create", "--study-id", "cli-bad", "--d", "4", "--n", "10000",
              "--epsilon", "1", "--delta", "2"])

    # A file, with a flag overriding one of its fields.
    path = tmp_path / "study.json"
    path.write_text(json.dumps({"study_id": "cli-2", "loss": "logistic", "d": 3, "n": 5000,
                                "epsilon": 2.0, "delta": 0.01}))
    assert _run(["study", "create", "--file", str(path), "--n", "8000"]) == 0
    capsys.readouterr()
    assert load_study(r, "cli-2")[0].n == 8000

    r.hset(StudyKeys("cli-1").published, mapping={"1": 111, "2": 222})
    assert _run(["study", "show", "cli-1", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["status"] == "open" and shown["rounds_published"] == 2
    assert shown["study"]["study_id"] == "cli-1" and shown["calibration"]["d"] == 4
    assert _run(["study", "show", "cli-1"]) == 0
    text = capsys.readouterr().out
    assert "rounds published" in text and "local (ε, δ)" in text

    assert _run(["study", "close", "cli-1"]) == 0
    assert "closed study cli-1" in capsys.readouterr().out
    assert read_studies_topic(kafka_settings, env_topics)["cli-1"][1] == CLOSED

    assert _run(["study", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["study", "status"]
    assert [ln.split()[:2] for ln in lines[1:]] == [["cli-1", "closed"], ["cli-2", "open"]]

    with pytest.raises(UnknownStudy, match="unknown study 'ghost'"):
        _run(["study", "show", "ghost"])
    with pytest.raises(UnknownStudy, match="unknown study 'ghost'"):
        _run(["study", "close", "ghost"])


def test_study_create_from_yaml(env_topics, r, capsys, tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "study.yaml"
    path.write_text("study_id: cli-yaml\nd: 4\nn: 10000\nepsilon: 1.0\ndelta: 0.01\n")
    assert _run(["study", "create", "--file", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["created"] is True
    assert load_study(r, "cli-yaml")[0].d == 4
    path.write_text("study_id: cli-yaml2\nd: 4\nbogus: 1\n")
    with pytest.raises(UsageError, match="bogus"):
        _run(["study", "create", "--file", str(path)])


def test_yaml_without_pyyaml_is_a_clear_error(tmp_path, monkeypatch):
    import sys

    path = tmp_path / "s.yml"
    path.write_text("study_id: x\n")
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(UsageError, match="need PyYAML"):
        _run(["study", "create", "--file", str(path)])


def test_redis_auth_failure_is_a_usage_error(tmp_path):
    from ipdp.embedded import EmbeddedRedis, find_redis_server

    try:
        find_redis_server()
    except IpdpError as exc:
        pytest.skip(str(exc))
    server = EmbeddedRedis(data_dir=tmp_path / "redis", password="right-password")
    server.start()
    try:
        url = f"redis://:wrong-password@127.0.0.1:{server.port}/0"
        with pytest.raises(RedisAuthError, match="authentication failed"):
            _run(["study", "list", "--redis-url", url])
        assert _run(["study", "list", "--redis-url",
                     f"redis://:right-password@127.0.0.1:{server.port}/0"]) == 0
    finally:
        server.stop()


def test_models_cli(env_topics, producer, r, capsys):
    a = Study(study_id="m-a", **PARAMS)
    b = Study(study_id="m-b", **PARAMS)
    register_study(r, a)  # `models --study` reads the study and its progress from Redis
    _publish_models(producer, env_topics, [_model(a, 1), _model(a, 1), _model(b, 1),
                                           _model(a, 2, w=(0.6, 0.8, 0.0, 0.0))])
    assert _run(["models"]) == 0
    cap = capsys.readouterr()
    lines = cap.out.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("m-a  round 1  n=10000  ‖w‖=0.5000  ε=1  δ=0.01  mode=rigorous")
    assert "solve" not in lines[0]  # a data-dependent duration is never published
    assert "‖w‖=1.0000" in lines[2]
    assert "1 duplicate(s) dropped" in cap.err

    assert _run(["models", "--study", "m-a", "--json"]) == 0
    objs = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [(o["study_id"], o["round"]) for o in objs] == [("m-a", 1), ("m-a", 2)]
    assert ModelMessage.model_validate(objs[1]).weights == [0.6, 0.8, 0.0, 0.0]


def test_a_live_paper_mode_study_needs_the_explicit_flag(env_topics, kafka_settings, r, capsys):
    argv = ["study", "create", "--study-id", "paper-1", "--d", "4", "--n", "10000",
            "--epsilon", "1", "--delta", "0.01", "--mode", "paper"]
    with pytest.raises(UsageError, match="no proven guarantee.*--allow-unproven-paper-calibration"):
        _run(argv)
    assert load_study(r, "paper-1") is None
    assert _run([*argv, "--allow-unproven-paper-calibration"]) == 0
    assert "NOT proven" in capsys.readouterr().out
    assert load_study(r, "paper-1")[0].mode == "paper"


def test_study_create_takes_the_feature_bound_instead_of_lambda_and_p(env_topics, r, capsys):
    assert _run(["study", "create", "--study-id", "xb-1", "--loss", "logistic", "--d", "4",
                 "--n", "10000", "--epsilon", "1", "--delta", "0.01", "--x-bound", "2"]) == 0
    study = load_study(r, "xb-1")[0]
    assert (study.lam, study.p_bound) == (1.0, 1.0)  # logistic: λ = R²/4, P = R/2


def test_a_signed_study_from_the_cli_verifies_and_closing_it_needs_its_key(
        env_topics, kafka_settings, r, capsys, tmp_path, monkeypatch):
    from ipdp.errors import ConfigurationError
    from ipdp.signing import generate_key_files, parse_trusted_keys

    owner = generate_key_files(tmp_path / "owner")
    assert _run(["study", "create", "--study-id", "cli-signed", "--d", "4", "--n", "10000",
                 "--epsilon", "1", "--delta", "0.01", "--signing-key",
                 str(tmp_path / "owner.key")]) == 0
    assert f"signed by key {owner.key_id}" in capsys.readouterr().out
    pinned = parse_trusted_keys(str(tmp_path / "owner.pub"))
    study, _ = load_study(r, "cli-signed", pinned)
    assert read_studies_topic(kafka_settings, env_topics, trusted=pinned)["cli-signed"] == \
        (study, OPEN)
    assert _run(["study", "show", "cli-signed"]) == 0
    assert f"key {owner.key_id}" in capsys.readouterr().out

    with pytest.raises(ConfigurationError, match="closing it needs that signing key"):
        _run(["study", "close", "cli-signed"])
    assert load_study(r, "cli-signed")[1] == OPEN
    monkeypatch.setenv("IPDP_STUDY_SIGNING_KEY", str(tmp_path / "owner.key"))
    assert _run(["study", "close", "cli-signed"]) == 0
    assert read_studies_topic(kafka_settings, env_topics, trusted=pinned)["cli-signed"][1] == \
        CLOSED


def test_a_study_stored_before_the_error_rule_keeps_its_hash_and_noise_in_redis(r, producer,
                                                                               topics):
    # As the previous release stored it: its JSON without noise, its envelope with the noise
    # devices have been adding, and its wire hash.
    before = json.loads((Path(__file__).parent / "studies_before_error_rule.json").read_text())
    stored = before["studies"][0]
    text = json.loads(json.loads(stored["envelope"])["study"])
    old_hash = bytes.fromhex(stored["study_hash"])
    sid = text["study_id"]
    params = {k: v for k, v in text.items() if k != "noise"}
    r.hset(StudyKeys(sid).study, mapping={"json": json.dumps(params), "status": "open",
                                    "created_ms": 0, "envelope": stored["envelope"]})
    r.hset(STUDY_HASHES, old_hash, sid)
    for study, _ in (load_study(r, sid), study_by_hash(r, old_hash)):
        assert study.hash == old_hash
        assert study.calibration.sigma_u2 == pytest.approx(stored["sigma_u2"], rel=1e-12)
    # Creating it again is the no-op it always was, and closing it keeps its text.
    assert create_study(r, producer, topics, Study(**params)) is False
    closed = close_study(r, producer, topics, sid)
    assert closed.hash == old_hash
    assert load_study(r, sid)[0].hash == old_hash


def test_study_create_prints_what_n_buys_and_warns_below_the_advised_n(env_topics, r, capsys):
    assert _run(["study", "create", "--study-id", "small-1", "--d", "14", "--n", "2000",
                 "--epsilon", "0.1", "--delta", "0.01"]) == 0
    captured = capsys.readouterr()
    assert "n = 2,000 buys" in captured.out and "BELOW" in captured.out
    assert "the largest standard deviation y's range [-1, 1] allows" in captured.out
    assert re.search(r"WARNING: at n = 2,000 the promise against the non-private model is "
                     r"τ = [0-9.]+; "
                     r"0\.3·s = 0\.3 needs n ≥ [0-9,]+", captured.err)
    assert load_study(r, "small-1")[1] == OPEN  # a warning, not a refusal
    assert _run(["study", "create", "--study-id", "big-1", "--d", "14", "--n", "10000",
                 "--epsilon", "1", "--delta", "0.01", "--margin", "0.5", "--target-sd", "0.5"]) == 0
    captured = capsys.readouterr()
    assert "0.5·s = 0.25 needs n ≥" in captured.out and "BELOW" not in captured.out
    assert "s = 0.5, the target's standard deviation as given" in captured.out
    assert "WARNING" not in captured.err