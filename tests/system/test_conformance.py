"""Request smuggling and HTTP/1.1 conformance of the deployed pair: raw requests to an `ipdp
gateway` process directly and through the shipped nginx edge (bench/edge.py), each answered or
refused as RFC 9112 allows, in order; then the records topic holds exactly the records the
gateway answered 202 for, so no refused, lost or hidden request produced a record.

Each case is a byte string sent at once on a new connection (pipelined requests included), and
a table of the outcomes it may have on each path: the statuses of the answers in order, and
whether the connection must then be closed. Where the RFC leaves a choice (a bare LF, an
obs-fold, a request with both Content-Length and Transfer-Encoding) every allowed outcome is
listed; a path is held to what the RFC allows, not to what nginx happens to do.
"""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from bench.devices import DEVICE_LIMITS_RAISED
from bench.edge import Edge
from bench.process_tree import rss_bytes
from ipdp.credentials import issue_credential, token_text
from ipdp.embedded import free_port
from ipdp.kafka_io import ensure_topics, kafka_consumer
from ipdp.settings import KafkaSettings, TopicSettings
from ipdp.signing import SigningKey, generate_key_files
from ipdp.study import Study
from ipdp.wire import CONTAINER_VERSION, VERSION_BYTE, container_count, header_study
from producer.contributor import Contributor
from producer.gateway_client import GatewayClient
from tests.pipeline import create, wait_for
from tests.proc_services import service_env, start, stop
from tests.tooling import require_tool

HOST = "127.0.0.1"
PARAMS = {"d": 3, "n": 10**6, "epsilon": 1.0, "delta": 0.01}
#: How long the next answer is waited for (a 202 waits for Kafka's acknowledgement).
ANSWER_S = 5.0
#: How long a connection that must close is given to close after its answers.
CLOSE_S = 3.0
PATHS = ("direct", "edge")


@dataclass(frozen=True)
class Outcome:
    """Answers' statuses in order; ``closed``: the connection must then be closed."""

    statuses: tuple[int, ...]
    closed: bool = False


@dataclass
class Case:
    name: str
    #: The bytes sent, given the study's records path and a fresh record per call.
    request: Callable[[Pair], bytes]
    #: The outcomes allowed on both paths, or per path.
    allowed: list[Outcome] | dict[str, list[Outcome]]
    #: Methods of the requests in order, as far as a HEAD's answer must have no body.
    methods: tuple[str, ...] = ()
    #: Its records are the guarded study's (which requires credentials).
    credential: bool = False

    def outcomes(self, path: str) -> list[Outcome]:
        return self.allowed[path] if isinstance(self.allowed, dict) else self.allowed


@dataclass
class Pair:
    """The deployed pair, its two studies, and the records each was answered 202 for."""

    direct: tuple[str, int]
    edge: Edge
    kafka: KafkaSettings
    topics: TopicSettings
    plain: Study
    guarded: Study
    issuer: SigningKey
    gateway_pid: int
    accepted: Counter = field(default_factory=Counter)

    def path(self, credential: bool = False) -> str:
        return f"/studies/{(self.guarded if credential else self.plain).study_id}/records"

    def record(self) -> bytes:
        """A fresh record of the plain study."""
        c = Contributor(self.plain, producer=None, topic="unused")
        return c.encode_many([[0.1, 0.2, 0.0]], [0.5])[1][0]

    def credential_record(self) -> tuple[str, bytes]:
        """A fresh credential of the guarded study, and a record in its one slot."""
        now = time.time_ns() // 1_000_000
        token = token_text(issue_credential(self.issuer, self.guarded.hash, now, now + 600_000))
        c = Contributor(self.guarded, producer=None, topic="unused", credential=token)
        return token, c.encode_many([[0.1, 0.2, 0.0]], [0.5])[1][0]


def _post(path: str, body: bytes, extra: str = "", version: str = "1.1") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def _chunked_post(path: str, chunks: bytes, extra: str = "", version: str = "1.1") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            f"Transfer-Encoding: chunked\r\n{extra}\r\n").encode() + chunks


def _chunks(body: bytes, ext: bytes = b"", trailers: bytes = b"") -> bytes:
    """``body`` as two chunks (each with ``ext`` after its size), the last chunk and
    ``trailers`` (header lines, each ending in CRLF)."""
    half = len(body) // 2
    return b"".join(b"%x%s\r\n%s\r\n" % (len(part), ext, part)
                    for part in (body[:half], body[half:])) + b"0\r\n" + trailers + b"\r\n"


