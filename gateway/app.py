"""The gateway's ASGI application, served by granian (gateway.service).

``POST /studies/{study_id}/records`` is the device path: a raw ASGI handler runs the ingest
pipeline (gateway.ingest: admit → size → check → produce) and answers 202 once Kafka
acknowledged the records, or the one :class:`~gateway.refusals.Refusal` a step raised. Every
other route (the study, health, metrics, the OpenAPI document, the contributor's page) and the
lifespan, which starts and stops the :class:`~gateway.ingest.Ingest`, are Starlette's. A request
without exactly one Host header (HTTP/1.1) is refused 400 before either. Nothing here logs or
keeps a record's bytes: an error names the reason and the record's position, never its content.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from functools import cache

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.ingest import Ingest, read_body
from gateway.openapi import openapi_document
from gateway.refusals import JSON_TYPE, Refusal, count_refusal, refused
from gateway.settings import GatewaySettings
from gateway.web import web_directory, web_routes
from ipdp.metrics import (
    GATEWAY_RECORDS_ACCEPTED,
    GATEWAY_REQUEST_SECONDS,
    GATEWAY_REQUESTS,
    role_registry,
)
from ipdp.process import stop_with_parent
from ipdp.settings import KafkaSettings, TopicSettings
from ipdp.wire import RejectReason

__all__ = ["GatewayApp", "create_app", "records_study", "worker_app"]

RECORDS_ROUTE = "/studies/{study_id}/records"
_RECORDS_PREFIX, _RECORDS_SUFFIX = "/studies/", "/records"
_JSON_HEADERS = [(b"content-type", JSON_TYPE.encode())]
#: The answer to a device's request (one record), built once.
_ACCEPTED_ONE = b'{"accepted":1}'


@cache
def _requests_counter(route: str, status: int):
    """The labelled ``GATEWAY_REQUESTS`` child (looked up once, not per request)."""
    return GATEWAY_REQUESTS.labels(route, str(status))


def records_study(path: str) -> str | None:
    """The study id if ``path`` is the records route (as Starlette would match
    "/studies/{study_id}/records": no "/" in the id), else None."""
    if path.startswith(_RECORDS_PREFIX) and path.endswith(_RECORDS_SUFFIX):
        study_id = path[len(_RECORDS_PREFIX):-len(_RECORDS_SUFFIX)]
        if study_id and "/" not in study_id:
            return study_id
    return None


def host_fault(scope: dict) -> str | None:
    """Why an HTTP/1.1 request's Host header is unacceptable (RFC 9112 §3.2: exactly one, and
    an origin-form request names its host in it), or None. granian stands in an empty Host for
    a missing one and reports HTTP/1.0 as "1"."""
    if scope.get("http_version") in _HTTP_1_0:
        return None
    hosts = 0
    for name, value in scope["headers"]:
        if name == b"host":
            if not value:
                return "no Host header"
            hosts += 1
    if hosts == 1:
        return None
    return "no Host header" if not hosts else "more than one Host header"


_HTTP_1_0 = frozenset({"1.0", "1"})


class GatewayApp:
    """The gateway as one ASGI app: the records route through the ingest pipeline, everything
    else (and the lifespan) through the Starlette app ``routes``."""

    def __init__(self, ingest: Ingest, routes: Starlette) -> None:
        self.ingest, self.routes, self.state = ingest, routes, routes.state
        self.max_body_bytes = ingest.settings.max_body_bytes

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] == "http":
            fault = host_fault(scope)
            if fault is not None:
                return await self._answer(send, "other", count_refusal(
                    Refusal(RejectReason.BAD_REQUEST, fault)))
            study_id = records_study(scope["path"])
            if study_id is not None:
                return await self.records(scope, receive, send, study_id)
        await self.routes(scope, receive, send)

    async def records(self, scope: dict, receive, send, study_id: str) -> None:
        """``POST /studies/{study_id}/records``: the pipeline's steps, then one answer."""
        started = time.perf_counter()
        ingest = self.ingest
        try:
            if scope["method"] != "POST":
                raise Refusal(RejectReason.METHOD_NOT_ALLOWED, "Method Not Allowed",
                              headers={"Allow": "POST"})
            client = scope.get("client")
            admission = ingest.admit(study_id, scope["headers"],
                                     client[0] if client else "unknown")
            body = await read_body(receive, self.max_body_bytes)
            records, k = ingest.check(admission, body)
            await ingest.produce(admission, records, k)
        except Refusal as refusal:
            await self._answer(send, RECORDS_ROUTE, count_refusal(refusal))
        else:
            GATEWAY_RECORDS_ACCEPTED.inc(k)
            await send({"type": "http.response.start", "status": 202, "headers": _JSON_HEADERS})
            await send({"type": "http.response.body",
                        "body": _ACCEPTED_ONE if k == 1 else b'{"accepted":%d}' % k})
            _requests_counter(RECORDS_ROUTE, 202).inc()
        GATEWAY_REQUEST_SECONDS.observe(time.perf_counter() - started)

    @staticmethod
    async def _answer(send, route: str, refusal: Refusal) -> None:
        await send({"type": "http.response.start", "status": refusal.status,
                    "headers": refusal.asgi_headers()})
        await send({"type": "http.response.body", "body": refusal.body()})
        _requests_counter(route, refusal.status).inc()


