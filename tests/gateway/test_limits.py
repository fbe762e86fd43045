"""The gateway's HTTP limits, each against the real server over raw sockets: the head's size and
deadline (the server's, from IPDP_GATEWAY_MAX_HEADER_BYTES and …_HEADER_TIMEOUT_S), the default
request limit and the record limits of a device's address and a relay's. Connection caps, slow
bodies and idle connections are the edge's (tests/system/test_proxy.py)."""

from __future__ import annotations

import http.client
import json
import random
import socket
import time

import numpy as np
import pytest

from gateway.settings import GatewaySettings
from ipdp.errors import RecordRefused
from ipdp.metrics import EVERY_METRIC
from ipdp.study import Study
from ipdp.wire import decode_record, split_container
from producer.contributor import Contributor
from producer.gateway_client import GatewayClient, records_path
from producer.retry import RetryPolicy, parse_retry_after
from tests.gateway.conftest import running_gateway
from tests.gateway.test_gateway import D, known, records
from tests.pipeline import create, read_records


def read_until_closed(sock: socket.socket, timeout_s: float = 10) -> bytes:
    """Everything the server sends until it closes the connection (or the time is up)."""
    sock.settimeout(timeout_s)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def status_and_error(raw: bytes) -> tuple[int, str | None]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    return status, json.loads(body).get("error") if body else None


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """True if the server closes (EOF or reset) within ``within_s`` seconds."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.fixture
def limited(kafka_settings, redis_settings, topics):
    """A gateway with small limits, so each is reached in a fraction of a second, and an open
    study ``limits``."""
    create(kafka_settings, redis_settings, topics, study_id="limits", d=D, n=1000, epsilon=1.0,
           delta=0.01)
    with running_gateway(kafka_settings, topics, max_header_bytes=8192,
                         header_timeout_s=0.5) as url:
        known(url, "limits")
        yield url


def test_a_head_above_the_limit_is_refused_whether_sent_at_once_or_in_pieces(limited, connect):
    at_once = connect(limited)
    at_once.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
    assert status_and_error(read_until_closed(at_once))[0] == 431
    # A 128 MiB header would be read whole; the gateway stops after the limit.
    pieces = connect(limited)
    pieces.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
    sent = 0
    with pytest.raises(OSError):  # the server closes while the header is still coming
        while sent < 128 << 20:
            pieces.sendall(b"a" * 4096)
            sent += 4096
            time.sleep(0.001)
    assert sent < 1 << 20
    small = connect(limited)
    small.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status_and_error(read_until_closed(small))[0] == 200


def test_responses_with_and_without_a_body_arrive_whole_on_one_connection(limited, connect):
    """The protocol holds a response's head for the body's first write: a HEAD answer (no body)
    still gets its head, and the next requests on the connection their whole answers."""
    # A record as a device sends it (created now, perturbed), so the gateway's checks admit it.
    [value] = records(Study(study_id="limits", d=D, n=1000, epsilon=1.0, delta=0.01), 1)
    rec = decode_record(value)
    body = json.dumps({"records": [{
        "record_id": rec.record_id.hex(), "created_ms": rec.created_ms,
        "q": rec.q.tolist(), "p": rec.p.tolist()}]}).encode()
    sock = connect(limited)
    sock.sendall(b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
                 b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
                 b"POST /studies/limits/records HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                 b"Connection: close\r\n\r\n%s" % (len(body), body))
    answers = read_until_closed(sock).split(b"HTTP/1.1 ")[1:]
    assert [int(a.split(b" ")[0]) for a in answers] == [200, 200, 202]
    assert answers[0].endswith(b"\r\n\r\n")
    assert answers[1].endswith(b'{"status":"ok"}')
    assert answers[2].endswith(b'{"accepted":1}')


def test_a_silent_connection_is_closed_after_the_head_timeout(limited, connect):
    silent = connect(limited)
    t0 = time.monotonic()
    assert read_until_closed(silent) == b""
    assert time.monotonic() - t0 < 5


def test_an_idle_keep_alive_connection_is_closed(limited, connect):
    sock = connect(limited)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(10)
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    assert closed_by_server(sock, within_s=5)


def test_the_rate_limit_is_on_by_default(kafka_settings, redis_settings, topics):
    assert GatewaySettings().rate_limit_per_s > 0
    study = create(kafka_settings, redis_settings, topics, study_id="limits-rate", d=D,
                   n=1000, epsilon=1.0, delta=0.01)
    defaults = GatewaySettings()
    with running_gateway(kafka_settings, topics, relay_addresses=defaults.relay_addresses) as url:
        known(url, study.study_id)
        with GatewayClient(url) as c:
            statuses = [c.post_records(study.study_id, r).status
                        for r in records(study, defaults.rate_limit_burst + 5)]
    assert statuses.count(202) >= defaults.rate_limit_burst
    assert statuses[-1] == 429


def post_from(url: str, source: str, study_id: str, body: bytes) -> tuple[int, str | None, str]:
    """POST ``body`` from the address ``source``: (status, error, Retry-After header)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10, source_address=(source, 0))
    try:
        conn.request("POST", records_path(study_id), body,
                     {"Content-Type": "application/octet-stream"})
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read()).get("error"), \
            answer.getheader("Retry-After", "")
    finally:
        conn.close()