GET = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


def _plain(pair: Pair) -> tuple[str, Callable[[], bytes]]:
    return pair.path(), pair.record


def _case_cl_te(pair: Pair) -> bytes:
    # Content-Length covers the first 4 bytes of the chunked body; the rest, read by Content-
    # Length, would be a second request that posts a record.
    path, record = _plain(pair)
    chunked = _chunks(record())
    follower = _post(path, record())
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n").encode() \
        + chunked + follower


def _case_te_cl(pair: Pair) -> bytes:
    # Transfer-Encoding first, and a Content-Length that covers the chunked body and a hidden
    # request behind it.
    path, record = _plain(pair)
    hidden = _post(path, record())
    chunked = _chunks(record())
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            f"Transfer-Encoding: chunked\r\nContent-Length: {len(chunked) + len(hidden)}"
            "\r\n\r\n").encode() + chunked + hidden


def _case_two_lengths(pair: Pair) -> bytes:
    path, record = _plain(pair)
    body = record()
    return _post(path, body, f"Content-Length: {len(body) + 10}\r\n") + b"\0" * 10 + GET


def _case_signed_length(pair: Pair) -> bytes:
    path, record = _plain(pair)
    body = record()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Length: +{len(body)}\r\n\r\n").encode() + body + GET


def _bad_chunk_size(size: bytes) -> Callable[[Pair], bytes]:
    def build(pair: Pair) -> bytes:
        path, record = _plain(pair)
        body = record()
        return _chunked_post(path, size + b"\r\n" + body + b"\r\n0\r\n\r\n") + _post(path, record())
    return build


def _case_chunk_extensions(pair: Pair) -> bytes:
    path, record = _plain(pair)
    return _chunked_post(path, _chunks(record(), ext=b';ipdp=1;quoted="a;b"')) + GET


def _trailers(lines: bytes, credential: bool = False) -> Callable[[Pair], bytes]:
    """A chunked POST whose trailer section is ``lines``, TOKEN in them the credential of its
    record (of the guarded study if ``credential``, else a credential the plain study
    ignores)."""
    def build(pair: Pair) -> bytes:
        token, record = pair.credential_record()
        if not credential:
            record = pair.record()
        trailers = lines.replace(b"TOKEN", token.encode())
        return _chunked_post(pair.path(credential), _chunks(record, trailers=trailers)) + GET
    return build


def _case_credential_in_head(pair: Pair) -> bytes:
    token, record = pair.credential_record()
    return _post(pair.path(True), record, f"Authorization: IPDP-Credential {token}\r\n") + GET


def _case_bare_lf(pair: Pair) -> bytes:
    return b"GET /healthz HTTP/1.1\nHost: x\n\n" + GET


def _case_bare_cr(pair: Pair) -> bytes:
    return b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Note: a\rb\r\n\r\n" + GET


def _case_obs_fold(pair: Pair) -> bytes:
    return b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Note: a\r\n b\r\n\r\n" + GET


def _case_after_close(pair: Pair) -> bytes:
    path, record = _plain(pair)
    return b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" + _post(path, record())


def _case_after_bad_target(pair: Pair) -> bytes:
    path, record = _plain(pair)
    return GET + b"GET /a b HTTP/1.1\r\nHost: x\r\n\r\n" + _post(path, record())


def _case_after_port_target(pair: Pair) -> bytes:
    path, record = _plain(pair)
    return GET + b"GET http://x:99999/healthz HTTP/1.1\r\nHost: x\r\n\r\n" + _post(path, record())


def _case_http10_keep_alive(pair: Pair) -> bytes:
    return (b"GET /healthz HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
            b"GET /healthz HTTP/1.0\r\n\r\n" + GET)


def _case_http10_chunked(pair: Pair) -> bytes:
    path, record = _plain(pair)
    return _chunked_post(path, _chunks(record()), version="1.0") + _post(path, record())


def _case_head(pair: Pair) -> bytes:
    return b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n" + GET


def _case_missing_host(pair: Pair) -> bytes:
    path, record = _plain(pair)
    return _post(path, record()).replace(b"Host: x\r\n", b"")


