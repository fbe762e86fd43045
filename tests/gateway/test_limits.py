"""The gateway's HTTP limits, each against a real server over raw sockets: head size, head and
body deadlines, keep-alive, connection caps (per client address and per prefix), eviction when
the connection table is full, the default request limit and the record limits of a device's
address and a relay's."""

from __future__ import annotations

import http.client
import json
import random
import socket
import time
from contextlib import ExitStack

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


def connect(url: str, source: str = "127.0.0.1") -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10, source_address=(source, 0))
    return sock


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
    with running_gateway(kafka_settings, topics, max_header_bytes=4096, header_timeout_s=0.5,
                         body_timeout_s=0.5, keep_alive_timeout_s=0.5, max_connections=8,
                         max_connections_per_client=4) as url:
        known(url, "limits")
        yield url


def test_a_head_above_the_limit_is_answered_431_whether_sent_at_once_or_in_pieces(limited):
    at_once = connect(limited)
    at_once.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8000 + b"\r\n\r\n")
    assert status_and_error(read_until_closed(at_once)) == (431, "headers_too_large")
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


def test_responses_with_and_without_a_body_arrive_whole_on_one_connection(limited):
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


def test_a_silent_connection_is_closed_after_the_head_timeout(limited):
    silent = connect(limited)
    t0 = time.monotonic()
    assert read_until_closed(silent) == b""
    assert time.monotonic() - t0 < 5


def test_a_slow_head_or_body_is_answered_408_and_closed(limited):
    slow_head = connect(limited)
    slow_head.sendall(b"POST /studies/x/records HTTP/1.1\r\nHost: x\r\n")
    assert status_and_error(read_until_closed(slow_head)) == (408, "request_timeout")
    slow_body = connect(limited)
    slow_body.sendall(b"POST /studies/limits/records HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/octet-stream\r\nContent-Length: 1000\r\n\r\n"
                      b"0123456789")
    assert status_and_error(read_until_closed(slow_body)) == (408, "request_timeout")


def test_an_idle_keep_alive_connection_is_closed(limited):
    sock = connect(limited)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(10)
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    assert closed_by_server(sock, within_s=5)


def test_connections_above_the_caps_are_closed_and_cost_only_their_client(
        kafka_settings, redis_settings, topics):
    """A connection above a cap is never read, never answered, and closed at the head
    deadline (held, not closed at once: a flood that re-opens it at once would otherwise cost
    the gateway an accept and a close per re-opening)."""
    study = create(kafka_settings, redis_settings, topics, study_id="limits-caps", d=D,
                   n=1000, epsilon=1.0, delta=0.01)
    one = records(study, 4)
    with running_gateway(kafka_settings, topics, max_connections=64, header_timeout_s=1.0,
                         max_connections_per_client=4, max_connections_per_prefix=6) as url, \
            ExitStack() as held:
        known(url, study.study_id)
        # One client (127.0.0.2) opens more connections than it may: four are served, the
        # fifth gets no answer and is closed.
        flood = [held.enter_context(connect(url, "127.0.0.2")) for _ in range(5)]
        assert ask(flood[0], study.study_id, one[0]) == 202
        flood[4].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_until_closed(flood[4]) == b""
        # Another client (127.0.0.1) is still served.
        with GatewayClient(url) as c:
            assert c.post_records(study.study_id, one[1]).status == 202
        # The prefix cap: 127.0.9.0/24 may hold 6 connections, whatever its addresses.
        site = [held.enter_context(connect(url, f"127.0.9.{i}")) for i in range(1, 8)]
        assert ask(site[5], study.study_id, one[2]) == 202
        site[6].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_until_closed(site[6]) == b""
        # Another /24 is still served.
        assert ask(held.enter_context(connect(url, "127.0.10.1")), study.study_id,
                   one[3]) == 202


def test_a_full_table_evicts_a_silent_connection_and_serves_an_honest_request(
        kafka_settings, redis_settings, topics):
    """Connections held open without a request cannot lock devices out: when the table is full,
    a newcomer evicts the oldest of those that sent nothing, and is served. The evicted one is
    held unread until its head deadline rather than closed, so a flood does not learn of it."""
    study = create(kafka_settings, redis_settings, topics, study_id="limits-evict", d=D,
                   n=1000, epsilon=1.0, delta=0.01)
    with running_gateway(kafka_settings, topics, max_connections=8, header_timeout_s=5.0,
                         max_connections_per_client=8) as url, ExitStack() as held:
        known(url, study.study_id)
        # One connection that sent a whole request stays; seven from other /24s send nothing.
        honest = held.enter_context(connect(url))
        assert ask(honest, study.study_id, records(study, 1, seed=1)[0]) == 202
        silent = [held.enter_context(connect(url, f"127.0.{20 + i}.1")) for i in range(7)]
        # The table is full: a device's connection evicts the oldest silent one, and is served.
        device = held.enter_context(connect(url, "127.0.30.1"))
        assert ask(device, study.study_id, records(study, 1, seed=2)[0]) == 202
        # The next silent one was not evicted: it is served when it sends a request.
        assert ask(silent[1], study.study_id, records(study, 1, seed=3)[0]) == 202
        # The connection that had sent a request was not the one evicted.
        assert ask(honest, study.study_id, records(study, 1, seed=4)[0]) == 202
        # The evicted one is never read or answered, and is closed at its head deadline.
        silent[0].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_until_closed(silent[0]) == b""


def ask(sock: socket.socket, study_id: str, record: bytes) -> int:
    """POST one record on an open connection; the answer's status (the connection stays)."""
    sock.sendall(b"POST /studies/%s/records HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/octet-stream\r\nContent-Length: %d\r\n\r\n%s"
                 % (study_id.encode(), len(record), record))
    sock.settimeout(10)
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += sock.recv(65536)
    head, _, body = raw.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split(b" ")[1])


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
