"""The load generator: many independent simulated devices, in vectorised batches.

Each batch of devices is one (batch, d) array: :func:`ipdp.losses.prepare` perturbs every row with
its own noise draw (exactly what each device would do alone), :func:`ipdp.wire.encode_batch`
encodes the rows in one structured-array pass, and each value goes to ``producer.send`` with its
record id as the key. The only per-record Python work is the ``send`` call itself.

Noise is OS-seeded unless an ``rng`` is passed (tests); ``--seed`` on the command line seeds only
the simulated dataset. Record ids always come from ``os.urandom``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from ipdp.losses import prepare
from ipdp.metrics import LOADGEN_RECORDS_SENT, LOADGEN_SEND_ERRORS
from ipdp.settings import KafkaSettings, TopicSettings
from ipdp.study import Study
from ipdp.wire import encode_batch
from producer.contributor import _Delivery, new_record_ids, now_ms, split_ids

if TYPE_CHECKING:
    from kafka import KafkaProducer

log = logging.getLogger(__name__)

__all__ = ["LoadgenError", "LoadgenResult", "cmd_loadgen", "run_loadgen", "run_loadgen_batches"]

#: Abort after this many consecutive synchronous send failures (broker unreachable, buffer full).
MAX_CONSECUTIVE_SEND_FAILURES = 10
#: With a rate limit, records are released in chunks of about this many seconds' worth.
PACING_S = 0.05


class LoadgenError(RuntimeError):
    """The load generator cannot reach the broker or the topic."""


@dataclass(frozen=True)
class LoadgenResult:
    """Totals of one run: records Kafka acknowledged, records that failed, wall time, rate."""

    sent: int
    errors: int
    seconds: float
    rate: float
    interrupted: bool = False


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
    batches = ((x[i : i + batch], y[i : i + batch]) for i in range(0, k, batch))
    return run_loadgen_batches(study, kafka, topics, batches, total=k, rate=rate,
                               progress=progress, rng=rng, producer=producer, batch=batch)


def _chunks(n: int, size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, size):
        yield start, min(n, start + size)


def run_loadgen_batches(study: Study, kafka: KafkaSettings, topics: TopicSettings,
                        batches: Iterable[tuple[np.ndarray, np.ndarray]], total: int | None = None,
                        rate: float | None = None, progress: bool = True,
                        rng: np.random.Generator | None = None,
                        producer: KafkaProducer | None = None,
                        batch: int = 2000) -> LoadgenResult:
    """:func:`run_loadgen` over an iterable of (x, y) batches (no need to hold every row)."""
    from kafka.errors import KafkaError

    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be > 0 records/s, got {rate}")
    rng = np.random.default_rng() if rng is None else rng
    cal = study.calibration
    label = study.study_id
    sent_metric = LOADGEN_RECORDS_SENT.labels(label)
    error_metric = LOADGEN_SEND_ERRORS.labels(label)
    topic = topics.records

    own = producer is None
    if own:
        from ipdp.clients import kafka_producer

        try:
            producer = kafka_producer(kafka, max_block_ms=15_000, bootstrap_timeout_ms=10_000)
        except KafkaError as exc:
            raise LoadgenError(f"cannot reach Kafka at {kafka.bootstrap}: {exc!r}") from None
    delivery = _Delivery()
    sync_failures = 0
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
        try:
            for xb, yb in batches:
                k = xb.shape[0]
                if k == 0:
                    continue
                q, p = prepare(study.loss, xb, yb, cal, rng)
                ids = new_record_ids(k)
                values = encode_batch(study.hash, ids, np.full(k, now_ms(), dtype=np.int64), q, p)
                keys = split_ids(ids)
                del q, p
                for lo, hi in _chunks(k, chunk):
                    if rate is not None:
                        wait = start + queued / rate - time.monotonic()
                        if wait > 0:
                            time.sleep(wait)
                    for i in range(lo, hi):
                        try:
                            send(topic, key=keys[i], value=values[i]).add_callback(
                                on_ok).add_errback(on_error)
                            consecutive = 0
                        except KafkaError as exc:
                            sync_failures += 1
                            consecutive += 1
                            if consecutive >= MAX_CONSECUTIVE_SEND_FAILURES:
                                raise LoadgenError(
                                    f"{consecutive} consecutive sends to {topic!r} failed; last: "
                                    f"{exc!r}") from None
                    queued += hi - lo
                    bar.update(hi - lo)
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
                             rate=ok / seconds if seconds > 0 else 0.0, interrupted=interrupted)
    finally:
        bar.close()
        if own:
            producer.close(timeout=5)


# --------------------------------------------------------------------------- CLI


def _kafka_from_args(args: argparse.Namespace) -> KafkaSettings:
    kafka = KafkaSettings()
    if getattr(args, "bootstrap", None):
        kafka = kafka.model_copy(update={"bootstrap": args.bootstrap})
    return kafka


def _find_study(args: argparse.Namespace, kafka: KafkaSettings, topics: TopicSettings) -> Study:
    """The study from the studies topic, falling back to Redis when --redis-url is given."""
    from kafka.errors import KafkaError

    from ipdp.cli import UsageError
    from ipdp.registry import CLOSED, load_study, read_studies_topic

    found = None
    try:
        found = read_studies_topic(kafka, topics, timeout_s=10).get(args.study)
    except (KafkaError, TimeoutError) as exc:
        if not getattr(args, "redis_url", None):
            raise UsageError(f"cannot read studies topic {topics.studies!r} at "
                             f"{kafka.bootstrap}: {exc}") from None
    if found is None and getattr(args, "redis_url", None):
        import redis

        from ipdp.clients import check_redis, redis_client
        from ipdp.settings import RedisSettings

        client = redis_client(RedisSettings().model_copy(update={"url": args.redis_url}))
        try:
            check_redis(client)
            found = load_study(client, args.study)
        except (RuntimeError, redis.RedisError) as exc:
            raise UsageError(f"cannot read the study from Redis: {exc}") from None
        finally:
            client.close()
    if found is None:
        raise UsageError(f"unknown study {args.study!r} (create it with `ipdp study create`)")
    study, status = found
    if status == CLOSED:
        raise UsageError(f"study {args.study!r} is closed and accepts no more records")
    return study


def cmd_loadgen(args: argparse.Namespace) -> int:
    """`ipdp loadgen`: simulate --devices devices contributing to --study."""
    from ipdp.cli import UsageError
    from ipdp.metrics import serve
    from ipdp.settings import MetricsSettings
    from producer.datasets import from_csv, synthetic_batches

    if args.devices < 1:
        raise UsageError(f"--devices must be ≥ 1, got {args.devices}")
    if args.batch < 1:
        raise UsageError(f"--batch must be ≥ 1, got {args.batch}")
    if args.rate is not None and not args.rate > 0:
        raise UsageError(f"--rate must be > 0, got {args.rate}")
    kafka = _kafka_from_args(args)
    topics = TopicSettings()
    study = _find_study(args, kafka, topics)
    serve(MetricsSettings())
    progress = not args.no_progress
    common = {"rate": args.rate, "progress": progress, "batch": args.batch}
    try:
        if args.dataset == "synthetic":
            _, batches = synthetic_batches(args.devices, study.d, study.loss, args.batch,
                                           seed=args.seed)
            result = run_loadgen_batches(study, kafka, topics, batches, total=args.devices,
                                         **common)
        elif args.dataset.startswith("csv:"):
            if not args.target:
                raise UsageError("--dataset csv:PATH needs --target COLUMN")
            try:
                ds = from_csv(args.dataset[4:], args.target, study.loss)
            except (OSError, ValueError) as exc:
                raise UsageError(str(exc)) from None
            if ds.d != study.d:
                raise UsageError(f"{args.dataset[4:]} has {ds.d} feature columns, study "
                                 f"{study.study_id!r} has d={study.d}")
            # One device per row, in random order; more devices than rows reuse rows.
            order = np.random.default_rng(args.seed).permutation(len(ds))
            idx = np.resize(order, args.devices)
            result = run_loadgen(study, kafka, topics, ds.x[idx], ds.y[idx], **common)
        else:
            raise UsageError(f"--dataset must be 'synthetic' or 'csv:PATH', got {args.dataset!r}")
    except LoadgenError as exc:
        raise UsageError(str(exc)) from None
    print(f"records sent  {result.sent}")
    print(f"errors        {result.errors}")
    print(f"elapsed       {result.seconds:.2f} s")
    print(f"records/s     {result.rate:.0f}")
    if result.interrupted:
        print("interrupted   yes")
        return 130
    return 0 if result.errors == 0 else 1
