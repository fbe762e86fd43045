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
d, which a container needs anyway.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ipdp.credentials import credential_run_size, credentials_header
from ipdp.metrics import GATEWAY_CONTAINER_RECORDS, GATEWAY_KAFKA_SECONDS
from ipdp.wire import (
    CONTAINER_HEADER_SIZE,
    RECORD_ID_BYTES,
    container_of,
    record_size,
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


class GroupCommit:
    """Coalesces checked records into containers and settles each waiting request on ack.

    ``producer`` returns the connected kafka-python producer, or None before it is connected
    (then every request is refused at once); ``on_failure`` is told about each refused
    container (the gateway's readiness).
    """

    def __init__(self, topic: str, producer: Callable[[], object | None], *,
                 linger_s: float, max_message_bytes: int, kafka_timeout_s: float,
                 on_failure: Callable[[], None] = lambda: None) -> None:
        self.topic, self._producer = topic, producer
        self.linger_s, self.max_message_bytes = linger_s, max_message_bytes
        self.kafka_timeout_s, self._on_failure = kafka_timeout_s, on_failure
        self._open: dict[str, _Container] = {}

    async def commit(self, study_id: str, d: int, records: bytes,
                     credential: bytes | None = None) -> None:
        """Append ``records`` (checked records of one study, back to back) to the study's open
        container(s) and return once Kafka acknowledged every one of them; raise
        :class:`ContainerRefused` if Kafka refused or timed out on any of them. ``credential``:
        the device credential the records were admitted with, carried next to them."""
        if self._producer() is None:
            raise ContainerRefused("not connected to Kafka yet")
        loop = asyncio.get_running_loop()
        size = record_size(d)
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
                box.linger = loop.call_later(self.linger_s, self._flush, box)
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
        for waiter in waits:
            await waiter

    def flush_all(self) -> None:
        """Produce every open container now (at shutdown, before the producer closes)."""
        for box in list(self._open.values()):
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
            sent = producer.send(self.topic, key=bytes(box.records[RECORD_ID_BYTES]),
                                 value=container_of(box.records, box.count),
                                 headers=headers)
        except Exception as exc:  # noqa: BLE001 - any failure to hand over is a refusal
            self._settle(box, exc)
            return
        # kafka-python's delivery timeout fires the errback; this deadline covers a future that
        # is never resolved at all.
        box.deadline = loop.call_later(self.kafka_timeout_s + 1, self._settle, box,
                                       TimeoutError("no acknowledgement"))
        sent.add_callback(lambda _: loop.call_soon_threadsafe(self._settle, box, None))
        sent.add_errback(lambda exc: loop.call_soon_threadsafe(self._settle, box, exc))

    def _settle(self, box: _Container, exc: BaseException | None) -> None:
        """Answer every request waiting on ``box``: acknowledged, or refused with ``exc``."""
        if box.deadline is not None:
            box.deadline.cancel()
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
        refused = ContainerRefused(type(exc).__name__)
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(refused)
                # A request that went away (client disconnect) never retrieves it.
                waiter.exception()
