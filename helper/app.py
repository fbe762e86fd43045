"""The helper's ASGI application (Starlette on granian, helper.service).

| route | what |
|---|---|
| `GET /healthz` | 200 while the process serves (no credential) |
| `PUT /jobs/{job_id}` | prepare: check and open a job's records, answer the accept mask |
| `POST /jobs/{job_id}/commit` | fold the accepted records the leader assigns to rounds |
| `GET /studies/{study_id}/rounds/{round}` | a full round's count, id checksum and sum share |
| `GET /metrics` | the helper's Prometheus metrics (ipdp.metrics, role ``helper``) |

Every route but /healthz needs ``Authorization: Bearer <IPDP_HELPER_LEADER_TOKEN>`` (compared
in constant time; 401 otherwise). A job learns its study from the signed studies-topic value the
leader sends with it, verified against IPDP_TRUSTED_STUDY_KEYS: an unsigned or unverifiable one
is refused (403), so a leader cannot make the helper fold for a study its owner never signed.
For a study that requires device credentials, each record's credential (the request's
``credentials``) is checked against the helper's own pinned issuer keys,
IPDP_TRUSTED_CREDENTIAL_KEYS (helper.records, helper.store).
Nothing here logs a record, a share or a sum.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

import redis
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from helper.records import CredentialRequirement, check_records
from helper.settings import HelperSettings
from helper.store import HelperStore, JobConflict, UnknownJob
from ipdp.credentials import CredentialRefused, CredentialVerifier, token_from_text
from ipdp.errors import ConfigurationError, MalformedValue, SignatureError
from ipdp.metrics import HELPER_RECORDS, HELPER_RECORDS_FOLDED, HELPER_REQUESTS, role_registry
from ipdp.sealing import HelperKey
from ipdp.signing import TrustedKeys
from ipdp.study import StudyStatus, parse_study_message

__all__ = ["create_app", "job_digest", "service_app"]

_JOB_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
RecordIdHex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]


class PrepareRequest(BaseModel):
    """A job: the study's signed studies-topic value and, per record, its helper part
    (helper.records.helper_part), standard base64."""

    model_config = ConfigDict(extra="forbid")

    study: str = Field(description="The studies-topic value (format 2), as text.")
    records: list[str] = Field(min_length=1)
    credentials: list[str | None] | None = Field(
        None, description="Per record, in order, the device credential the leader admitted it "
        "with (its text, unpadded base64url; null for none): for a study that requires "
        "credentials, the helper checks each against its own pinned issuer keys.")

    @model_validator(mode="after")
    def one_credential_per_record(self) -> PrepareRequest:
        if self.credentials is not None and len(self.credentials) != len(self.records):
            raise ValueError(f"{len(self.credentials)} credentials for {len(self.records)} "
                             "records")
        return self


class RoundAssignment(BaseModel):
    model_config = ConfigDict(extra="forbid")

    round: int = Field(ge=0)
    ids: list[RecordIdHex] = Field(min_length=1)


class CommitRequest(BaseModel):
    """Which of the job's accepted records go into which round."""

    model_config = ConfigDict(extra="forbid")

    rounds: list[RoundAssignment] = Field(min_length=1)


#: The length prefix of a record without a credential in a job's digest (no item is this long).
_NO_CREDENTIAL = (1 << 64) - 1


def job_digest(study_value: bytes, parts: list[bytes],
               credentials: list[str | None] | None = None) -> bytes:
    """SHA-256 of a prepare request's content (length-prefixed): the same job resent has the
    same digest whatever its JSON spacing."""
    h = hashlib.sha256()
    for item in (study_value, *parts):
        h.update(len(item).to_bytes(8, "little"))
        h.update(item)
    for text in credentials or ():
        item = b"" if text is None else text.encode()
        h.update((_NO_CREDENTIAL if text is None else len(item)).to_bytes(8, "little"))
        h.update(item)
    return h.digest()


def _tokens(credentials: list[str | None] | None, k: int) -> list:
    """Per record its token, None (no credential) or the CredentialRefused of its text."""
    tokens: list = []
    for text in credentials or [None] * k:
        try:
            tokens.append(None if text is None else token_from_text(text))
        except CredentialRefused as refusal:
            tokens.append(refusal)
    return tokens


def _error(status: int, reason: str, detail: str) -> JSONResponse:
    return JSONResponse({"error": reason, "detail": detail}, status_code=status)


