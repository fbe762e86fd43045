"""The helper on granian's embeddable server over a real redis-server, driven by the leader's
client (ipdp.helper_client): prepare and commit by job id, its own refusals, rounds
released at n, and what its Redis holds."""

from __future__ import annotations

import base64
import http.client
import json
import threading
import time
import urllib.request
from urllib.parse import urlsplit

import numpy as np
import pytest
import redis
from scipy.stats import chisquare

from ipdp.fixed_point import combine, decode, fold
from ipdp.helper_client import HelperRefused
from ipdp.helper_protocol import helper_part
from ipdp.metrics import EVERY_METRIC
from ipdp.signing import SigningKey
from ipdp.study import StudyStatus
from tests.helper.conftest import TOKEN, make_study
from tests.helper.devices import fixed_point_of, make_records


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(37)


def records_counted(study_id: str, outcome: str) -> float:
    return EVERY_METRIC.get_sample_value("ipdp_helper_records_total",
                                         {"study": study_id, "outcome": outcome}) or 0.0


def folded_counted(study_id: str) -> float:
    return EVERY_METRIC.get_sample_value("ipdp_helper_records_folded_total",
                                         {"study": study_id}) or 0.0


def test_every_route_but_healthz_needs_the_leaders_token(rig):
    with rig.client(token="not-the-token") as wrong:
        assert wrong.request("GET", "/healthz")[0] == 200
        assert wrong.request("PUT", "/jobs/j1", {"study": "", "records": ["AA=="]})[0] == 401
        assert wrong.request("POST", "/jobs/j1/commit", {"rounds": []})[0] == 401
        assert wrong.request("GET", "/studies/two-server/rounds/0")[0] == 401
    with rig.client(token=TOKEN[:-1]) as prefix:
        assert prefix.request("GET", "/studies/two-server/rounds/0")[0] == 401
    with rig.client() as right:
        assert right.request("GET", "/studies/two-server/rounds/0")[0] == 409
    scrape = urllib.request.Request(f"{rig.url}/metrics",
                                    headers={"authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(scrape, timeout=10) as response:
        assert b"ipdp_helper_requests_total" in response.read()
    assert EVERY_METRIC.get_sample_value(
        "ipdp_helper_requests_total", {"route": "/jobs/{job_id}", "status": "401"}) >= 1


def test_a_job_prepared_twice_gets_one_answer_and_another_body_is_refused(rig, rng):
    batch = make_records(rig.study, rig.key.public, 5, rng)
    before = records_counted(rig.study.study_id, "accepted")
    with rig.client() as client:
        first = client.prepare("p0:e1:0-4", rig.study_value(), batch.records, rig.study.d)
        again = client.prepare("p0:e1:0-4", rig.study_value(), batch.records, rig.study.d)
        assert first.mask.tolist() == again.mask.tolist() == [True] * 5
        assert first.refused == again.refused == {}
        with pytest.raises(HelperRefused) as refused:
            client.prepare("p0:e1:0-4", rig.study_value(), batch.records[:4], rig.study.d)
        assert (refused.value.status, refused.value.reason) == (409, "job_conflict")
    assert records_counted(rig.study.study_id, "accepted") == before + 5  # the job, once


def test_the_helper_refuses_on_its_own_with_a_reason_per_record(rig, rng):
    study, d = rig.study, rig.study.d
    good = make_records(study, rig.key.public, 3, rng)
    tampered = bytearray(good.records[1])
    tampered[-20] ^= 1  # inside the sealed share (its AES-GCM tag)
    moved = bytearray(good.records[2])
    moved[41] ^= 1  # created_ms: the header the share is bound to changed
    day_ms = 86_400_000
    stale = make_records(study, rig.key.public, 1, rng,
                         created_ms=time.time_ns() // 1_000_000 - 2 * day_ms)
    future = make_records(study, rig.key.public, 1, rng,
                          created_ms=time.time_ns() // 1_000_000 + 3_600_000)
    proof = make_records(study, rig.key.public, 1, rng, proof=b"\x01" * 8)
    other_study = make_records(make_study(epsilon=2.0), rig.key.public, 1, rng)
    v1 = bytearray(good.records[0])
    v1[0] = 1
    records = [good.records[0], bytes(tampered), bytes(moved), *stale.records, *future.records,
               *proof.records, *other_study.records, bytes(v1), good.records[0]]
    seals = records_counted(study.study_id, "bad_seal")
    with rig.client() as client:
        got = client.prepare("job-refusals", rig.study_value(), records, d)
        assert records_counted(study.study_id, "bad_seal") == seals + 2
        assert got.mask.tolist() == [True] + [False] * 8
        assert got.refused == {1: "bad_seal", 2: "bad_seal", 3: "stale", 4: "future",
                               5: "unexpected_proof", 6: "study_mismatch",
                               7: "unsupported_version", 8: "duplicate_record"}
        later = make_records(study, rig.key.public, 1, rng)
        client.commit("job-refusals", {0: [good.ids[0]]})
        replay = client.prepare("job-later", rig.study_value(),
                                [good.records[0], later.records[0]], d)
        assert replay.refused == {0: "replayed"}
        assert replay.mask.tolist() == [False, True]


def test_an_id_is_seen_at_commit_so_a_job_never_committed_blocks_nothing(rig, rng):
    """A leader that crashed between its prepare and its own commit point sends the records
    again in a new job: prepared but uncommitted ids are accepted again, and of two jobs
    holding one id only the first committed folds it."""
    study, d = rig.study, rig.study.d
    batch = make_records(study, rig.key.public, 3, rng)
    with rig.client() as client:
        assert client.prepare("crashed", rig.study_value(), batch.records, d).mask.all()
        again = client.prepare("resent", rig.study_value(), batch.records, d)
        assert again.mask.all() and again.refused == {}
        client.commit("resent", {0: batch.ids})
        with pytest.raises(HelperRefused) as refused:
            client.commit("crashed", {0: batch.ids[:1]})
        assert (refused.value.status, refused.value.reason) == (409, "already_committed")
        third = client.prepare("third", rig.study_value(), batch.records, d)
        assert third.refused == {0: "replayed", 1: "replayed", 2: "replayed"}
        assert client.request("GET", f"/studies/{study.study_id}/rounds/0")[1]["detail"] \
            .endswith("holds 3 records, not n")


def test_a_study_it_cannot_verify_or_a_closed_one_folds_nothing(rig, rng):
    batch = make_records(rig.study, rig.key.public, 2, rng)
    stranger = SigningKey(__import__("cryptography.hazmat.primitives.asymmetric.ed25519",
                                     fromlist=["x"]).Ed25519PrivateKey.generate())
    with rig.client() as client:
        for value in (rig.study_value(signed=False),
                      rig.study_value().replace(b'"open"', b'"closed"')):
            with pytest.raises(HelperRefused) as refused:
                client.prepare("job-unsigned", value, batch.records, rig.study.d)
            assert (refused.value.status, refused.value.reason) == (403, "untrusted_study")
        from ipdp.study import study_message
        with pytest.raises(HelperRefused) as refused:
            client.prepare("job-stranger", study_message(rig.study, "open", stranger),
                           batch.records, rig.study.d)
        assert refused.value.status == 403
        closed = client.prepare("job-closed", rig.study_value(StudyStatus.CLOSED),
                                batch.records, rig.study.d)
        assert closed.refused == {0: "closed_study", 1: "closed_study"}


def test_commit_folds_once_and_a_round_is_released_only_at_n(rig, rng):
    study, d, n = rig.study, rig.study.d, rig.study.n
    folded = folded_counted(study.study_id)
    first = make_records(study, rig.key.public, 50, rng)
    second = make_records(study, rig.key.public, 60, rng)
    with rig.client() as client:
        client.prepare("job-a", rig.study_value(), first.records, d)
        client.prepare("job-b", rig.study_value(), second.records, d)
        assignment = {0: first.ids}
        assert client.commit("job-a", assignment) == client.commit("job-a", assignment)
        assert client.round_share(study.study_id, 0) is None  # 50 of n = 100
        with pytest.raises(HelperRefused) as refused:
            client.commit("job-a", {0: first.ids[:4]})
        assert (refused.value.status, refused.value.reason) == (409, "job_conflict")
        with pytest.raises(HelperRefused) as refused:
            client.commit("job-b", {0: second.ids})  # 50 + 60 > n
        assert refused.value.reason == "round_over_n"
        with pytest.raises(HelperRefused) as refused:
            client.commit("job-b", {0: [first.ids[0]]})  # accepted in another job
        assert refused.value.reason == "not_accepted"
        with pytest.raises(HelperRefused) as refused:
            client.commit("job-never", {0: [first.ids[0]]})
        assert refused.value.status == 404
        client.commit("job-b", {0: second.ids[:50], 1: second.ids[50:]})
        client.commit("job-b", {0: second.ids[:50], 1: second.ids[50:]})
        full = client.round_share(study.study_id, 0)
        assert client.round_share(study.study_id, 1) is None  # 10 of n
    assert full is not None and full.count == n
    assert folded_counted(study.study_id) == folded + 110  # each committed job counted once
    in_round = first.ids + second.ids[:50]
    leader_sum = fold(np.concatenate([first.leader, second.leader[:50]]))
    total = combine(leader_sum, full.sum)
    assert np.array_equal(total, fold(np.concatenate([first.values, second.values[:50]])))
    fp = fixed_point_of(study)
    exact = sum(int(v) for v in np.concatenate([first.values, second.values[:50]])
                .view(np.int64)[:, 0])  # the records' first entry, summed without rounding
    a, _ = decode(total, fp)
    assert a[0, 0] == np.ldexp(float(exact), -fp.fraction_bits)
    from helper.store import id_checksum
    assert full.checksum == id_checksum(in_round)


def _nibbles(data: bytes) -> np.ndarray:
    raw = np.frombuffer(data, np.uint8)
    return np.bincount(np.concatenate([raw >> 4, raw & 15]), minlength=16)


def test_nothing_plain_in_the_helpers_redis(rig, fresh_redis, rng):
    """Every key after a prepare and after the round: shares and sums pass a chi-square test of
    uniform bytes (the encoded values themselves fail it), nothing holds a leader share or a
    value, and the helper's sum alone decodes to noise: reconstruction needs the leader's."""
    study = make_study(study_id="plain-check", d=14, n=120)
    batch = make_records(study, rig.key.public, study.n, rng)
    r = redis.Redis.from_url(rig.redis_url)

    def stored() -> dict[bytes, dict[bytes, bytes]]:
        out = {}
        for key in r.scan_iter():
            kind = r.type(key)
            if kind == b"hash":
                out[key] = r.hgetall(key)
            elif kind == b"string":
                out[key] = {b"": r.get(key)}
            elif kind == b"zset":
                out[key] = {m: str(s).encode() for m, s in r.zrange(key, 0, -1, withscores=True)}
            else:
                pytest.fail(f"unexpected key {key!r} of type {kind!r}")
        return out

    values_bytes = [v.astype("<u8").tobytes() for v in batch.values]
    leader_bytes = [v.astype("<u8").tobytes() for v in batch.leader]
    with rig.client() as client:
        client.prepare("plain-job", rig.study_value(study=study), batch.records, study.d)
        prepared = stored()
        job = prepared[b"ipdp-helper:job:plain-job"]
        counts = np.bincount(np.frombuffer(job[b"shares"], np.uint8), minlength=256)
        assert chisquare(counts).pvalue > 1e-4
        plain = np.bincount(np.frombuffer(b"".join(values_bytes), np.uint8), minlength=256)
        assert chisquare(plain).pvalue < 1e-12  # the test tells plain values from shares
        client.commit("plain-job", {0: batch.ids})
        share = client.round_share(study.study_id, 0)
    after = stored()
    assert set(after) == {b"ipdp-helper:job:plain-job", b"ipdp-helper:{plain-check}:hash",
                          b"ipdp-helper:{plain-check}:seen",
                          b"ipdp-helper:{plain-check}:round:0"}
    assert b"shares" not in after[b"ipdp-helper:job:plain-job"]  # folded, then dropped
    everything = b"".join(k + b"".join(f + v for f, v in fields.items())
                          for k, fields in {**prepared, **after}.items())
    for chunk in values_bytes + leader_bytes:
        assert chunk[:16] not in everything
    round_sum = after[b"ipdp-helper:{plain-check}:round:0"][b"sum"]
    assert chisquare(_nibbles(round_sum)).pvalue > 1e-4
    fp = fixed_point_of(study)
    true_a, _ = decode(fold(batch.values), fp)
    helper_a, _ = decode(np.frombuffer(round_sum, "<u8").astype(np.uint64), fp)
    # Alone, the helper's sum is a uniform ring element: its decoding is off by the ring's scale.
    assert np.median(np.abs(helper_a - true_a)) > 2.0 ** (62 - fp.fraction_bits) / 16
    assert np.array_equal(combine(fold(batch.leader), share.sum), fold(batch.values))


def test_the_helper_never_takes_a_record_with_the_leaders_share(rig, rng):
    """A leader that forwarded whole records (both shares) is refused: the helper part has its
    own length."""
    batch = make_records(rig.study, rig.key.public, 2, rng)
    with rig.client() as client:
        whole = [base64.b64encode(r).decode() for r in batch.records]
        status, answer = client.request("PUT", "/jobs/whole", {
            "study": rig.study_value().decode(), "records": whole})
    assert status == 200 and answer["mask"] == "00"
    assert {r["reason"] for r in answer["refused"]} == {"undecodable"}
    assert len(helper_part(batch.records[0], rig.study.d)) < len(batch.records[0])


def test_a_redis_outage_is_answered_503_and_the_leader_waits_it_out(rig, fresh_redis, rng):
    batch = make_records(rig.study, rig.key.public, 4, rng)
    fresh_redis.stop()
    with rig.client(retry_s=0) as impatient:
        status, answer = impatient.request("GET", "/studies/two-server/rounds/0")
        assert (status, answer["error"]) == (503, "redis_unavailable")
    restart = threading.Timer(1.0, fresh_redis.start)
    restart.start()
    try:
        with rig.client(retry_s=60) as client:
            got = client.prepare("job-outage", rig.study_value(), batch.records, rig.study.d)
            assert got.mask.all()
            client.commit("job-outage", {0: batch.ids})
            assert client.request("GET", "/studies/two-server/rounds/0")[1]["detail"].endswith(
                "holds 4 records, not n")
    finally:
        restart.join()


def test_a_malformed_request_is_refused_before_anything_is_stored(rig, rng):
    batch = make_records(rig.study, rig.key.public, 1, rng)
    part = base64.b64encode(helper_part(batch.records[0], rig.study.d)).decode()
    value = rig.study_value().decode()
    with rig.client() as client:
        for path, body in (("/jobs/a%20b", {"study": value, "records": [part]}),
                           ("/jobs/j", {"study": value, "records": ["not base64!"]}),
                           ("/jobs/j", {"study": value, "records": []}),
                           ("/jobs/j", {"study": "{}", "records": [part]})):
            status, answer = client.request("PUT", path, body)
            assert (status, answer["error"]) == (400, "bad_request"), (path, answer)
        for rounds in ([{"round": -1, "ids": [batch.ids[0].hex()]}],
                       [{"round": 0, "ids": ["00"]}]):
            status, answer = client.request("POST", "/jobs/j/commit", {"rounds": rounds})
            assert (status, answer["error"]) == (400, "bad_request")
    conn = http.client.HTTPConnection(urlsplit(rig.url).hostname, urlsplit(rig.url).port,
                                      timeout=10)
    conn.putrequest("PUT", "/jobs/big")  # a head that announces more than the helper takes
    conn.putheader("authorization", f"Bearer {TOKEN}")
    conn.putheader("content-length", str((64 << 20) + 1))
    conn.endheaders()
    response = conn.getresponse()
    assert (response.status, json.loads(response.read())["error"]) == (413, "too_large")
    conn.close()
    assert redis.Redis.from_url(rig.redis_url).dbsize() == 0
