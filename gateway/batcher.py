"""Group commit: the checked records of concurrent requests share Kafka messages.

Each study has one open container, a buffer of checked records. A request appends its records
and waits; the container is produced (acks=all) once it has lingered ``linger_s`` since its
first record, or as soon as the next record would take it past ``max_message_bytes``. When
Kafka acknowledges it, every request with records in it is answered; when Kafka refuses it or
does not answer within ``kafka_timeout_s``, each of them gets a 503. A request whose records
span several containers is answered once all of them are settled, so a 202 always means every
record of the request is on the topic, and a record of a refused container is never
acknowledged.

One container per study, not per topic: the container's Kafka key (its first record id) and
its ``study`` header are per message, and the header is what lets the aggregator tell
``study_mismatch`` from ``unknown_study`` (docs/wire-format.md). Records of one study share one
version and d, hence one size, which a container needs anyway.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.producer_process import ProducerRefused
from ipdp.credentials import credential_run_size, credentials_header
from ipdp.metrics import GATEWAY_CONTAINER_RECORDS, GATEWAY_KAFKA_SECONDS
from ipdp.wire import (
    CONTAINER_HEADER_SIZE,
    RECORD_ID_BYTES,
    container_of,
    study_headers,
)

log = logging.getLogger(__name__)

__all__ = ["ContainerRefused", "GroupCommit"]

class ContainerRefused(Exception):
    """Kafka did not acknowledge a container holding some of the request's records."""


@dataclass(eq=False)
class _Container:
    """The open (or in-flight) container of one study and the requests waiting on it."""

    study_id: str
    records: bytearray = field(default_factory=bytearray)
    count: int = 0
    credentials: list[tuple[bytes, int]] = field(default_factory=list)
    """(device credential, its records' count) per request, in order, when the study requires
    credentials; the container's ``credentials`` header (ipdp.credentials)."""
    header_bytes: int = 0
    """Bytes of the ``credentials`` header so far (counted in the message size)."""
    waiters: list[asyncio.Future] = field(default_factory=list)
    linger: asyncio.TimerHandle | None = None
    deadline: asyncio.TimerHandle | None = None
    sent_at: float = 0.0
    held: bool = False
    """Its linger ended while ``in_flight`` containers of the study were unsettled: it goes
    when one of them settles, or when it is full."""
    flying: bool = False
    """Produced and not yet settled."""


class GroupCommit:
    """Coalesces checked records into containers and settles each waiting request on ack.

    ``producer`` returns the connected producer (gateway.producer_process), or None before it is
    (then every request is refused at once); ``on_failure`` is told about each refused
    container (the gateway's readiness).
    """

    def __init__(self, topic: str, producer: Callable[[], object | None], *,
                 linger_s: float, max_message_bytes: int, kafka_timeout_s: float,
                 in_flight: int = 0, on_failure: Callable[[], None] = lambda: None) -> None:
        self.topic, self._producer = topic, producer
        self.linger_s, self.max_message_bytes = linger_s, max_message_bytes
        self.kafka_timeout_s, self._on_failure = kafka_timeout_s, on_failure
        self.in_flight = in_flight
        self._open: dict[str, _Container] = {}
        self._flying: dict[str, int] = {}

    def enqueue(self, study_id: str, size: int, records: bytes,
                credential: bytes | None = None) -> list[asyncio.Future]:
        """Append ``records`` (checked records of one study, ``size`` bytes each, back to back:
        gateway.checks.study_record_size) to the study's open container(s): one future per
        container holding some of them, settled when Kafka acknowledged it, or failed with
        :class:`ContainerRefused`. ``credential``: the device credential the records were
        admitted with, carried next to them. Raises ContainerRefused at once before the producer
        is connected."""
        if self._producer() is None:
            raise ContainerRefused("not connected to Kafka yet")
        loop = asyncio.get_running_loop()
        # A credential travels in the container's header, once per request (a run): it counts
        # against the message size with the records, or a full container of one-record devices
        # would pass the limit Kafka and the aggregator hold it to.
        run = 0 if credential is None else credential_run_size(credential)
        view = memoryview(records)
        waits = []
        while view:
            box = self._open.get(study_id)
            if box is None:
                box = self._open[study_id] = _Container(study_id)
                box.linger = loop.call_later(self.linger_s, self._lingered, box)
            room = (self.max_message_bytes - CONTAINER_HEADER_SIZE - len(box.records)
                    - box.header_bytes - run) // size
            if room < 1 and box.count:
                self._flush(box)
                continue
            take = min(max(room, 1), len(view) // size)
            box.records += view[:take * size]
            box.count += take
            if credential is not None:
                box.credentials.append((credential, take))
                box.header_bytes += run
            view = view[take * size:]
            waiter = loop.create_future()
            box.waiters.append(waiter)
            waits.append(waiter)
            if room - take < 1:
                self._flush(box)
        return waits

    def flush_all(self) -> None:
        """Produce every open container now (at shutdown, before the producer closes)."""
        for box in list(self._open.values()):
            self._flush(box)

    def _lingered(self, box: _Container) -> None:
        """The container's linger is over: produce it, or hold it while ``in_flight``
        containers of its study are unsettled."""
        if self.in_flight and self._flying.get(box.study_id, 0) >= self.in_flight:
            box.held = True
            return
        self._flush(box)

    def _flush(self, box: _Container) -> None:
        """Produce the container (once) and arrange for its waiters to be settled."""
        if self._open.get(box.study_id) is not box:
            return
        del self._open[box.study_id]
        box.linger.cancel()
        loop = asyncio.get_running_loop()
        producer = self._producer()
        box.sent_at = time.perf_counter()
        headers = study_headers(box.study_id)
        if box.credentials:
            headers.append(credentials_header(box.credentials))
        try:
            sent = producer.send(bytes(box.records[RECORD_ID_BYTES]),
                                 container_of(box.records, box.count), headers)
        except Exception as exc:  # noqa: BLE001 - any failure to hand over is a refusal
            self._settle(box, exc)
            return
        # kafka-python's delivery timeout refuses the container; this deadline covers one
        # that is never settled at all.
        box.flying = True
        self._flying[box.study_id] = self._flying.get(box.study_id, 0) + 1
        box.deadline = loop.call_later(self.kafka_timeout_s + 1, self._settle, box,
                                       TimeoutError("no acknowledgement"))
        sent.add_done_callback(lambda done: self._settle(box, done.exception()))

    def _settle(self, box: _Container, exc: BaseException | None) -> None:
        """Answer every request waiting on ``box``: acknowledged, or refused with ``exc``."""
        if box.deadline is not None:
            box.deadline.cancel()
        if box.flying:
            box.flying = False
            left = self._flying.pop(box.study_id) - 1
            if left:
                self._flying[box.study_id] = left
            held = self._open.get(box.study_id)
            if held is not None and held.held:
                self._flush(held)
        waiters, box.waiters = box.waiters, []
        if not waiters:
            return  # settled already (the deadline and a late callback)
        if exc is None:
            GATEWAY_KAFKA_SECONDS.observe(time.perf_counter() - box.sent_at)
            GATEWAY_CONTAINER_RECORDS.observe(box.count)
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
            return
        self._on_failure()
        log.warning("gateway: Kafka did not acknowledge a container of %d record(s): %r",
                    box.count, exc)
        refused = ContainerRefused(str(exc) if isinstance(exc, ProducerRefused)
                                   else type(exc).__name__)
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(refused)
                # A request that went away (client disconnect) never retrieves it.
                waiter.exception()
