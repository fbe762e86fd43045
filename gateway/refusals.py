"""A refused request: its reason, its status and the JSON answer every refusal gets.

Every refusal is ``{"error": reason, "detail": text}`` with the status ``gateway.checks.HTTP_STATUS``
gives its reason (``ipdp.wire.RejectReason``); the records it carried are counted as rejected.
"""

from __future__ import annotations

import json
from functools import cache, lru_cache

from starlette.responses import Response

from gateway.batcher import ContainerRefused
from gateway.checks import HTTP_STATUS
from ipdp.credentials import AUTH_SCHEME, CredentialRefused
from ipdp.metrics import GATEWAY_RECORDS_REJECTED, GATEWAY_REFUSALS
from ipdp.wire import RejectReason

__all__ = ["JSON_TYPE", "Refusal", "count_refusal", "credential_refusal", "kafka_refusal",
           "refused"]

JSON_TYPE = "application/json"


class Refusal(Exception):
    """A request the gateway answers with a 4xx or 503: ``{"error": reason, "detail": ...}``,
    with the status ``HTTP_STATUS`` gives the reason."""

    def __init__(self, reason: RejectReason, detail: str, records: int = 0,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(reason, detail)
        self.status, self.reason, self.detail = HTTP_STATUS[reason], reason, detail
        self.records, self.headers = records, headers

    def body(self) -> bytes:
        """The JSON answer's body."""
        render = _refusal_body if len(self.detail) <= _KEPT_DETAIL else _refusal_body.__wrapped__
        return render(self.reason.value, self.detail)

    def asgi_headers(self) -> list[tuple[bytes, bytes]]:
        """The answer's headers as an ASGI ``http.response.start`` message carries them."""
        if not self.headers:
            return _JSON_HEADERS
        return [*_JSON_HEADERS, *((name.lower().encode("latin-1"), value.encode("latin-1"))
                                  for name, value in self.headers.items())]

    def response(self) -> Response:
        """The answer as a Starlette response (the routes other than the records route)."""
        return Response(self.body(), status_code=self.status, headers=self.headers,
                        media_type=JSON_TYPE)


_JSON_HEADERS = [(b"content-type", JSON_TYPE.encode())]


#: Refusal bodies are kept for details up to this length (a detail can quote a client's path).
_KEPT_DETAIL = 256


@lru_cache(maxsize=1024)
def _refusal_body(reason: str, detail: str) -> bytes:
    """A refusal's JSON body, as JSONResponse renders it. Kept: a client that sends bad records
    tends to send the same ones again, and a refusal should cost the gateway about what an
    acceptance does."""
    return json.dumps({"error": reason, "detail": detail}, ensure_ascii=False, allow_nan=False,
                      separators=(",", ":")).encode("utf-8")


def count_refusal(refusal: Refusal) -> Refusal:
    """Count ``refusal`` by reason, and its records as rejected (a 503 rejects none)."""
    _refusals_counter(refusal.reason).inc()
    if refusal.records and refusal.status != 503:
        GATEWAY_RECORDS_REJECTED.labels(refusal.reason).inc(refusal.records)
    return refusal


def refused(refusal: Refusal) -> Response:
    """A Refusal's JSON answer as a Starlette response, counted (:func:`count_refusal`)."""
    return count_refusal(refusal).response()


@cache
def _refusals_counter(reason: str):
    """The labelled ``GATEWAY_REFUSALS`` child (looked up once, not per request)."""
    return GATEWAY_REFUSALS.labels(reason)


def kafka_refusal(exc: ContainerRefused, records: int) -> Refusal:
    """The answer to records Kafka did not acknowledge: 503, retry in a second."""
    return Refusal(RejectReason.KAFKA_UNAVAILABLE, f"Kafka did not acknowledge the records: {exc}",
                   records=records, headers={"Retry-After": "1"})


def credential_refusal(refusal: CredentialRefused, records: int = 0) -> Refusal:
    """The answer to a refused credential; a 401 names the scheme the gateway expects."""
    unauthorized = HTTP_STATUS[refusal.reason] == 401
    return Refusal(refusal.reason, refusal.detail, records,
                   headers={"WWW-Authenticate": AUTH_SCHEME} if unauthorized else None)
