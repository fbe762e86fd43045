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
from gateway.http_connection import DeviceRequest
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

__all__ = ["GatewayApp", "create_app"]

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
    """``POST /studies/{study_id}/records``: the one handler of a device's request, whatever
    its shape (chunked or not, with ``Expect: 100-continue`` or not); the server
    (gateway.server) calls it once the body is in, and it calls ``respond`` with the answer
    once Kafka settled the records, without a coroutine."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def answer(self, request: DeviceRequest, respond: Callable[[Response], None]) -> None:
        gw, started = self.gw, time.perf_counter()

        def finish(response: Response) -> None:
            _requests_counter(_RECORDS_ROUTE, response.status_code).inc()
            GATEWAY_REQUEST_SECONDS.observe(time.perf_counter() - started)
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
    """A request admitted before its records are checked: its study, media type, declared length,
    device credential and its client's bucket (its records are taken from it once counted)."""

    study: Study
    media: str
    declared: bytes | None
    credential: tuple[bytes, Credential] | None
    bucket: Bucket


def admit(gw: Gateway, request: DeviceRequest) -> Admitted:
    """The client's request limit, the study open, the headers and the device credential;
    Refusal otherwise."""
    content_type, declared, authorization, forwarded_for = b"", None, None, None
    for name, value in request.headers:
        if name == b"content-type":
            content_type = value
        elif name == b"content-length":
            declared = value
        elif name == b"authorization":
            authorization = value
        elif name == FORWARDED_FOR:
            forwarded_for = value
    bucket = gw.limits.admit(gw.proxies.client(request.client or "unknown", forwarded_for))
    study = gw.study_for(request.study_id, open_only=True).study
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
               ) -> GatewayApp:
    """The gateway for its server (gateway.server); settings default to the IPDP_*
    environment. ``owns_process``: the app is the process's only job (an ``ipdp gateway``
    worker), so it tunes the garbage collector once connected
    (:func:`gateway.heap.settle_heap`)."""
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
    and the lifespan that starts and stops the :class:`~gateway.ingest.Gateway`)."""

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
