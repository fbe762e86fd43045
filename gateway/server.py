"""The gateway's HTTP/1.1 server: httptools' parser on an asyncio protocol (docs/architecture.md,
"The gateway's server"; the limits are in docs/operations.md).

Each connection is a :class:`~gateway.http_connection.HttpConnection`; the server of one worker
(:class:`HttpServer`) owns the connection table (gateway.connections: caps per address and
prefix, eviction) and the deadlines. Per request it enforces

- a largest request head (``max_header_bytes``): 431 ``headers_too_large``, connection closed;
- a head deadline (``header_timeout_s``, from the connection's opening or a request's first
  byte) and a body deadline (``body_timeout_s``, from the end of the head): 408
  ``request_timeout`` if the request had begun (a silent connection is just closed);
- the idle keep-alive timeout (``keep_alive_timeout_s``);
- a largest body (``max_body_bytes``), read whole, chunked or not, before a handler runs.

The deadlines are not timers: a connection notes when its deadline falls, and one sweep per
server (every quarter of the shorter timeout, at most every second) closes the connections past
theirs; so a timeout fires up to a quarter of itself (at most 1 s) late.

A device's POST (the app's :meth:`~gateway.app.GatewayApp.device_study` names its study) goes
straight to the app's one device handler, which answers through a callback once Kafka settled
the records: no task, no coroutine. Every other request runs through the ASGI app
(gateway.asgi). Pipelined requests are answered in order, one at a time; a response's head and
body go out in one write.
"""

from __future__ import annotations

import asyncio
import time

from gateway.asgi import Lifespan
from gateway.client_address import trusted_proxies
from gateway.connections import CAPS, ConnectionTable
from gateway.http_connection import HttpConnection
from gateway.settings import GatewaySettings
from ipdp.metrics import GATEWAY_CONNECTIONS, GATEWAY_CONNECTIONS_REFUSED

__all__ = ["HttpServer"]

#: The longest time between two deadline sweeps.
_SWEEP_MAX_S = 1.0


class HttpServer:
    """The HTTP server of one worker: its listening sockets, connections and deadline sweep."""

    def __init__(self, app, settings: GatewaySettings) -> None:
        self.app, self.settings = app, settings
        self.table = ConnectionTable(
            settings.max_connections, settings.max_connections_per_client,
            settings.max_connections_per_prefix, settings.ipv4_prefix_bits,
            settings.ipv6_prefix_bits)
        # Each cap's refusal count is served from the start (at 0), so a rate of refusals reads
        # 0, not "no data", until a connection is first refused.
        for cap in CAPS:
            GATEWAY_CONNECTIONS_REFUSED.labels(cap)
        self.connections: set[HttpConnection] = set()
        #: Refused connections left open, unread, until their head deadline (see :meth:`hold`).
        self.held: set[HttpConnection] = set()
        self.proxies = trusted_proxies(settings.trusted_proxies or "")
        self.lifespan = Lifespan(app.asgi)
        self.draining = False
        self._servers: list[asyncio.AbstractServer] = []
        self._sweep: asyncio.TimerHandle | None = None
        self._period = min(_SWEEP_MAX_S, settings.header_timeout_s / 4,
                           settings.body_timeout_s / 4, settings.keep_alive_timeout_s / 4)

    async def serve(self, sockets, stop: asyncio.Event) -> None:
        """Start the app, serve on the listening ``sockets`` until ``stop`` is set, then drain:
        stop accepting, let the requests in progress be answered (up to ``kafka_timeout_s``),
        close every connection and shut the app down."""
        loop = asyncio.get_running_loop()
        await self.lifespan.startup()
        try:
            for sock in sockets:
                self._servers.append(await loop.create_server(
                    lambda: HttpConnection(self), sock=sock, backlog=2048))
            await stop.wait()
            await self._drain()
        finally:
            for server in self._servers:
                server.close()
            if self._sweep is not None:
                self._sweep.cancel()
            await self.lifespan.shutdown()

    async def _drain(self) -> None:
        self.draining = True
        for server in self._servers:
            server.close()
        for connection in list(self.held):
            connection.transport.abort()
        for connection in list(self.connections):
            connection.close_when_idle()
        deadline = time.monotonic() + self.settings.kafka_timeout_s
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for connection in list(self.connections):
            connection.transport.close()

    def opened(self, connection: HttpConnection) -> bool:
        """Whether a new connection may stay (the table may evict another for it)."""
        if self.draining:
            return False
        refused = self.table.open(connection, connection.client,
                                  bool(self.proxies) and connection.client in self.proxies)
        if refused is not None:
            GATEWAY_CONNECTIONS_REFUSED.labels(refused).inc()
            return False
        GATEWAY_CONNECTIONS.inc()
        self.connections.add(connection)
        self._sweep_later(connection.loop)
        return True

    def hold(self, connection: HttpConnection) -> bool:
        """Whether a refused connection is held rather than closed at once.

        A flood re-opens a closed connection at once, so closing the refused ones at once would
        cost the gateway an accept and a close per re-opening, as fast as the flood can go.
        Held unread until the head deadline (as many as ``max_connections``; above that they
        are closed at once), a refused connection costs its holder a turn, as an admitted
        silent one does, and the gateway one descriptor, no work.
        """
        if self.draining or len(self.held) >= self.settings.max_connections:
            return False
        self.held.add(connection)
        self._sweep_later(connection.loop)
        return True

    def _sweep_later(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._sweep is None:
            self._sweep = loop.call_later(self._period, self._sweep_now, loop)

    def closed(self, connection: HttpConnection) -> None:
        self.left(connection)
        self.table.close(connection)

    def left(self, connection: HttpConnection) -> None:
        """A connection is no longer served (closed, or evicted: the table forgot it)."""
        GATEWAY_CONNECTIONS.dec()
        self.connections.discard(connection)

    def _sweep_now(self, loop: asyncio.AbstractEventLoop) -> None:
        """Time out the connections past their deadline; again later while any is open."""
        now = loop.time()
        for connection in [*self.connections, *self.held]:
            if connection.due is not None and connection.due <= now:
                connection.timed_out()
        self._sweep = (loop.call_later(self._period, self._sweep_now, loop)
                       if self.connections or self.held else None)
