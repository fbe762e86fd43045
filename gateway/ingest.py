"""The gateway's state and the steps of a records request it holds: the studies it follows,
what each client may still send, the device credentials, and the hand-off to Kafka.

The request path itself (admission, the body, the checks, the answer) is gateway.app's; it
calls these steps. A record's bytes are never logged or kept here: an error names the reason and
the record's position, never its content.
"""

from __future__ import annotations

import asyncio
import time

from gateway.batcher import ContainerRefused, GroupCommit
from gateway.checks import HTTP_STATUS
from gateway.client_address import trusted_proxies
from gateway.credentials import DeviceCredentials
from gateway.heap import settle_heap
from gateway.limits import ClientLimits
from gateway.producer_process import ProducerProcess
from gateway.producer_supervisor import ProducerSupervisor
from gateway.refusals import Refusal, credential_refusal, kafka_refusal
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

__all__ = ["Gateway"]


class Gateway:
    """The state behind the routes: settings, the studies follower and the Kafka producer."""

    def __init__(self, settings: GatewaySettings, kafka: KafkaSettings,
                 topics: TopicSettings, *, owns_process: bool = False) -> None:
        self.settings, self.kafka, self.topics = settings, kafka, topics
        #: True in an ``ipdp gateway`` worker: the process is the gateway's alone, so it may
        #: tune the garbage collector for it (:func:`gateway.heap.settle_heap`).
        self.owns_process = owns_process
        # The gateway refuses, like a device, a study whose signature does not verify under the
        # pinned owner keys (IPDP_TRUSTED_STUDY_KEYS); GET /studies/{id} serves only verified ones.
        # Each study's norm bounds are computed as the follower reads it (the first imports
        # scipy.stats, about a second), so no request waits for them.
        start_at_zero(GATEWAY_REFUSALS, *((reason.value,) for reason in HTTP_STATUS))
        start_at_zero(GATEWAY_RECORDS_REJECTED, *((reason.value,) for reason, status
                                                  in HTTP_STATUS.items() if status != 503))
        start_studies_reader_at_zero("gateway")
        self.studies = StudiesFollower(
            kafka, topics, trusted=TrustSettings().study_keys(),
            prepare=lambda study: study.norm_bounds)
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
            raise credential_refusal(refusal) from None

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
                raise credential_refusal(refusal, k) from None
            token = credential[0]
        try:
            return self.batcher.enqueue(study.study_id, study.d, records, token)
        except ContainerRefused as exc:
            raise kafka_refusal(exc, k) from None
