"""The gateway admits a credential-requiring study's records only with a valid credential whose
slots are their ids (401/403 with the reason otherwise); a slot sent again through another
gateway worker or after a restart is acknowledged there and dead-lettered by the aggregator, so
each credential contributes at most records_per_device records to the study."""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ipdp import state
from ipdp.credentials import (
    credential_id,
    issue_batch,
    issue_credential,
    slot_record_ids,
    token_from_text,
    token_text,
    tokens_of_header,
)
from ipdp.kafka_io import kafka_producer
from ipdp.redis_io import redis_client
from ipdp.signing import generate_key_files
from ipdp.state import create_study
from ipdp.study import Study
from producer.contributor import Contributor
from producer.gateway_client import GatewayClient
from tests.gateway.conftest import running_gateway
from tests.gateway.test_gateway import known
from tests.pipeline import create, read_records, services, total_stats, wait_for
from tests.tooling import require_tool, unavailable

WEB = Path(__file__).resolve().parents[2] / "producer" / "web"
PARAMS = {"d": 3, "n": 1_000, "epsilon": 1.0, "delta": 0.01}
X, Y = [0.1, 0.2, 0.0], 0.5


def _rejected(r, topics) -> dict[str, int]:
    """Refusals by reason of the aggregator the tests run (tests.pipeline.services' group)."""
    return state.rejected_counts(r, f"agg-{topics.records}", topics.records)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def device_records(study, credential: str | None, k: int = 1) -> bytes:
    """What a device posts: k perturbed records, their ids its credential's slots."""
    c = Contributor(study, producer=None, topic="unused", credential=credential,
                    records_per_device=None if credential else k)
    return b"".join(c.encode_many([X] * k, [Y] * k)[1])


def test_the_gateway_refuses_each_bad_credential_with_its_status_and_reason(
        kafka_settings, redis_settings, env_topics, tmp_path, monkeypatch):
    topics = env_topics
    issuer = generate_key_files(tmp_path / "issuer")
    stranger = generate_key_files(tmp_path / "stranger")
    monkeypatch.setenv("IPDP_TRUSTED_CREDENTIAL_KEYS", issuer.public_b64)
    study = create(kafka_settings, redis_settings, topics, study_id="gc1",
                   require_credentials=True, records_per_device=2, **PARAMS)
    other = create(kafka_settings, redis_settings, topics, study_id="gc2",
                   require_credentials=True, **PARAMS)
    plain = create(kafka_settings, redis_settings, topics, study_id="gc3", **PARAMS)
    t = now_ms()
    good = token_text(issue_credential(issuer, study.hash, t, t + 600_000))
    cases = {
        "credential_missing": (None, device_records(study, good), 401),
        "credential_invalid": ("not-a-credential", device_records(study, good), 401),
        "credential_untrusted": (token_text(issue_credential(stranger, study.hash, t, t + 9_000)),
                                 device_records(study, good), 401),
        "credential_expired": (token_text(issue_credential(issuer, study.hash, t - 9, t - 1)),
                               device_records(study, good), 403),
        "credential_wrong_study": (token_text(issue_credential(issuer, other.hash, t, t + 9_000)),
                                   device_records(study, good), 403),
        "credential_bad_slot": (good, device_records(study, None), 403),
        "credential_reused": (good, device_records(study, good, 2) + device_records(study, None),
                              403),
        "duplicate_record": (good, device_records(study, good) * 2, 400),
    }
    with running_gateway(kafka_settings, topics) as url, GatewayClient(url) as client:
        known(url, "gc1")
        known(url, "gc3")
        for reason, (credential, body, status) in cases.items():
            answer = client.post_records("gc1", body, credential=credential)
            assert (answer.status, answer.error) == (status, reason), (reason, answer.body)
        scheme = client.request("POST", "/studies/gc1/records", device_records(study, good),
                                "application/octet-stream")
        assert scheme.status == 401
        accepted = client.post_records("gc1", device_records(study, good, 2), credential=good)
        assert (accepted.status, accepted.body) == (202, {"accepted": 2})
        # Version 2: one of a batch; the same token with an altered path node is refused.
        in_batch = issue_batch(issuer, study.hash, t, t + 600_000, 3)[2]
        altered = bytearray(in_batch)
        altered[-1] ^= 1
        for token, status in ((in_batch, 202), (bytes(altered), 401)):
            answer = client.post_records("gc1", device_records(study, token_text(in_batch)),
                                         credential=token_text(token))
            assert answer.status == status, answer.body
        assert answer.error == "credential_invalid"
        # A study that does not require credentials ignores them.
        assert client.post_records("gc3", device_records(plain, None)).status == 202


