"""The gateway server's bridge to an ASGI app (Starlette) for every route but the device POST.

Those routes are small (studies, health, metrics, the OpenAPI document, the contributor's page),
so the bridge gives the app the whole request body in one ``http.request`` message and collects
the whole response before the server writes it, head and body together. The lifespan protocol
(startup, shutdown) is driven by :class:`Lifespan`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = ["Lifespan", "call_app"]

log = logging.getLogger(__name__)

_ASGI = {"version": "3.0", "spec_version": "2.3"}
_SERVER_ERROR = (500, [(b"content-type", b"text/plain; charset=utf-8")],
                 b"Internal Server Error")


async def call_app(app, scope: dict[str, Any], body: bytes, disconnected: asyncio.Future
                   ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Run one HTTP request through ``app``: its (status, headers, body). A 500 if the app
    raises or ends without an answer; ``disconnected`` settles when the client goes."""
    scope["asgi"] = _ASGI
    delivered = False
    status: int | None = None
    headers: list[tuple[bytes, bytes]] = []
    chunks: list[bytes] = []

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.shield(disconnected)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status, headers = message["status"], list(message.get("headers", ()))
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    try:
        await app(scope, receive, send)
    except Exception:
        log.exception("gateway: the app raised on %s %s", scope["method"], scope["path"])
        return _SERVER_ERROR
    if status is None:
        log.error("gateway: the app sent no answer to %s %s", scope["method"], scope["path"])
        return _SERVER_ERROR
    return status, headers, b"".join(chunks)


class Lifespan:
    """The ASGI lifespan of ``app``: :meth:`startup` before serving, :meth:`shutdown` after."""

    def __init__(self, app) -> None:
        self.app = app
        #: The lifespan state, copied into every request's scope.
        self.state: dict[str, Any] = {}
        self._messages: asyncio.Queue[dict] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._waiting: asyncio.Future | None = None

    async def startup(self) -> None:
        """Start the app; raises RuntimeError if its startup fails."""
        scope = {"type": "lifespan", "asgi": _ASGI, "state": self.state}
        self._task = asyncio.create_task(self.app(scope, self._messages.get, self._send))
        await self._step("lifespan.startup")

    async def shutdown(self) -> None:
        """Stop the app (its shutdown runs to the end)."""
        if self._task is None:
            return
        await self._step("lifespan.shutdown")
        await self._task

    async def _step(self, message: str) -> None:
        self._waiting = asyncio.get_running_loop().create_future()
        await self._messages.put({"type": message})
        done, _ = await asyncio.wait({self._waiting, self._task},
                                     return_when=asyncio.FIRST_COMPLETED)
        if self._waiting not in done:
            self._task.result()  # the app's own exception, if it raised
            raise RuntimeError(f"the app ended before answering {message}")
        self._waiting.result()

    async def _send(self, message: dict) -> None:
        kind = message["type"]
        if kind.endswith(".complete"):
            self._waiting.set_result(None)
        elif kind.endswith(".failed"):
            self._waiting.set_exception(RuntimeError(message.get("message", kind)))
