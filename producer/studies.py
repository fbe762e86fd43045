"""A device's first step: learn the study's public parameters from the compacted studies topic.

Devices read the topic, never Redis, so a device needs Kafka access and nothing else.
"""

from __future__ import annotations

import logging
import time

from ipdp.errors import StudyClosed, UnknownStudy
from ipdp.kafka_io import assign_all, kafka_consumer, read_to_end
from ipdp.settings import KafkaSettings, TopicSettings
from ipdp.study import Study, StudyStatus, parse_study_message

log = logging.getLogger(__name__)

__all__ = ["find_open_study", "read_studies_topic"]


def read_studies_topic(kafka: KafkaSettings, topics: TopicSettings,
                       timeout_s: float = 10) -> dict[str, tuple[Study, StudyStatus]]:
    """Replay the compacted studies topic: {id: (study, status)}, the last value per key winning.

    Assigns every partition (no consumer group), seeks to the beginning and reads to the end. A
    tombstone (null value) removes the key; a malformed value is logged and skipped. Raises
    TimeoutError if the topic cannot be found or read within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    consumer = kafka_consumer(kafka, group_id=None, enable_auto_commit=False,
                              bootstrap_timeout_ms=max(1000, int(timeout_s * 1000)))
    try:
        tps = assign_all(consumer, topics.studies, timeout_s, label="studies topic")
        consumer.seek_to_beginning(*tps)
        out: dict[str, tuple[Study, StudyStatus]] = {}
        for m in read_to_end(consumer, tps, timeout_s=max(0.1, deadline - time.monotonic())):
            if m.key is None:
                continue
            sid = m.key.decode("utf-8", "replace")
            if m.value is None:
                out.pop(sid, None)
                continue
            try:
                out[sid] = parse_study_message(m.value)
            except ValueError as exc:
                log.warning("skipping studies-topic offset %d: %s", m.offset, exc)
        return out
    finally:
        consumer.close()


def find_open_study(study_id: str, kafka: KafkaSettings, topics: TopicSettings,
                    timeout_s: float = 10) -> Study:
    """The study a device contributes to; raises UnknownStudy or StudyClosed."""
    found = read_studies_topic(kafka, topics, timeout_s=timeout_s).get(study_id)
    if found is None:
        raise UnknownStudy(f"study {study_id!r} is not on the studies topic {topics.studies!r}")
    study, status = found
    if status is StudyStatus.CLOSED:
        raise StudyClosed(f"study {study_id!r} is closed and accepts no more records")
    return study
