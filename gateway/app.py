"""The gateway's HTTP application (Starlette): routes, admission, checks and the Kafka hand-off.

A POST goes through admission (the client's rate, the study open), the per-record checks of
``gateway.checks`` (one vectorised pass over several records, scalar checks for one), then the
group commit (``gateway.batcher``), which packs the records of concurrent requests unchanged
into version-2 containers of at most ``max_message_bytes`` and produces them with acks=all; the
handler answers 202 once the container(s) holding its records are acknowledged, so the event
loop never blocks on the broker. Nothing here logs or keeps a record's bytes: an error names the
reason and the record's position, never its content.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from functools import cache, lru_cache
from typing import NamedTuple

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.batcher import ContainerRefused, GroupCommit
from gateway.checks import HTTP_STATUS, first_rejection
from gateway.credentials import DeviceCredentials
from gateway.http_connection import DeviceRequest
from gateway.openapi import openapi_document
from gateway.producer_process import ProducerExited, ProducerProcess
from gateway.settings import GatewaySettings
from gateway.web import web_directory, web_routes
from ipdp.credentials import AUTH_SCHEME, Credential, CredentialRefused
from ipdp.metrics import GATEWAY_RECORDS_ACCEPTED, GATEWAY_RECORDS_REJECTED, GATEWAY_REQUESTS
from ipdp.settings import KafkaSettings, RecordWindowSettings, TopicSettings, TrustSettings
from ipdp.studies_topic import StudiesFollower
from ipdp.study import Study, StudyStatus
from ipdp.wire import RejectReason, encode_batch, record_size

log = logging.getLogger(__name__)

__all__ = ["GatewayApp", "Refusal", "create_app"]

OCTET_STREAM = "application/octet-stream"
JSON_TYPE = "application/json"
_I64 = (-(2**63), 2**63 - 1)


class Refusal(Exception):
    """A request the gateway answers with a 4xx or 503: ``{"error": reason, "detail": ...}``,
    with the status ``HTTP_STATUS`` gives the reason."""

    def __init__(self, reason: RejectReason, detail: str, records: int = 0,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(reason, detail)
        self.status, self.reason, self.detail = HTTP_STATUS[reason], reason, detail
        self.records, self.headers = records, headers

    def response(self) -> Response:
        render = _refusal_body if len(self.detail) <= _KEPT_DETAIL else _refusal_body.__wrapped__
        return Response(render(self.reason.value, self.detail), status_code=self.status,
                        headers=self.headers, media_type=JSON_TYPE)


#: Refusal bodies are kept for details up to this length (a detail can quote a client's path).
_KEPT_DETAIL = 256


@lru_cache(maxsize=1024)
def _refusal_body(reason: str, detail: str) -> bytes:
    """A refusal's JSON body, as JSONResponse renders it. Kept: a client that sends bad records
    tends to send the same ones again, and a refusal should cost the gateway about what an
    acceptance does."""
    return json.dumps({"error": reason, "detail": detail}, ensure_ascii=False, allow_nan=False,
                      separators=(",", ":")).encode("utf-8")


class JsonRecord(BaseModel):
    """One record in the JSON form of a POST (the gateway wire-encodes it). Strict types: a
    number in a string, or a boolean, is refused (a JSON integer is a number for q and p)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    record_id: str = Field(pattern=r"^[0-9a-fA-F]{32}$")
    created_ms: int = Field(ge=_I64[0], le=_I64[1])
    q: list[float] = Field(min_length=1)
    p: list[float] = Field(min_length=1)


