"""How a device's records leave it: straight to Kafka, or through the ingest gateway.

:class:`~producer.contributor.Contributor` perturbs and encodes; a transport delivers, counts what
was accepted and what was refused (by reason) in a :class:`DeliveryCounter`, and raises a new
failure from ``flush``, with one vocabulary (ipdp.errors) whichever the path:

- :class:`KafkaTransport`: one ``producer.send`` per record, acknowledged asynchronously;
  ``flush`` waits for Kafka, and a record Kafka did not take raises
  :class:`~ipdp.errors.ContributionError`.
- :class:`GatewayTransport`: ``POST /studies/{id}/records`` (docs/architecture.md, "The
  gateway"), one record per request unless ``per_request`` says more (a batch uploader), over
  up to ``connections`` keep-alive connections; ``send`` returns once every record was answered,
  and a 202 means Kafka acknowledged it. A 429 or 503, or a connection lost before the answer,
  is sent again with the same bytes after its ``Retry-After`` plus jitter, up to
  ``retry.max_attempts`` tries (producer.retry: a record sent twice is a replay the aggregator
  drops). Any other refusal is final: ``unknown_study`` raises
  :class:`~ipdp.errors.UnknownStudy` and ``closed_study`` :class:`~ipdp.errors.StudyClosed`
  (what the Kafka path raises for them), the rest :class:`~ipdp.errors.RecordRefused` with the
  gateway's reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ipdp.credentials import credentials_header, token_text
from ipdp.errors import (
    BackendUnavailable,
    ContributionError,
    IpdpError,
    RecordRefused,
    StudyClosed,
    UnknownStudy,
)
from ipdp.signing import TrustedKeys, warn_once
from ipdp.study import Study, StudyStatus
from ipdp.wire import RejectReason, study_headers
from producer.gateway_client import AsyncGatewayConnection, GatewayAnswer, GatewayClient
from producer.retry import DEVICE_RETRY, RetryPolicy

if TYPE_CHECKING:
    from kafka import KafkaProducer

log = logging.getLogger(__name__)

__all__ = ["DeliveryCounter", "GatewayTransport", "KafkaTransport", "SharedPace", "Transport",
           "refusal_error", "split_ids"]

#: The reason of a request that got no answer (connection refused, reset or timed out).
UNREACHABLE = "unreachable"


def split_ids(ids: np.ndarray) -> list[bytes]:
    """(k, 16) uint8 → k bytes objects (one tobytes, then slices)."""
    raw = np.ascontiguousarray(ids, dtype=np.uint8).tobytes()
    return [raw[i : i + 16] for i in range(0, len(raw), 16)]


class DeliveryCounter:
    """Thread-safe counts of records accepted and refused, the refused by reason (a Kafka
    error's class name, or the gateway's machine reason), and the last refusal's error."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ok = 0
        self.failed = 0
        self.reasons: Counter[str] = Counter()
        self.last_error: BaseException | None = None

    def on_ok(self, _metadata=None, k: int = 1) -> None:
        with self._lock:
            self.ok += k

    def on_error(self, exc: BaseException, reason: str | None = None, k: int = 1) -> None:
        with self._lock:
            self.failed += k
            self.reasons[reason or type(exc).__name__] += k
            self.last_error = exc

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.ok, self.failed


class Transport(Protocol):
    """What a Contributor needs of the way its records leave the device."""

    delivery: DeliveryCounter

    def send(self, study: Study, ids: np.ndarray, values: list[bytes],
             credential: bytes | None) -> None: ...

    def flush(self, timeout_s: float | None = None) -> None: ...

    def close(self) -> None: ...


