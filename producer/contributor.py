"""The contributor SDK: one device's (x, y) in, one perturbed record out.

Everything privacy-relevant happens inside :meth:`Contributor.submit`: encode (q, p) → clip to the
public bounds → add the study's Gaussian noise → wire-encode → produce. The raw (x, y) never leave
the call: they are not stored, logged, or sent; only (q̃, p̃), the study hash, a random record id
and the creation time go on the wire (ipdp.wire).

Noise comes from an OS-seeded generator (``np.random.default_rng()``) unless an ``rng`` is passed
(tests only). Record ids are always 16 bytes from ``os.urandom`` (UUID4-shaped), never from
``rng``: replay detection needs them unique across runs, even runs with a seeded ``rng``.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Self

import numpy as np

from ipdp.accounting import GroupPrivacy, group_privacy
from ipdp.errors import ContributionError, StudyClosed, TooManyRecords, UnknownStudy
from ipdp.losses import prepare
from ipdp.settings import KafkaSettings, TopicSettings
from ipdp.study import Study
from ipdp.wire import encode_batch

if TYPE_CHECKING:
    from kafka import KafkaProducer

__all__ = [
    "ContributionError",
    "Contributor",
    "DeliveryCounter",
    "StudyClosed",
    "TooManyRecords",
    "UnknownStudy",
    "new_record_ids",
    "now_ms",
    "perturb_records",
]


def now_ms() -> int:
    """Milliseconds since the Unix epoch."""
    return time.time_ns() // 1_000_000


def new_record_ids(k: int) -> np.ndarray:
    """k random UUID4-shaped record ids as a (k, 16) uint8 array (os.urandom)."""
    ids = np.frombuffer(os.urandom(16 * k), dtype=np.uint8).reshape(k, 16).copy()
    ids[:, 6] = (ids[:, 6] & 0x0F) | 0x40  # version 4
    ids[:, 8] = (ids[:, 8] & 0x3F) | 0x80  # RFC 4122 variant
    return ids


def split_ids(ids: np.ndarray) -> list[bytes]:
    """(k, 16) uint8 → k bytes objects (one tobytes, then slices)."""
    raw = np.ascontiguousarray(ids, dtype=np.uint8).tobytes()
    return [raw[i : i + 16] for i in range(0, len(raw), 16)]


def perturb_records(study: Study, x: np.ndarray, y: np.ndarray,
                    rng: np.random.Generator | None = None) -> tuple[np.ndarray, list[bytes]]:
    """What k devices do before anything leaves them: encode → clip → perturb → wire-encode.

    x (k, d), y (k,) → (record ids (k, 16) uint8, k wire values). The one device step: the SDK,
    the load generator and the benchmarks all call it.
    """
    q, p = prepare(study.loss, x, y, study.calibration, rng)
    k = x.shape[0]
    ids = new_record_ids(k)
    return ids, encode_batch(study.hash, ids, np.full(k, now_ms(), dtype=np.int64), q, p)


class DeliveryCounter:
    """Thread-safe success/failure counters fed by producer future callbacks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ok = 0
        self.failed = 0
        self.last_error: BaseException | None = None

    def on_ok(self, _metadata) -> None:
        with self._lock:
            self.ok += 1

    def on_error(self, exc: BaseException) -> None:
        with self._lock:
            self.failed += 1
            self.last_error = exc

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.ok, self.failed