def _case_two_hosts(pair: Pair) -> bytes:
    path, record = _plain(pair)
    return _post(path, record(), "Host: y\r\n")


def _case_unknown_coding(pair: Pair) -> bytes:
    path, record = _plain(pair)
    return (_chunked_post(path, _chunks(record())).replace(b"chunked", b"chunked, x-unknown")
            + _post(path, record()))


def _case_refusal_then_post(pair: Pair) -> bytes:
    path, record = _plain(pair)
    return _post(path, b"\x01" * 10) + _post(path, record())


def _case_pipelined_posts(pair: Pair) -> bytes:
    path, record = _plain(pair)
    return _post(path, record()) + _post(path, record()) + GET


def _case_oversized_line(pair: Pair) -> bytes:
    path, record = _plain(pair)
    return _post(path, record(), f"X-Pad: {'a' * (17 << 10)}\r\n")


def _case_declared_too_large(pair: Pair) -> bytes:
    path, record = _plain(pair)
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Length: {5 << 20}\r\n\r\n").encode() + record()


REFUSED = [Outcome((400,), closed=True)]

CASES = [
    Case("pipelined POSTs are answered in order", _case_pipelined_posts,
         [Outcome((202, 202, 200))]),
    Case("a refused POST, then a POST", _case_refusal_then_post, [Outcome((400, 202))]),
    # RFC 9112 §6.3: a server may refuse CL + TE or use TE alone; either way it closes after.
    Case("Content-Length then Transfer-Encoding", _case_cl_te,
         [Outcome((400,), closed=True), Outcome((202,), closed=True)]),
    Case("Transfer-Encoding then Content-Length over a hidden request", _case_te_cl,
         [Outcome((400,), closed=True), Outcome((202,), closed=True)]),
    # §6.3: differing Content-Lengths, or one not all digits, are unrecoverable: 400 and close.
    Case("two Content-Lengths", _case_two_lengths, REFUSED),
    Case("a Content-Length with a sign", _case_signed_length, REFUSED),
    # §7.1: a chunk size is 1*HEXDIG; anything else leaves the framing unknown.
    Case("a chunk size that is not hex", _bad_chunk_size(b"zz"), REFUSED),
    Case("a negative chunk size", _bad_chunk_size(b"-1"), REFUSED),
    Case("a chunk size of 2^80", _bad_chunk_size(b"1" + b"0" * 20),
         [Outcome((400,), closed=True), Outcome((413,), closed=True)]),
    # §7.1.1: unrecognised chunk extensions are ignored.
    Case("chunk extensions", _case_chunk_extensions, [Outcome((202, 200))]),
    # §7.1.2: trailers are not merged into the header section: a trailer changes nothing. A
    # refusal decided on the head may close the connection rather than read the body.
    Case("a trailer naming another Content-Type",
         _trailers(b"Content-Type: application/json\r\n"), [Outcome((202, 200))]),
    Case("trailers naming Authorization and X-Forwarded-For",
         _trailers(b"Authorization: IPDP-Credential TOKEN\r\nX-Forwarded-For: 10.1.2.3\r\n"),
         [Outcome((202, 200))]),
    Case("a credential in the head is accepted", _case_credential_in_head,
         [Outcome((202, 200))], credential=True),
    Case("a credential sent only in a trailer is refused",
         _trailers(b"Authorization: IPDP-Credential TOKEN\r\n", credential=True),
         [Outcome((401, 200)), Outcome((401,), closed=True), Outcome((400,), closed=True)],
         credential=True),
    # §2.2: a recipient may take a bare LF as a line end; a bare CR is refused or read as SP.
    Case("bare LF line ends", _case_bare_lf,
         [Outcome((200, 200)), Outcome((400,), closed=True)]),
    Case("a bare CR in a field value", _case_bare_cr,
         [Outcome((200, 200)), Outcome((400,), closed=True)]),
    # §5.2: a server refuses obs-fold with 400 or replaces it with SP.
    Case("obs-fold", _case_obs_fold, [Outcome((200, 200)), Outcome((400,), closed=True)]),
    # §9.6: nothing after a request with Connection: close is read.
    Case("a POST pipelined after Connection: close", _case_after_close,
         [Outcome((200,), closed=True)]),
    Case("a POST pipelined after an unparsable target", _case_after_bad_target,
         [Outcome((200, 400), closed=True)]),
    # An absolute-form target with port 99999 is syntactically valid (RFC 3986 port = *DIGIT):
    # it is refused (and nothing after it read) or answered, then the POST answered.
    Case("a POST pipelined after an absolute target with port 99999", _case_after_port_target,
         [Outcome((200, 400), closed=True)]
         + [Outcome((200, s, 202)) for s in (200, 400, 404)]),
    # §9.3: an HTTP/1.0 keep-alive connection may be kept; a request without it closes.
    Case("HTTP/1.0 keep-alive", _case_http10_keep_alive,
         [Outcome((200,), closed=True), Outcome((200, 200), closed=True)]),
    # §6.1: Transfer-Encoding on HTTP/1.0 is faulty framing: close after the message.
    Case("chunked on HTTP/1.0", _case_http10_chunked,
         [Outcome((400,), closed=True), Outcome((202,), closed=True)]),
    # §6.3: a final coding other than chunked: 400 and close (or 501 for an unknown coding).
    Case("a coding after chunked", _case_unknown_coding,
         [Outcome((400,), closed=True), Outcome((501,), closed=True)]),
    # RFC 9110 §9.3.2: HEAD is GET without the content.
    Case("HEAD", _case_head, [Outcome((200, 200))], methods=("HEAD",)),
    # §3.2: 400 for an HTTP/1.1 request without Host or with two.
    Case("no Host", _case_missing_host, [Outcome((400,)), Outcome((400,), closed=True)]),
    Case("two Hosts", _case_two_hosts, [Outcome((400,)), Outcome((400,), closed=True)]),
    # A field line above the edge's 16 KiB (nginx answers 400 for its 494).
    Case("a field line above 16 KiB", _case_oversized_line,
         [Outcome((431,), closed=True), Outcome((400,), closed=True)]),
    Case("a declared body above the largest", _case_declared_too_large,
         [Outcome((413,)), Outcome((413,), closed=True)]),
]


