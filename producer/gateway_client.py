"""HTTP clients of the ingest gateway: one blocking connection, and one on asyncio.

A device sends through the SDK (:class:`producer.contributor.Contributor` with
``via=URL``), whose :class:`~producer.transport.GatewayTransport` adds what a device needs
around these: the study verified against pinned keys, the retries of a 429 or 503, the refusals
as exceptions. See docs/architecture.md, "The clients".

:class:`GatewayClient` holds one persistent ``http.client`` connection (not thread-safe: one per
thread) and returns each answer as it is: for reading a study, waiting for readiness, and for
tests and benchmarks that send records they built themselves.

:class:`AsyncGatewayConnection` is one keep-alive connection on asyncio streams, with h11 (the
sans-I/O HTTP/1.1 library uvicorn itself is built on) for the protocol: the transport keeps
many of them busy from one thread, so a process playing many devices (the load generator) costs
a fraction of the CPU of a thread and an ``http.client`` connection per device.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self
from urllib.parse import quote, urlsplit

import h11

from ipdp.credentials import AUTH_SCHEME
from ipdp.signing import TrustedKeys
from ipdp.study import Study, StudyStatus, parse_study_message
from producer.retry import RETRYABLE_STATUSES, parse_retry_after

__all__ = ["AsyncGatewayConnection", "GatewayAnswer", "GatewayClient", "records_path"]


@dataclass(frozen=True)
class GatewayAnswer:
    """One HTTP answer: status, parsed JSON body (or None), the raw body, and the delay its
    ``Retry-After`` header asks for (seconds, or None)."""

    status: int
    body: dict | None
    raw: bytes
    retry_after_s: float | None = None

    @property
    def error(self) -> str | None:
        """The machine reason of a refusal (``{"error": ...}``), if any."""
        return self.body.get("error") if isinstance(self.body, dict) else None

    @property
    def retryable(self) -> bool:
        """A refusal the same bytes may be sent again for, after ``retry_after_s``."""
        return self.status in RETRYABLE_STATUSES

    @classmethod
    def of(cls, status: int, content_type: str, raw: bytes,
           retry_after: str | None = None) -> GatewayAnswer:
        """The answer with its body parsed when it is JSON."""
        parsed = None
        if content_type.startswith("application/json"):
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = None
        return cls(status, parsed, raw, parse_retry_after(retry_after))


def records_path(study_id: str) -> str:
    """The path devices POST a study's records to."""
    return f"/studies/{quote(study_id, safe='')}/records"