def test_records_past_an_address_allowance_get_429_and_only_a_listed_relay_gets_more(
        kafka_settings, redis_settings, topics):
    study = create(kafka_settings, redis_settings, topics, study_id="limits-records", d=D,
                   n=1000, epsilon=1.0, delta=0.01)
    batch = records(study, 300)
    # Requests unlimited, so only the record limits apply: a device address gets 10 records at
    # once, the relay 400; both refill at one record a second.
    with running_gateway(kafka_settings, topics, rate_limit_per_s=0.0, record_limit_per_s=1.0,
                         record_limit_burst=10, relay_addresses="127.0.0.2",
                         relay_record_limit_per_s=1.0, relay_record_limit_burst=400) as url:
        known(url, study.study_id)
        device = [post_from(url, "127.0.0.1", study.study_id, b"".join(batch[i:i + 6]))
                  for i in (0, 6)]
        too_many = post_from(url, "127.0.0.3", study.study_id, b"".join(batch[:11]))
        relay = [post_from(url, "127.0.0.2", study.study_id, b"".join(batch[i:i + 150]))
                 for i in (0, 150, 150)]
    assert [a[:2] for a in device] == [(202, None), (429, "rate_limited")]
    assert int(device[1][2]) >= 1  # Retry-After: when 6 records' tokens are back
    assert too_many[:2] == (413, "too_large")  # more than the address may ever send at once
    # The relay's allowance is larger, not absent.
    assert [a[:2] for a in relay] == [(202, None), (202, None), (429, "rate_limited")]
    accepted = read_records(kafka_settings, topics.records, expected=3, timeout_s=10)
    assert sorted(len(split_container(m.value)) for m in accepted) == [6, 150, 150]


def test_a_device_sends_its_refused_record_again_after_retry_after(
        kafka_settings, redis_settings, topics):
    study = create(kafka_settings, redis_settings, topics, study_id="limits-retry", d=D,
                   n=1000, epsilon=1.0, delta=0.01)
    # One request a second, no burst: every second device of this address is refused at first.
    with running_gateway(kafka_settings, topics, rate_limit_per_s=1.0, rate_limit_burst=1,
                         relay_addresses=None) as url:
        known(url, study.study_id)
        sent = records(study, 2)
        with GatewayClient(url) as c:
            c.post_records(study.study_id, sent[0])
            refused = c.post_records(study.study_id, sent[1])
        assert refused.status == 429 and refused.retry_after_s == 1.0
        with Contributor.connect(study.study_id, via=url, records_per_device=2) as device:
            for _ in range(2):
                device.submit(np.full(D, 0.1), 0.2)
    assert (device.delivered, device.failed) == (2, 0)
    assert device.transport.retried >= 1


def test_a_device_gives_up_after_its_tries_with_the_last_refusal(
        kafka_settings, redis_settings, topics):
    study = create(kafka_settings, redis_settings, topics, study_id="limits-give-up", d=D,
                   n=1000, epsilon=1.0, delta=0.01)
    # A token every 20 s: the tries below, each waiting at most 15 ms, all meet an empty bucket.
    with running_gateway(kafka_settings, topics, rate_limit_per_s=0.05, rate_limit_burst=1,
                         relay_addresses=None) as url:
        known(url, study.study_id)
        with GatewayClient(url) as c:
            assert c.post_records(study.study_id, records(study, 1)[0]).status == 202
        before = refusals("rate_limited")
        device = Contributor.connect(study.study_id, via=url,
                                     retry=RetryPolicy(max_attempts=3, max_wait_s=0.01))
        device.submit(np.full(D, 0.1), 0.2)
        with pytest.raises(RecordRefused) as refused:
            device.flush()
        device.close()
    assert (refused.value.status, refused.value.reason) == (429, "rate_limited")
    assert (device.delivered, device.failed, device.transport.retried) == (0, 1, 2)
    assert refusals("rate_limited") == before + 3


def refusals(reason: str) -> float:
    return EVERY_METRIC.get_sample_value("ipdp_gateway_refusals_total", {"reason": reason}) or 0


def test_a_retry_waits_the_servers_delay_or_a_doubling_backoff_stretched_by_jitter():
    policy = RetryPolicy(max_attempts=3, backoff_s=0.01, max_wait_s=0.05, jitter=0.5)
    waits = [policy.wait_s(k, None, random.Random(k)) for k in (1, 2, 3)]
    assert 0.01 <= waits[0] <= 0.015 and 0.02 <= waits[1] <= 0.03
    assert waits[2] <= 0.05 * 1.5, "a wait is at most max_wait_s, stretched by the jitter"
    assert policy.wait_s(1, 120.0, random.Random(1)) <= 0.05 * 1.5
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert parse_retry_after("-1") is None
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)
