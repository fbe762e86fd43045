"""The gateway's HTTP application (Starlette): the routes and the path of a records POST.

A POST goes through admission (the client's limits: gateway.limits; the study open; its
credential), the per-record checks of ``gateway.checks``, then the group commit
(``gateway.batcher``), which packs the records of concurrent requests unchanged into version-2
containers of at most ``max_message_bytes`` and produces them with acks=all; the handler answers
202 once the container(s) holding its records are acknowledged, so the event loop never blocks
on the broker. The state those steps use is :class:`gateway.ingest.Gateway`'s. Nothing here logs
or keeps a record's bytes: an error names the reason and the record's position, never its
content.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from functools import cache
from typing import NamedTuple

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.checks import first_rejection
from gateway.client_address import FORWARDED_FOR
from gateway.ingest import Gateway
from gateway.json_records import encode_json
from gateway.limits import Bucket
from gateway.openapi import openapi_document
from gateway.refusals import JSON_TYPE, Refusal, kafka_refusal, refused
from gateway.settings import GatewaySettings
from gateway.web import web_directory, web_routes
from ipdp.credentials import Credential
from ipdp.metrics import (
    GATEWAY_RECORDS_ACCEPTED,
    GATEWAY_REQUEST_SECONDS,
    GATEWAY_REQUESTS,
    role_registry,
)
from ipdp.settings import KafkaSettings, TopicSettings
from ipdp.study import Study
from ipdp.wire import RejectReason, record_size

__all__ = ["create_app", "create_app_from_env"]

OCTET_STREAM = "application/octet-stream"


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
            response = refused(refusal)
        _requests_counter(route, response.status_code).inc()
        return response

    return endpoint


#: The answer to a device's request (one record), built once.
_ACCEPTED_ONE = Response(b'{"accepted":1}', status_code=202, media_type=JSON_TYPE)
_RECORDS_ROUTE = "/studies/{study_id}/records"


class RecordsEndpoint:
    """``POST /studies/{study_id}/records`` as a plain ASGI app: the path a device takes on
    every request, so it reads the scope's headers and ``receive`` directly rather than through
    a Starlette Request (whose client address, headers and body stream each cost a few
    microseconds a request)."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def __call__(self, scope, receive, send) -> None:
        started = time.perf_counter()
        try:
            admitted = admit(self.gw, scope)
            body = await self.gw.read_body(admitted.declared, receive)
            records, k = checked(self.gw, admitted, body)
            await self.gw.commit(records, k, admitted.study, admitted.credential)
            response = _accepted(k)
        except Refusal as refusal:
            response = refused(refusal)
        _requests_counter(_RECORDS_ROUTE, response.status_code).inc()
        GATEWAY_REQUEST_SECONDS.observe(time.perf_counter() - started)
        await response(scope, receive, send)

    def answer(self, scope, body: bytes, respond: Callable[[Response], None]) -> None:
        """The same request, its body already read, without a coroutine: ``respond`` is called
        with the answer once Kafka settled the records (the HTTP protocol's device lane,
        gateway.protocol; the answer, the metrics and the refusals are the ASGI path's)."""
        gw, started = self.gw, time.perf_counter()

        def finish(response: Response) -> None:
            _requests_counter(_RECORDS_ROUTE, response.status_code).inc()
            GATEWAY_REQUEST_SECONDS.observe(time.perf_counter() - started)
            respond(response)

        try:
            admitted = admit(gw, scope)
            gw.read_declared(admitted.declared, len(body))
            records, k = checked(gw, admitted, body)
            waiters = gw.enqueue(records, k, admitted.study, admitted.credential)
        except Refusal as refusal:
            finish(refused(refusal))
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
                finish(refused(kafka_refusal(failed, k)))

        for waiter in waiters:
            waiter.add_done_callback(settled)


class Admitted(NamedTuple):
    """A request admitted before its body is read: its study, media type, declared length,
    device credential and its client's bucket (its records are taken from it once counted)."""

    study: Study
    media: str
    declared: bytes | None
    credential: tuple[bytes, Credential] | None
    bucket: Bucket