class KafkaTransport:
    """Records produced to the records topic, keyed by record id, with the study header (and
    the device's credential header for a study that requires credentials)."""

    def __init__(self, producer: KafkaProducer, topic: str, owns_producer: bool = False) -> None:
        self.producer = producer
        self.topic = topic
        self.delivery = DeliveryCounter()
        self._owns_producer = owns_producer
        self._reported_failures = 0

    def send(self, study: Study, ids: np.ndarray, values: list[bytes],
             credential: bytes | None) -> None:
        """Queue the records; Kafka acknowledges them later (:meth:`flush` waits)."""
        send, topic, d = self.producer.send, self.topic, self.delivery
        headers = study_headers(study.study_id)
        if credential is not None:
            headers.append(credentials_header([(credential, 1)]))
        for key, value in zip(split_ids(ids), values):
            send(topic, key=key, value=value, headers=headers).add_callback(
                d.on_ok).add_errback(d.on_error)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for every queued record; :class:`ContributionError` for any new failure."""
        self.producer.flush(timeout=timeout_s)
        failed = self.delivery.snapshot()[1]
        if failed > self._reported_failures:
            new, self._reported_failures = failed - self._reported_failures, failed
            raise ContributionError(
                f"{new} record(s) were not accepted by Kafka: {self.delivery.last_error!r}")

    def close(self) -> None:
        """Close the producer if the transport built it."""
        if self._owns_producer:
            self.producer.close()


def refusal_error(base_url: str, study_id: str, status: int | None, reason: str,
                  detail: str) -> IpdpError:
    """The exception a refused record raises: the Kafka path's own where the refusal means the
    same (unknown or closed study), :class:`RecordRefused` with the gateway's reason otherwise."""
    said = f"{status} {reason}" if status is not None else reason
    message = f"the gateway at {base_url} refused a record for study {study_id!r}: {said}" + (
        f": {detail}" if detail else "")
    if reason == RejectReason.UNKNOWN_STUDY:
        return UnknownStudy(message)
    if reason == RejectReason.CLOSED_STUDY:
        return StudyClosed(message)
    return RecordRefused(message, reason, status)


class SharedPace:
    """When the next request of a process that plays many devices may go.

    The gateway limits requests per client address, and every simulated device here has the
    same one. Each device honouring its own 429 is not enough: with C connections, C − rate of
    them would be refused again every second, and the last records would run out of tries. So
    a refusal also holds every connection until its ``Retry-After`` is over, and a 429 sets a
    request rate for the whole process: half of what was accepted in the second before, then
    one request/s more each second without a 429 (additive increase, multiplicative decrease,
    as TCP does). Requests then go at about the gateway's rate, and a refusal is rare.
    """

    def __init__(self, rate: float | None) -> None:
        #: Requests per second, or None while nothing was refused (and no rate is set).
        self.rate = rate
        self._ceiling = rate
        self._next = 0.0
        self._hold_until = 0.0
        self._last_cut = -float("inf")
        self._accepted: deque[float] = deque()

    async def turn(self) -> None:
        """Wait until this request may go."""
        while True:
            now = time.monotonic()
            due = max(self._hold_until, self._next if self.rate else 0.0)
            if due <= now:
                break
            await asyncio.sleep(due - now)
        if self.rate:
            self._next = max(now, self._next) + 1.0 / self.rate

    def accepted(self) -> None:
        now = time.monotonic()
        self._accepted.append(now)
        while self._accepted and self._accepted[0] < now - 1.0:
            self._accepted.popleft()
        if self.rate and now >= self._hold_until:
            grown = self.rate + 1.0 / self.rate
            self.rate = grown if self._ceiling is None else min(grown, self._ceiling)

    def refused(self, status: int, retry_after_s: float | None) -> None:
        now = time.monotonic()
        hold = retry_after_s if retry_after_s is not None else 1.0
        self._hold_until = max(self._hold_until, now + hold)
        # Answers to requests already in flight say the same thing: one cut per hold.
        if status == 429 and now >= self._last_cut + hold:
            self._last_cut = now
            recent = sum(1 for t in self._accepted if t >= now - 1.0)
            current = self.rate if self.rate else float(recent)
            self.rate = max(1.0, min(current, max(recent, 1)) / 2)


