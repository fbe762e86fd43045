"""The load generator: many independent simulated devices, in vectorised batches.

Each batch of devices is one (batch, d) array: :func:`ipdp.losses.prepare` perturbs every row with
its own noise draw (exactly what each device would do alone), :func:`ipdp.wire.encode_batch`
encodes the rows in one structured-array pass, and each value goes to ``producer.send`` with its
record id as the key. The only per-record Python work is the ``send`` call itself.

Simulated devices draw their noise from numpy's PCG64 (OS-seeded unless an ``rng`` is passed, in
tests), not from the CSPRNG real devices use (ipdp.losses.SystemNoise): a simulator needs speed and
reproducibility, and its records protect no one. ``--seed`` on the command line seeds only the
simulated dataset. Record ids always come from ``os.urandom``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from tqdm import tqdm

from ipdp.credentials import credential_id, credentials_header, slot_record_ids
from ipdp.errors import BackendUnavailable
from ipdp.metrics import LOADGEN_RECORDS_SENT, LOADGEN_SEND_ERRORS
from ipdp.settings import KafkaSettings, TopicSettings
from ipdp.study import Study
from ipdp.wire import study_headers
from producer.contributor import DeliveryCounter, perturb_records, split_ids
from producer.retry import DEVICE_RETRY, RetryPolicy

if TYPE_CHECKING:
    from kafka import KafkaProducer

log = logging.getLogger(__name__)

__all__ = ["LoadgenError", "LoadgenResult", "LoadgenSettings", "run_loadgen", "run_loadgen_batches",
           "run_loadgen_http"]

#: Abort after this many consecutive synchronous send failures (broker unreachable, buffer full).
MAX_CONSECUTIVE_SEND_FAILURES = 10
#: With a rate limit, records are released in chunks of about this many seconds' worth.
PACING_S = 0.05


class LoadgenError(BackendUnavailable):
    """The load generator cannot reach the broker or the topic."""


class LoadgenSettings(BaseSettings):
    """The device simulator."""

    model_config = SettingsConfigDict(env_prefix="IPDP_LOADGEN_", extra="ignore")

    batch: int = Field(2000, ge=1, description="Devices simulated per vectorised step.")
    connections: int = Field(
        64, ge=1, description="With --via: concurrent keep-alive HTTP connections to the gateway "
        "(requests in flight at once).")
    per_request: int = Field(
        1, ge=1, description="With --via: records per POST; 1 is a device sending its own "
        "record, more is a batch uploader.")


@dataclass(frozen=True)
class LoadgenResult:
    """Totals of one run: records Kafka acknowledged, records that failed, wall time, rate."""

    sent: int
    errors: int
    seconds: float
    rate: float
    interrupted: bool = False
    #: Records finally not accepted, by reason (through the gateway: its last refusal's).
    refused: dict[str, int] = field(default_factory=dict)


def run_loadgen(study: Study, kafka: KafkaSettings, topics: TopicSettings, x, y,
                rate: float | None = None, batch: int = 2000, progress: bool = True,
                rng: np.random.Generator | None = None,
                producer: KafkaProducer | None = None) -> LoadgenResult:
    """Simulate one device per row of x (k, d) / y (k,) and publish their perturbed records.

    ``rate`` limits records per second (None: as fast as the broker takes them). A ``producer``
    may be passed in (it is flushed, not closed); otherwise one is built from ``kafka``.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != study.d:
        raise ValueError(f"x must have shape (k, {study.d}), got {x.shape}")
    if y.shape != (x.shape[0],):
        raise ValueError(f"y must have shape ({x.shape[0]},), got {y.shape}")
    if batch < 1:
        raise ValueError(f"batch must be ≥ 1, got {batch}")
    k = x.shape[0]
    batches = row_batches(x, y, batch)
    return run_loadgen_batches(study, kafka, topics, batches, total=k, rate=rate,
                               progress=progress, rng=rng, producer=producer, batch=batch)


