"""The browser contributor end to end, in a real browser: headless Chromium opens the demo page the
gateway serves, verifies a signed study with a schema, asks for each named column with its range,
and contributes n raw rows (one typed into the page's own fields, with a value the page says it
clipped, the rest through its test hook); the aggregator and the trainer run as real
processes. Exactly one model of n records comes out, and the bytes the browser sent are exactly
the records the page showed and returned, none dead-lettered.

In the same browser, the page then contributes to a two-server study through a second gateway
(whose records topic no aggregator reads: the leader's fold of version-3 records is another
part's): its version-3 records, made by the bundled src/two-server.js, reach the topic byte for
byte, and the helper's key opens their sealed shares to what the page says it encoded.

Needs Node.js, Debian's chromium (scripts/install-test-deps.sh) and producer/web built with
playwright-core installed (`cd producer/web && npm ci && npm test`; `make test` does all three).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from ipdp import state
from ipdp.fixed_point import combine, encode
from ipdp.kafka_io import ensure_topics, kafka_producer
from ipdp.redis_io import redis_client
from ipdp.sealing import HelperKey, open_share
from ipdp.settings import TopicSettings
from ipdp.signing import generate_key_files
from ipdp.state import create_study
from ipdp.study import Study
from ipdp.subscriber import ModelSubscriber
from ipdp.two_server_wire import decode_two_server_batch, two_server_record_size
from ipdp.wire import decode_batch, header_study, record_size, split_container
from tests import proc_services as ps
from tests.gateway.conftest import running_gateway
from tests.gateway.test_gateway import known
from tests.pipeline import read_records, wait_for
from tests.tooling import require_tool, unavailable

pytestmark = pytest.mark.browser

WEB = Path(__file__).resolve().parents[2] / "producer" / "web"
SCRIPT = WEB / "test" / "e2e" / "contribute.mjs"
BROWSER_TIMEOUT_S = 180


def _browser() -> tuple[str, str]:
    """(node, chromium) paths, with the page built and playwright-core installed."""
    node = require_tool("node", "driving Chromium from the browser end-to-end test")
    chromium = os.environ.get("IPDP_CHROMIUM") or require_tool(
        "chromium", "the browser end-to-end test (Debian's chromium package)")
    if not (WEB / "node_modules" / "playwright-core").is_dir():
        unavailable("producer/web has no node_modules/playwright-core; run "
                    "`cd producer/web && npm ci`")
    if not (WEB / "dist" / "demo" / "index.html").is_file():
        unavailable("producer/web/dist is not built; run `cd producer/web && npm run build`")
    sources = [f for d in ("src", "demo") for f in (WEB / d).rglob("*") if f.is_file()]
    built = [f for f in (WEB / "dist").rglob("*") if f.is_file()]
    if max(f.stat().st_mtime for f in sources) > min(f.stat().st_mtime for f in built):
        # The page under test must be the one in the tree (make test builds it first).
        pytest.fail("producer/web/dist is older than producer/web/src or demo; run "
                    "`cd producer/web && npm run build`", pytrace=False)
    return node, chromium


SCHEMA = {"features": [{"name": "age", "min": 21, "max": 35},
                       {"name": "income", "min": 0, "max": 100}],
          "target": {"name": "weeks", "min": 0, "max": 52}, "intercept": True}


def _rows(k: int, seed: int) -> list[dict]:
    """k distinct raw rows in the schema's units; the first one's age lies outside its range."""
    rng = np.random.default_rng(seed)
    age, income = rng.uniform(21, 35, k).round(1), rng.uniform(5, 95, k).round(2)
    weeks = np.clip(60 - 1.5 * age + 0.1 * income + rng.normal(0, 2, k), 0, 52).round(1)
    age[0] = 41.5
    return [{"row": {"age": float(a), "income": float(i), "weeks": float(w)}}
            for a, i, w in zip(age, income, weeks, strict=True)]


HELPER = HelperKey(X25519PrivateKey.from_private_bytes(bytes(range(40, 72))))
#: Two-server devices' examples (x, y) for the page's form and its test hook.
TWO_SERVER_EXAMPLES = [{"x": [0.5, -0.25, 0.125], "y": 0.3}, {"x": [-0.1, 0.6, 0.2], "y": -0.4}]


def test_n_records_from_the_page_in_chromium_make_exactly_one_model_of_those_bytes(
        runtime, kafka_settings, redis_settings, topics, tmp_path):
    node, chromium = _browser()
    n, d = 50, 3
    owner = generate_key_files(tmp_path / "owner")
    # ε = 8: the smallest ε for which n = 50, d = 3 calibrates with noise on q̃ and p̃ both.
    study = Study(study_id="browser-e2e", loss="squared", n=n, epsilon=8.0, delta=0.01,
                  schema=SCHEMA)
    assert study.d == d
    two = Study(study_id="browser-two-server", d=d, n=1000, epsilon=1.0, delta=0.01,
                two_server={"helper_id": "helper-b", "helper_url": "https://helper.example.org",
                            "helper_key": HELPER.public_b64})
    # The two-server study's records go to a topic of their own, through a gateway of their own.
    two_topics = TopicSettings(**{**topics.model_dump(), "records": f"{topics.records}.two"})
    ensure_topics(kafka_settings, two_topics)
    producer = kafka_producer(kafka_settings)
    try:
        for each in (study, two):
            create_study(redis_client(redis_settings), producer, topics, each, owner)
    finally:
        producer.close()
    examples = _rows(n, seed=11)
    screenshot = tmp_path / "page-after-contributing.png"

    # The aggregator pins the owner's key too: it folds nothing of a study the owner did not sign.
    with ps.pipeline(runtime, topics, tmp_path, f"browser-{topics.records}",
                     IPDP_TRUSTED_STUDY_KEYS=owner.public_b64), \
            running_gateway(kafka_settings, topics, web_dir=str(WEB / "dist")) as url, \
            running_gateway(kafka_settings, two_topics, web_dir=str(WEB / "dist")) as two_url:
        known(url, study.study_id)
        known(two_url, two.study_id)
        key = quote(owner.public_b64, safe="")
        page = f"{url}/web/?study={quote(study.study_id)}&key={key}"
        second = {"url": f"{two_url}/web/?study={quote(two.study_id)}&key={key}", "k": 3,
                  "screenshot": str(tmp_path / "two-server-page.png"),
                  "examples": TWO_SERVER_EXAMPLES}
        run = subprocess.run(
            [node, str(SCRIPT), page, str(n), str(screenshot), json.dumps(examples),
             json.dumps(second)],
            cwd=WEB, env={**os.environ, "IPDP_CHROMIUM": chromium}, capture_output=True,
            text=True, timeout=BROWSER_TIMEOUT_S, check=False)
        try:
            out = json.loads(run.stdout)
        except json.JSONDecodeError:
            pytest.fail(f"contribute.mjs exited {run.returncode}:\n{run.stdout}\n{run.stderr}")
        assert run.returncode == 0 and "error" not in out and "error" not in out["second"], \
            json.dumps(out, indent=1)[:4000]

        def models():
            return list(ModelSubscriber(kafka_settings, topics, study_id=study.study_id,
                                        from_beginning=True))

        wait_for(lambda: len(models()) >= 1, 90, "the round's model")
        # The model means every record is on the topic; the group commit may have put several
        # one-record POSTs in one message, so read until nothing more comes.
        on_topic = read_records(kafka_settings, topics.records, expected=len(out["posts"]),
                                timeout_s=3)
        dead = read_records(kafka_settings, topics.dead_letter, expected=1, timeout_s=3)
        # Each two-server POST was answered 202 before the next: one container each.
        two_on_topic = read_records(kafka_settings, two_topics.records,
                                    expected=len(out["second"]["posts"]), timeout_s=10)

    # The page verified the study and said what it guarantees, without a page error.
    assert out["studyStatus"].startswith("Signature verified with the pinned key")
    assert any("ε" in sentence for sentence in out["report"]), out["report"]
    assert (out["pageErrors"], out["failedResponses"]) == ([], [])
    assert not [m for m in out["console"] if m.startswith("error")], out["console"]
    assert out["sendStatus"].startswith("Accepted: record " + out["prepared"]["recordId"])
    # It asked for each named column with its public range, and said which value it clipped.
    assert out["fields"] == ["age (21 – 35)", "income (0 – 100)", "weeks (0 – 52)"]
    assert out["exampleStatus"].endswith("Outside its public range, so clipped to it: "
                                         "age (21 – 35).")

    # What the page returned: the record a person prepared and sent, then n − 1 from the hook,
    # each device's record in a POST of its own.
    many = out["many"]
    assert len(out["posts"]) == n
    assert many["accepted"] == n - 1
    page_ids = [out["prepared"]["recordId"], *many["recordIds"]]
    page_records = [bytes.fromhex(out["prepared"]["hex"]),
                    *(bytes.fromhex(h) for h in many["records"])]
    assert len(set(page_ids)) == n
    # The page displays the last record sent.
    assert (out["displayed"]["recordId"], out["displayed"]["hex"]) == \
        (many["recordIds"][-1], many["records"][-1])

    # What the browser sent, captured on the network, is exactly those bytes, in order …
    assert {p["contentType"] for p in out["posts"]} == {"application/octet-stream"}
    assert {p["url"] for p in out["posts"]} == {f"{url}/studies/{study.study_id}/records"}
    sent = b"".join(bytes.fromhex(p["body"]) for p in out["posts"])
    size = record_size(d)
    assert [sent[i:i + size] for i in range(0, len(sent), size)] == page_records
    # … it decodes to the record ids, q̃ and p̃ the page returned, under the signed study's hash …
    (batch,), rejects = decode_batch(page_records)
    assert rejects == []
    assert [bytes(r).hex() for r in batch.record_id] == page_ids
    assert (batch.study_hash == np.frombuffer(study.hash, np.uint8)).all()
    np.testing.assert_array_equal(batch.q[1:], np.array(many["q"]))
    np.testing.assert_array_equal(batch.p[1:], np.array(many["p"]))
    shown_q = [float(v) for v in out["prepared"]["q"].strip("[]").split(",")]
    np.testing.assert_allclose(batch.q[0], shown_q, rtol=1e-5)
    # … the rows were encoded through the schema as a Python device encodes them …
    # (the hook cycles through the rows from the first: it sent rows 0 … n − 2)
    columns = {c: [e["row"][c] for e in examples[:n - 1]] for c in ("age", "income", "weeks")}
    encoded = study.schema_.encode(columns)
    q_clean = np.array(many["q"])
    # q̃ = x + u: the encoded x is what remains once the page's own noise draw is taken out,
    # which is not returned; bound it by the noise scale instead.
    assert np.abs(q_clean - encoded.x).max() < 8 * study.calibration.noise_std_q
    # … the raw values never left the page …
    for example in examples:
        for v in example["row"].values():
            assert np.float64(v).tobytes() not in sent
    # … and Kafka holds exactly those records.
    held = [r for m in on_topic for r in split_container(m.value)]
    assert sorted(held) == sorted(page_records)

    # Exactly one model, of exactly the n records; nothing dead-lettered.
    assert [(m.round, m.n) for m in models()] == [(1, n)]
    assert dead == []
    counts = redis_client(redis_settings).hgetall(state.StudyKeys(study.study_id).counts)
    assert int(counts[b"folded"]) == n
    assert screenshot.stat().st_size > 10_000

    _check_two_server_page(out["second"], two, two_url, two_on_topic)


def _check_two_server_page(out: dict, study: Study, url: str, on_topic: list) -> None:
    """The two-server page, in the same browser: it said what the mode protects, sent one
    version-3 record per POST, and the topic holds exactly those bytes, whose sealed shares the
    helper's key opens, under each record's header, to what the page says it encoded."""
    assert (out["pageErrors"], out["failedResponses"]) == ([], [])
    assert not [m for m in out["console"] if m.startswith("error")], out["console"]
    assert any("two-server study" in sentence and "helper-b" in sentence
               for sentence in out["report"]), out["report"]
    assert out["sendStatus"].startswith("Accepted: record " + out["prepared"]["recordId"])
    many = out["many"]
    assert many["accepted"] == 2 and len(out["posts"]) == 3
    page_records = [bytes.fromhex(out["prepared"]["hex"]),
                    *(bytes.fromhex(h) for h in many["records"])]
    assert {len(r) for r in page_records} == {two_server_record_size(study.d)}
    assert [bytes.fromhex(p["body"]) for p in out["posts"]] == page_records
    assert {p["url"] for p in out["posts"]} == {f"{url}/studies/{study.study_id}/records"}
    held = [r for m in on_topic for r in split_container(m.value)]
    assert sorted(held) == sorted(page_records)
    assert {header_study(m.headers) for m in on_topic} == {study.study_id}

    batch, rejects = decode_two_server_batch(page_records, study.d)
    assert rejects == []
    assert [bytes(r).hex() for r in batch.record_id] == [out["prepared"]["recordId"],
                                                         *many["recordIds"]]
    assert (batch.study_hash == np.frombuffer(study.hash, np.uint8)).all()
    helper = np.stack([np.frombuffer(open_share(HELPER.private, sealed, header.tobytes()), "<u8")
                       for sealed, header in zip(batch.sealed, batch.header, strict=True)])
    # The hook's records: q̃ and p̂ as the page returned them, encoded as the Python device
    # encodes them, are exactly what the two shares add up to.
    expected, _ = encode(np.array(many["q"]), np.array(many["p"]), study.encoding)
    np.testing.assert_array_equal(combine(batch.leader, helper)[1:], expected)
    assert not np.array_equal(batch.leader[1:], expected)
