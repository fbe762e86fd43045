"""The gateway's ingest pipeline: what a records request goes through, one step per method.

    admit → size → check → produce → answer

:meth:`Ingest.admit` decides from the request's head alone (the client's request limit, the
study open, the device credential, the media type and the declared length), so a refused client
never sends its body (``Expect: 100-continue`` is answered only once the body is read);
:func:`read_body` reads at most ``max_body_bytes``; :meth:`Ingest.check` turns the body into
wire records and runs the record limit and the per-record checks (gateway.checks);
:meth:`Ingest.produce` hands them to the group commit (gateway.batcher) and returns once Kafka
acknowledged the container(s) holding them. Every step refuses with the one
:class:`~gateway.refusals.Refusal`. gateway.app answers; this module holds the state the steps
use: the studies followed, what each client may still send, the credentials and the producer.

A record's bytes are never logged or kept here: an error names the reason and the record's
position, never its content.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from gateway.batcher import ContainerRefused, GroupCommit
from gateway.checks import HTTP_STATUS, study_record_size, why_refused
from gateway.client_address import FORWARDED_FOR, trusted_proxies
from gateway.credentials import DeviceCredentials
from gateway.heap import settle_heap
from gateway.json_records import encode_json
from gateway.limits import Bucket, ClientLimits
from gateway.producer_process import ProducerProcess
from gateway.producer_supervisor import ProducerSupervisor
from gateway.refusals import JSON_TYPE, Refusal, credential_refusal, kafka_refusal
from gateway.settings import GatewaySettings
from ipdp.credentials import Credential, CredentialRefused
from ipdp.metrics import (
    GATEWAY_RECORDS_REJECTED,
    GATEWAY_REFUSALS,
    start_at_zero,
    start_studies_reader_at_zero,
)
from ipdp.settings import KafkaSettings, RecordWindowSettings, TopicSettings, TrustSettings
from ipdp.studies_topic import StudiesFollower
from ipdp.study import Study, StudyStatus
from ipdp.wire import RejectReason

__all__ = ["OCTET_STREAM", "Admission", "Ingest", "read_body"]

OCTET_STREAM = "application/octet-stream"


class Admission(NamedTuple):
    """A request admitted on its head: its study, media type, device credential (token and
    credential, for a study that requires one) and its client's bucket (its records are taken
    from it once counted)."""

    study: Study
    media: str
    credential: tuple[bytes, Credential] | None
    bucket: Bucket


class Ingest:
    """The state behind the pipeline's steps: settings, the studies follower, the client limits,
    the credentials and the Kafka producer with its group commit."""

    def __init__(self, settings: GatewaySettings, kafka: KafkaSettings,
                 topics: TopicSettings, *, owns_process: bool = False) -> None:
        self.settings, self.kafka, self.topics = settings, kafka, topics
        #: True in an ``ipdp gateway`` worker: the process is the gateway's alone, so it may
        #: tune the garbage collector for it (:func:`gateway.heap.settle_heap`).
        self.owns_process = owns_process
        # The gateway refuses, like a device, a study whose signature does not verify under the
        # pinned owner keys (IPDP_TRUSTED_STUDY_KEYS); GET /studies/{id} serves only verified ones.
        # Each one-server study's norm bounds are computed as the follower reads it (the first
        # imports scipy.stats, about a second), so no request waits for them; a two-server
        # study's records have no norm the gateway can read.
        start_at_zero(GATEWAY_REFUSALS, *((reason.value,) for reason in HTTP_STATUS))
        start_at_zero(GATEWAY_RECORDS_REJECTED, *((reason.value,) for reason, status
                                                  in HTTP_STATUS.items() if status != 503))
        start_studies_reader_at_zero("gateway")
        self.studies = StudiesFollower(
            kafka, topics, trusted=TrustSettings().study_keys(),
            prepare=_prepare_checks)
        #: The aggregator's record window (IPDP_AGGREGATOR_REPLAY_WINDOW_S, …_MAX_FUTURE_SKEW_S).
        self.window = RecordWindowSettings().window()
        self.credentials = DeviceCredentials(TrustSettings().credential_keys())
        #: The reverse proxies whose X-Forwarded-For names the client (IPDP_GATEWAY_TRUSTED_PROXIES).
        self.proxies = trusted_proxies(settings.trusted_proxies or "")
        #: What each client address may still send (IPDP_GATEWAY_RATE_LIMIT_*, …RECORD_LIMIT_*,
        #: …RELAY_*).
        self.limits = ClientLimits.of(settings)
        self.supervisor = ProducerSupervisor(settings, kafka, topics.records,
                                             on_connected=self._producer_connected,
                                             on_exit=self._kafka_failed)
        self._heap_settled = False
        self.batcher = GroupCommit(topics.records, lambda: self.supervisor.producer,
                                   linger_s=settings.linger_ms / 1000,
                                   max_message_bytes=settings.max_message_bytes,
                                   kafka_timeout_s=settings.kafka_timeout_s,
                                   in_flight=settings.containers_in_flight,
                                   on_failure=self._kafka_failed)
        self._last_kafka_failure = -float("inf")

    def _kafka_failed(self) -> None:
        self._last_kafka_failure = time.monotonic()

    def _producer_connected(self) -> None:
        if self.owns_process and not self._heap_settled:
            settle_heap()
            self._heap_settled = True

    @property
    def producer(self) -> ProducerProcess | None:
        """The connected Kafka producer process, None while there is none."""
        return self.supervisor.producer

    async def start(self) -> None:
        """Follow the studies topic and connect the producer in the background."""
        self.studies.start()
        self.supervisor.start()

    async def stop(self) -> None:
        """Flush what is in flight, close the producer, stop following."""
        self.batcher.flush_all()
        await self.supervisor.stop()
        await asyncio.to_thread(self.studies.stop)

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
        """The studies topic's entry of ``study_id``; Refusal if it is unknown (or, with
        ``open_only``, closed) or the topic has not been read yet."""
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

    # The pipeline's steps.

    def admit(self, study_id: str, headers, peer: str) -> Admission:
        """Step 1, on the head alone: the client's request limit, the study open, the device
        credential of a study that requires one, the media type and the declared length."""
        content_type, declared, authorization, forwarded_for = b"", None, None, None
        for name, value in headers:
            if name == b"content-type":
                content_type = value
            elif name == b"content-length":
                declared = value
            elif name == b"authorization":
                authorization = value
            elif name == FORWARDED_FOR:
                forwarded_for = value
        bucket = self.limits.take_request(self.proxies.client(peer, forwarded_for))
        study = self.study_for(study_id, open_only=True).study
        credential = self._verify_credential(authorization, study)
        media = content_type.decode("latin-1").split(";")[0].strip().lower()
        if media not in (OCTET_STREAM, JSON_TYPE):
            raise Refusal(RejectReason.UNSUPPORTED_MEDIA_TYPE,
                          f"Content-Type must be {OCTET_STREAM} or {JSON_TYPE}, got {media!r}")
        if media == JSON_TYPE and study.two_server is not None:
            # The JSON form carries q̃ and p̃ in clear: the leader would read the record.
            raise Refusal(RejectReason.UNSUPPORTED_MEDIA_TYPE,
                          f"study {study_id!r} is a two-server study: its records are version-3 "
                          f"records (the leader's share and the helper's sealed share) sent as "
                          f"{OCTET_STREAM}; the JSON form holds q̃ and p̃ in clear")
        limit = self.settings.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(f"body of {declared.decode()} bytes exceeds {limit}")
        return Admission(study, media, credential, bucket)

    def check(self, admission: Admission, body: bytes) -> tuple[bytes, int]:
        """Step 3: the body's records, wire-encoded, and their count, once the client's record
        limit allowed them and every per-record check passed."""
        study = admission.study
        if admission.media == JSON_TYPE:
            body = encode_json(body, study)
        k = len(body) // study_record_size(study)
        admission.bucket.take_records(k)
        why = why_refused(body, study, self.window, time.time_ns() // 1_000_000)
        if why is not None:
            raise Refusal(*why, records=k)
        return body, k

    async def produce(self, admission: Admission, records: bytes, k: int) -> None:
        """Step 4: k checked records (back to back) to Kafka through the group commit; returns
        once the container(s) holding them are acknowledged. With a credential, the records' ids
        must be its slots, and it travels with them."""
        token = None
        if admission.credential is not None:
            try:
                self.credentials.check_slots(records, admission.study, admission.credential[1])
            except CredentialRefused as refusal:
                raise credential_refusal(refusal, k) from None
            token = admission.credential[0]
        study = admission.study
        try:
            waiters = self.batcher.enqueue(study.study_id, study_record_size(study), records,
                                           token)
        except ContainerRefused as exc:
            raise kafka_refusal(exc, k) from None
        if len(waiters) > 1:
            await asyncio.wait(waiters)
        for waiter in waiters:
            try:
                await waiter
            except ContainerRefused as exc:
                raise kafka_refusal(exc, k) from None

    def _verify_credential(self, authorization: bytes | None, study: Study
                           ) -> tuple[bytes, Credential] | None:
        if not study.require_credentials:
            return None
        try:
            return self.credentials.verify(authorization, study)
        except CredentialRefused as refusal:
            raise credential_refusal(refusal) from None


def _prepare_checks(study: Study) -> object:
    """What the checks of a study's records need, computed when the follower reads the study:
    a one-server study's norm bounds (a cached property of the study)."""
    return study.norm_bounds if study.two_server is None else None


def _too_large(detail: str) -> Refusal:
    return Refusal(RejectReason.TOO_LARGE, detail)


async def read_body(receive: Callable[[], Awaitable[dict]], limit: int) -> bytes:
    """Step 2: the request's body, at most ``limit`` bytes (Refusal 413 as soon as it is
    longer, the rest unread). A body that ends before its end (a malformed chunk, or the
    client gone: the server says ``http.disconnect`` for both) is refused 400; a client that
    went away does not read the answer."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Refusal(RejectReason.BAD_REQUEST, "the body ended before its end (a malformed "
                          "chunk, or the connection closed)")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(f"body exceeds {limit} bytes")
        if not message.get("more_body"):
            if not chunks:
                return chunk
            chunks.append(chunk)
            return b"".join(chunks)
        chunks.append(chunk)