def test_records_per_device_holds_across_two_gateway_workers_and_a_restart(
        kafka_settings, redis_settings, env_topics, tmp_path, monkeypatch):
    topics = env_topics
    issuer = generate_key_files(tmp_path / "issuer")
    monkeypatch.setenv("IPDP_TRUSTED_CREDENTIAL_KEYS", f"{tmp_path / 'issuer'}.pub")
    study = create(kafka_settings, redis_settings, topics, study_id="gc4",
                   require_credentials=True, records_per_device=2, **PARAMS)
    t = now_ms()
    # Devices of either token version, alternating: six with a signature each, six of one batch.
    batch = issue_batch(issuer, study.hash, t, t + 600_000, 6)
    devices = [token_text(token) for i in range(6)
               for token in (issue_credential(issuer, study.hash, t, t + 600_000), batch[i])]
    # Two workers at once, with a linger long enough that concurrent devices share containers.
    with running_gateway(kafka_settings, topics, linger_ms=50.0) as a, \
            running_gateway(kafka_settings, topics, linger_ms=50.0) as b:
        known(a, "gc4")
        known(b, "gc4")

        def post(url: str, credential: str, body: bytes) -> int:
            with GatewayClient(url) as c:
                return c.post_records("gc4", body, credential=credential).status

        with ThreadPoolExecutor(8) as pool:
            # Ten devices send both slots through worker a, concurrently.
            first = list(pool.map(lambda cred: post(a, cred, device_records(study, cred, 2)),
                                  devices[:10]))
            # The same devices send their slots again through worker b: acknowledged there.
            again = list(pool.map(lambda cred: post(b, cred, device_records(study, cred, 2)),
                                  devices[:5]))
        assert first == [202] * 10 and again == [202] * 5
    # A restarted gateway (a fresh process: nothing cached) takes slot 0 of device 0 again.
    with running_gateway(kafka_settings, topics) as c:
        known(c, "gc4")
        assert post(c, devices[0], device_records(study, devices[0], 1)) == 202
        assert post(c, devices[10], device_records(study, devices[10], 2)) == 202
    r = redis_client(redis_settings)
    with services(kafka_settings, redis_settings, topics, trainer=False):
        wait_for(lambda: int(r.hget(state.StudyKeys("gc4").counts, "folded") or 0) == 22
                 and _rejected(r, topics).get("credential_reused", 0) == 11, 60,
                 "22 records folded (11 devices × 2) and 11 reused slots dead-lettered")
        time.sleep(1.0)  # nothing more arrives
    assert total_stats(redis_settings, study)[2] == 22
    # Concurrent devices shared containers: a message carried several devices' credentials.
    messages = read_records(kafka_settings, topics.records, expected=17, timeout_s=3)  # ≤ 17 posts
    assert max(len({*tokens_of_header(m.headers)}) for m in messages) > 1
    assert _rejected(r, topics) == \
        {"credential_reused": 11}



def test_credentials_count_against_the_message_size_of_a_shared_container(
        kafka_settings, redis_settings, env_topics, tmp_path, monkeypatch):
    topics = env_topics
    issuer = generate_key_files(tmp_path / "issuer")
    monkeypatch.setenv("IPDP_TRUSTED_CREDENTIAL_KEYS", issuer.public_b64)
    study = create(kafka_settings, redis_settings, topics, study_id="gc5",
                   require_credentials=True, **PARAMS)
    t = now_ms()
    devices = [token_text(x) for x in issue_batch(issuer, study.hash, t, t + 600_000, 12)]
    # Twelve one-record devices within one linger: their records alone (12 × 96 bytes) fit one
    # 2,000-byte message, their credentials (12 × 290 bytes) do not.
    limit = 2_000
    with running_gateway(kafka_settings, topics, linger_ms=300.0,
                         max_message_bytes=limit) as url:
        known(url, "gc5")

        def post(credential: str) -> int:
            with GatewayClient(url) as c:
                return c.post_records("gc5", device_records(study, credential),
                                      credential=credential).status

        with ThreadPoolExecutor(12) as pool:
            assert list(pool.map(post, devices)) == [202] * 12
    messages = read_records(kafka_settings, topics.records, expected=12, timeout_s=3)
    assert sum(len(tokens_of_header(m.headers)) for m in messages) == 12
    assert all(len(m.value) + len(dict(m.headers)["credentials"]) <= limit for m in messages)
    assert len(messages) < 12  # still shared


def test_the_browser_sdk_sends_its_credential_to_a_real_gateway(
        kafka_settings, redis_settings, env_topics, tmp_path, monkeypatch):
    """The TypeScript SDK (built producer/web, run by Node with the fetch and WebCrypto a
    browser has) against the real gateway and aggregator, with a version-2 credential (one of a
    batch): its slots and Authorization header are the ones the gateway checks, a reused slot is
    dead-lettered, and nothing is sent without a credential."""
    node = require_tool("node", "running the browser SDK against the gateway")
    if not (WEB / "dist" / "src" / "credential.js").is_file():
        unavailable("producer/web is not built; run `cd producer/web && npm ci && npm run build`")
    topics = env_topics
    owner = generate_key_files(tmp_path / "owner")
    issuer = generate_key_files(tmp_path / "issuer")
    monkeypatch.setenv("IPDP_TRUSTED_CREDENTIAL_KEYS", issuer.public_b64)
    study = Study(study_id="gc-web", require_credentials=True, records_per_device=2, **PARAMS)
    producer = kafka_producer(kafka_settings)
    try:
        create_study(redis_client(redis_settings), producer, topics, study, owner)
    finally:
        producer.close()
    t = now_ms()
    credential = token_text(issue_batch(issuer, study.hash, t, t + 600_000, 5)[3])
    with running_gateway(kafka_settings, topics) as url:
        known(url, "gc-web")
        run = subprocess.run([node, str(WEB / "test" / "e2e" / "credential.mjs"), url, "gc-web",
                              owner.public_b64, credential], cwd=WEB, capture_output=True,
                             text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    slots = [s.tobytes().hex() for s in slot_record_ids(credential_id(token_from_text(credential)), 2)]
    assert [out[k].get("recordId") for k in ("slot0", "slot1", "slot0_again")] == \
        [slots[0], slots[1], slots[0]]
    assert out["none"]["reason"] == "credential_required"
    assert (out["altered"]["status"], out["altered"]["gatewayReason"]) == \
        (401, "credential_invalid")
    r = redis_client(redis_settings)
    with services(kafka_settings, redis_settings, topics, trainer=False):
        wait_for(lambda: int(r.hget(state.StudyKeys("gc-web").counts, "folded") or 0) == 2
                 and _rejected(r, topics).get("credential_reused", 0) == 1, 60,
                 "both slots folded once and the reused slot dead-lettered")