@dataclass
class Answer:
    status: int
    body: bytes


def _parse(buf: bytes, methods: tuple[str, ...], answers: list[Answer], eof: bool
           ) -> tuple[bytes, bool]:
    """Take the complete answers off ``buf`` (1xx skipped); (the rest, whether it is
    malformed)."""
    while True:
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return buf, bool(buf) and eof
        head = buf[:end].decode("latin-1")
        match = re.match(r"HTTP/1\.[01] (\d{3})", head)
        if not match:
            return buf, True
        status = int(match[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in
                  (line.partition(":") for line in head.split("\r\n")[1:])}
        rest = buf[end + 4:]
        if 100 <= status < 200:
            buf = rest
            continue
        index = len(answers)
        if (index < len(methods) and methods[index] == "HEAD") or status in (204, 304):
            body = b""
        elif "chunked" in fields.get("transfer-encoding", ""):
            body, pos = b"", 0
            while True:
                line_end = rest.find(b"\r\n", pos)
                if line_end < 0:
                    return buf, eof
                size = int(rest[pos:line_end].split(b";")[0], 16)
                if size == 0:
                    done = rest.find(b"\r\n\r\n", line_end)
                    if done < 0:
                        return buf, eof
                    rest = rest[done + 4:]
                    break
                if len(rest) < line_end + 2 + size + 2:
                    return buf, eof
                body += rest[line_end + 2:line_end + 2 + size]
                pos = line_end + 2 + size + 2
        elif "content-length" in fields:
            size = int(fields["content-length"])
            if len(rest) < size:
                return buf, eof
            body, rest = rest[:size], rest[size:]
        else:
            if not eof:
                return buf, False
            body, rest = rest, b""
        answers.append(Answer(status, body))
        buf = rest


def exchange(pair: Pair, path: str, raw: bytes, case: Case) -> tuple[list[Answer], bool]:
    """Send ``raw`` at once on a new connection; (the answers in order, whether the
    connection was closed)."""
    most = max(len(o.statuses) for o in case.outcomes(path))
    if path == "edge":
        sock = pair.edge.tls().wrap_socket(
            socket.create_connection((pair.edge.address, pair.edge.port), timeout=10),
            server_hostname=pair.edge.address)
    else:
        sock = socket.create_connection(pair.direct, timeout=10)
    answers: list[Answer] = []
    buf, closed = b"", False
    with sock:
        try:
            sock.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):
            pass
        last = time.monotonic()
        while True:
            wait = CLOSE_S if len(answers) >= most else ANSWER_S
            remaining = last + wait - time.monotonic()
            if remaining <= 0:
                break
            sock.settimeout(remaining)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            except (ConnectionResetError, ssl.SSLError):
                chunk = b""
            if not chunk:
                closed = True
            buf += chunk
            buf, malformed = _parse(buf, case.methods, answers, closed)
            assert not malformed, f"not an HTTP answer: {buf[:200]!r}"
            if closed:
                break
            last = time.monotonic()
            if len(answers) >= most and not any(o.closed for o in case.outcomes(path)
                                                if len(o.statuses) == len(answers)):
                break
    return answers, closed


