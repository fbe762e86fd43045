"""A device's POST through granian to the records route's one pipeline, over raw sockets, as
HTTP/1.1 requires: answers in request order on a pipelined connection, ``Connection: close``
honoured, every shape of the request (chunked, ``Expect: 100-continue``) given the same answers
by the same handler, and admission decided before the body is read."""

from __future__ import annotations

import pytest

from ipdp.wire import split_container
from tests.gateway.conftest import running_gateway
from tests.gateway.test_gateway import D, known, records
from tests.gateway.test_limits import read_until_closed
from tests.pipeline import create, read_records


@pytest.fixture
def device(kafka_settings, redis_settings, topics):
    study = create(kafka_settings, redis_settings, topics, study_id="door", d=D, n=1000,
                   epsilon=1.0, delta=0.01)
    with running_gateway(kafka_settings, topics) as url:
        known(url, study.study_id)
        yield url, study


def post(body: bytes, *extra: bytes, length: bool = True) -> bytes:
    head = [b"POST /studies/door/records HTTP/1.1", b"Host: x",
            b"Content-Type: application/octet-stream", *extra]
    if length:
        head.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def answers(raw: bytes) -> list[tuple[int, bytes]]:
    """(status, body) of each response in a connection's bytes, in order."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        fields = dict(line.lower().split(b": ", 1) for line in lines[1:])
        size = int(fields[b"content-length"])
        out.append((int(lines[0].split(b" ")[1]), rest[:size]))
        raw = rest[size:]
    return out


def test_pipelined_device_posts_are_answered_in_order_and_close_is_honoured(device, connect,
                                                                            kafka_settings,
                                                                            topics):
    url, study = device
    good = records(study, 3, seed=21)
    bad = bytearray(records(study, 1, seed=22)[0])
    bad[0] = 99  # an unsupported wire version
    sock = connect(url)
    sock.sendall(post(good[0]) + post(bytes(bad)) + post(good[1])
                 + post(good[2], b"Connection: close"))
    got = answers(read_until_closed(sock))
    assert [status for status, _ in got] == [202, 400, 202, 202]
    assert got[0][1] == got[2][1] == got[3][1] == b'{"accepted":1}'
    assert b"unsupported_version" in got[1][1]
    messages = read_records(kafka_settings, topics.records, expected=3, timeout_s=10)
    assert sorted(r for m in messages for r in split_container(m.value)) == sorted(good)


def test_a_chunked_or_continued_post_gets_the_same_answers(device, connect, kafka_settings,
                                                           topics):
    url, study = device
    chunked_record, continued_record = records(study, 2, seed=23)
    chunked = post(b"%x\r\n%s\r\n0\r\n\r\n" % (len(chunked_record), chunked_record),
                   b"Transfer-Encoding: chunked", length=False)
    sock = connect(url)
    sock.sendall(chunked)
    sock.settimeout(10)
    reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 202") and reply.endswith(b'{"accepted":1}')
    # Expect: 100-continue: the body goes only after the interim answer.
    head = post(continued_record, b"Expect: 100-continue", b"Connection: close")
    sock.sendall(head[:-len(continued_record)])
    assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
    sock.sendall(continued_record)
    assert answers(read_until_closed(sock)) == [(202, b'{"accepted":1}')]
    messages = read_records(kafka_settings, topics.records, expected=2, timeout_s=10)
    assert sorted(r for m in messages for r in split_container(m.value)) == sorted(
        [chunked_record, continued_record])


def test_the_records_route_is_matched_as_starlette_would_and_only_post_is_allowed(device,
                                                                                  connect):
    from gateway.app import records_study

    assert records_study("/studies/s-1/records") == "s-1"
    for path in ["/studies/s-1", "/studies/a/b/records", "/studies//records",
                 "/studies/records", "/healthz"]:
        assert records_study(path) is None, path
    url, _ = device
    sock = connect(url)
    sock.sendall(b"GET /studies/door/records HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    raw = read_until_closed(sock)
    assert b"\r\nallow: POST\r\n" in raw
    assert answers(raw) == [(405, b'{"error":"method_not_allowed","detail":"Method Not Allowed"}')]


@pytest.mark.parametrize("refusal", ["rate_limited", "too_large", "unknown_study"])
def test_a_client_refused_on_its_head_never_gets_100_continue_nor_sends_its_body(
        refusal, connect, kafka_settings, redis_settings, topics):
    """Admission (the request limit, the study, the declared size) is decided on the head: a
    refused ``Expect: 100-continue`` client is answered at once and never asked for its body."""
    study = create(kafka_settings, redis_settings, topics, study_id="door", d=D, n=1000,
                   epsilon=1.0, delta=0.01)
    limits = {"rate_limited": {"relay_addresses": "", "rate_limit_per_s": 0.01,
                               "rate_limit_burst": 1}}.get(refusal, {})
    with running_gateway(kafka_settings, topics, max_body_bytes=4096, **limits) as url:
        known(url, study.study_id)
        record = records(study, 1, seed=31)[0]
        body = b"x" * 5000 if refusal == "too_large" else record
        path = b"/studies/nowhere/records" if refusal == "unknown_study" else None
        head = post(body, b"Expect: 100-continue")[:-len(body)]
        if path:
            head = head.replace(b"/studies/door/records", path)
        sock = connect(url)
        if refusal == "rate_limited":  # the first request takes the one token
            sock.sendall(post(record))
            assert answers(sock.recv(65536)) == [(202, b'{"accepted":1}')]
        sock.sendall(head)
        sock.settimeout(10)
        reply = sock.recv(65536)
        assert not reply.startswith(b"HTTP/1.1 100"), reply
        status = {"rate_limited": 429, "too_large": 413, "unknown_study": 404}[refusal]
        assert reply.startswith(b"HTTP/1.1 %d" % status), reply
        assert refusal.encode() in reply


@pytest.mark.parametrize("hosts", [[], [b""], [b"a", b"b"]])
def test_an_http_1_1_request_without_exactly_one_host_is_refused_400(device, connect, hosts):
    url, _ = device
    sock = connect(url)
    head = b"".join(b"Host: %s\r\n" % h for h in hosts)
    sock.sendall(b"GET /healthz HTTP/1.1\r\n" + head + b"Connection: close\r\n\r\n")
    [(status, body)] = answers(read_until_closed(sock))
    assert status == 400 and b'"bad_request"' in body and b"Host" in body
    # HTTP/1.0 needs no Host.
    sock = connect(url)
    sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
    assert answers(read_until_closed(sock)) == [(200, b'{"status":"ok"}')]