async def _redis_unavailable(request: Request, exc: Exception) -> JSONResponse:
    """503 while the helper's Redis cannot be reached: nothing was stored, and the leader sends
    the same request again (every request is idempotent)."""
    answer = _error(503, "redis_unavailable", f"the helper's Redis: {type(exc).__name__}")
    answer.headers["retry-after"] = "1"
    return answer


class HelperApp:
    """The routes over one store, key and set of trusted study keys."""

    def __init__(self, settings: HelperSettings, store: HelperStore, key: HelperKey,
                 trusted: TrustedKeys, token: str, credential_keys: TrustedKeys) -> None:
        self.settings = settings
        self.store = store
        self.key = key
        self.trusted = trusted
        # As the leader's: a credential valid longer than the record window is refused, so a
        # slot is never forgotten while its credential could use it again.
        self.credentials = CredentialVerifier(
            credential_keys, max_validity_ms=settings.replay_window_s * 1000,
            skew_ms=settings.max_future_skew_s * 1000)
        self.credentials_lock = threading.Lock()
        self._token = f"Bearer {token}".encode()

    def authorised(self, request: Request) -> bool:
        given = request.headers.get("authorization", "").encode()
        return hmac.compare_digest(given, self._token)

    async def body(self, request: Request) -> bytes | None:
        """The request body, or None past max_body_bytes (read no further than that)."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return None
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def healthz(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def prepare(self, request: Request) -> JSONResponse:
        body = await self.body(request)
        if body is None:
            return _error(413, "too_large", f"a job is at most {self.settings.max_body_bytes} "
                          "bytes (IPDP_HELPER_MAX_BODY_BYTES)")
        try:
            job_id = _job_id(request)
            job = PrepareRequest.model_validate_json(body)
            parts = [base64.b64decode(r, validate=True) for r in job.records]
        except (ValidationError, ValueError) as exc:
            return _error(400, "bad_request", _first_line(exc))
        study_value = job.study.encode()
        try:
            study, status = parse_study_message(study_value, self.trusted)
        except SignatureError as exc:
            return _error(403, "untrusted_study", str(exc))
        except MalformedValue as exc:
            return _error(400, "bad_request", str(exc))
        digest = job_digest(study_value, parts, job.credentials)
        required = (CredentialRequirement(self.credentials, self.credentials_lock,
                                          _tokens(job.credentials, len(parts)),
                                          study.records_per_device)
                    if study.require_credentials else None)

        def run() -> tuple[dict, bool]:
            stored = self.store.prepared_answer(job_id, digest)
            if stored is not None:
                return stored, False
            now_ms = time.time_ns() // 1_000_000
            checked = check_records(parts, d=study.d, study_hash=study.hash,
                                    open_study=status == StudyStatus.OPEN,
                                    window=self.settings.window(), now_ms=now_ms,
                                    private_key=self.key.private, credentials=required)
            return self.store.prepare(job_id, study_id=study.study_id, study_hash=study.hash,
                                      n=study.n, d=study.d, digest=digest, checked=checked)
        try:
            answer, new = await run_in_threadpool(run)
        except JobConflict as exc:
            return _error(409, exc.reason, exc.detail)
        if new:
            refused = [r["reason"] for r in answer["refused"]]
            if answer["accepted"]:
                HELPER_RECORDS.labels(study.study_id, "accepted").inc(answer["accepted"])
            for reason in set(refused):
                HELPER_RECORDS.labels(study.study_id, reason).inc(refused.count(reason))
        return JSONResponse(answer)

    async def commit(self, request: Request) -> JSONResponse:
        body = await self.body(request)
        if body is None:
            return _error(413, "too_large", "a commit is at most "
                          f"{self.settings.max_body_bytes} bytes")
        try:
            job_id = _job_id(request)
            assignment = CommitRequest.model_validate_json(body)
        except (ValidationError, ValueError) as exc:
            return _error(400, "bad_request", _first_line(exc))
        rounds = [(a.round, [bytes.fromhex(i) for i in a.ids]) for a in assignment.rounds]
        digest = hashlib.sha256(assignment.model_dump_json().encode()).digest()
        try:
            answer, new = await run_in_threadpool(self.store.commit, job_id, rounds, digest,
                                                  time.time_ns() // 1_000_000)
        except UnknownJob:
            return _error(404, "unknown_job", f"job {job_id!r} was not prepared here")
        except JobConflict as exc:
            return _error(409, exc.reason, exc.detail)
        if new:
            HELPER_RECORDS_FOLDED.labels(answer["study_id"]).inc(sum(len(ids) for _, ids in rounds))
        return JSONResponse(answer)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(role_registry("helper")),
                        media_type=CONTENT_TYPE_LATEST)

    async def round_share(self, request: Request) -> JSONResponse:
        study_id = request.path_params["study_id"]
        round_no = request.path_params["round"]
        share = await run_in_threadpool(self.store.round_share, study_id, round_no)
        if share is None:
            count = await run_in_threadpool(self.store.round_count, study_id, round_no)
            return _error(409, "round_not_full", f"round {round_no} of {study_id!r} holds "
                          f"{count} records, not n")
        return JSONResponse({
            "study_id": study_id, "round": round_no, "count": share.count, "n": share.n,
            "checksum": share.checksum.hex(),
            "sum": base64.b64encode(share.sum.astype("<u8").tobytes()).decode("ascii"),
        })


_ROUTE_TEMPLATES = [
    (re.compile(r"/jobs/[^/]+"), "/jobs/{job_id}"),
    (re.compile(r"/jobs/[^/]+/commit"), "/jobs/{job_id}/commit"),
    (re.compile(r"/studies/[^/]+/rounds/[^/]+"), "/studies/{study_id}/rounds/{round}"),
    (re.compile(r"/healthz|/metrics"), None),
]


def route_template(path: str) -> str:
    """The route a path names, as the request metric labels it (``other`` for no route)."""
    for pattern, template in _ROUTE_TEMPLATES:
        if pattern.fullmatch(path):
            return template or path
    return "other"


def _job_id(request: Request) -> str:
    job_id = request.path_params["job_id"]
    if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):
        raise ValueError(f"a job id matches {_JOB_ID.pattern}")
    return job_id


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def create_app(settings: HelperSettings, store: HelperStore, key: HelperKey,
               trusted: TrustedKeys, credential_keys: TrustedKeys) -> Starlette:
    """The helper's ASGI app; every route but /healthz answers 401 without the leader's token.
    ``credential_keys``: the device-credential issuers it pins (none: every record of a study
    that requires credentials is refused)."""
    if settings.leader_token is None or not settings.leader_token.get_secret_value():
        raise ConfigurationError("IPDP_HELPER_LEADER_TOKEN is required: the leader's "
                                 "credential for every route but /healthz")
    if not trusted:
        raise ConfigurationError("IPDP_TRUSTED_STUDY_KEYS is required: without a pinned key "
                                 "parse_study_message would not verify the study")
    helper = HelperApp(settings, store, key, trusted, settings.leader_token.get_secret_value(),
                       credential_keys)
    routes = [
        Route("/healthz", helper.healthz, methods=["GET"]),
        Route("/jobs/{job_id}", helper.prepare, methods=["PUT"]),
        Route("/jobs/{job_id}/commit", helper.commit, methods=["POST"]),
        Route("/studies/{study_id}/rounds/{round:int}", helper.round_share, methods=["GET"]),
        Route("/metrics", helper.metrics, methods=["GET"]),
    ]

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        yield
        store.r.close()  # the app owns its store's Redis connections for its lifetime

    app = Starlette(routes=routes, exception_handlers={redis.RedisError: _redis_unavailable},
                    lifespan=lifespan)

    async def require_token(scope, receive, send):
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        route = route_template(scope["path"])

        async def counted(message):
            if message["type"] == "http.response.start":
                HELPER_REQUESTS.labels(route, str(message["status"])).inc()
            await send(message)

        if route != "/healthz" and not helper.authorised(Request(scope)):
            response = JSONResponse({"error": "unauthorised", "detail": "the leader's bearer "
                                     "token is required"}, status_code=401,
                                    headers={"www-authenticate": "Bearer"})
            await response(scope, receive, counted)
            return
        await app(scope, receive, counted)

    return require_token


def service_app():
    """The app of `ipdp helper run`, from the environment (helper.service's factory). Its
    granian worker stops with a main process killed without stopping it, as the gateway's do."""
    from helper.service import load_service
    from ipdp.process import stop_with_parent

    stop_with_parent()
    return create_app(*load_service(HelperSettings()))