class Contributor:
    """One device's contribution to one round of a study.

    The unit of privacy is one record of one device in one round (docs/accounting.md), so a
    Contributor sends at most ``records_per_device`` records (default 1) and refuses more with
    :class:`TooManyRecords`. Allowing k > 1 costs that device group privacy, stated by
    :attr:`privacy`. For a later round, use a new Contributor.

    >>> c = Contributor.connect("my-study", KafkaSettings(), TopicSettings())
    >>> record_id = c.submit(x, y); c.flush()
    """

    def __init__(self, study: Study, producer: KafkaProducer, topic: str,
                 rng: np.random.Generator | None = None, *, records_per_device: int = 1):
        if records_per_device < 1:
            raise ValueError(f"records_per_device must be ≥ 1, got {records_per_device}")
        self.records_per_device = records_per_device
        self.submitted = 0
        self.study = study
        self.producer = producer
        self.topic = topic
        # One OS-seeded generator per contributor unless a seeded one is passed (tests).
        self._rng = np.random.default_rng() if rng is None else rng
        self._delivery = DeliveryCounter()
        self._reported_failures = 0
        self._owns_producer = False

    @classmethod
    def connect(cls, study_id: str, kafka: KafkaSettings, topics: TopicSettings,
                rng: np.random.Generator | None = None, timeout_s: float = 10.0,
                records_per_device: int = 1, **producer_overrides) -> Contributor:
        """Read the study from the studies topic and build a producer of our own.

        Raises :class:`UnknownStudy` for an unknown id and :class:`StudyClosed` for a closed
        study.
        """
        from ipdp.kafka_io import kafka_producer
        from producer.studies import find_open_study

        study = find_open_study(study_id, kafka, topics, timeout_s=timeout_s)
        c = cls(study, kafka_producer(kafka, **producer_overrides), topics.records, rng=rng,
                records_per_device=records_per_device)
        c._owns_producer = True
        return c

    # ------------------------------------------------------------------ submitting
    def _check(self, x: np.ndarray, y: np.ndarray) -> None:
        d = self.study.d
        if x.ndim != 2 or x.shape[1] != d:
            raise ValueError(f"x must have shape (k, {d}) for study {self.study.study_id!r}, "
                             f"got {x.shape}")
        if y.shape != (x.shape[0],):
            raise ValueError(f"y must have shape ({x.shape[0]},), got {y.shape}")

    @property
    def privacy(self) -> GroupPrivacy:
        """This device's per-round guarantee: the study's (ε, δ) for one record, the group-privacy
        cost (kε, k·e^{(k−1)ε}·δ) when it may send k = records_per_device."""
        cal = self.study.calibration
        return group_privacy(cal.epsilon, cal.delta, self.records_per_device)

    def encode_many(self, x, y) -> tuple[np.ndarray, list[bytes]]:
        """Perturb and wire-encode k examples without sending: (ids (k,16) uint8, values).

        Counts against ``records_per_device``: raises :class:`TooManyRecords` past it.
        """
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        self._check(x, y)
        k = x.shape[0]
        if self.submitted + k > self.records_per_device:
            raise TooManyRecords(
                f"this device already sent {self.submitted} record(s) to study "
                f"{self.study.study_id!r} and may send {self.records_per_device} per round: "
                f"{k} more would be {self.submitted + k}. The unit of privacy is one record per "
                f"device per round; allow k records with Contributor(..., records_per_device=k), "
                f"which costs the device (kε, k·e^(k−1)ε·δ) by group privacy")
        self.submitted += k
        return perturb_records(self.study, x, y, self._rng)

    def _send(self, ids: np.ndarray, values: list[bytes]) -> None:
        send, topic, d = self.producer.send, self.topic, self._delivery
        for key, value in zip(split_ids(ids), values):
            send(topic, key=key, value=value).add_callback(d.on_ok).add_errback(d.on_error)

    def submit(self, x, y: float) -> bytes:
        """Perturb and publish one example; returns its 16-byte record id.

        The record is queued in the producer; :meth:`flush` waits for delivery.
        """
        x = np.asarray(x, dtype=np.float64)
        if x.ndim != 1:
            raise ValueError(f"x must have shape ({self.study.d},), got {x.shape}")
        ids, values = self.encode_many(x[np.newaxis], np.asarray([y], dtype=np.float64))
        self._send(ids, values)
        return ids[0].tobytes()

    def submit_many(self, x, y) -> np.ndarray:
        """Perturb and publish k examples (x (k, d), y (k,)); returns their ids, (k, 16) uint8."""
        ids, values = self.encode_many(x, y)
        self._send(ids, values)
        return ids

    @property
    def delivered(self) -> int:
        """Records Kafka acknowledged so far."""
        return self._delivery.snapshot()[0]

    @property
    def failed(self) -> int:
        """Records Kafka refused so far."""
        return self._delivery.snapshot()[1]

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for every queued record; raise :class:`ContributionError` if any new failure."""
        self.producer.flush(timeout=timeout_s)
        failed = self.failed
        if failed > self._reported_failures:
            new = failed - self._reported_failures
            self._reported_failures = failed
            raise ContributionError(
                f"{new} record(s) were not accepted by Kafka: {self._delivery.last_error!r}")

    def close(self) -> None:
        """Flush, and close the producer if :meth:`connect` built it."""
        try:
            self.flush()
        finally:
            if self._owns_producer:
                self.producer.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
