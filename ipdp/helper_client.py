"""The leader's client of a two-server study's helper (helper/; docs/architecture.md, "The
helper"): the aggregator prepares a job and commits it to rounds, the trainer fetches a full
round's sum share.

Every call carries the leader's bearer token. Prepare and commit are idempotent by job id on the
helper, so a call that fails on the connection (the helper restarting, a reset) or is answered
503 (the helper's Redis unreachable) or, from a TLS edge in front of the helper, 502 or 504 (the
helper restarting or slow) is sent again with the same job id and body until it is answered or
``retry_s`` has passed: the helper answers the stored result of a job it already
prepared or committed, and folds each record once.

A job id must name one batch for good (for instance the aggregator's partition, epoch, first
and last offset), so that a leader that crashed and polled the batch again sends the same job.
The client forwards each record's helper part only (ipdp.helper_protocol.helper_part): the
helper never receives the leader's share.

An ``https://`` helper's certificate is verified, host name included, against ``ca_file`` (the
leader's IPDP_HELPER_CA_FILE: the helper's own CA, docs/operations.md, "The helper's
deployment") or else the system's trust store. A certificate that does not verify is a
configuration error and is not sent again.
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import time
from dataclasses import dataclass
from typing import Self
from urllib.parse import quote, urlsplit

import numpy as np

from ipdp.credentials import token_text
from ipdp.errors import IpdpError
from ipdp.helper_protocol import helper_part

__all__ = ["HelperClient", "HelperRefused", "Prepared", "RoundShare"]

_RETRIED = (ConnectionError, http.client.HTTPException, TimeoutError, OSError)
#: 503: the helper's Redis is unreachable; 502, 504: an edge's answers while the helper restarts
#: or is slow.
_RETRIED_STATUS = frozenset({502, 503, 504})


class HelperRefused(IpdpError):
    """The helper answered a request with an error: ``status`` and its ``reason`` word."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(f"the helper refused ({status} {reason}): {detail}")
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Prepared:
    """The helper's answer to a job: which records it accepted, and why it refused the rest."""

    mask: np.ndarray
    """One bool per record of the job, in its order."""
    refused: dict[int, str]
    """Record index → the helper's reason."""


@dataclass(frozen=True)
class RoundShare:
    """The helper's part of a full round: its count, id checksum and sum of shares."""

    count: int
    checksum: bytes
    sum: np.ndarray


def _answer(response: http.client.HTTPResponse, data: bytes) -> dict:
    """The helper's JSON answer; an edge's own error page (nginx's 403, 413, 502) is not JSON
    and becomes an answer naming its status, never its body."""
    if not data:
        return {}
    try:
        answer = json.loads(data)
    except ValueError:
        answer = None
    if isinstance(answer, dict):
        return answer
    return {"error": f"http_{response.status}",
            "detail": f"an answer that is not the helper's JSON "
                      f"({response.getheader('content-type', 'no content type')}), from the "
                      f"helper's edge or another server at its address"}


class HelperClient:
    """One keep-alive HTTP/1.1 connection to the helper (not thread-safe: one per thread)."""

    def __init__(self, base_url: str, token: str, *, timeout_s: float = 30.0,
                 retry_s: float = 60.0, ca_file: str | None = None) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"the helper's URL is http(s)://host[:port], not {base_url!r}")
        # Built once, so that an unreadable CA file fails here, before any request.
        self._tls = ssl.create_default_context(cafile=ca_file) if url.scheme == "https" \
            else None
        self._host, self._port = url.hostname, url.port
        self._base = url.path.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self._tls is None:
                self._conn = http.client.HTTPConnection(self._host, self._port,
                                                        timeout=self.timeout_s)
            else:
                self._conn = http.client.HTTPSConnection(self._host, self._port,
                                                         timeout=self.timeout_s,
                                                         context=self._tls)
        return self._conn

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        """(status, JSON answer) of one request, sent again on a connection error or a 502, 503
        or 504 until ``retry_s`` has passed (every request here is idempotent)."""
        payload = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        headers = {"authorization": f"Bearer {self._token}", "accept": "application/json"}
        if payload is not None:
            headers["content-type"] = "application/json"
        deadline = time.monotonic() + self.retry_s
        pause = 0.05
        while True:
            try:
                conn = self._connection()
                conn.request(method, self._base + path, body=payload, headers=headers)
                response = conn.getresponse()
                data = response.read()
                answer = _answer(response, data)
                if response.status not in _RETRIED_STATUS or \
                        time.monotonic() + pause > deadline:
                    return response.status, answer
            except ssl.SSLCertVerificationError:
                self.close()
                raise
            except _RETRIED:
                self.close()
                if time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(1.0, pause * 2)

    def _expect_ok(self, status: int, answer: dict) -> dict:
        if status != 200:
            raise HelperRefused(status, str(answer.get("error", "")), str(answer.get("detail", "")))
        return answer

    def prepare(self, job_id: str, study_value: bytes, records: list[bytes], d: int,
                credentials: list[bytes | None] | None = None) -> Prepared:
        """Send a job: the study's signed studies-topic value and its version-3 records (their
        helper parts go out), with, for a study that requires them, the credential each record
        was admitted with (``credentials``, in the records' order; None for a record without
        one). The same job again gets the same answer."""
        body = {"study": study_value.decode("utf-8"),
                "records": [base64.b64encode(helper_part(r, d)).decode("ascii")
                            for r in records]}
        if credentials is not None:
            body["credentials"] = [None if t is None else token_text(t) for t in credentials]
        answer = self._expect_ok(*self.request("PUT", f"/jobs/{quote(job_id, safe='')}", body))
        mask = np.frombuffer(answer["mask"].encode("ascii"), np.uint8) == ord("1")
        return Prepared(mask=mask, refused={int(r["index"]): r["reason"]
                                            for r in answer["refused"]})

    def commit(self, job_id: str, rounds: dict[int, list[bytes]]) -> dict:
        """Fold the job's records ``rounds`` names (round → 16-byte record ids, all accepted
        by both servers) on the helper, once."""
        body = {"rounds": [{"round": r, "ids": [i.hex() for i in ids]}
                           for r, ids in sorted(rounds.items())]}
        return self._expect_ok(*self.request("POST", f"/jobs/{quote(job_id, safe='')}/commit",
                                             body))

    def round_share(self, study_id: str, round_no: int) -> RoundShare | None:
        """The helper's part of a round that holds n records; None while it holds fewer."""
        status, answer = self.request("GET", f"/studies/{quote(study_id, safe='')}/rounds/"
                                      f"{round_no}")
        if status == 409 and answer.get("error") == "round_not_full":
            return None
        answer = self._expect_ok(status, answer)
        return RoundShare(count=int(answer["count"]), checksum=bytes.fromhex(answer["checksum"]),
                          sum=np.frombuffer(base64.b64decode(answer["sum"]), "<u8")
                          .astype(np.uint64))