class JsonRecords(BaseModel):
    """The JSON body of a POST: ``{"records": [...]}``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    records: list[JsonRecord] = Field(min_length=1)


class RateLimiter:
    """A token bucket per client address: ``rate`` requests/s, bursts of ``burst``.

    Remembers at most ``max_clients`` addresses (least recently seen dropped first), so a flood
    of addresses costs bounded memory; a dropped client starts again with a full bucket.
    """

    def __init__(self, rate: float, burst: int, max_clients: int = 100_000) -> None:
        self.rate, self.burst, self.max_clients = rate, float(burst), max_clients
        # client -> [tokens, last refill], updated in place (no tuple per request).
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()

    def allow(self, client: str, now: float | None = None) -> bool:
        """Take one token for ``client``; False if its bucket is empty."""
        now = time.monotonic() if now is None else now
        bucket = self._buckets.get(client)
        if bucket is None:
            bucket = self._buckets[client] = [self.burst, now]
            if len(self._buckets) > self.max_clients:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(client)
        tokens = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
        allowed = tokens >= 1.0
        bucket[0], bucket[1] = (tokens - 1.0 if allowed else tokens), now
        return allowed

    def retry_after_s(self) -> int:
        """Seconds until one token is back, rounded up (the Retry-After header)."""
        return max(1, int(np.ceil(1.0 / self.rate)))


def encode_json(body: bytes, study: Study) -> bytes:
    """Wire-encode the records of a JSON body, back to back; raises Refusal (400) if one is
    unusable."""
    try:
        parsed = JsonRecords.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise Refusal(RejectReason.UNDECODABLE, f"{where}: {first['msg']}") from None
    recs = parsed.records
    k = len(recs)
    for i, r in enumerate(recs):
        if len(r.q) != study.d or len(r.p) != study.d:
            raise Refusal(RejectReason.WRONG_DIMENSION, f"record {i} has len(q)={len(r.q)}, "
                          f"len(p)={len(r.p)}, study {study.study_id!r} has d={study.d}",
                          records=k)
    q = np.array([r.q for r in recs], dtype=np.float64)
    p = np.array([r.p for r in recs], dtype=np.float64)
    bad = np.flatnonzero(~(np.isfinite(q).all(axis=1) & np.isfinite(p).all(axis=1)))
    if bad.size:
        raise Refusal(RejectReason.NON_FINITE, f"record {int(bad[0])}: q̃ or p̃ holds NaN or Inf",
                      records=k)
    ids = np.frombuffer(b"".join(bytes.fromhex(r.record_id) for r in recs),
                        dtype=np.uint8).reshape(k, 16)
    ms = np.array([r.created_ms for r in recs], dtype=np.int64)
    return b"".join(encode_batch(study.hash, ids, ms, q, p))


#: How long a new producer process may take to connect before it is killed and started again.
_PRODUCER_START_S = 60.0

#: Allocations between two collections of the youngest generation (CPython's default: 700).
GC_YOUNG_THRESHOLD = 10_000


def settle_heap() -> None:
    """Keep the garbage collector off the request path once the worker is up.

    Every request leaves a few reference cycles (its task, futures, protocol callbacks), so
    CPython collects often, and each full collection walks every object the worker holds: some
    85,000 after its imports (numpy, scipy, pydantic, kafka-python), with the event loop
    stopped: that was most of the gateway's p99 latency under load (docs/architecture.md).
    Everything alive once the producer is connected lives as long as the worker, so it is moved
    out of the collector's sight (:func:`gc.freeze`), and the youngest generation is collected
    less often; cycles are still collected, so memory stays bounded.
    """
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, oldest)


class Gateway:
    """The state behind the routes: settings, the studies follower and the Kafka producer."""

    def __init__(self, settings: GatewaySettings, kafka: KafkaSettings,
                 topics: TopicSettings, *, owns_process: bool = False) -> None:
        self.settings, self.kafka, self.topics = settings, kafka, topics
        #: True in an ``ipdp gateway`` worker: the process is the gateway's alone, so it may
        #: tune the garbage collector for it (:func:`settle_heap`).
        self.owns_process = owns_process
        # The gateway refuses, like a device, a study whose signature does not verify under the
        # pinned owner keys (IPDP_TRUSTED_STUDY_KEYS); GET /studies/{id} serves only verified ones.
        # Each study's norm bounds are computed as the follower reads it (the first imports
        # scipy.stats, about a second), so no request waits for them.
        self.studies = StudiesFollower(
            kafka, topics, trusted=TrustSettings().study_keys(),
            prepare=lambda study: study.norm_bounds)
        #: The aggregator's record window (IPDP_AGGREGATOR_REPLAY_WINDOW_S, …_MAX_FUTURE_SKEW_S).
        self.window = RecordWindowSettings().window()
        self.credentials = DeviceCredentials(TrustSettings().credential_keys())
        self.producer = None
        self.limiter = (RateLimiter(settings.rate_limit_per_s, settings.rate_limit_burst)
                        if settings.rate_limit_per_s > 0 else None)
        self.batcher = GroupCommit(topics.records, lambda: self.producer,
                                   linger_s=settings.linger_ms / 1000,
                                   max_message_bytes=settings.max_message_bytes,
                                   kafka_timeout_s=settings.kafka_timeout_s,
                                   in_flight=settings.containers_in_flight,
                                   on_failure=self._kafka_failed)
        self._connector: asyncio.Task | None = None
        self._last_kafka_failure = -float("inf")

    def _kafka_failed(self) -> None:
        self._last_kafka_failure = time.monotonic()

    async def start(self) -> None:
        """Follow the studies topic and connect the producer in the background."""
        self.studies.start()
        self._connector = asyncio.create_task(self._connect())

    async def stop(self) -> None:
        """Flush what is in flight, close the producer, stop following."""
        if self._connector is not None:
            self._connector.cancel()
        self.batcher.flush_all()
        if self.producer is not None:
            await self.producer.close(10)
        await asyncio.to_thread(self.studies.stop)

    async def _connect(self) -> None:
        """Start the Kafka producer process (gateway.producer_process), and another whenever
        it exits, backing off while it cannot connect."""
        timeout_ms = int(self.settings.kafka_timeout_s * 1000)
        options = {
            "delivery_timeout_ms": timeout_ms,
            "request_timeout_ms": max(1000, timeout_ms - 100),
            "max_block_ms": min(timeout_ms, 2000),
            # The group commit decides when a container goes: send each one at once.
            "linger_ms": 0,
            # kafka-python's own metrics (sensors updated on every produce request and
            # response) are read by nothing here: ipdp's are Prometheus'. Off, its I/O thread
            # spends less CPU per container.
            "metrics_enabled": False,
            "max_request_size": max(self.settings.max_message_bytes + 1024, 1 << 20),
        }
        delay, settled = 0.5, False
        while True:
            try:
                producer = await ProducerProcess.start(self.kafka, self.topics.records, options,
                                                       timeout_s=_PRODUCER_START_S)
            except (TimeoutError, ProducerExited, OSError) as exc:
                log.warning("gateway: no Kafka producer for %s yet: %s", self.kafka.bootstrap,
                            exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10)
                continue
            self.producer, delay = producer, 0.5
            log.info("gateway: Kafka producer connected to %s", self.kafka.bootstrap)
            if self.owns_process and not settled:
                settle_heap()
                settled = True
            code = await asyncio.shield(producer.exited)  # stop() cancels this task, not it
            self.producer = None
            self._kafka_failed()
            log.warning("gateway: the Kafka producer process exited with code %s; starting "
                        "another", code)

    def ready(self) -> tuple[bool, str]:
        """Ready: producer bootstrapped, no Kafka failure in the last ``kafka_timeout_s``, and
        the studies topic read once."""
        if self.producer is None:
            return False, "Kafka producer not connected"
        since = time.monotonic() - self._last_kafka_failure
        if since < self.settings.kafka_timeout_s:
            return False, f"Kafka refused or timed out {since:.1f}s ago"
        if not self.studies.ready.is_set():
            return False, "studies topic not read yet"
        return True, "ready"

    def study_for(self, study_id: str, *, open_only: bool):
        if not self.studies.ready.is_set():
            raise Refusal(RejectReason.STUDIES_UNAVAILABLE, "the studies topic has not been read yet",
                          headers={"Retry-After": "1"})
        entry = self.studies.get(study_id)
        if entry is None:
            raise Refusal(RejectReason.UNKNOWN_STUDY, f"no study {study_id!r} on the studies topic")
        if open_only and entry.status is not StudyStatus.OPEN:
            raise Refusal(RejectReason.CLOSED_STUDY, f"study {study_id!r} is {entry.status.value} "
                          "and accepts no more records")
        return entry

    def check_size(self, declared: bytes | None, whole: bool) -> None:
        """Refusal (413) when the Content-Length header (``declared``) exceeds
        ``max_body_bytes``, or the body did (``whole`` False: the server stopped reading it)."""
        limit = self.settings.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise Refusal(RejectReason.TOO_LARGE,
                          f"body of {declared.decode()} bytes exceeds {limit}")
        if not whole:
            raise Refusal(RejectReason.TOO_LARGE, f"body exceeds {limit} bytes")

    def admit_credential(self, authorization: bytes | None, study: Study
                         ) -> tuple[bytes, Credential] | None:
        """The device credential of a request (its Authorization header) to a study that
        requires one (None for other studies); Refusal (401/403) when it does not admit it."""
        if not study.require_credentials:
            return None
        try:
            return self.credentials.admit(authorization, study)
        except CredentialRefused as refusal:
            raise _credential_refusal(refusal) from None

    def enqueue(self, records: bytes, k: int, study: Study,
                credential: tuple[bytes, Credential] | None = None) -> list[asyncio.Future]:
        """Hand k checked records (back to back) to the group commit: the futures that settle
        when Kafka acknowledged (or refused) the container(s) holding them. With a
        ``credential``, the records' ids must be its slots (Refusal 403 otherwise), and it
        travels with them."""
        token = None
        if credential is not None:
            try:
                self.credentials.check_slots(records, study, credential[1])
            except CredentialRefused as refusal:
                raise _credential_refusal(refusal, k) from None
            token = credential[0]
        try:
            return self.batcher.enqueue(study.study_id, study.d, records, token)
        except ContainerRefused as exc:
            raise _kafka_refusal(exc, k) from None

    async def commit(self, records: bytes, k: int, study: Study,
                     credential: tuple[bytes, Credential] | None = None) -> None:
        """:meth:`enqueue`, then wait until Kafka acknowledged every record; Refusal(503) if it
        did not."""
        for waiter in self.enqueue(records, k, study, credential):
            try:
                await waiter
            except ContainerRefused as exc:
                raise _kafka_refusal(exc, k) from None


def _kafka_refusal(exc: ContainerRefused, records: int) -> Refusal:
    return Refusal(RejectReason.KAFKA_UNAVAILABLE, f"Kafka did not acknowledge the records: {exc}",
                   records=records, headers={"Retry-After": "1"})


def _credential_refusal(refusal: CredentialRefused, records: int = 0) -> Refusal:
    """The answer to a refused credential; a 401 names the scheme the gateway expects."""
    unauthorized = HTTP_STATUS[refusal.reason] == 401
    return Refusal(refusal.reason, refusal.detail, records,
                   headers={"WWW-Authenticate": AUTH_SCHEME} if unauthorized else None)


def _refused(refusal: Refusal) -> Response:
    """A Refusal's JSON answer; its records counted as rejected (a 503 rejects none)."""
    if refusal.records and refusal.status != 503:
        GATEWAY_RECORDS_REJECTED.labels(refusal.reason).inc(refusal.records)
    return refusal.response()


