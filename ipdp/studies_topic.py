"""Reading the compacted studies topic: one replay to the end, or a follower that keeps up.

The device reads it once to learn a study's public parameters (producer/studies.py); the gateway
follows it to know which studies are open and to serve each study's current message unchanged.
Both go through :func:`apply_study_message`, so a tombstone or a malformed value means the same
thing everywhere.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from ipdp.kafka_io import assign_all, kafka_consumer, read_to_end
from ipdp.settings import KafkaSettings, TopicSettings
from ipdp.study import Study, StudyStatus, parse_study_message

log = logging.getLogger(__name__)

__all__ = ["StudiesFollower", "StudyEntry", "apply_study_message", "read_studies_topic"]


@dataclass(frozen=True)
class StudyEntry:
    """The latest studies-topic value of one study: parsed, and the exact bytes."""

    study: Study
    status: StudyStatus
    value: bytes


def apply_study_message(entries: dict[str, StudyEntry], message) -> None:
    """Fold one studies-topic message into ``entries`` (last value per key wins).

    A tombstone (null value) removes the key; a malformed value is logged and skipped, leaving
    the previous value in place.
    """
    if message.key is None:
        return
    sid = message.key.decode("utf-8", "replace")
    if message.value is None:
        entries.pop(sid, None)
        return
    try:
        study, status = parse_study_message(message.value)
    except ValueError as exc:
        log.warning("skipping studies-topic offset %d: %s", message.offset, exc)
        return
    entries[sid] = StudyEntry(study, status, bytes(message.value))


def read_study_entries(kafka: KafkaSettings, topics: TopicSettings,
                       timeout_s: float = 10) -> dict[str, StudyEntry]:
    """Replay the studies topic from the beginning to its end: {id: StudyEntry}.

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
        for m in read_to_end(consumer, tps, timeout_s=max(0.1, deadline - time.monotonic())):
            apply_study_message(out, m)
        return out
    finally:
        consumer.close()


def read_studies_topic(kafka: KafkaSettings, topics: TopicSettings,
                       timeout_s: float = 10) -> dict[str, tuple[Study, StudyStatus]]:
    """Replay the compacted studies topic: {id: (study, status)}, the last value per key winning.

    See :func:`read_study_entries`; raises TimeoutError if the topic cannot be read in time.
    """
    return {sid: (e.study, e.status)
            for sid, e in read_study_entries(kafka, topics, timeout_s).items()}


class StudiesFollower:
    """A thread that replays the studies topic, then keeps following it.

    ``get(study_id)`` answers from memory. ``ready`` is set once the first replay reached the
    end of the topic, so a caller never mistakes "not read yet" for "unknown study".
    """

    def __init__(self, kafka: KafkaSettings, topics: TopicSettings, poll_ms: int = 500,
                 retry_s: float = 2.0) -> None:
        self._kafka, self._topics = kafka, topics
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

    def _follow(self) -> None:
        consumer = kafka_consumer(self._kafka, group_id=None, enable_auto_commit=False)
        try:
            tps = assign_all(consumer, self._topics.studies, 30, label="studies topic")
            consumer.seek_to_beginning(*tps)
            entries: dict[str, StudyEntry] = {}
            for m in read_to_end(consumer, tps, stop=self._stop):
                apply_study_message(entries, m)
            self._entries = entries
            self.ready.set()
            while not self._stop.is_set():
                batch = consumer.poll(timeout_ms=self._poll_ms)
                if batch:
                    updated = dict(self._entries)
                    for msgs in batch.values():
                        for m in msgs:
                            apply_study_message(updated, m)
                    self._entries = updated
        finally:
            consumer.close()