def _split_url(base_url: str) -> tuple[str, str, int | None, str]:
    """(scheme, host, port, path prefix) of a gateway URL."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"gateway URL must be http(s)://HOST[:PORT], got {base_url!r}")
    return parts.scheme, parts.hostname, parts.port, parts.path.rstrip("/")


class GatewayClient:
    """Keep-alive HTTP/1.1 connection to one gateway at ``base_url`` (http://HOST:PORT)."""

    def __init__(self, base_url: str, timeout_s: float = 30.0) -> None:
        scheme, self._host, self._port, self._prefix = _split_url(base_url)
        self._cls = (http.client.HTTPSConnection if scheme == "https"
                     else http.client.HTTPConnection)
        self._timeout = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, body: bytes | None = None,
                content_type: str | None = None,
                credential: str | None = None) -> GatewayAnswer:
        """Send one request; reconnects once if the kept-alive connection was closed.
        ``credential``: a device credential's text form, sent as ``Authorization``."""
        headers = {"Content-Type": content_type} if content_type else {}
        if credential is not None:
            headers["Authorization"] = f"{AUTH_SCHEME} {credential}"
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = self._cls(self._host, self._port, timeout=self._timeout)
            try:
                self._conn.request(method, self._prefix + path, body=body, headers=headers)
                resp = self._conn.getresponse()
                raw = resp.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()
                if attempt:
                    raise
            except BaseException:
                self.close()
                raise
        if resp.will_close:
            self.close()
        return GatewayAnswer.of(resp.status, resp.getheader("Content-Type", ""), raw,
                                resp.getheader("Retry-After"))

    def post_records(self, study_id: str, body: bytes,
                     content_type: str = "application/octet-stream",
                     credential: str | None = None) -> GatewayAnswer:
        """POST records (concatenated version-1 records, or the JSON form) for a study and
        return the answer as it is: a refusal is not sent again (a device sends through
        :class:`~producer.contributor.Contributor`, which does). A study that requires
        credentials needs the sender's ``credential`` (its text form), and record ids that are
        its slots (ipdp.credentials.slot_record_ids)."""
        return self.request("POST", records_path(study_id), body, content_type, credential)

    def study(self, study_id: str, trusted: TrustedKeys | None = None,
              ) -> tuple[Study, StudyStatus] | None:
        """The study as the gateway serves it, or None if the gateway does not know it.

        With ``trusted`` study-owner keys the served envelope must verify under one of them
        (SignatureError otherwise), exactly as on the studies topic: the gateway relays the
        owner's signature, so a device need not trust the gateway for the parameters."""
        answer = self.request("GET", f"/studies/{quote(study_id, safe='')}")
        if answer.status == 404:
            return None
        if answer.status != 200:
            raise ConnectionError(f"GET /studies/{study_id}: {answer.status} {answer.error}")
        study, status = parse_study_message(answer.raw, trusted)
        if study.study_id != study_id:
            raise ConnectionError(f"GET /studies/{study_id} served study {study.study_id!r}")
        return study, status

    def wait_ready(self, timeout_s: float = 60.0, path: str = "/readyz",
                   alive: Callable[[], bool] = lambda: True) -> None:
        """Poll ``path`` until it answers 200; TimeoutError after ``timeout_s``, RuntimeError as
        soon as ``alive()`` is False (a child gateway that exited)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not alive():
                raise RuntimeError(f"the gateway at {self._host}:{self._port} is gone")
            try:
                if self.request("GET", path).status == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway at {self._host}:{self._port} did not answer "
                                   f"{path} with 200 within {timeout_s:.0f} s")
            time.sleep(0.1)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncGatewayConnection:
    """One keep-alive HTTP/1.1 connection to a gateway, on asyncio streams (one task at a time).

    Reconnects once when the kept-alive connection was closed before the answer began (the
    server's keep-alive timeout); any other failure raises OSError.
    """

    def __init__(self, base_url: str, timeout_s: float = 30.0) -> None:
        scheme, self._host, port, self._prefix = _split_url(base_url)
        self._tls = scheme == "https"
        self._port = port or (443 if self._tls else 80)
        self._timeout = timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._http: h11.Connection | None = None

    async def request(self, method: str, path: str, body: bytes = b"",
                      content_type: str | None = None,
                      credential: str | None = None) -> GatewayAnswer:
        """Send one request and read its answer. ``credential``: a device credential's text
        form, sent as ``Authorization``."""
        headers = [("Host", self._host), ("Content-Length", str(len(body)))]
        if content_type:
            headers.append(("Content-Type", content_type))
        if credential is not None:
            headers.append(("Authorization", f"{AUTH_SCHEME} {credential}"))
        for attempt in (0, 1):
            try:
                return await asyncio.wait_for(
                    self._exchange(h11.Request(method=method, target=self._prefix + path,
                                               headers=headers), body), self._timeout)
            except _StaleConnection:
                await self.close()
                if attempt:
                    raise ConnectionResetError("the gateway closed the connection") from None
            except (OSError, TimeoutError, h11.ProtocolError) as exc:
                await self.close()
                raise OSError(f"{method} {path}: {exc!r}") from exc
        raise AssertionError("unreachable")

    async def _exchange(self, request: h11.Request, body: bytes) -> GatewayAnswer:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(
                self._host, self._port, ssl=self._tls or None)
            self._http = h11.Connection(h11.CLIENT)
        http, answered = self._http, False
        self._writer.write(http.send(request) + http.send(h11.Data(data=body))
                           + http.send(h11.EndOfMessage()))
        status, content_type, retry_after, chunks = 0, "", None, []
        while True:
            event = http.next_event()
            if event is h11.NEED_DATA:
                data = await self._reader.read(65536)
                if not data and not answered:
                    raise _StaleConnection
                http.receive_data(data)
            elif isinstance(event, h11.Response):
                answered, status = True, event.status_code
                for name, value in event.headers:
                    if name == b"content-type":
                        content_type = value.decode("latin-1")
                    elif name == b"retry-after":
                        retry_after = value.decode("latin-1")
            elif isinstance(event, h11.Data):
                chunks.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                break
        if http.our_state is h11.DONE and http.their_state is h11.DONE:
            http.start_next_cycle()
        else:
            await self.close()
        return GatewayAnswer.of(status, content_type, b"".join(chunks), retry_after)

    async def post_records(self, study_id: str, body: bytes,
                           credential: str | None = None) -> GatewayAnswer:
        """POST version-1 records (one for a device) for a study, with the device's
        ``credential`` (text form) when the study requires one."""
        return await self.request("POST", records_path(study_id), body,
                                  "application/octet-stream", credential)

    async def close(self) -> None:
        writer, self._reader, self._writer, self._http = self._writer, None, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _StaleConnection(Exception):
    """The kept-alive connection was closed before the answer began: resend on a new one."""
