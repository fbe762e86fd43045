"""One client connection of the gateway's server (gateway.server): httptools' parser fed by an
asyncio protocol, the limits of a request, and its answer in one write."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.parse
from collections import deque
from email.utils import formatdate
from functools import cache
from http import HTTPStatus
from typing import Any, NamedTuple, Protocol

import httptools

from gateway.asgi import Lifespan, call_app
from gateway.checks import HTTP_STATUS
from gateway.connections import ConnectionTable
from gateway.settings import GatewaySettings
from ipdp.metrics import GATEWAY_CONNECTIONS_EVICTED
from ipdp.wire import RejectReason

__all__ = ["DeviceRequest", "HttpConnection"]

log = logging.getLogger(__name__)

#: Pipelined requests a connection may have waiting before the server stops reading it.
_MAX_QUEUED = 16
#: Which deadline a connection has armed: its request head's, its body's, or the idle one's.
_HEAD, _BODY, _IDLE = 0, 1, 2


class DeviceRequest(NamedTuple):
    """A request to the records route, as the device handler gets it."""

    method: bytes
    study_id: str
    client: str
    #: (lower-case name, value) pairs, in order.
    headers: list[tuple[bytes, bytes]]
    body: bytes
    #: False when the body exceeded ``max_body_bytes`` and was not read (the handler refuses it).
    whole: bool


class ConnectionOwner(Protocol):
    """What a connection needs of the server that accepted it (gateway.server.HttpServer)."""

    settings: GatewaySettings
    app: Any
    table: ConnectionTable
    held: set[HttpConnection]
    lifespan: Lifespan

    def opened(self, connection: HttpConnection) -> bool: ...
    def hold(self, connection: HttpConnection) -> bool: ...
    def closed(self, connection: HttpConnection) -> None: ...
    def left(self, connection: HttpConnection) -> None: ...


class _Request:
    """A request being read or waiting for its turn."""

    __slots__ = ("chunks", "headers", "keep_alive", "method", "size", "url", "whole")

    def __init__(self) -> None:
        self.url, self.headers, self.chunks, self.size = b"", [], [], 0
        self.method, self.keep_alive, self.whole = b"", True, True


@cache
def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase.encode())


_date = [0, b""]


def _date_line() -> bytes:
    now = int(time.time())
    if now != _date[0]:
        _date[:] = now, b"date: %s\r\n" % formatdate(now, usegmt=True).encode()
    return _date[1]


class HttpConnection(asyncio.Protocol):
    """One client connection: parses its requests, answers them in order, keeps its deadline."""

    def __init__(self, server: ConnectionOwner) -> None:
        self.server, self.settings, self.app = server, server.settings, server.app
        self.loop = asyncio.get_running_loop()
        #: Made once the connection is admitted (a refused one costs no parser).
        self.parser: httptools.HttpRequestParser | None = None
        self.transport: asyncio.Transport | None = None
        self.client, self.peer = "", ("", 0)
        #: Bytes received so far (the eviction order).
        self.received = 0
        #: When the armed deadline falls (the loop's clock), or None; and which one it is.
        self.due: float | None = None
        self.due_kind = _HEAD
        self.reading: _Request | None = None  # the request whose head or body is arriving
        self.in_head = False
        self.head_bytes = 0
        self.waiting: deque[_Request] = deque()
        self.answering: _Request | None = None
        self.continue_owed = False
        self.close_after = False
        self.admitted = False
        self.head_too_large = False
        self._disconnected: asyncio.Future | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = peer[:2] if isinstance(peer, tuple) else ("", 0)
        self.client = self.peer[0]
        if not self.server.opened(self):
            if self.server.hold(self):
                transport.pause_reading()
                self._arm(self.settings.header_timeout_s, _HEAD)
            else:
                transport.abort()
            return
        self.admitted = True
        self.parser = httptools.HttpRequestParser(self)
        self._arm(self.settings.header_timeout_s, _HEAD)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.admitted:
            self.server.closed(self)
        else:
            self.server.held.discard(self)
        self.due, self.answering = None, None
        self.waiting.clear()
        if self._disconnected is not None and not self._disconnected.done():
            self._disconnected.set_result(None)

    def data_received(self, data: bytes) -> None:
        if not self.received:
            self.server.table.sent_bytes(self)
        self.received += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No protocol upgrades: answer what came, read no more, then close.
            self.close_after = True
            self.transport.pause_reading()
        except httptools.HttpParserError:
            if self.head_too_large:
                self._refuse(RejectReason.HEADERS_TOO_LARGE, self._head_detail())
            else:
                self._refuse(RejectReason.BAD_REQUEST, "malformed HTTP request", 400)
            return
        # The parser keeps a partial head to itself: count what arrived while the head is
        # incomplete, so a head sent in many reads is refused before it grows.
        if self.in_head:
            self.head_bytes += len(data)
            if self.head_bytes > self.settings.max_header_bytes:
                self._refuse(RejectReason.HEADERS_TOO_LARGE, self._head_detail())

    def pause_writing(self) -> None:
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.transport.resume_reading()

    # httptools' callbacks

    def on_message_begin(self) -> None:
        self.reading, self.in_head, self.head_bytes = _Request(), True, 0
        if self.due_kind == _IDLE or self.due is None:
            self._arm(self.settings.header_timeout_s, _HEAD)

    def on_url(self, url: bytes) -> None:
        self.reading.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.reading.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        request, self.in_head = self.reading, False
        if (len(request.url) + sum(len(n) + len(v) + 4 for n, v in request.headers)
                > self.settings.max_header_bytes):
            # An exception in a callback stops the parser (feed_data raises a parser error).
            self.head_too_large = True
            raise ValueError("request head too large")
        self.server.table.busy(self)
        request.method = self.parser.get_method()
        request.keep_alive = self.parser.should_keep_alive()
        self._arm(self.settings.body_timeout_s, _BODY)
        declared = expect = None
        for name, value in request.headers:
            if name == b"content-length":
                declared = value
            elif name == b"expect":
                expect = value.lower()
        if declared is not None and declared.isdigit() \
                and int(declared) > self.settings.max_body_bytes:
            self._overflow(request)
        elif expect == b"100-continue":
            self.continue_owed = True
            self._owe_continue()

    def on_body(self, body: bytes) -> None:
        request = self.reading
        if request is None or not request.whole:
            return
        request.size += len(body)
        if request.size > self.settings.max_body_bytes:
            self._overflow(request)
            return
        request.chunks.append(body)

    def on_message_complete(self) -> None:
        request, self.reading = self.reading, None
        if request is None:
            return
        self.continue_owed = False
        self.due = None
        self._queue(request)

    # requests and answers

    def _overflow(self, request: _Request) -> None:
        """A body above the limit: answer the request without it, read nothing more."""
        request.whole, request.keep_alive, request.chunks = False, False, []
        self.reading, self.continue_owed, self.due = None, False, None
        self.transport.pause_reading()
        self._queue(request)

    def _queue(self, request: _Request) -> None:
        if self.answering is None:
            self._start(request)
        else:
            self.waiting.append(request)
            if len(self.waiting) >= _MAX_QUEUED:
                self.transport.pause_reading()

    def _start(self, request: _Request) -> None:
        self.answering = request
        raw_path, _, query = request.url.partition(b"?")
        if not raw_path.startswith(b"/"):  # absolute form: http://host/path
            url = httptools.parse_url(request.url)
            raw_path, query = url.path or b"/", url.query or b""
        path = raw_path.decode("latin-1")
        if "%" in path:
            path = urllib.parse.unquote(path)
        body = request.chunks[0] if len(request.chunks) == 1 else b"".join(request.chunks)
        study_id = self.app.device_study(path)
        if study_id is not None:
            try:
                self.app.answer(DeviceRequest(request.method, study_id, self.client,
                                              request.headers, body, request.whole),
                                lambda response: self._answer_device(request, response))
            except Exception:
                log.exception("gateway: the device handler raised")
                self._answer(request, 500, [(b"content-length", b"0")], b"")
            return
        if not request.whole:
            self._refuse(RejectReason.TOO_LARGE,
                         f"body exceeds {self.settings.max_body_bytes} bytes", 413)
            return
        scope = {"type": "http", "http_version": self.parser.get_http_version(),
                 "method": request.method.decode("ascii"), "scheme": "http", "path": path,
                 "raw_path": raw_path, "query_string": query, "root_path": "",
                 "headers": request.headers, "client": self.peer,
                 "server": self.transport.get_extra_info("sockname")[:2],
                 "state": dict(self.server.lifespan.state)}
        if self._disconnected is None:
            self._disconnected = self.loop.create_future()
        task = self.loop.create_task(call_app(self.app.asgi, scope, body, self._disconnected))
        task.add_done_callback(lambda done: self._answer_asgi(request, done.result()))

    def _answer_device(self, request: _Request, response) -> None:
        self._answer(request, response.status_code, response.raw_headers, response.body)

    def _answer_asgi(self, request: _Request, answer) -> None:
        status, headers, body = answer
        if request.method == b"HEAD":
            body = b""
        elif not any(name == b"content-length" for name, _ in headers):
            headers.append((b"content-length", b"%d" % len(body)))
        self._answer(request, status, headers, body)

    def _answer(self, request: _Request, status: int, headers, body: bytes) -> None:
        """Write ``request``'s answer (head and body in one write), then start the next."""
        if request is not self.answering or self.transport.is_closing():
            return
        keep_alive = request.keep_alive and not self.close_after
        head = [_status_line(status), _date_line()]
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        if not keep_alive:
            head.append(b"connection: close\r\n")
        head += (b"\r\n", body)
        self.transport.write(b"".join(head))
        self.answering = None
        if not keep_alive:
            self.transport.close()
            return
        if self.waiting:
            if len(self.waiting) == _MAX_QUEUED:
                self.transport.resume_reading()
            self._start(self.waiting.popleft())
            return
        self._owe_continue()
        if self.reading is None:
            self.server.table.idle(self)
            self._arm(self.settings.keep_alive_timeout_s, _IDLE)

    def _owe_continue(self) -> None:
        """Send the 100 Continue a request's head asked for, once the answers before it went."""
        if self.continue_owed and self.answering is None and not self.waiting:
            self.continue_owed = False
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def close_when_idle(self) -> None:
        """Draining: close now if no request is in progress, else after its answer."""
        self.close_after = True
        if self.answering is None and not self.waiting and self.reading is None:
            self.transport.close()

    def evict(self) -> None:
        """Make room for a newer connection (gateway.connections). One that never completed
        its request head is held unread until its head deadline, as a refused one is (so a
        flood does not learn of it and re-open it at once, evicting another); an idle one is
        closed."""
        GATEWAY_CONNECTIONS_EVICTED.inc()
        self.server.left(self)
        self.admitted = False
        if (self.in_head or not self.received) and self.server.hold(self):
            self.transport.pause_reading()
        else:
            self.transport.close()

    def timed_out(self) -> None:
        kind, self.due = self.due_kind, None
        if self.transport.is_closing():
            return
        if kind == _HEAD and self.in_head:
            self._refuse(RejectReason.REQUEST_TIMEOUT, "the request head did not arrive within "
                         f"{self.settings.header_timeout_s:g} s")
        elif kind == _BODY and self.reading is not None:
            self._refuse(RejectReason.REQUEST_TIMEOUT, "the request body did not arrive within "
                         f"{self.settings.body_timeout_s:g} s")
        else:
            self.transport.close()  # nothing sent at all, or idle between requests

    def _arm(self, seconds: float, kind: int) -> None:
        self.due, self.due_kind = self.loop.time() + seconds, kind

    def _head_detail(self) -> str:
        return f"the request head exceeds {self.settings.max_header_bytes} bytes"

    def _refuse(self, reason: RejectReason, detail: str, status: int | None = None) -> None:
        """Answer ``{"error": reason, "detail": detail}`` at once, out of turn, and close."""
        self.due = None
        if self.transport.is_closing():
            return
        body = json.dumps({"error": reason.value, "detail": detail}).encode()
        self.transport.write(b"".join((
            _status_line(status or HTTP_STATUS[reason]), _date_line(),
            b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n", body)))
        self.transport.close()