@pytest.fixture(scope="module")
def pair(runtime, tmp_path_factory) -> Iterator[Pair]:
    """A gateway process and the edge in front of it, with a plain study and one that requires
    credentials (records of every case come from here)."""
    require_tool("nginx", "tests/system/test_conformance.py (the shipped edge)")
    directory = tmp_path_factory.mktemp("conformance")
    suffix = uuid.uuid4().hex[:12]
    topics = TopicSettings(records=f"ipdp.records.{suffix}", models=f"ipdp.models.{suffix}",
                           dead_letter=f"ipdp.dead-letter.{suffix}",
                           studies=f"ipdp.studies.{suffix}", records_partitions=1,
                           replication_factor=1)
    kafka = runtime.kafka_settings()
    ensure_topics(kafka, topics)
    issuer = generate_key_files(directory / "issuer")
    plain = create(kafka, runtime.redis_settings(), topics, study_id="conf-plain", **PARAMS)
    guarded = create(kafka, runtime.redis_settings(), topics, study_id="conf-guarded",
                     require_credentials=True, **PARAMS)
    port = free_port()
    env = service_env(runtime, topics, IPDP_GATEWAY_HOST=HOST, IPDP_GATEWAY_PORT=str(port),
                      IPDP_GATEWAY_TRUSTED_PROXIES=HOST,
                      IPDP_TRUSTED_CREDENTIAL_KEYS=issuer.public_b64, **DEVICE_LIMITS_RAISED)
    gateway = start(["gateway"], env, directory, "gateway")
    try:
        with GatewayClient(f"http://{HOST}:{port}", timeout_s=5) as client:
            client.wait_ready(60, "/readyz", alive=lambda: gateway.proc.poll() is None)
            for study in (plain, guarded):
                wait_for(lambda s=study: client.study(s.study_id) is not None, 15,
                         f"the gateway to know {study.study_id}")
        with Edge((HOST, port), directory / "edge") as edge:
            yield Pair((HOST, port), edge, kafka, topics, plain, guarded, issuer,
                       gateway.proc.pid)
    finally:
        stop(gateway)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_request_is_answered_or_refused_as_rfc_9112_allows_in_order(pair, case, path):
    raw = case.request(pair)
    answers, closed = exchange(pair, path, raw, case)
    for answer in answers:
        if answer.status == 202:
            study = pair.guarded if case.credential else pair.plain
            pair.accepted[study.study_id] += int(re.search(rb'"accepted":\s*(\d+)', answer.body)[1])
    got = Outcome(tuple(a.status for a in answers), closed)
    allowed = case.outcomes(path)
    assert any(got.statuses == o.statuses and (closed or not o.closed) for o in allowed), \
        f"{path}: answered {got.statuses}, closed={closed}; allowed: {allowed}; " \
        f"first answer: {answers[0].body[:200] if answers else b''!r}"


#: The memory flood: connections stalling a 4 MiB − 1 B body after its first 512 KiB, and
#: connections sending trailer lines without end, for ``FLOOD_S``.
STALLED, ENDLESS, FLOOD_S = 180, 20, 10.0
#: What "flat" allows: the gateway's heap and allocator may move by a few MiB on their own.
FLAT_BYTES = 32 << 20


