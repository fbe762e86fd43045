"""A device's first step: learn the study's public parameters from the compacted studies topic.

Devices read the topic, never Redis, so a device needs Kafka access and nothing else. The reader
itself is in the contract (ipdp/studies_topic.py): the gateway follows the same topic.
"""

from __future__ import annotations

from ipdp.errors import StudyClosed, UnknownStudy
from ipdp.settings import KafkaSettings, TopicSettings
from ipdp.studies_topic import read_studies_topic
from ipdp.study import Study, StudyStatus

__all__ = ["find_open_study", "read_studies_topic"]


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
