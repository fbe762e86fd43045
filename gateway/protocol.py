"""uvicorn's httptools protocol with the limits a public ingest needs (docs/operations.md).

uvicorn bounds the request head only in its pure-Python h11 protocol, has no timeout for a
connection that sends nothing or sends its request slowly, and answers requests above
``limit_concurrency`` with 503 while it keeps every connection open, so half-open connections
exhaust the file descriptors. This subclass adds, per worker:

- a largest request head (``max_header_bytes``): 431 ``headers_too_large``, connection closed;
- a head deadline (``header_timeout_s``, from the connection's opening or a request's first
  byte) and a body deadline (``body_timeout_s``, from the end of the head): 408
  ``request_timeout`` if the request had begun, then the connection is closed;
- a connection cap (``max_connections``) and a cap per client address
  (``max_connections_per_client``): a connection above either is closed as soon as it is
  accepted, so one client's flood costs that client, not the other devices. A trusted proxy
  (``trusted_proxies``, gateway.client_address) is held to the first cap only: it carries many
  clients' connections and caps each client's itself.

The idle keep-alive timeout is uvicorn's own (``timeout_keep_alive``). The per-client request
rate is the app's (``gateway.limits``), as it answers 429 with Retry-After.

The deadlines are not timers: arming one per request and cancelling it cost two timer handles per
request on the device path. A connection notes when its deadline falls, and one sweep
per server (every quarter of the shorter timeout, at most every second) closes the connections
past theirs; so a timeout fires up to a quarter of itself (at most 1 s) late.

It also writes a response's head together with its body: uvicorn writes each at once, and uvloop
sends each write straight to the socket, so a device's 202 cost two send(2) calls, each as dear
as the request's own checks and hand-off on loopback (docs/architecture.md).

**The device lane.** An app may offer ``device_lane(scope)``: for the requests it takes (the
gateway's ``POST /studies/{id}/records``), a function ``answer(scope, body, respond)`` that the
protocol calls once the body is in, and that calls ``respond(response)`` when the answer is
known. Such a request runs no ASGI task: uvicorn's task, its receive and send coroutines and
their messages are a large share of what a bare endpoint costs per request
(docs/architecture.md). The protocol writes the answer, with uvicorn's default headers, and then
completes the request as uvicorn's own send does (keep-alive, the next pipelined request, the
keep-alive timer). The lane takes only what it can hold without flow control: a declared
Content-Length up to uvicorn's read high-water mark, no Transfer-Encoding, no ``Expect:
100-continue``; anything else, like every other route, goes through the ASGI app.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from collections import Counter

from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from gateway.checks import HTTP_STATUS
from gateway.client_address import trusted_proxies
from gateway.settings import GatewaySettings
from ipdp.metrics import GATEWAY_CONNECTIONS, GATEWAY_CONNECTIONS_REFUSED
from ipdp.wire import RejectReason

__all__ = ["BoundedHttpToolsProtocol"]

log = logging.getLogger(__name__)

_PHRASES = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}

#: Open connections per client address, per server (one uvicorn server per worker).
_PER_CLIENT: weakref.WeakKeyDictionary[object, Counter[str]] = weakref.WeakKeyDictionary()
#: The deadline sweep of each server with open connections (see the module docstring).
_SWEEPS: weakref.WeakKeyDictionary[object, asyncio.TimerHandle] = weakref.WeakKeyDictionary()
#: Connections closed at once, by the cap they were above.
_REFUSED_TOTAL = GATEWAY_CONNECTIONS_REFUSED.labels("max_connections")
_REFUSED_PER_CLIENT = GATEWAY_CONNECTIONS_REFUSED.labels("max_connections_per_client")
#: The longest time between two sweeps.
_SWEEP_MAX_S = 1.0


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a head above the limit."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's HttpToolsProtocol plus the limits of :class:`GatewaySettings` (``limits``)."""

    def __init__(self, *args, limits: GatewaySettings, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._per_client = _PER_CLIENT.setdefault(self.server_state, Counter())
        self._host: str | None = None
        self._head_bytes = 0
        self._in_head = False
        #: When the armed deadline falls (the loop's clock), or None.
        self._due: float | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        host = self.client[0] if self.client else ""
        if len(self.connections) > self.limits.max_connections:
            _REFUSED_TOTAL.inc()
            transport.abort()
            return
        # A trusted proxy carries many clients' connections, and caps each client's itself.
        if (self._per_client[host] >= self.limits.max_connections_per_client
                and host not in trusted_proxies(self.limits.trusted_proxies or "")):
            _REFUSED_PER_CLIENT.inc()
            transport.abort()
            return
        self._host = host
        self._per_client[host] += 1
        GATEWAY_CONNECTIONS.inc()
        self._arm(self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._host is not None:
            GATEWAY_CONNECTIONS.dec()
            self._per_client[self._host] -= 1
            if not self._per_client[self._host]:
                del self._per_client[self._host]
            self._host = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # The parser keeps a partial head to itself: count what arrived while the head is
        # incomplete, so a head sent in many reads is refused before it grows.
        if self._in_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                self._refuse(RejectReason.HEADERS_TOO_LARGE, self._head_limit_detail())

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0
        if self._due is None:
            self._arm(self.limits.header_timeout_s)

    def on_headers_complete(self) -> None:
        self._in_head = False
        # A head that arrived in one read was never counted: measure it exactly.
        if self._head_too_large():
            raise _HeadTooLarge
        self._arm(self.limits.body_timeout_s)
        super().on_headers_complete()
        if type(self.cycle) is RequestResponseCycle:
            self.cycle.__class__ = _HeadWithBodyCycle

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()
        if getattr(self.cycle, "lane", None) is not None:
            self._run_lane(self.cycle)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app) -> None:
        # uvicorn starts every request here, a pipelined one once the previous is answered.
        lane = getattr(app, "device_lane", None)
        answer = lane(cycle.scope) if lane is not None and _fits_lane(cycle) else None
        if answer is None:
            super()._start_asgi_task(cycle, app)
            return
        cycle.lane = answer
        self._run_lane(cycle)

    def _run_lane(self, cycle: RequestResponseCycle) -> None:
        """Hand a device-lane request to its app once its body is complete (and only once)."""
        if cycle.more_body or cycle.lane is None:
            return
        answer, cycle.lane = cycle.lane, None
        try:
            answer(cycle.scope, bytes(cycle.body), lambda response: self._respond(cycle, response))
        except Exception:  # what uvicorn does when an app raises
            log.exception("Exception in the device lane")
            self._respond(cycle, None)

    def _respond(self, cycle: RequestResponseCycle, response) -> None:
        """Write a lane request's answer (None: a 500) and complete the request."""
        if cycle.disconnected or cycle.response_complete or self.transport.is_closing():
            return
        if response is None:
            status, headers, body = 500, _ERROR_HEADERS, b"Internal Server Error"
            cycle.keep_alive = False
        else:
            status, headers, body = response.status_code, response.raw_headers, response.body
        head = [STATUS_LINE[status]]
        for name, value in (*self.server_state.default_headers, *headers):
            head += (name, b": ", value, b"\r\n")
        if not cycle.keep_alive:
            head.append(b"connection: close\r\n")
        head += (b"\r\n", body)
        self.transport.write(b"".join(head))
        cycle.response_started = cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            self.transport.close()
        cycle.on_response()

    def send_400_response(self, msg: str) -> None:
        # uvicorn answers every parser error with 400; on_headers_complete's _HeadTooLarge
        # (re-raised by the parser as a parser error) is a 431.
        if self._head_too_large():
            self._refuse(RejectReason.HEADERS_TOO_LARGE, self._head_limit_detail())
            return
        super().send_400_response(msg)

    def _head_too_large(self) -> bool:
        return (self.headers is not None and not self._in_head
                and len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
                > self.limits.max_header_bytes)

    def _head_limit_detail(self) -> str:
        return f"the request head exceeds {self.limits.max_header_bytes} bytes"

    def _arm(self, seconds: float) -> None:
        self._due = self.loop.time() + seconds
        if self.server_state not in _SWEEPS:
            self._sweep_later()

    def _disarm(self) -> None:
        self._due = None

    def _sweep_later(self) -> None:
        period = min(_SWEEP_MAX_S, self.limits.header_timeout_s / 4,
                     self.limits.body_timeout_s / 4)
        _SWEEPS[self.server_state] = self.loop.call_later(period, _sweep, self.server_state,
                                                          self.loop)

    def _timed_out(self) -> None:
        self._due = None
        if self.transport.is_closing():
            return
        if self._in_head:
            self._refuse(RejectReason.REQUEST_TIMEOUT, "the request head did not arrive within "
                         f"{self.limits.header_timeout_s:g} s")
        elif self.cycle is None or self.cycle.response_started:
            self.transport.close()  # nothing sent at all, or the app already answered
        else:
            self._refuse(RejectReason.REQUEST_TIMEOUT, "the request body did not arrive within "
                         f"{self.limits.body_timeout_s:g} s")

    def _refuse(self, reason: RejectReason, detail: str) -> None:
        """Answer ``{"error": reason, "detail": detail}`` with the reason's status; close."""
        status = HTTP_STATUS[reason]
        body = json.dumps({"error": reason.value, "detail": detail}).encode()
        self.transport.write(b"".join((
            b"HTTP/1.1 %d %s\r\n" % (status, _PHRASES[status]),
            b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n", body)))
        self.transport.close()
        self._disarm()


def _sweep(server_state, loop: asyncio.AbstractEventLoop) -> None:
    """Time out the server's connections past their deadline; again later while any is open."""
    del _SWEEPS[server_state]
    now = loop.time()
    waiting = None
    for connection in list(server_state.connections):
        due = getattr(connection, "_due", None)
        if due is not None and due <= now:
            connection._timed_out()
        if getattr(connection, "_due", None) is not None:
            waiting = connection
    if waiting is not None:
        waiting._sweep_later()


_ERROR_HEADERS = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"21")]


def _fits_lane(cycle: RequestResponseCycle) -> bool:
    """A request the device lane can hold: a declared body up to the read high-water mark (so
    uvicorn never pauses reading it), not chunked, no 100-continue to send."""
    if cycle.waiting_for_100_continue:
        return False
    length = None
    for name, value in cycle.scope["headers"]:
        if name == b"content-length":
            length = value
        elif name == b"transfer-encoding":
            return False
    return length is not None and length.isdigit() and int(length) <= HIGH_WATER_LIMIT


class _HeadWithBodyCycle(RequestResponseCycle):
    """uvicorn's request/response cycle, with the response head held for the first body write.

    Only the ASGI ``send`` changes: from the ``http.response.start`` message on, the cycle
    writes through a :class:`_HeldHead`, which sends the head with the body's first bytes in one
    write, or on its own once the response is complete without any (a HEAD request, an empty
    body) or the connection is closed.
    """

    async def send(self, message) -> None:
        if not self.response_started and message["type"] == "http.response.start":
            if self.flow.write_paused and not self.disconnected:
                await self.flow.drain()  # so that uvicorn's send does not wait with the head held
            self.transport = _HeldHead(self.transport)
        await super().send(message)
        if self.response_complete and isinstance(self.transport, _HeldHead):
            self.transport.flush()


class _HeldHead:
    """A transport that keeps its first write (the response head) until the next one or
    :meth:`flush`; everything else goes to the connection's transport."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._head: bytes | None = None
        self._holding = True

    def write(self, data: bytes) -> None:
        if self._holding:
            self._head, self._holding = data, False
            return
        self.flush(data)

    def flush(self, data: bytes = b"") -> None:
        """Write the held head (if still held) followed by ``data``."""
        head, self._head = self._head, None
        if head is not None:
            data = head + data
        if data:
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)
