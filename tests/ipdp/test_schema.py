"""A study's schema: validated at the edge, signed in the study text, encoding raw rows through
public ranges only, and a published model that predicts back in raw units (ipdp.model)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from ipdp import load_model
from ipdp.errors import ConfigurationError, SignatureError
from ipdp.model import Model
from ipdp.model_message import ModelMessage, PrivacyReport, model_value, parse_model_value
from ipdp.signing import SigningKey, TrustedKeys
from ipdp.study import Study, parse_study_message, study_message
from producer.datasets import from_csv_schema
from tests.system.test_cli import ipdp

RENTS = {"features": [{"name": "area", "min": 20, "max": 150},
                      {"name": "rooms", "min": 1, "max": 6}],
         "target": {"name": "rent", "min": 0, "max": 2500}, "intercept": True}
LOANS = {"features": [{"name": "income", "min": 0, "max": 200},
                      {"name": "debt", "min": 0, "max": 50}],
         "target": {"name": "approved", "classes": ["no", "yes"]}, "intercept": True}


def study(schema=RENTS, **params) -> Study:
    return Study(**({"study_id": "s", "n": 1000, "epsilon": 1.0, "delta": 1e-5,
                     "schema": schema} | params))


def test_the_schema_sets_d_and_bounds_every_encoded_row_by_construction():
    s = study()
    assert (s.d, s.x_bound, s.y_bound, s.lam, s.p_bound) == (3, 1.0, 1.0, 1.0, 1.0)
    logistic = study(LOANS, loss="logistic")
    assert (logistic.d, logistic.lam, logistic.p_bound) == (3, 0.25, 0.5)
    assert study(RENTS | {"intercept": False}).d == 2


def test_the_schema_is_in_the_signed_study_text_and_a_changed_range_changes_the_hash():
    s = study()
    assert json.loads(s.canonical_text)["schema"]["features"][0] == {
        "name": "area", "min": 20.0, "max": 150.0}
    wider = json.loads(json.dumps(RENTS))
    wider["features"][0]["max"] = 151
    assert study(wider).hash != s.hash
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = SigningKey(Ed25519PrivateKey.generate())
    trusted = TrustedKeys([key.private.public_key()])
    value = study_message(s, "open", key)
    assert parse_study_message(value, trusted)[0] == s
    tampered = value.replace(b'\\"max\\":150.0', b'\\"max\\":151.0')
    assert tampered != value
    with pytest.raises(SignatureError):
        parse_study_message(tampered, trusted)


def test_a_study_without_a_schema_keeps_its_text():
    text = json.loads(Study(study_id="s", n=1000, epsilon=1.0, delta=1e-5, d=3).canonical_text)
    assert "schema" not in text


@pytest.mark.parametrize(("schema", "params", "message"), [
    (RENTS | {"features": [{"name": "area", "min": 20, "max": 10}]}, {},
     "schema.features.0: 'area': max=10.0 must be greater than min=20.0"),
    (RENTS | {"features": [{"name": "a", "min": 0, "max": 1}, {"name": "a", "min": 0, "max": 2}]},
     {}, "feature names must be unique; repeated: a"),
    (RENTS | {"target": {"name": "rent", "min": 0, "max": 1, "classes": ["a", "b"]}}, {},
     "give either min and max (a number) or classes"),
    (RENTS | {"target": {"name": "area", "min": 0, "max": 1}}, {}, ("target 'area' is also a "
     "feature")),
    (RENTS | {"features": []}, {}, "schema.features: Tuple should have at least 1 item"),
    (RENTS | {"colour": "red"}, {}, "schema.colour: Extra inputs are not permitted"),
    (RENTS, {"loss": "logistic"}, "a logistic study's target is a class label"),
    (LOANS, {}, "a class target needs loss logistic"),
    (LOANS | {"target": {"name": "approved", "classes": ["yes", "yes"]}}, {"loss": "logistic"},
     "its two classes must be distinct"),
    (LOANS | {"target": {"name": "approved", "classes": ["no", " yes"]}}, {"loss": "logistic"},
     "non-empty names without surrounding spaces"),
    (RENTS, {"d": 5}, "d=5 contradicts the schema, which gives d=3"),
    (RENTS, {"x_bound": 2.0}, "x_bound=2.0 contradicts the schema"),
])
def test_an_invalid_schema_is_refused_with_what_is_wrong(schema, params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        study(schema, **params)


def test_the_cli_says_what_is_wrong_with_a_schema_file(tmp_path):
    bad = tmp_path / "schema.json"
    bad.write_text(json.dumps(RENTS | {"features": [{"name": "area", "min": 5, "max": 5}]}))
    done = ipdp("calibrate", "--schema", str(bad), "--n", "1000", "--epsilon", "1", "--delta",
                "1e-5")
    assert done.returncode == 2
    assert "'area': max=5.0 must be greater than min=5.0" in done.stderr
    assert "at least 1 item" not in done.stderr  # the cause only, not its echo on the list
    assert "Traceback" not in done.stderr
    good = tmp_path / "good.json"
    good.write_text(json.dumps(RENTS))
    done = ipdp("calibrate", "--schema", str(good), "--n", "1000", "--epsilon", "1", "--delta",
                "1e-5", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["d"] == 3


def test_raw_rows_are_mapped_through_their_ranges_and_out_of_range_values_clipped_and_counted():
    s = study()
    rows = {"area": [20, 85, 400], "rooms": [1, 6, 0], "rent": [1250, -10, 2500]}
    enc = s.schema_.encode(rows)
    root3 = math.sqrt(3)
    np.testing.assert_allclose(enc.x, np.array([[1, -1, -1], [1, 0, 1], [1, 1, -1]]) / root3)
    np.testing.assert_allclose(enc.y, [0.0, -1.0, 1.0])
    assert enc.clipped == {"area": 1, "rooms": 1, "rent": 1}
    assert (np.linalg.norm(enc.x, axis=1) <= 1 + 1e-12).all()
    labels = study(LOANS, loss="logistic").schema_.encode(
        {"income": [10, 20], "debt": [1, 2], "approved": ["yes", "no"]})
    np.testing.assert_array_equal(labels.y, [1.0, -1.0])
    with pytest.raises(ValueError, match=r"\['maybe'\] not among its classes \['no', 'yes'\]"):
        study(LOANS, loss="logistic").schema_.encode(
            {"income": [1], "debt": [1], "approved": ["maybe"]})
    with pytest.raises(ValueError, match="row has no column"):
        s.schema_.encode({"area": [1], "rent": [1]})


def test_a_csv_is_read_by_the_schema_names_with_unusable_rows_skipped(tmp_path):
    path = tmp_path / "rents.csv"
    path.write_text("rent,colour,rooms,area\n1250,red,1,20\n,blue,2,30\n3000,green,9,85\n"
                    "900,red,x,40\n")
    ds = from_csv_schema(path, study().schema_)
    assert len(ds) == 2 and ds.meta["rows_skipped"] == 2
    assert ds.meta["clipped"] == {"area": 0, "rooms": 1, "rent": 1}
    np.testing.assert_allclose(ds.x[1], np.array([1, 0, 1]) / math.sqrt(3))


def message(s: Study, weights) -> ModelMessage:
    return ModelMessage(study_id=s.study_id, round=1, n=s.n, d=s.d, loss=s.loss,
                        weights=list(weights), constraint_active=False,
                        privacy=PrivacyReport.from_calibration(s.calibration),
                        schema=s.schema_, round_closed_ms=0, published_ms=0)


def test_a_loaded_model_predicts_in_raw_units_what_its_weights_give_on_the_encoded_rows(tmp_path):
    s = study()
    w = np.array([0.2, 1.1, -0.4])
    path = tmp_path / "model.json"
    path.write_text(message(s, w).model_dump_json())
    m = load_model(path)
    rows = {"area": np.array([35.0, 90.0, 140.0]), "rooms": np.array([1.0, 3.0, 5.0])}
    direct = 1250.0 + 1250.0 * (s.schema_.encode(rows | {"rent": [0, 0, 0]}).x @ w)
    np.testing.assert_allclose(m.predict(rows), direct, rtol=1e-12)
    np.testing.assert_allclose(m.predict(np.column_stack([rows["area"], rows["rooms"]])), direct,
                               rtol=1e-12)
    np.testing.assert_allclose(m.intercept_ + np.column_stack(list(rows.values())) @ m.coef_,
                               direct, rtol=1e-12)
    assert m.feature_names == ["area", "rooms"]
    assert m.privacy.epsilon == 1.0
    with pytest.raises(KeyError, match="no column\\(s\\) 'rooms'"):
        m.predict({"area": [1.0]})
    with pytest.raises(AttributeError, match="predict_proba is for a class target"):
        m.predict_proba(rows)


def test_a_model_without_an_intercept_keeps_every_weight_for_a_feature(tmp_path):
    s = study(RENTS | {"intercept": False})
    w = np.array([1.1, -0.4])
    path = tmp_path / "model.json"
    path.write_text(message(s, w).model_dump_json())
    m = load_model(path)
    rows = {"area": np.array([35.0, 90.0, 140.0]), "rooms": np.array([1.0, 3.0, 5.0])}
    direct = 1250.0 + 1250.0 * (s.schema_.encode(rows | {"rent": [0, 0, 0]}).x @ w)
    assert m.coef_.shape == (2,)
    np.testing.assert_allclose(m.predict(rows), direct, rtol=1e-12)
    np.testing.assert_allclose(m.intercept_ + np.column_stack(list(rows.values())) @ m.coef_,
                               direct, rtol=1e-12)


def test_a_pandas_data_frame_is_a_mapping_of_columns_to_predict_from():
    pd = pytest.importorskip("pandas")
    m = Model(message(study(), [0.2, 1.1, -0.4]))
    rows = {"rooms": [1.0, 3.0], "area": [35.0, 90.0]}
    frame = pd.DataFrame(rows | {"colour": ["red", "blue"]})
    np.testing.assert_array_equal(m.predict(frame), m.predict(rows))


def test_a_logistic_model_gives_class_probabilities_and_labels():
    s = study(LOANS, loss="logistic")
    w = np.array([-0.3, 0.9, -0.8])
    m = Model(message(s, w))
    rows = {"income": np.array([20.0, 180.0]), "debt": np.array([45.0, 5.0])}
    score = s.schema_.encode(rows | {"approved": ["no", "no"]}).x @ w
    proba = m.predict_proba(rows)
    np.testing.assert_allclose(proba[:, 1], 1 / (1 + np.exp(-score)), rtol=1e-12)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0)
    assert m.predict(rows).tolist() == ["no", "yes"]


def test_an_exported_signed_model_is_verified_again_when_loaded_with_trainer_keys(tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    trainer, stranger = (SigningKey(Ed25519PrivateKey.generate()) for _ in range(2))
    path = tmp_path / "model.json"
    path.write_text(json.dumps(json.loads(model_value(message(study(), [0.1, 0.2, 0.3]),
                                                      trainer)), indent=2))
    assert load_model(path, trusted_keys=[trainer.public_b64]).coef_.shape == (2,)
    assert load_model(path).feature_names == ["area", "rooms"]  # believed without keys
    with pytest.raises(SignatureError, match="not by a trusted key"):
        load_model(path, trusted_keys=[stranger.public_b64])
    path.write_text(path.read_text().replace('0.1,', '0.9,'))
    with pytest.raises(SignatureError, match="does not verify"):
        load_model(path, trusted_keys=[trainer.public_b64])


def test_the_signed_model_carries_its_schema_and_a_model_without_one_cannot_be_loaded():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = SigningKey(Ed25519PrivateKey.generate())
    m = message(study(), [0.1, 0.2, 0.3])
    parsed = parse_model_value(model_value(m, key), TrustedKeys([key.private.public_key()]))
    assert parsed.schema_ == study().schema_
    schemaless = m.model_copy(update={"schema_": None})
    with pytest.raises(ConfigurationError) as refused:
        Model(schemaless)
    assert str(refused.value) == (
        "the model of study 's' round 1 has no schema: its weights are in the encoded space the "
        "devices used, with no map back to raw units (create the study with --schema)")


def test_a_model_names_what_is_wrong_with_the_rows_it_is_given():
    m = Model(message(study(), [0.2, 1.1, -0.4]))
    for rows, got in ((np.ones((2, 3)), "(2, 3)"), (np.ones(2), "(2,)")):
        with pytest.raises(ValueError) as refused:
            m.predict(rows)
        assert str(refused.value) == ("X must have shape (k, 2) with columns ['area', "
                                      f"'rooms'], got {got}")
    with pytest.raises(KeyError) as refused:
        m.predict({"colour": [1.0]})
    assert refused.value.args[0] == "no column(s) 'area', 'rooms'; the model needs 'area', 'rooms'"
    with pytest.raises(AttributeError) as refused:
        m.predict_proba({"area": [1.0], "rooms": [2.0]})
    assert str(refused.value) == ("target 'rent' is a number: predict_proba is for a class "
                                  "target (a logistic study)")


def test_a_model_reads_columns_of_numbers_written_as_text_or_in_any_array_shape():
    m = Model(message(study(), [0.2, 1.1, -0.4]))
    expected = m.predict({"area": np.array([35.0, 90.0]), "rooms": np.array([1.0, 3.0])})
    np.testing.assert_array_equal(m.predict({"area": ["35", "90"], "rooms": ["1", "3"]}), expected)
    np.testing.assert_array_equal(m.predict({"area": [[35.0, 90.0]], "rooms": [[1.0], [3.0]]}),
                                  expected)
    np.testing.assert_array_equal(m.predict([["35", "1"], ["90", "3"]]), expected)
    assert m.schema == study().schema_


def test_a_model_says_which_study_and_round_it_is():
    m = Model(message(study(), [0.2, 1.1, -0.4]).model_copy(update={"round": 7}))
    assert (m.study_id, m.round, m.target_name, m.classes) == ("s", 7, "rent", None)
    assert repr(m) == "Model(study='s', round=7, features=['area', 'rooms'], target='rent')"


def test_a_logistic_model_at_a_score_of_zero_says_the_second_class_at_even_odds():
    m = Model(message(study(LOANS, loss="logistic"), [0.0, 0.0, 0.0]))
    rows = {"income": [20.0], "debt": [5.0]}
    assert m.classes == ("no", "yes")
    assert m.predict(rows).tolist() == ["yes"]
    np.testing.assert_array_equal(m.predict_proba(rows), [[0.5, 0.5]])
    assert m.intercept_ == 0.0 and m.coef_.tolist() == [0.0, 0.0]


def test_a_model_file_that_cannot_be_read_is_a_configuration_error(tmp_path):
    with pytest.raises(ConfigurationError) as refused:
        load_model(tmp_path / "absent.json")
    assert str(refused.value).startswith(f"cannot read model {str(tmp_path / 'absent.json')!r}: ")
    assert "No such file" in str(refused.value)


def test_trusted_keys_are_read_from_base64_lines_or_a_key_set(tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = SigningKey(Ed25519PrivateKey.generate())
    path = tmp_path / "model.json"
    path.write_text(model_value(message(study(), [0.1, 0.2, 0.3]), key).decode())
    assert load_model(path, trusted_keys=key.public_b64).round == 1
    assert load_model(path, trusted_keys=TrustedKeys([key.private.public_key()])).round == 1


def test_importing_ipdp_loads_neither_the_model_code_nor_numpy_until_load_model_is_used():
    import subprocess
    import sys

    probe = ("import sys, ipdp; before = sorted(m for m in sys.modules if m.startswith("
             "('ipdp.', 'numpy', 'pydantic'))); from ipdp import load_model; "
             "print(before, load_model.__module__)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    assert out == "[] ipdp.model\n"


@pytest.mark.parametrize(("schema", "message"), [
    (RENTS | {"target": {"name": "rent", "min": 0}},
     "target 'rent': a numeric target needs both min and max"),
    (RENTS | {"target": {"name": "rent"}},
     ("target 'rent': give either min and max (a number) or classes (two class names), not both "
     "and not neither")),
    (RENTS | {"target": {"name": "rent", "min": 0, "max": math.inf}},
     "'rent': min=0.0 and max=inf must be finite numbers"),
    (RENTS | {"features": [{"name": "area", "min": -math.inf, "max": 1}]},
     "'area': min=-inf and max=1.0 must be finite numbers"),
    (LOANS | {"target": {"name": "approved", "classes": ["yes ", "no"]}},
     ("target 'approved': its two classes must be distinct, non-empty names without surrounding "
     "spaces, got ['yes ', 'no']")),
    (LOANS | {"target": {"name": "approved", "classes": ["", "no"]}},
     ("target 'approved': its two classes must be distinct, non-empty names without surrounding "
     "spaces, got ['', 'no']")),
    (RENTS | {"features": [{"name": f"f{i}", "min": 0, "max": 1} for i in range(4096)]},
     "4096 features give d=4097 > 4096"),
    (RENTS | {"features": [{"name": "a", "min": 0, "max": 1}] * 2 + [{"name": "b", "min": 0,
                                                                      "max": 1}] * 2},
     "feature names must be unique; repeated: a, b"),
])
def test_a_schema_is_refused_with_exactly_what_is_wrong(schema, message):
    from ipdp.schema import Schema

    with pytest.raises(ValueError) as refused:
        Schema.model_validate(schema)
    assert message in str(refused.value)
    assert Schema.model_validate(RENTS | {"features": [
        {"name": f"f{i}", "min": 0, "max": 1} for i in range(4095)]}).d == 4096


def test_values_at_a_range_s_ends_are_not_counted_as_clipped_and_labels_are_stripped():
    s = study()
    enc = s.schema_.encode({"area": [20, 150], "rooms": [1, 6], "rent": [0, 2500]})
    assert enc.clipped == {"area": 0, "rooms": 0, "rent": 0}
    np.testing.assert_allclose(enc.y, [-1.0, 1.0])
    one = s.schema_.encode({"area": 85, "rooms": 3.5, "rent": 1250})
    np.testing.assert_allclose(one.x, [[1 / math.sqrt(3), 0.0, 0.0]], atol=1e-15)
    labels = study(LOANS, loss="logistic").schema_.encode(
        {"income": [10, 20], "debt": [1, 2], "approved": [" yes", "no "]})
    np.testing.assert_array_equal(labels.y, [1.0, -1.0])


@pytest.mark.parametrize(("rows", "message"), [
    ({"area": [1], "rent": [1]},
     "row has no column(s) 'rooms'; the schema names 'area', 'rooms' and target 'rent'"),
    ({"area": [1, 2], "rooms": [1, 2], "rent": [1]}, "target 'rent' has 1 value(s) for 2 row(s)"),
    ({"area": ["big"], "rooms": [1], "rent": [1]},
     "column 'area' holds a value that is not a number"),
    ({"area": [[1, 2]], "rooms": [1], "rent": [1]}, "column 'area' must be 1-D, got shape (1, 2)"),
    ({"area": [math.nan], "rooms": [1], "rent": [1]},
     "column 'area' holds a missing or non-finite value"),
    ({"area": [1], "rooms": [1], "rent": [None]}, "column 'rent' holds a missing or non-finite value"),
])
def test_a_row_that_cannot_be_encoded_is_refused_naming_the_column(rows, message):
    with pytest.raises(ValueError) as refused:
        study().schema_.encode(rows)
    assert str(refused.value) == message


def test_the_target_map_gives_the_middle_and_half_width_of_the_range():
    assert study().schema_.target_map() == (1250.0, 1250.0)
    a, c = study().schema_.feature_map()
    root3 = math.sqrt(3)
    np.testing.assert_allclose(a, [2 / (130 * root3), 2 / (5 * root3)])
    np.testing.assert_allclose(c, [-170 / (130 * root3), -7 / (5 * root3)])


def test_a_target_range_off_zero_maps_to_minus_one_one_and_back():
    s = study(RENTS | {"target": {"name": "rent", "min": 500, "max": 2500}})
    enc = s.schema_.encode({"area": [20, 20, 20, 20], "rooms": [1, 1, 1, 1],
                            "rent": [500, 1500, 2500, 4000]})
    np.testing.assert_allclose(enc.y, [-1.0, 0.0, 1.0, 1.0])
    assert enc.clipped["rent"] == 1
    assert s.schema_.target_map() == (1500.0, 1000.0)


def test_a_range_of_one_point_and_two_missing_columns_and_many_unknown_labels_are_refused():
    from ipdp.schema import Feature

    with pytest.raises(ValueError, match=re.escape("'a': max=5.0 must be greater than min=5.0")):
        Feature(name="a", min=5, max=5)
    with pytest.raises(ValueError) as refused:
        study().schema_.encode({"rent": [1]})
    assert str(refused.value).startswith("row has no column(s) 'area', 'rooms'; ")
    with pytest.raises(ValueError) as refused:
        study(LOANS, loss="logistic").schema_.encode(
            {"income": [1] * 4, "debt": [1] * 4, "approved": ["a", "b", "c", "d"]})
    assert str(refused.value) == "target 'approved': ['a', 'b', 'c'] not among its classes " \
                                 "['no', 'yes']"