def row_batches(x: np.ndarray, y: np.ndarray, size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(x, y) in consecutive slices of ``size`` rows: one vectorised step of devices each."""
    return ((x[i : i + size], y[i : i + size]) for i in range(0, x.shape[0], size))


def _chunks(n: int, size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, size):
        yield start, min(n, start + size)


def run_loadgen_batches(study: Study, kafka: KafkaSettings, topics: TopicSettings,
                        batches: Iterable[tuple[np.ndarray, np.ndarray]], total: int | None = None,
                        rate: float | None = None, progress: bool = True,
                        rng: np.random.Generator | None = None,
                        producer: KafkaProducer | None = None,
                        batch: int = 2000,
                        credentials: list[bytes] | None = None) -> LoadgenResult:
    """:func:`run_loadgen` over an iterable of (x, y) batches (no need to hold every row).

    ``credentials``: one device credential (a token of either version) per simulated device, in
    order, for a study that requires them; device i's record is then its credential's slot 0 and
    carries the credential in its ``credentials`` header (ipdp.credentials)."""
    from kafka.errors import KafkaError

    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be > 0 records/s, got {rate}")
    rng = np.random.default_rng() if rng is None else rng
    label = study.study_id
    sent_metric = LOADGEN_RECORDS_SENT.labels(label)
    error_metric = LOADGEN_SEND_ERRORS.labels(label)
    topic = topics.records

    own = producer is None
    if own:
        from ipdp.kafka_io import kafka_producer

        try:
            producer = kafka_producer(kafka, max_block_ms=15_000, bootstrap_timeout_ms=10_000)
        except KafkaError as exc:
            raise LoadgenError(f"cannot reach Kafka at {kafka.bootstrap}: {exc!r}") from None
    delivery = DeliveryCounter()
    sync_failures = 0
    sync_reasons: Counter[str] = Counter()
    consecutive = 0
    reported_ok = reported_failed = 0
    queued = 0
    interrupted = False
    chunk = batch if rate is None else max(1, min(batch, int(rate * PACING_S)))
    bar = tqdm(total=total, unit="rec", unit_scale=True, file=sys.stderr, disable=not progress,
               desc=f"loadgen {label}", mininterval=0.5, dynamic_ncols=True)

    def report() -> None:
        nonlocal reported_ok, reported_failed
        ok, failed = delivery.snapshot()
        failed += sync_failures
        if ok > reported_ok:
            sent_metric.inc(ok - reported_ok)
            bar.update(ok - reported_ok)
            reported_ok = ok
        if failed > reported_failed:
            error_metric.inc(failed - reported_failed)
            reported_failed = failed

    try:
        try:
            if not producer.partitions_for(topic):
                raise LoadgenError(f"topic {topic!r} has no partitions")
        except KafkaError as exc:
            raise LoadgenError(
                f"cannot get metadata for topic {topic!r} at {kafka.bootstrap}: {exc!r}") from None
        start = time.monotonic()
        send = producer.send
        on_ok, on_error = delivery.on_ok, delivery.on_error
        headers = study_headers(study.study_id)
        per_record: list | None = None
        devices = 0
        try:
            for xb, yb in batches:
                k = xb.shape[0]
                if k == 0:
                    continue
                ids = None
                if credentials is not None:
                    tokens = credentials[devices:devices + k]
                    ids = np.concatenate([slot_record_ids(credential_id(t), 1) for t in tokens])
                    per_record = [[*headers, credentials_header([(t, 1)])] for t in tokens]
                devices += k
                ids, values = perturb_records(study, xb, yb, rng, ids)
                keys = split_ids(ids)
                for lo, hi in _chunks(k, chunk):
                    if rate is not None:
                        wait = start + queued / rate - time.monotonic()
                        if wait > 0:
                            time.sleep(wait)
                    for i in range(lo, hi):
                        try:
                            send(topic, key=keys[i], value=values[i],
                                 headers=headers if per_record is None else per_record[i],
                                 ).add_callback(on_ok).add_errback(on_error)
                            consecutive = 0
                        except KafkaError as exc:
                            sync_failures += 1
                            sync_reasons[type(exc).__name__] += 1
                            consecutive += 1
                            if consecutive >= MAX_CONSECUTIVE_SEND_FAILURES:
                                raise LoadgenError(
                                    f"{consecutive} consecutive sends to {topic!r} failed; last: "
                                    f"{exc!r}") from None
                    queued += hi - lo
                    report()
        except KeyboardInterrupt:
            interrupted = True
            log.warning("interrupted: flushing the %d records already queued", queued)
        producer.flush()
        seconds = time.monotonic() - start
        report()
        ok, failed = delivery.snapshot()
        errors = failed + sync_failures
        bar.set_postfix(errors=errors, refresh=False)
        return LoadgenResult(sent=ok, errors=errors, seconds=seconds,
                             rate=ok / seconds if seconds > 0 else 0.0, interrupted=interrupted,
                             refused=dict(sorted((delivery.reasons + sync_reasons).items())))
    finally:
        bar.close()
        if own:
            producer.close(timeout=5)


def run_loadgen_http(study: Study, base_url: str,
                     batches: Iterable[tuple[np.ndarray, np.ndarray]], total: int | None = None,
                     connections: int = 64, per_request: int = 1, rate: float | None = None,
                     progress: bool = True, rng: np.random.Generator | None = None,
                     retry: RetryPolicy = DEVICE_RETRY) -> LoadgenResult:
    """:func:`run_loadgen_batches` through the HTTP gateway at ``base_url`` instead of Kafka.

    Each batch is perturbed in one step (every row its own device), then cut into request bodies
    of ``per_request`` concatenated records (one by default: each device sends its own record);
    ``connections`` asyncio tasks, each with one keep-alive connection, POST them. A 429 or 503
    is sent again with the same bytes after its ``Retry-After`` and jitter, up to
    ``retry.max_attempts`` tries (producer.retry); every simulated device shares this process's
    address, so a 429 also slows all of them down (:class:`SharedPace`). ``sent`` counts records
    the gateway answered 202 for, i.e. that Kafka acknowledged, and so does the progress bar;
    ``refused`` counts the others by their last refusal's reason.
    """
    import asyncio

    if connections < 1 or per_request < 1:
        raise ValueError("connections and per_request must be ≥ 1")
    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be > 0 records/s, got {rate}")
    rng = np.random.default_rng() if rng is None else rng
    totals = {"ok": 0, "failed": 0}
    reasons: dict[str, int] = {}
    bar = tqdm(total=total, unit="rec", unit_scale=True, file=sys.stderr, disable=not progress,
               desc=f"loadgen {study.study_id} via {base_url}", mininterval=0.5,
               dynamic_ncols=True)
    start = time.monotonic()
    interrupted = False
    try:
        asyncio.run(_post_all(study, base_url, batches, connections, per_request, rate, rng,
                              retry, totals, reasons, bar))
    except KeyboardInterrupt:
        interrupted = True
        log.warning("interrupted: stopped with the requests in flight unanswered")
    finally:
        bar.close()
    seconds = time.monotonic() - start
    ok, failed = totals["ok"], totals["failed"]
    return LoadgenResult(sent=ok, errors=failed, seconds=seconds,
                         rate=ok / seconds if seconds > 0 else 0.0, interrupted=interrupted,
                         refused=dict(sorted(reasons.items())))


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
        #: Requests per second, or None while nothing was refused (and no --rate is set).
        self.rate = rate
        self._ceiling = rate
        self._next = 0.0
        self._hold_until = 0.0
        self._last_cut = -float("inf")
        self._accepted: deque[float] = deque()

    async def turn(self) -> None:
        """Wait until this request may go."""
        import asyncio

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


async def _post_all(study: Study, base_url: str,
                    batches: Iterable[tuple[np.ndarray, np.ndarray]], connections: int,
                    per_request: int, rate: float | None, rng: np.random.Generator,
                    retry: RetryPolicy, totals: dict[str, int], reasons: dict[str, int],
                    bar) -> None:
    """Perturb and queue the bodies; ``connections`` tasks POST them, counting into totals."""
    import asyncio
    import random

    from producer.gateway_client import AsyncGatewayConnection

    sent_metric = LOADGEN_RECORDS_SENT.labels(study.study_id)
    error_metric = LOADGEN_SEND_ERRORS.labels(study.study_id)
    bodies: asyncio.Queue[tuple[bytes, int] | None] = asyncio.Queue(maxsize=4 * connections)
    pace = SharedPace(None if rate is None else rate / per_request)
    jitter = random.Random(int(rng.integers(1 << 62)))

    async def post(conn: AsyncGatewayConnection, body: bytes) -> str | None:
        """POST one body; None once accepted, else the last refusal's reason."""
        for attempt in range(1, retry.max_attempts + 1):
            await pace.turn()
            try:
                answer = await conn.post_records(study.study_id, body)
            except OSError as exc:
                reason, retry_after = f"unreachable: {exc!r}", None
            else:
                if answer.status == 202:
                    pace.accepted()
                    return None
                reason, retry_after = answer.error or f"HTTP {answer.status}", answer.retry_after_s
                if not answer.retryable:
                    return reason
                pace.refused(answer.status, retry_after)
            if attempt < retry.max_attempts:
                await asyncio.sleep(retry.wait_s(attempt, retry_after, jitter))
        return reason

    async def worker() -> None:
        async with AsyncGatewayConnection(base_url) as conn:
            while (item := await bodies.get()) is not None:
                body, k = item
                reason = await post(conn, body)
                if reason is None:
                    totals["ok"] += k
                    sent_metric.inc(k)
                    bar.update(k)
                else:
                    totals["failed"] += k
                    error_metric.inc(k)
                    reasons[reason] = reasons.get(reason, 0) + k
                    bar.set_postfix(refused=totals["failed"], refresh=False)

    workers = [asyncio.create_task(worker()) for _ in range(connections)]
    for xb, yb in batches:
        if xb.shape[0] == 0:
            continue
        _, values = perturb_records(study, xb, yb, rng)
        for lo, hi in _chunks(len(values), per_request):
            await bodies.put((b"".join(values[lo:hi]), hi - lo))
    for _ in workers:
        await bodies.put(None)
    await asyncio.gather(*workers)