class GatewayTransport:
    """Records POSTed to the ingest gateway at ``base_url`` (http(s)://HOST[:PORT]).

    ``connections`` keep-alive connections (one is a device; more are requests in flight at
    once, for a process that plays many devices), ``per_request`` records per POST, ``rate``
    records per second at most (None: as fast as the gateway answers). The connections live on
    an event loop of the transport's own, in a thread, so they stay open from one ``send`` to
    the next and a caller inside another event loop is not disturbed. ``on_answer`` is called
    (from that thread) after each answer, with the transport, so a caller can show progress.

    Counters: :attr:`delivery` (records accepted and refused, by reason), :attr:`retried`
    (requests sent again after a 429, a 503 or a lost connection) and :attr:`rate_limited`
    (answers 429 ``rate_limited``: the gateway's per-address limit held this client back).
    """

    def __init__(self, base_url: str, *, connections: int = 1, per_request: int = 1,
                 rate: float | None = None, retry: RetryPolicy = DEVICE_RETRY,
                 timeout_s: float = 30.0,
                 on_answer: Callable[[GatewayTransport], None] | None = None) -> None:
        if connections < 1 or per_request < 1:
            raise ValueError("connections and per_request must be ≥ 1")
        if rate is not None and not rate > 0:
            raise ValueError(f"rate must be > 0 records/s, got {rate}")
        self.base_url = base_url
        self.connections = connections
        self.per_request = per_request
        self.retry = retry
        self.timeout_s = timeout_s
        self.on_answer = on_answer
        self.delivery = DeliveryCounter()
        self.retried = 0
        self.rate_limited = 0
        self._pace = SharedPace(None if rate is None else rate / per_request)
        self._jitter = random.Random()
        self._open: list[AsyncGatewayConnection] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._reported_failures = 0

    def study(self, study_id: str, trusted: TrustedKeys | None = None) -> Study:
        """The open study as the gateway serves it (``GET /studies/{id}``), verified against the
        pinned ``trusted`` keys exactly as on the studies topic (the gateway relays the owner's
        signature). Raises :class:`UnknownStudy`, :class:`StudyClosed`,
        :class:`~ipdp.errors.SignatureError`, or :class:`BackendUnavailable` when the gateway
        cannot be asked."""
        try:
            with GatewayClient(self.base_url, timeout_s=self.timeout_s) as client:
                found = client.study(study_id, trusted)
        except OSError as exc:
            raise BackendUnavailable(f"cannot read study {study_id!r} from the gateway at "
                                     f"{self.base_url}: {exc}") from None
        if found is None:
            raise UnknownStudy(f"the gateway at {self.base_url} has no study {study_id!r}")
        study, status = found
        if status is StudyStatus.CLOSED:
            raise StudyClosed(f"study {study_id!r} is closed and accepts no more records")
        if not trusted:
            warn_once(log, ("gateway-studies", self.base_url),
                      "no trusted study key pinned: studies from the gateway at %s are used "
                      "UNVERIFIED; whoever runs it or can write its studies topic can change "
                      "what this device does. Pin the study owner's public key: "
                      "IPDP_TRUSTED_STUDY_KEYS=PREFIX.pub (docs/security.md)", self.base_url)
        return study

    # ------------------------------------------------------------------ sending
    def send(self, study: Study, ids: np.ndarray, values: list[bytes],
             credential: bytes | None) -> None:
        """POST the records and return once each was answered (accepted or finally refused)."""
        del ids  # each record carries its id; the gateway needs no key
        step = self.per_request
        bodies = [(b"".join(values[i:i + step]), len(values[i:i + step]))
                  for i in range(0, len(values), step)]
        text = None if credential is None else token_text(credential)
        self._run(self._post_all(study.study_id, bodies, text))

    def flush(self, timeout_s: float | None = None) -> None:
        """Raise the last new refusal since the previous flush (every record is answered when
        :meth:`send` returns, so nothing is waited for); a note says how many records it
        stands for."""
        del timeout_s
        failed = self.delivery.snapshot()[1]
        if failed > self._reported_failures:
            new, self._reported_failures = failed - self._reported_failures, failed
            error = self.delivery.last_error
            if new > 1:
                error.add_note(f"{new} records were refused since the last flush; all refused "
                               f"so far, by reason: {dict(self.delivery.reasons)}")
            raise error

    def close(self) -> None:
        """Close the connections and stop the transport's event loop."""
        if self._loop is None:
            return
        with contextlib.suppress(Exception):
            self._run(self._close_connections())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
        self._loop = self._thread = None

    def _run(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` on the transport's loop and wait; an interrupt cancels what is in flight."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                            name=f"ipdp-gateway {self.base_url}")
            self._thread.start()
        future = asyncio.run_coroutine_threadsafe(work, self._loop)
        try:
            future.result()
        except BaseException:
            future.cancel()
            raise

    async def _close_connections(self) -> None:
        open_, self._open = self._open, []
        for conn in open_:
            await conn.close()

    async def _post_all(self, study_id: str, bodies: list[tuple[bytes, int]],
                        credential: str | None) -> None:
        while len(self._open) < min(self.connections, len(bodies)):
            self._open.append(AsyncGatewayConnection(self.base_url, self.timeout_s))
        pending = iter(bodies)

        async def worker(conn: AsyncGatewayConnection) -> None:
            for body, k in pending:
                await self._post(conn, study_id, body, k, credential)

        await asyncio.gather(*(worker(conn) for conn in self._open[:len(bodies)]))

    async def _post(self, conn: AsyncGatewayConnection, study_id: str, body: bytes, k: int,
                    credential: str | None) -> None:
        """POST one body of k records until it is accepted or finally refused; count it."""
        retry, pace = self.retry, self._pace
        for attempt in range(1, retry.max_attempts + 1):
            await pace.turn()
            try:
                answer = await conn.post_records(study_id, body, credential)
            except OSError as exc:
                status, reason, detail, retry_after = None, UNREACHABLE, str(exc), None
            else:
                if answer.status == 202:
                    accepted = answer.body.get("accepted") if isinstance(answer.body, dict) \
                        else None
                    if accepted == k:
                        pace.accepted()
                        self.delivery.on_ok(k=k)
                        self._answered()
                        return
                    # Never sent by a gateway that works as documented (a request is accepted
                    # whole or refused whole); counted as refused, as the browser SDK does.
                    status, reason, retry_after = 202, "partial_accept", None
                    detail = f"the gateway accepted {accepted!r} of {k} records"
                    break
                status, reason, detail = answer.status, *_reason_and_detail(answer)
                retry_after = answer.retry_after_s
                if reason == RejectReason.RATE_LIMITED:
                    self.rate_limited += 1
                if not answer.retryable:
                    break
                # Hold the other connections no longer than this one waits (retry.max_wait_s).
                pace.refused(answer.status, None if retry_after is None
                             else min(retry_after, retry.max_wait_s))
            if attempt == retry.max_attempts:
                break
            self.retried += 1
            self._answered()
            await asyncio.sleep(retry.wait_s(attempt, retry_after, self._jitter))
        self.delivery.on_error(refusal_error(self.base_url, study_id, status, reason, detail),
                               reason, k)
        self._answered()

    def _answered(self) -> None:
        if self.on_answer is not None:
            self.on_answer(self)


def _reason_and_detail(answer: GatewayAnswer) -> tuple[str, str]:
    """A refusal's machine reason (``http_<status>`` when its body names none) and detail."""
    body = answer.body if isinstance(answer.body, dict) else {}
    detail = body.get("detail")
    return answer.error or f"http_{answer.status}", detail if isinstance(detail, str) else ""
