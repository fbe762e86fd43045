"""A device's HTTP client for the ingest gateway: stdlib ``http.client`` with keep-alive.

One :class:`GatewayClient` holds one persistent connection (not thread-safe: one per thread).
The standard library is enough for what a device does here (POST bytes, GET a small JSON
document, reconnect when the server closed the connection) and is the cheapest client per
request in CPython; see docs/architecture.md, "The gateway".
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self
from urllib.parse import quote, urlsplit

from ipdp.credentials import AUTH_SCHEME
from ipdp.signing import TrustedKeys
from ipdp.study import Study, StudyStatus, parse_study_message

__all__ = ["GatewayAnswer", "GatewayClient"]


@dataclass(frozen=True)
class GatewayAnswer:
    """One HTTP answer: status, parsed JSON body (or None) and the raw body."""

    status: int
    body: dict | None
    raw: bytes

    @property
    def error(self) -> str | None:
        """The machine reason of a refusal (``{"error": ...}``), if any."""
        return self.body.get("error") if isinstance(self.body, dict) else None


class GatewayClient:
    """Keep-alive HTTP/1.1 connection to one gateway at ``base_url`` (http://HOST:PORT)."""

    def __init__(self, base_url: str, timeout_s: float = 30.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"gateway URL must be http(s)://HOST[:PORT], got {base_url!r}")
        self._cls = (http.client.HTTPSConnection if parts.scheme == "https"
                     else http.client.HTTPConnection)
        self._host, self._port = parts.hostname, parts.port
        self._prefix = parts.path.rstrip("/")
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
        parsed = None
        if resp.getheader("Content-Type", "").startswith("application/json"):
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = None
        return GatewayAnswer(resp.status, parsed, raw)

    def post_records(self, study_id: str, body: bytes,
                     content_type: str = "application/octet-stream",
                     credential: str | None = None) -> GatewayAnswer:
        """POST records (concatenated version-1 records, or the JSON form) for a study; a study
        that requires credentials needs the device's ``credential`` (its text form), and record
        ids that are its slots (ipdp.credentials.slot_record_ids)."""
        return self.request("POST", f"/studies/{quote(study_id, safe='')}/records", body,
                            content_type, credential)

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