@cache
def _requests_counter(route: str, status: int):
    """The labelled ``GATEWAY_REQUESTS`` child (looked up once, not per request)."""
    return GATEWAY_REQUESTS.labels(route, str(status))


def _counted(route: str, handler: Callable[[Gateway, Request], Awaitable[Response]]):
    """Wrap a handler: a Refusal becomes its JSON answer; every answer is counted by status."""

    async def endpoint(request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        try:
            response = await handler(gw, request)
        except Refusal as refusal:
            response = _refused(refusal)
        _requests_counter(route, response.status_code).inc()
        return response

    return endpoint


#: The answer to a device's request (one record), built once.
_ACCEPTED_ONE = Response(b'{"accepted":1}', status_code=202, media_type=JSON_TYPE)
_RECORDS_ROUTE = "/studies/{study_id}/records"


class RecordsEndpoint:
    """``POST /studies/{study_id}/records``: the one handler of a device's request, whatever
    its shape (chunked or not, with ``Expect: 100-continue`` or not); the server
    (gateway.server) calls it once the body is in, and it calls ``respond`` with the answer
    once Kafka settled the records, without a coroutine."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def answer(self, request: DeviceRequest, respond: Callable[[Response], None]) -> None:
        gw = self.gw

        def finish(response: Response) -> None:
            _requests_counter(_RECORDS_ROUTE, response.status_code).inc()
            respond(response)

        try:
            if request.method != b"POST":
                raise Refusal(RejectReason.METHOD_NOT_ALLOWED, "Method Not Allowed",
                              headers={"Allow": "POST"})
            admitted = admit(gw, request)
            gw.check_size(admitted.declared, request.whole)
            records, k = checked(gw, admitted, request.body)
            waiters = gw.enqueue(records, k, admitted.study, admitted.credential)
        except Refusal as refusal:
            finish(_refused(refusal))
            return
        pending = len(waiters)

        def settled(_future: asyncio.Future) -> None:
            nonlocal pending
            pending -= 1
            if pending:
                return
            failed = next((w.exception() for w in waiters if w.exception() is not None), None)
            if failed is None:
                finish(_accepted(k))
            else:
                finish(_refused(_kafka_refusal(failed, k)))

        for waiter in waiters:
            waiter.add_done_callback(settled)


class Admitted(NamedTuple):
    """A request admitted before its records are checked: its study, media type, declared
    length and device credential."""

    study: Study
    media: str
    declared: bytes | None
    credential: tuple[bytes, Credential] | None


def admit(gw: Gateway, request: DeviceRequest) -> Admitted:
    """The client's rate, the study open, the headers and the device credential; Refusal
    otherwise."""
    if gw.limiter is not None and not gw.limiter.allow(request.client or "unknown"):
        raise Refusal(RejectReason.RATE_LIMITED, f"more than {gw.settings.rate_limit_per_s:g} "
                      "requests per second from this client",
                      headers={"Retry-After": str(gw.limiter.retry_after_s())})
    study = gw.study_for(request.study_id, open_only=True).study
    content_type, declared, authorization = b"", None, None
    for name, value in request.headers:
        if name == b"content-type":
            content_type = value
        elif name == b"content-length":
            declared = value
        elif name == b"authorization":
            authorization = value
    credential = gw.admit_credential(authorization, study)
    media = content_type.decode("latin-1").split(";")[0].strip().lower()
    if media not in (OCTET_STREAM, JSON_TYPE):
        raise Refusal(RejectReason.UNSUPPORTED_MEDIA_TYPE,
                      f"Content-Type must be {OCTET_STREAM} or {JSON_TYPE}, got {media!r}")
    return Admitted(study, media, declared, credential)


def checked(gw: Gateway, admitted: Admitted, body: bytes) -> tuple[bytes, int]:
    """The body's records, wire-encoded, and their count, once every per-record check passed;
    Refusal with the first failure's reason otherwise."""
    study = admitted.study
    if admitted.media == JSON_TYPE:
        body = encode_json(body, study)
    k = len(body) // record_size(study.d)
    rejection = first_rejection(body, study, gw.window, time.time_ns() // 1_000_000)
    if rejection is not None:
        raise Refusal(*rejection, records=k)
    return body, k


def _accepted(k: int) -> Response:
    GATEWAY_RECORDS_ACCEPTED.inc(k)
    return _ACCEPTED_ONE if k == 1 else Response(b'{"accepted":%d}' % k, status_code=202,
                                                  media_type=JSON_TYPE)


async def get_study(gw: Gateway, request: Request) -> Response:
    entry = gw.study_for(request.path_params["study_id"], open_only=False)
    return Response(entry.value, media_type=JSON_TYPE)


async def healthz(gw: Gateway, request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(gw: Gateway, request: Request) -> Response:
    ok, why = gw.ready()
    if not ok:
        raise Refusal(RejectReason.NOT_READY, why)
    return JSONResponse({"status": why})


async def metrics(gw: Gateway, request: Request) -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


async def openapi(gw: Gateway, request: Request) -> Response:
    return JSONResponse(openapi_document())


_REASONS = {404: RejectReason.NOT_FOUND, 405: RejectReason.METHOD_NOT_ALLOWED}


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    reason = _REASONS.get(exc.status_code, RejectReason.BAD_REQUEST)
    _requests_counter("other", exc.status_code).inc()
    return JSONResponse({"error": reason, "detail": str(exc.detail)},
                        status_code=exc.status_code, headers=exc.headers)


def create_app(settings: GatewaySettings | None = None, kafka: KafkaSettings | None = None,
               topics: TopicSettings | None = None, *, owns_process: bool = False
               ) -> GatewayApp:
    """The gateway for its server (gateway.server); settings default to the IPDP_*
    environment. ``owns_process``: the app is the process's only job (an ``ipdp gateway``
    worker), so it tunes the garbage collector once connected (:func:`settle_heap`)."""
    gw = Gateway(settings or GatewaySettings(), kafka or KafkaSettings(),
                 topics or TopicSettings(), owns_process=owns_process)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    routes = [
        Route("/studies/{study_id}", _counted("/studies/{study_id}", get_study),
              methods=["GET"]),
        Route("/healthz", _counted("/healthz", healthz), methods=["GET"]),
        Route("/readyz", _counted("/readyz", readyz), methods=["GET"]),
        Route("/metrics", _counted("/metrics", metrics), methods=["GET"]),
        Route("/openapi.json", _counted("/openapi.json", openapi), methods=["GET"]),
        *web_routes(web_directory(gw.settings.web_dir)),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error})
    app.state.gateway = gw
    return GatewayApp(app, RecordsEndpoint(gw))


class GatewayApp:
    """The gateway's two doors, as its server sees them: the records route, whose every request
    goes to :meth:`RecordsEndpoint.answer`, and the Starlette app (``asgi``: every other route,
    and the lifespan that starts and stops the :class:`Gateway`)."""

    def __init__(self, asgi: Starlette, records: RecordsEndpoint) -> None:
        self.asgi, self.state, self.answer = asgi, asgi.state, records.answer

    @staticmethod
    def device_study(path: str) -> str | None:
        """The study id if ``path`` is the records route (as Starlette would match
        "/studies/{study_id}/records": no "/" in the id), else None."""
        if path.startswith("/studies/") and path.endswith("/records"):
            study_id = path[len("/studies/"):-len("/records")]
            if study_id and "/" not in study_id:
                return study_id
        return None
