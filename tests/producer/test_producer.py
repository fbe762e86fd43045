"""Producer side: datasets honour the public bounds; the contributor and the load generator encode
what prepare() produces; the load generator sends exactly one record per device (real broker)."""

from __future__ import annotations

import argparse
import time

import numpy as np
import pytest

from ipdp.losses import prepare
from ipdp.study import Study
from ipdp.wire import RECORD_ID_BYTES, decode_batch
from producer.contributor import Contributor, new_record_ids
from producer.datasets import from_csv, synthetic, synthetic_batches, train_test_split
from tests.pipeline import create, read_records

STUDY = {"d": 5, "n": 10_000, "epsilon": 1.0, "delta": 0.01}


# --------------------------------------------------------------------------- datasets


@pytest.mark.parametrize("loss", ["squared", "logistic"])
@pytest.mark.parametrize("d", [1, 14, 100])
def test_synthetic_honours_public_bounds(loss, d):
    ds = synthetic(5000, d, loss, seed=1)
    assert ds.x.shape == (5000, d) and ds.y.shape == (5000,)
    assert np.linalg.norm(ds.x, axis=1).max() <= 1.0 + 1e-12
    assert np.abs(ds.y).max() <= 1.0
    assert np.linalg.norm(ds.w_true) <= 1.0 + 1e-12
    if loss == "logistic":
        assert set(np.unique(ds.y)) <= {-1.0, 1.0}


def test_synthetic_is_reproducible_and_seed_dependent():
    a, b, c = (synthetic(100, 4, "squared", seed=s) for s in (3, 3, 4))
    assert np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y)
    assert not np.array_equal(a.x, c.x)


def test_synthetic_signal_is_learnable():
    """A non-private fit is far better than chance / the constant predictor."""
    ds = synthetic(20_000, 14, "logistic", seed=2)
    w = np.linalg.lstsq(ds.x, ds.y, rcond=None)[0]
    assert np.mean(np.sign(ds.x @ w) == ds.y) > 0.85
    sq = synthetic(20_000, 14, "squared", seed=2)
    w = np.linalg.lstsq(sq.x, sq.y, rcond=None)[0]
    r2 = 1 - np.mean((sq.x @ w - sq.y) ** 2) / np.var(sq.y)
    assert r2 > 0.8
    assert np.linalg.norm(w - sq.w_true) < 0.1


def test_synthetic_batches_total_and_bounds():
    w, it = synthetic_batches(2500, 3, "logistic", batch=1000, seed=0)
    sizes = []
    for x, y in it:
        sizes.append(len(y))
        assert np.linalg.norm(x, axis=1).max() <= 1.0 + 1e-12
        assert set(np.unique(y)) <= {-1.0, 1.0}
    assert sizes == [1000, 1000, 500]
    assert np.linalg.norm(w) == pytest.approx(1.0)


def test_bad_loss_refused():
    with pytest.raises(ValueError, match="unknown loss"):
        synthetic(10, 2, "hinge")


