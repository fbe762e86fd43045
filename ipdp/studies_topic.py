"""Reading the compacted studies topic: one replay to the end, or a follower that keeps up.

The device reads it once to learn a study's public parameters (producer/studies.py); the gateway
follows it to know which studies are open and to serve each study's current message unchanged.
Both go through :func:`apply_study_message`, so a tombstone, a malformed value or a signature
that does not verify means the same thing everywhere: the last value per key decides, so a forged
redefinition makes the study *refused* (SignatureError), never silently replaced. Without pinned
study-owner keys anything on the topic is believed, and the readers say so in their logs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ipdp.errors import MalformedValue, SignatureError
from ipdp.kafka_io import assign_all, kafka_consumer, read_to_end
from ipdp.metrics import STUDIES_REFUSED
from ipdp.settings import KafkaSettings, TopicSettings
from ipdp.signing import TrustedKeys, warn_once
from ipdp.study import Study, StudyStatus, parse_study_message
from ipdp.topic_values import DEFAULT_MAX_VALUE_BYTES, skip_malformed

log = logging.getLogger(__name__)

__all__ = ["StudiesFollower", "StudyEntry", "apply_study_message", "read_studies_topic"]


@dataclass(frozen=True)
class StudyEntry:
    """The latest studies-topic value of one study: parsed, and the exact bytes."""

    study: Study
    status: StudyStatus
    value: bytes


def apply_study_message(entries: dict[str, StudyEntry], message,
                        trusted: TrustedKeys | None = None,
                        refused: dict[str, SignatureError] | None = None, *,
                        reader: str = "device",
                        max_bytes: int = DEFAULT_MAX_VALUE_BYTES,
                        prepare: Callable[[Study], object] | None = None) -> None:
    """Fold one studies-topic message into ``entries``: the last value per key decides.

    A tombstone (null value) removes the key. So does a value that does not verify against
    ``trusted`` keys (kept in ``refused``, logged and counted by the reader), and any value that
    cannot be read at all, whatever the exception (skipped, counted and logged with its offset by
    ipdp.topic_values.skip_malformed): no value can stop the reader. ``prepare(study)`` runs on
    a study before it enters ``entries``; a study it raises on is skipped the same way.
    """
    if message.key is None:
        return
    sid = message.key.decode("utf-8", "replace")
    entries.pop(sid, None)
    if refused is not None:
        refused.pop(sid, None)
    if message.value is None:
        return
    try:
        study, status = parse_study_message(message.value, trusted, max_bytes)
        if study.study_id != sid:
            raise MalformedValue("invalid", f"the value holds study {study.study_id!r}, "
                                 f"not its key {sid!r}")
        if prepare is not None:
            prepare(study)
    except SignatureError as exc:
        if refused is not None:
            refused[sid] = exc
        return
    except Exception as exc:  # noqa: BLE001 - no value on the topic may stop the reader
        skip_malformed("studies", reader, message, exc)
        return
    entries[sid] = StudyEntry(study, status, bytes(message.value))


def _say(reader: str, topics: TopicSettings, entries: dict, refused: dict,
         trusted: TrustedKeys | None) -> None:
    for sid, exc in refused.items():
        STUDIES_REFUSED.labels(reader).inc()
        log.error("study %s refused: %s", sid, exc)
    if not trusted and entries:
        warn_once(log, ("studies", topics.studies, reader),
                  "no trusted study key pinned: studies on %r are used UNVERIFIED; anyone who "
                  "can write that topic can change what this %s does. Pin the study owner's "
                  "public key: IPDP_TRUSTED_STUDY_KEYS=PREFIX.pub (docs/security.md)",
                  topics.studies, reader)


def read_study_entries(kafka: KafkaSettings, topics: TopicSettings, timeout_s: float = 10,
                       trusted: TrustedKeys | None = None, reader: str = "device",
                       ) -> tuple[dict[str, StudyEntry], dict[str, SignatureError]]:
    """Replay the studies topic from the beginning to its end: ({id: StudyEntry}, {id: why
    refused}).

    Assigns every partition (no consumer group). Raises TimeoutError if the topic cannot be
    found or read within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    consumer = kafka_consumer(kafka, group_id=None, enable_auto_commit=False,
                              bootstrap_timeout_ms=max(1000, int(timeout_s * 1000)))
    try:
        tps = assign_all(consumer, topics.studies, timeout_s, label="studies topic")
        consumer.seek_to_beginning(*tps)
        out: dict[str, StudyEntry] = {}
        refused: dict[str, SignatureError] = {}
        for m in read_to_end(consumer, tps, timeout_s=max(0.1, deadline - time.monotonic())):
            apply_study_message(out, m, trusted, refused, reader=reader,
                                max_bytes=topics.max_value_bytes)
    finally:
        consumer.close()
    _say(reader, topics, out, refused, trusted)
    return out, refused