def _counted(route: str, handler: Callable[[Ingest, Request], Awaitable[Response]]):
    """Wrap a handler: a Refusal becomes its JSON answer; every answer is counted by status."""

    async def endpoint(request: Request) -> Response:
        ingest: Ingest = request.app.state.ingest
        try:
            response = await handler(ingest, request)
        except Refusal as refusal:
            response = refused(refusal)
        _requests_counter(route, response.status_code).inc()
        return response

    return endpoint


async def get_study(ingest: Ingest, request: Request) -> Response:
    entry = ingest.study_for(request.path_params["study_id"], open_only=False)
    return Response(entry.value, media_type=JSON_TYPE)


async def healthz(ingest: Ingest, request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(ingest: Ingest, request: Request) -> Response:
    ok, why = ingest.ready()
    if not ok:
        raise Refusal(RejectReason.NOT_READY, why)
    return JSONResponse({"status": why})


async def metrics(ingest: Ingest, request: Request) -> Response:
    return Response(generate_latest(role_registry("gateway")), media_type=CONTENT_TYPE_LATEST)


async def openapi(ingest: Ingest, request: Request) -> Response:
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
    """The gateway's ASGI app; settings default to the IPDP_* environment. ``owns_process``:
    the app is the process's only job (an ``ipdp gateway`` worker), so it tunes the garbage
    collector once connected (:func:`gateway.heap.settle_heap`)."""
    ingest = Ingest(settings or GatewaySettings(), kafka or KafkaSettings(),
                    topics or TopicSettings(), owns_process=owns_process)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        await ingest.start()
        try:
            yield
        finally:
            await ingest.stop()

    routes = [
        Route("/studies/{study_id}", _counted("/studies/{study_id}", get_study),
              methods=["GET"]),
        Route("/healthz", _counted("/healthz", healthz), methods=["GET"]),
        Route("/readyz", _counted("/readyz", readyz), methods=["GET"]),
        Route("/metrics", _counted("/metrics", metrics), methods=["GET"]),
        Route("/openapi.json", _counted("/openapi.json", openapi), methods=["GET"]),
        *web_routes(web_directory(ingest.settings.web_dir)),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error})
    app.state.ingest = ingest
    return GatewayApp(ingest, app)


def worker_app() -> GatewayApp:
    """The app of an ``ipdp gateway`` worker (granian's factory): settings from the IPDP_*
    environment, and the process is the gateway's alone. granian's workers are processes of
    their own: each is told to stop (SIGTERM: its requests answered, its producer flushed) if
    the main process dies without stopping it, so a killed gateway leaves no worker serving."""
    stop_with_parent()
    return create_app(owns_process=True)
