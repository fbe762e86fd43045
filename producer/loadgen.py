"""The load generator: many independent simulated devices, in vectorised batches.

Each batch of devices is one (batch, d) array: :func:`ipdp.losses.prepare` perturbs every row with
its own noise draw (exactly what each device would do alone), :func:`ipdp.wire.encode_batch`
encodes the rows in one structured-array pass, and each value goes to ``producer.send`` with its
record id as the key. The only per-record Python work is the ``send`` call itself (and, for a
two-server study, sealing each record's helper share: perturb_two_server → fixed point → shares →
seal → version 3, producer.contributor.perturb_records). Through the gateway
(:func:`run_loadgen_http`) the device SDK sends them, one record per request.

Simulated devices draw their noise from numpy's PCG64 (OS-seeded unless an ``rng`` is passed, in
tests), not from the CSPRNG real devices use (ipdp.losses.SystemNoise), and so do a two-server
study's grid noise and helper shares: a simulator needs speed and
reproducibility, and its records protect no one. ``--seed`` on the command line seeds only the
simulated dataset. Record ids always come from ``os.urandom``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
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
from producer.contributor import perturb_records
from producer.retry import DEVICE_RETRY, RetryPolicy
from producer.transport import DeliveryCounter, split_ids

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
    #: Through the gateway: requests sent again after a 429, a 503 or a lost connection.
    retried: int = 0
    #: Through the gateway: answers 429 ``rate_limited`` (its per-address limit).
    rate_limited: int = 0


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
                ids, values = perturb_records(study, xb, yb, rng, ids, grid_generator=rng,
                                              random_bytes=rng.bytes)
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

    The device SDK does the work: one :class:`~producer.contributor.Contributor` on a
    :class:`~producer.transport.GatewayTransport` plays every device (its limit is all of them:
    a simulator, not a device). Each batch is perturbed in one step (every row its own device),
    then cut into request bodies of ``per_request`` records (one by default: each device sends
    its own record) and POSTed over ``connections`` keep-alive connections. A 429 or 503 is
    sent again with the same bytes after its ``Retry-After`` and jitter, up to
    ``retry.max_attempts`` tries; every simulated device shares this process's address, so a 429
    also slows all of them down (:class:`~producer.transport.SharedPace`). The progress bar
    counts records the gateway answered 202 for (Kafka acknowledged them), its postfix the
    records finally refused and the requests sent again; the first 429 ``rate_limited`` says
    once, on stderr, that the gateway's per-address limit is what holds the run back and which
    gateway setting lifts it. ``refused`` counts records by their last refusal's reason.
    """
    import threading

    from producer.contributor import Contributor
    from producer.transport import GatewayTransport

    rng = np.random.default_rng() if rng is None else rng
    sent_metric = LOADGEN_RECORDS_SENT.labels(study.study_id)
    error_metric = LOADGEN_SEND_ERRORS.labels(study.study_id)
    bar = tqdm(total=total, unit="rec", unit_scale=True, file=sys.stderr, disable=not progress,
               desc=f"loadgen {study.study_id} via gateway", mininterval=0.5,
               dynamic_ncols=True)
    shown = {"ok": 0, "failed": 0, "hinted": False}
    lock = threading.Lock()

    def on_answer(transport: GatewayTransport) -> None:
        ok, failed = transport.delivery.snapshot()
        with lock:
            if ok > shown["ok"]:
                sent_metric.inc(ok - shown["ok"])
                bar.update(ok - shown["ok"])
                shown["ok"] = ok
            if failed > shown["failed"]:
                error_metric.inc(failed - shown["failed"])
                shown["failed"] = failed
            bar.set_postfix(refused=failed, retried=transport.retried, refresh=False)
            if transport.rate_limited and not shown["hinted"]:
                shown["hinted"] = True
                tqdm.write(RATE_LIMITED_HINT.format(url=base_url), file=sys.stderr)

    transport = GatewayTransport(base_url, connections=connections, per_request=per_request,
                                 rate=rate, retry=retry, on_answer=on_answer)
    device = Contributor(study, noise=rng, transport=transport,
                         records_per_device=total if total else sys.maxsize)
    start = time.monotonic()
    interrupted = False
    try:
        for xb, yb in batches:
            if xb.shape[0]:
                device.submit_many(xb, yb)
    except KeyboardInterrupt:
        interrupted = True
        log.warning("interrupted: stopped with the requests in flight unanswered")
    finally:
        transport.close()
        bar.close()
    seconds = time.monotonic() - start
    ok, failed = transport.delivery.snapshot()
    return LoadgenResult(sent=ok, errors=failed, seconds=seconds,
                         rate=ok / seconds if seconds > 0 else 0.0, interrupted=interrupted,
                         refused=dict(sorted(transport.delivery.reasons.items())),
                         retried=transport.retried, rate_limited=transport.rate_limited)


#: Said once per run, at the first 429 ``rate_limited`` (docs/operations.md, "The gateway").
RATE_LIMITED_HINT = (
    "the gateway at {url} answers 429 rate_limited: its per-address limit, not the gateway "
    "itself, sets this run's pace, because every simulated device sends from this one address. "
    "Refused requests are sent again after Retry-After, so every record still arrives, slowly. "
    "To simulate at the gateway's real rate, list this address in "
    "IPDP_GATEWAY_RELAY_ADDRESSES on the gateway (a relay's allowance is "
    "IPDP_GATEWAY_RELAY_RECORD_LIMIT_PER_S).")