def _write_csv(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("a,b,target,c\n"
                    "1,2,10,3\n"
                    "4,5,20,6\n"
                    "-7,8,30,9\n"
                    "1,,40,1\n"  # missing value: dropped
                    "0,0,0,0\n")
    return path


def test_from_csv_squared_scales_into_bounds(tmp_path):
    ds = from_csv(_write_csv(tmp_path), "target", "squared")
    assert ds.feature_names == ["a", "b", "c"]
    assert ds.x.shape == (4, 3)
    assert ds.meta["rows_dropped"] == 1
    assert np.linalg.norm(ds.x, axis=1).max() == pytest.approx(1.0)
    assert ds.y.min() == -1.0 and ds.y.max() == 1.0
    assert ds.y.tolist() == pytest.approx([-1 / 3, 1 / 3, 1.0, -1.0])


def test_from_csv_logistic_thresholds_at_median(tmp_path):
    ds = from_csv(_write_csv(tmp_path), "target", "logistic", features=["a", "c"])
    assert ds.x.shape == (5, 2)  # column b (with the missing value) is not used
    assert ds.meta["y_threshold"] == 20.0
    assert ds.y.tolist() == [-1.0, -1.0, 1.0, 1.0, -1.0]  # +1 strictly above the median


def test_from_csv_errors(tmp_path):
    path = _write_csv(tmp_path)
    with pytest.raises(ValueError, match="no column 'nope'"):
        from_csv(path, "nope", "squared")
    with pytest.raises(ValueError, match="missing or non-numeric"):
        from_csv(path, "target", "squared", drop_nonfinite=False)


def test_train_test_split_partitions():
    ds = synthetic(1000, 3, "squared", seed=0)
    train, test = train_test_split(ds, 0.2, seed=1)
    assert len(train) == 800 and len(test) == 200
    rows = np.concatenate([train.x, test.x])
    assert np.array_equal(np.sort(rows, axis=0), np.sort(ds.x, axis=0))
    with pytest.raises(ValueError):
        train_test_split(ds, 0.0)


# --------------------------------------------------------------------------- contributor (no I/O)


def test_record_ids_are_random_uuid4_shaped():
    ids = new_record_ids(1000)
    assert ids.shape == (1000, 16) and ids.dtype == np.uint8
    assert len({r.tobytes() for r in ids}) == 1000
    assert np.all(ids[:, 6] >> 4 == 4) and np.all(ids[:, 8] >> 6 == 2)


def test_encode_many_matches_prepare_with_same_seed():
    study = Study(study_id="unit", **STUDY)
    ds = synthetic(50, 5, "squared", seed=0)
    c = Contributor(study, producer=None, topic="unused", noise=np.random.default_rng(11),
                    records_per_device=50)
    ids, values = c.encode_many(ds.x, ds.y)
    (batch,), rejects = decode_batch(values)
    assert not rejects
    q, p = prepare("squared", ds.x, ds.y, study.calibration, np.random.default_rng(11))
    assert np.array_equal(batch.q, q) and np.array_equal(batch.p, p)
    assert np.array_equal(batch.record_id, ids)
    assert all(h.tobytes() == study.hash for h in batch.study_hash)
    assert abs(int(batch.created_ms[0]) - time.time() * 1000) < 60_000


def test_contributor_checks_shapes():
    study = Study(study_id="unit", **STUDY)
    c = Contributor(study, producer=None, topic="unused")
    with pytest.raises(ValueError, match=r"shape \(k, 5\)"):
        c.encode_many(np.zeros((3, 4)), np.zeros(3))
    with pytest.raises(ValueError, match=r"y must have shape \(3,\)"):
        c.encode_many(np.zeros((3, 5)), np.zeros(2))
    with pytest.raises(ValueError, match=r"x must have shape \(5,\)"):
        c.submit(np.zeros((1, 5)), 0.0)


def test_a_device_submits_its_raw_row_encoded_through_the_study_schema(kafka_settings, topics):
    from ipdp.kafka_io import kafka_producer

    study = Study(study_id="row", n=1000, epsilon=1.0, delta=0.01,
                  schema={"features": [{"name": "age", "min": 21, "max": 35},
                                       {"name": "income", "min": 0, "max": 100}],
                          "target": {"name": "weeks", "min": 0, "max": 52}})
    row = {"age": 40, "income": 50, "weeks": 13}
    with Contributor(study, kafka_producer(kafka_settings), topics.records,
                     noise=np.random.default_rng(4)) as device:
        record_id = device.submit_row(row)
        device._owns_producer = True  # close the producer this test built
    assert device.clipped == {"age": 1, "income": 0, "weeks": 0}
    (msg,) = read_records(kafka_settings, topics.records, 1)
    (batch,), _ = decode_batch([msg.value])
    assert batch.record_id[0].tobytes() == record_id
    x = np.array([[1.0, 1.0, 0.0]]) / np.sqrt(3)  # age clipped to 35 → +1, income mid-range → 0
    q, p = prepare("squared", x, np.array([-0.5]), study.calibration, np.random.default_rng(4))
    np.testing.assert_allclose(batch.q, q, rtol=1e-12)
    np.testing.assert_allclose(batch.p, p, rtol=1e-12)
    with pytest.raises(ValueError, match="has no schema: submit its encoded"):
        Contributor(Study(study_id="plain", **STUDY), None, "unused").submit_row(row)


# --------------------------------------------------------------------------- load generator


def _end_total(kafka, topic) -> int:
    """Records in the topic, counted by reading (tansu's end offsets can stop short)."""
    from kafka import TopicPartition

    from ipdp.kafka_io import kafka_consumer, read_to_end

    consumer = kafka_consumer(kafka, group_id=None)
    try:
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        return sum(1 for _ in read_to_end(consumer, tps, timeout_s=20))
    finally:
        consumer.close()


def test_loadgen_sends_one_record_per_device(kafka_settings, topics):
    from ipdp.metrics import LOADGEN_RECORDS_SENT
    from producer.loadgen import run_loadgen

    study = Study(study_id="lg-count", loss="logistic", **STUDY)
    ds = synthetic(3001, 5, "logistic", seed=0)
    before = LOADGEN_RECORDS_SENT.labels(study.study_id)._value.get()
    res = run_loadgen(study, kafka_settings, topics, ds.x, ds.y, batch=700, progress=False,
                      rng=np.random.default_rng(5))
    assert (res.sent, res.errors) == (3001, 0)
    assert res.seconds > 0 and res.rate > 0
    assert LOADGEN_RECORDS_SENT.labels(study.study_id)._value.get() - before == 3001
    assert _end_total(kafka_settings, topics.records) == 3001

    msgs = read_records(kafka_settings, topics.records, 3001)
    assert len(msgs) == 3001
    (batch,), rejects = decode_batch([m.value for m in msgs])
    assert not rejects and len(batch) == 3001
    assert all(m.key == m.value[RECORD_ID_BYTES] for m in msgs)  # key = record id
    assert len({m.key for m in msgs}) == 3001
    assert np.all(batch.study_hash == np.frombuffer(study.hash, np.uint8))
    # Same rng, same batch boundaries → exactly the noise prepare() draws.
    rng = np.random.default_rng(5)
    q = np.concatenate([prepare("logistic", ds.x[i:i + 700], ds.y[i:i + 700],
                                study.calibration, rng)[0] for i in range(0, 3001, 700)])
    assert np.array_equal(np.sort(batch.q, axis=0), np.sort(q, axis=0))


def test_loadgen_rate_limit(kafka_settings, topics, capsys):
    from producer.loadgen import run_loadgen

    study = Study(study_id="lg-rate", **STUDY)
    ds = synthetic(300, 5, "squared", seed=0)
    res = run_loadgen(study, kafka_settings, topics, ds.x, ds.y, rate=1000, batch=100,
                      progress=True)
    assert res.sent == 300 and res.errors == 0
    assert res.seconds >= 0.25  # 300 records at 1000/s: the last chunk is due at ≥ 0.25 s
    assert "loadgen lg-rate" in capsys.readouterr().err  # the progress bar, on stderr


def test_loadgen_cli(kafka_settings, topics, redis_settings, monkeypatch, capsys, tmp_path):
    from ipdp.cli.loadgen import add_commands
    from ipdp.kafka_io import kafka_producer
    from ipdp.redis_io import redis_client
    from ipdp.state import create_study

    for name, value in topics.model_dump().items():
        monkeypatch.setenv(f"IPDP_TOPIC_{name.upper()}", str(value))
    study = Study(study_id="lg-cli", **STUDY)
    r = redis_client(redis_settings)
    producer = kafka_producer(kafka_settings)
    try:
        create_study(r, producer, topics, study)
    finally:
        producer.close()
        r.close()

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["loadgen", "--study", "lg-cli", "--devices", "1200", "--seed", "3",
                              "--batch", "500", "--no-progress",
                              "--bootstrap", kafka_settings.bootstrap])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "records sent  1200" in out and "errors        0" in out and "records/s" in out
    assert _end_total(kafka_settings, topics.records) == 1200

    from ipdp.cli.common import UsageError

    csv_path = tmp_path / "rows.csv"
    csv_path.write_text("a,b,c,d,e,y\n1,2,3,4,5,1\n0,1,0,1,0,2\n5,4,3,2,1,3\n")
    csv_flags = ["loadgen", "--study", "lg-cli", "--devices", "7", "--no-progress",
                 "--dataset", f"csv:{csv_path}", "--target", "y",
                 "--bootstrap", kafka_settings.bootstrap]
    args = parser.parse_args(csv_flags)
    with pytest.raises(UsageError, match="has 3 usable rows for 7 devices: give --devices ≤ rows, "
                       "or --reuse-rows"):
        args.func(args)
    args = parser.parse_args([*csv_flags, "--reuse-rows"])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    assert "records sent  7" in out
    assert "WARNING: 7 devices from 3 rows: rows are reused" in err
    # A study without a schema: the file's own statistics scale it, and the command says so.
    assert ("has no schema, so " f"{csv_path} is scaled by statistics of the whole file") in err
    assert "largest row norm 7.4162" in err and "mapped from the file's [1, 3]" in err
    assert _end_total(kafka_settings, topics.records) == 1207
    narrow = tmp_path / "narrow.csv"
    narrow.write_text("a,b,y\n1,2,3\n4,5,6\n")
    args = parser.parse_args(["loadgen", "--study", "lg-cli", "--devices", "7", "--no-progress",
                              "--dataset", f"csv:{narrow}", "--target", "y",
                              "--bootstrap", kafka_settings.bootstrap])
    with pytest.raises(UsageError, match="has 2 feature columns, study 'lg-cli' has d=5"):
        args.func(args)

    # A study with a schema: its columns by name (order and extra columns do not matter), each
    # row encoded through the public ranges, out-of-range values clipped and counted per column.
    create(kafka_settings, redis_settings, topics, study_id="lg-schema", loss="logistic",
           n=1000, epsilon=1.0, delta=0.01,
           schema={"features": [{"name": "income", "min": 0, "max": 200},
                                {"name": "debt", "min": 0, "max": 50}],
                   "target": {"name": "approved", "classes": ["no", "yes"]}})
    rows = tmp_path / "loans.csv"
    rows.write_text("debt,name,approved,income\n10,ann,yes,120\n80,bob,no,30\n5,cy,maybe,90\n"
                    "2,dee,no,250\n")
    args = parser.parse_args(["loadgen", "--study", "lg-schema", "--devices", "3",
                              "--no-progress", "--dataset", f"csv:{rows}",
                              "--bootstrap", kafka_settings.bootstrap])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    assert "rows read     3 (1 skipped: a missing or unusable value)" in out
    assert "clipped       income 1, debt 1 (values outside their schema range" in out
    assert "records sent  3" in out and "WARNING" not in err
    assert _end_total(kafka_settings, topics.records) == 1210

    args = parser.parse_args(["loadgen", "--study", "nope", "--devices", "5", "--no-progress",
                              "--bootstrap", kafka_settings.bootstrap])
    with pytest.raises(UsageError, match="unknown study 'nope'"):
        args.func(args)
