"""A device's first step: learn the study's public parameters from the compacted studies topic.

Devices read the topic, never Redis, so a device needs Kafka access and nothing else. The reader
itself is in the contract (ipdp/studies_topic.py): the gateway follows the same topic. A device
that pins study-owner keys (``trusted``) uses a study only if its signed envelope verifies.
"""

from __future__ import annotations

from ipdp.errors import StudyClosed, UnknownStudy
from ipdp.settings import KafkaSettings, TopicSettings
from ipdp.signing import TrustedKeys
from ipdp.studies_topic import read_study_entries
from ipdp.study import Study, StudyStatus

__all__ = ["find_open_study", "find_study"]


def find_study(study_id: str, kafka: KafkaSettings, topics: TopicSettings,
               timeout_s: float = 10, trusted: TrustedKeys | None = None,
               ) -> tuple[Study, StudyStatus]:
    """(study, status) from the topic; raises UnknownStudy, or SignatureError when refused."""
    entries, refused = read_study_entries(kafka, topics, timeout_s, trusted)
    if study_id in refused:
        raise refused[study_id]
    found = entries.get(study_id)
    if found is None:
        raise UnknownStudy(f"study {study_id!r} is not on the studies topic {topics.studies!r}")
    return found.study, found.status


def find_open_study(study_id: str, kafka: KafkaSettings, topics: TopicSettings,
                    timeout_s: float = 10, trusted: TrustedKeys | None = None) -> Study:
    """The study a device contributes to; raises UnknownStudy, StudyClosed or SignatureError."""
    study, status = find_study(study_id, kafka, topics, timeout_s, trusted)
    if status is StudyStatus.CLOSED:
        raise StudyClosed(f"study {study_id!r} is closed and accepts no more records")
    return study