def read_studies_topic(kafka: KafkaSettings, topics: TopicSettings, timeout_s: float = 10,
                       trusted: TrustedKeys | None = None,
                       ) -> dict[str, tuple[Study, StudyStatus]]:
    """Replay the compacted studies topic: {id: (study, status)}, the last value per key winning.

    See :func:`read_study_entries`; raises TimeoutError if the topic cannot be read in time.
    """
    entries, _ = read_study_entries(kafka, topics, timeout_s, trusted)
    return {sid: (e.study, e.status) for sid, e in entries.items()}


class StudiesFollower:
    """A thread that replays the studies topic, then keeps following it.

    ``get(study_id)`` answers from memory. ``ready`` is set once the first replay reached the
    end of the topic, so a caller never mistakes "not read yet" for "unknown study".
    ``prepare(study)`` runs in the follower's thread on every study it reads, before ``get``
    can return it (the gateway computes the study's norm bounds there, never in a request); a
    study it raises on is skipped like a malformed value.
    """

    def __init__(self, kafka: KafkaSettings, topics: TopicSettings, poll_ms: int = 500,
                 retry_s: float = 2.0, trusted: TrustedKeys | None = None,
                 prepare: Callable[[Study], object] | None = None) -> None:
        self._kafka, self._topics, self._trusted = kafka, topics, trusted
        self._prepare = prepare
        self._poll_ms, self._retry_s = poll_ms, retry_s
        self._entries: dict[str, StudyEntry] = {}
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="studies-follower", daemon=True)

    def get(self, study_id: str) -> StudyEntry | None:
        """The study's latest value, or None if the topic has no (live) value for it."""
        return self._entries.get(study_id)

    def start(self) -> StudiesFollower:
        """Start following in the background."""
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop following and wait for the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._follow()
            except Exception as exc:  # noqa: BLE001 - a broker outage must not end the thread
                log.warning("studies topic %r: %r; retrying in %.1fs", self._topics.studies,
                            exc, self._retry_s)
                self._stop.wait(self._retry_s)

    def _apply(self, entries: dict[str, StudyEntry], message, refused: dict) -> None:
        apply_study_message(entries, message, self._trusted, refused, reader="gateway",
                            max_bytes=self._topics.max_value_bytes, prepare=self._prepare)

    def _follow(self) -> None:
        consumer = kafka_consumer(self._kafka, group_id=None, enable_auto_commit=False)
        try:
            tps = assign_all(consumer, self._topics.studies, 30, label="studies topic")
            consumer.seek_to_beginning(*tps)
            entries: dict[str, StudyEntry] = {}
            refused: dict[str, SignatureError] = {}
            for m in read_to_end(consumer, tps, stop=self._stop):
                self._apply(entries, m, refused)
            _say("gateway", self._topics, entries, refused, self._trusted)
            self._entries = entries
            self.ready.set()
            while not self._stop.is_set():
                batch = consumer.poll(timeout_ms=self._poll_ms)
                if batch:
                    updated = dict(self._entries)
                    refused = {}
                    for msgs in batch.values():
                        for m in msgs:
                            self._apply(updated, m, refused)
                    _say("gateway", self._topics, {}, refused, self._trusted)
                    self._entries = updated
        finally:
            consumer.close()