async def _memory_flood(pair: Pair) -> tuple[tuple[int, int], int, int]:
    """Open the flood through the edge and hold it for ``FLOOD_S``; (the gateway's and the
    edge's RSS at the end of it, body bytes sent, trailer bytes sent)."""
    edge, path = pair.edge, pair.path()
    sent = Counter()

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(edge.address, edge.port, ssl=edge.tls(),
                                             server_hostname=edge.address)

    async def stalled() -> asyncio.StreamWriter:
        _, writer = await connect()
        writer.write((f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/"
                      f"octet-stream\r\nContent-Length: {(4 << 20) - 1}\r\n\r\n").encode())
        writer.write(b"\0" * (512 << 10))
        await writer.drain()
        sent["body"] += 512 << 10
        return writer

    async def endless(stop: float) -> None:
        reader, writer = await connect()
        record = pair.record()
        writer.write(_chunked_post(path, b"%x\r\n%s\r\n0\r\n" % (len(record), record)))
        line = b"X-Trailer: " + b"t" * 4000 + b"\r\n"
        try:
            while time.monotonic() < stop and not reader.at_eof():
                writer.write(line * 16)
                await writer.drain()
                sent["trailers"] += len(line) * 16
                await asyncio.sleep(0.02)  # about 3 MB/s each: the machine is shared
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.transport.abort()

    held = await asyncio.gather(*(stalled() for _ in range(STALLED)))
    try:
        await asyncio.gather(*(endless(time.monotonic() + FLOOD_S) for _ in range(ENDLESS)))
        peak = rss_bytes(pair.gateway_pid), rss_bytes(pair.edge.proc.pid)
    finally:
        for writer in held:
            writer.transport.abort()
        # A TLS stream's close() waits on the peer's close_notify, which the loop's end can cut
        # short and leave the socket to the garbage collector; abort() closes it at once, once
        # the loop runs the callbacks it scheduled.
        await asyncio.sleep(0)
    return peak, sent["body"], sent["trailers"]


def test_stalled_bodies_and_endless_trailers_through_the_edge_leave_the_gateway_flat(pair):
    """The edge spools bodies and drops trailers, so neither reaches the gateway: its RSS (all
    its processes, from /proc) moves by less than 32 MiB while 180 connections each hold
    512 KiB of a 4 MiB − 1 B body and 20 send trailer lines for 10 s, and after; nor does the
    edge's."""
    before = rss_bytes(pair.gateway_pid), rss_bytes(pair.edge.proc.pid)
    peak, body, trailers = asyncio.run(_memory_flood(pair))
    time.sleep(1.0)
    after = rss_bytes(pair.gateway_pid), rss_bytes(pair.edge.proc.pid)
    assert body == STALLED * (512 << 10)
    assert trailers > 0
    assert peak[0] - before[0] < FLAT_BYTES, (before, peak, body, trailers)
    assert after[0] - before[0] < FLAT_BYTES, (before, after)
    # The edge spools the bodies to files and discards the trailers as they come.
    assert peak[1] - before[1] < FLAT_BYTES, (before, peak, body, trailers)
    # The pair still serves.
    answers, _ = exchange(pair, "edge", GET, Case("health", lambda _: GET, [Outcome((200,))]))
    assert [a.status for a in answers] == [200]


def test_the_records_topic_holds_exactly_the_records_answered_202(pair):
    """Runs after the cases: every record on the topic was answered 202, and each 202's records
    are there, so no refusal, lost answer or hidden request produced one."""
    expected = sum(pair.accepted.values())
    assert expected > 0, "run with the cases above"
    assert _records_by_study(pair, expected) == pair.accepted


def _records_by_study(pair: Pair, expected: int) -> Counter:
    """Records on the topic per study, read until ``expected`` arrived and then 2 s more (a
    record no 202 announced would come in that time too), or 20 s."""
    from kafka import TopicPartition

    consumer = kafka_consumer(pair.kafka, group_id=None)
    try:
        topic = pair.topics.records
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        counts: Counter = Counter()
        deadline, settled = time.monotonic() + 20, None
        while time.monotonic() < (settled or deadline):
            for messages in consumer.poll(timeout_ms=200).values():
                for m in messages:
                    k = container_count(m.value) if m.value[VERSION_BYTE] == CONTAINER_VERSION \
                        else 1
                    counts[header_study(m.headers)] += k
            if settled is None and sum(counts.values()) >= expected:
                settled = time.monotonic() + 2
        return counts
    finally:
        consumer.close()
