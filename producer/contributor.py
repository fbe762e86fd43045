"""The contributor SDK: one device's (x, y) in, one perturbed record out.

Everything privacy-relevant happens inside :meth:`Contributor.submit`: encode (q, p) → clip to the
public bounds → add the study's Gaussian noise → wire-encode → send. The raw (x, y) never leave
the call: they are not stored, logged, or sent; only (q̃, p̃), the study hash, a random record id
and the creation time go on the wire (ipdp.wire). The record goes straight to Kafka or through the
ingest gateway (``Contributor.connect(study_id, via=URL)``), with the same calls and the same
errors either way (producer.transport).

Noise comes from the operating system's CSPRNG (:class:`ipdp.losses.SystemNoise`: ``os.urandom``,
Box–Muller) unless another ``noise`` source is passed (tests only; the load generator passes its
fast seeded generator to :func:`perturb_records`, because its devices are simulated). Record ids
are always 16 bytes from ``os.urandom`` (UUID4-shaped), never from the noise source: replay
detection needs them unique across runs, even runs with seeded noise.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Self

import numpy as np

from ipdp.accounting import GroupPrivacy, group_privacy
from ipdp.credentials import credential_id, slot_record_ids, token_from_text
from ipdp.errors import (
    ContributionError,
    RecordRefused,
    SignatureError,
    StudyClosed,
    TooManyRecords,
    UnknownStudy,
)
from ipdp.fixed_point import RandomBytes
from ipdp.losses import NoiseSource, SystemNoise, clip, encode, prepare
from ipdp.settings import KafkaSettings, TopicSettings, TrustSettings
from ipdp.signing import TrustedKeys, parse_trusted_keys
from ipdp.study import Study
from ipdp.two_server import perturb_two_server
from ipdp.two_server_wire import two_server_records
from ipdp.wire import encode_batch
from producer.retry import DEVICE_RETRY, RetryPolicy
from producer.transport import GatewayTransport, KafkaTransport, Transport

if TYPE_CHECKING:
    from kafka import KafkaProducer

__all__ = [
    "ContributionError",
    "Contributor",
    "RecordRefused",
    "SignatureError",
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


def perturb_records(study: Study, x: np.ndarray, y: np.ndarray, noise: NoiseSource,
                    ids: np.ndarray | None = None, *,
                    grid_generator: np.random.Generator | None = None,
                    random_bytes: RandomBytes = os.urandom) -> tuple[np.ndarray, list[bytes]]:
    """What k devices do before anything leaves them: encode → clip → perturb → wire-encode.

    x (k, d), y (k,) → (record ids (k, 16) uint8, k wire values). The one device step: the SDK
    (with :class:`SystemNoise`), the load generator and the benchmarks (with numpy's seeded
    generator, for simulated devices) all call it, each naming its noise source. ``ids``: the
    record ids to use (a credential's slots), random ones when None.

    A two-server study's records are version 3 (ipdp.two_server_wire): q̃ and the grid noise of
    p̂ (ipdp.two_server.perturb_two_server; its Skellam draws from ``grid_generator``, a fresh
    CSPRNG-seeded one when None), fixed point, shares (the helper's from ``random_bytes``), the
    helper's sealed to the study's helper key.
    """
    k = x.shape[0]
    ids = new_record_ids(k) if ids is None else ids
    created = np.full(k, now_ms(), dtype=np.int64)
    two = study.two_server_calibration
    if two is None:
        q, p = prepare(study.loss, x, y, study.calibration, noise)
        return ids, encode_batch(study.hash, ids, created, q, p)
    q, p = encode(study.loss, x, y)
    q, p = clip(q, p, study.lam, study.p_bound)
    q_tilde, p_hat = perturb_two_server(q, p, two, noise, grid_generator)
    return ids, two_server_records(study.hash, ids, created, q_tilde, p_hat, two.encoding,
                                   study.two_server.public_key, random_bytes)


def trusted_study_keys(keys: TrustedKeys | str | Iterable[str] | None) -> TrustedKeys:
    """Pinned study keys: ``keys`` as given, or IPDP_TRUSTED_STUDY_KEYS when None."""
    if isinstance(keys, TrustedKeys):
        return keys
    return TrustSettings().study_keys() if keys is None else parse_trusted_keys(keys)


class Contributor:
    """One device's contribution to one round of a study.

    The unit of privacy is one record of one device in one round (docs/accounting.md), so a
    Contributor sends at most ``records_per_device`` records (default 1) and refuses more with
    :class:`TooManyRecords`. Allowing k > 1 costs that device group privacy, stated by
    :attr:`privacy`. For a later round, use a new Contributor.

    A study that requires credentials takes a ``credential`` (the line `ipdp credentials issue`
    printed, or its bytes): the device's records then use the credential's slots as record
    ids, in order, and carry it in their ``credentials`` header (ipdp.credentials); the limit is
    the study's ``records_per_device``. A device that restarts must not reuse a slot: the
    aggregator dead-letters a second record in a slot as ``credential_reused``.

    >>> c = Contributor.connect("my-study", KafkaSettings(), TopicSettings())
    >>> record_id = c.submit(x, y); c.flush()

    Through the ingest gateway instead of Kafka, with the same calls:

    >>> c = Contributor.connect("my-study", via="https://ingest.example.org")

    A study with a schema (ipdp.schema) takes a raw row instead, by column name:

    >>> c.submit_row({"age": 29, "income": 41_000, "weeks": 12}); c.flush()
    """

    def __init__(self, study: Study, producer: KafkaProducer | None = None,
                 topic: str | None = None, noise: NoiseSource | None = None, *,
                 transport: Transport | None = None, records_per_device: int | None = None,
                 credential: str | bytes | None = None):
        self.credential = token_from_text(credential) if isinstance(credential, str) \
            else credential
        if records_per_device is None:
            records_per_device = study.records_per_device if self.credential else 1
        if records_per_device < 1:
            raise ValueError(f"records_per_device must be ≥ 1, got {records_per_device}")
        if self.credential and records_per_device > study.records_per_device:
            raise ValueError(f"a credential holds {study.records_per_device} slot(s) for study "
                             f"{study.study_id!r}, not {records_per_device}")
        self.records_per_device = records_per_device
        self.submitted = 0
        self.study = study
        #: Where records go: ``transport`` as given, else ``producer`` to ``topic``.
        self.transport: Transport = KafkaTransport(producer, topic) if transport is None \
            else transport
        # The OS's CSPRNG unless a seeded source is passed (tests only).
        self.noise: NoiseSource = SystemNoise() if noise is None else noise
        #: Raw values submit_row clipped to their schema range so far, per column.
        self.clipped: dict[str, int] = {}

    @classmethod
    def connect(cls, study_id: str, kafka: KafkaSettings | None = None,
                topics: TopicSettings | None = None, noise: NoiseSource | None = None,
                timeout_s: float = 10.0,
                trusted_keys: TrustedKeys | str | Iterable[str] | None = None,
                records_per_device: int | None = None, credential: str | bytes | None = None,
                *, via: str | None = None, retry: RetryPolicy = DEVICE_RETRY,
                **producer_overrides) -> Contributor:
        """Read the study and open the way to send records: a Kafka producer of our own, or,
        ``via`` a gateway URL (http(s)://HOST[:PORT]), a connection to that ingest gateway.

        Straight to Kafka the study is read from the studies topic (``kafka`` and ``topics``,
        from the IPDP_* environment when None); through the gateway from ``GET /studies/{id}``,
        and each record is POSTed in its own request, sent again after a 429 or 503 as
        ``retry`` says (producer.retry). ``trusted_keys`` pins the study owner's public keys
        (base64 lines or ``.pub`` paths, or a :class:`TrustedKeys`); the study is used only if
        its signature verifies under one of them, on either path (the gateway relays the
        owner's signature). None reads ``IPDP_TRUSTED_STUDY_KEYS``; with no key at all the study
        is unverified. ``timeout_s`` bounds reading the studies topic (each of a gateway's
        answers has the transport's own timeout, longer than the gateway's wait for Kafka).
        Raises :class:`UnknownStudy` for an unknown id, :class:`StudyClosed` for a closed study,
        :class:`SignatureError` for a study whose signature does not verify, and
        :class:`~ipdp.errors.BackendUnavailable` when the gateway cannot be reached.
        """
        trusted = trusted_study_keys(trusted_keys)
        if via is not None:
            if kafka is not None or producer_overrides:
                raise ValueError("via= sends through the gateway: give no Kafka settings")
            transport: Transport = GatewayTransport(via, retry=retry)
            try:
                study = transport.study(study_id, trusted)
            except BaseException:
                transport.close()
                raise
        else:
            from ipdp.kafka_io import kafka_producer
            from producer.studies import find_open_study

            kafka = KafkaSettings() if kafka is None else kafka
            topics = TopicSettings() if topics is None else topics
            study = find_open_study(study_id, kafka, topics, timeout_s=timeout_s,
                                    trusted=trusted)
            transport = KafkaTransport(kafka_producer(kafka, **producer_overrides),
                                       topics.records, owns_producer=True)
        return cls(study, noise=noise, transport=transport,
                   records_per_device=records_per_device, credential=credential)

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
        ids = None if self.credential is None else slot_record_ids(
            credential_id(self.credential), self.submitted + k)[self.submitted:]
        self.submitted += k
        return perturb_records(self.study, x, y, self.noise, ids)

    def _send(self, ids: np.ndarray, values: list[bytes]) -> None:
        self.transport.send(self.study, ids, values, self.credential)

    def submit(self, x, y: float) -> bytes:
        """Perturb and publish one example; returns its 16-byte record id.

        Straight to Kafka the record is queued in the producer; through the gateway it was
        answered when this returns. :meth:`flush` waits for delivery and raises a refusal.
        """
        x = np.asarray(x, dtype=np.float64)
        if x.ndim != 1:
            raise ValueError(f"x must have shape ({self.study.d},), got {x.shape}")
        ids, values = self.encode_many(x[np.newaxis], np.asarray([y], dtype=np.float64))
        self._send(ids, values)
        return ids[0].tobytes()

    def submit_row(self, row: Mapping[str, object]) -> bytes:
        """Encode one raw row through the study's schema, then perturb and publish it.

        ``row`` maps each of the schema's feature names and its target name to a raw value (a
        number; a class name for a logistic study's target). A value outside its public range
        is clipped to it and counted in :attr:`clipped`. Returns the 16-byte record id.
        """
        schema = self.study.schema_
        if schema is None:
            raise ValueError(f"study {self.study.study_id!r} has no schema: submit its encoded "
                             "(x, y) with submit()")
        encoded = schema.encode(row)
        for name, k in encoded.clipped.items():
            self.clipped[name] = self.clipped.get(name, 0) + k
        ids, values = self.encode_many(encoded.x, encoded.y)
        self._send(ids, values)
        return ids[0].tobytes()

    def submit_many(self, x, y) -> np.ndarray:
        """Perturb and publish k examples (x (k, d), y (k,)); returns their ids, (k, 16) uint8."""
        ids, values = self.encode_many(x, y)
        self._send(ids, values)
        return ids

    @property
    def delivered(self) -> int:
        """Records accepted so far (Kafka acknowledged them, directly or through the gateway)."""
        return self.transport.delivery.snapshot()[0]

    @property
    def failed(self) -> int:
        """Records refused so far (by Kafka, or by the gateway after its retries)."""
        return self.transport.delivery.snapshot()[1]

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for every record sent; raise for a new failure: :class:`ContributionError`
        (:class:`RecordRefused` with the gateway's reason), or :class:`UnknownStudy` /
        :class:`StudyClosed` when the gateway refused the record for that."""
        self.transport.flush(timeout_s)

    def close(self) -> None:
        """Flush, and close what :meth:`connect` opened (the producer or the connection)."""
        try:
            self.flush()
        finally:
            self.transport.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