def admit(gw: Gateway, scope) -> Admitted:
    """The client's request limit, the study open, the headers and the device credential;
    Refusal otherwise."""
    study_id = scope["path_params"]["study_id"]
    content_type, declared, authorization, forwarded_for = b"", None, None, None
    for name, value in scope["headers"]:
        if name == b"content-type":
            content_type = value
        elif name == b"content-length":
            declared = value
        elif name == b"authorization":
            authorization = value
        elif name == FORWARDED_FOR:
            forwarded_for = value
    peer = scope.get("client")
    bucket = gw.limits.admit(gw.proxies.client(peer[0] if peer else "unknown", forwarded_for))
    study = gw.study_for(study_id, open_only=True).study
    credential = gw.admit_credential(authorization, study)
    media = content_type.decode("latin-1").split(";")[0].strip().lower()
    if media not in (OCTET_STREAM, JSON_TYPE):
        raise Refusal(RejectReason.UNSUPPORTED_MEDIA_TYPE,
                      f"Content-Type must be {OCTET_STREAM} or {JSON_TYPE}, got {media!r}")
    return Admitted(study, media, declared, credential, bucket)


def checked(gw: Gateway, admitted: Admitted, body: bytes) -> tuple[bytes, int]:
    """The body's records, wire-encoded, and their count, once the client's record limit
    allowed them and every per-record check passed; Refusal otherwise."""
    study = admitted.study
    if admitted.media == JSON_TYPE:
        body = encode_json(body, study)
    k = len(body) // record_size(study.d)
    admitted.bucket.take_records(k)
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
    return Response(generate_latest(role_registry("gateway")), media_type=CONTENT_TYPE_LATEST)


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
               ) -> DevicePath:
    """The gateway as an ASGI app; settings default to the IPDP_* environment.
    ``owns_process``: the app is the process's only job (an ``ipdp gateway`` worker), so it
    tunes the garbage collector once connected (:func:`gateway.heap.settle_heap`)."""
    gw = Gateway(settings or GatewaySettings(), kafka or KafkaSettings(),
                 topics or TopicSettings(), owns_process=owns_process)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    records = RecordsEndpoint(gw)
    routes = [
        Route(_RECORDS_ROUTE, records, methods=["POST"]),
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
    return DevicePath(app, records)


class DevicePath:
    """The gateway's ASGI app: a device's POST goes straight to its handler, the rest to
    Starlette.

    A POST waits for its container's acknowledgement, and resuming a request suspended under
    Starlette's middleware and router costs a dozen coroutine frames; devices make nearly every
    request, so theirs skips that stack (the handler, its Refusal answers and its metrics are the
    same :class:`RecordsEndpoint` the router serves; every other route and method goes through
    Starlette, which also runs the lifespan). Under ``ipdp gateway`` most device POSTs do not
    reach it either: the HTTP protocol takes them through :meth:`device_lane`.
    """

    def __init__(self, app: Starlette, records: RecordsEndpoint) -> None:
        self.app, self.state, self._records = app, app.state, records

    def device_lane(self, scope) -> Callable[[dict, bytes, Callable[[Response], None]],
                                             None] | None:
        """For a device's POST, :meth:`RecordsEndpoint.answer`, which answers it without a
        coroutine (the HTTP protocol calls it once the body is in: gateway.protocol); None for
        every other request."""
        return self._records.answer if _device_post(scope) else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and _device_post(scope):
            await self._records(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _device_post(scope) -> bool:
    """Whether an HTTP request is a POST to the records route; if so, its ``path_params``."""
    if scope["method"] != "POST":
        return False
    match = _RECORDS_PATH.fullmatch(scope["path"])
    if match is None:
        return False
    scope["path_params"] = {"study_id": match[1]}
    return True


#: The records route, as Starlette matches "/studies/{study_id}/records" (no "/" in the id).
_RECORDS_PATH = re.compile(r"/studies/([^/]+)/records")


def create_app_from_env() -> DevicePath:
    """uvicorn's factory (``gateway.app:create_app_from_env``): every worker builds its own."""
    return create_app(owns_process=True)

