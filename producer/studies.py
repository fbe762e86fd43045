"""A device's first step: learn the study's public parameters from the compacted studies topic.

Devices read the topic, never Redis, so a device needs Kafka access and nothing else. The reader
itself is in the contract (ipdp/studies_topic.py): the gateway follows the same topic. A device
that pins study-owner keys (``trusted``) uses a study only if its signed envelope verifies; the
last value per key decides, so a forged redefinition makes the study *refused* (SignatureError),
never silently replaced. Without pinned keys anything on the topic is believed, and we say so.
"""

from __future__ import annotations

import logging

from ipdp.errors import ConfigurationError, SignatureError, StudyClosed, UnknownStudy
from ipdp.metrics import STUDIES_REFUSED
from ipdp.settings import KafkaSettings, TopicSettings
from ipdp.signing import TrustedKeys
from ipdp.studies_topic import read_study_entries
from ipdp.study import Study, StudyStatus, parse_study_message

log = logging.getLogger(__name__)

__all__ = ["find_open_study", "find_study", "read_studies_topic"]


def _replay(kafka: KafkaSettings, topics: TopicSettings, timeout_s: float,
            trusted: TrustedKeys | None,
            ) -> tuple[dict[str, tuple[Study, StudyStatus]], dict[str, SignatureError]]:
    out: dict[str, tuple[Study, StudyStatus]] = {}
    refused: dict[str, SignatureError] = {}
    for sid, entry in read_study_entries(kafka, topics, timeout_s).items():
        try:
            study, status = parse_study_message(entry.value, trusted) if trusted else (
                entry.study, entry.status)
            if study.study_id != sid:
                raise ConfigurationError(f"value holds study {study.study_id!r}")
            out[sid] = (study, status)
        except SignatureError as exc:
            refused[sid] = exc
        except ConfigurationError as exc:
            log.warning("skipping studies-topic value of %r: %s", sid, exc)
    for sid, exc in refused.items():
        STUDIES_REFUSED.labels("device").inc()
        log.error("study %s refused: %s", sid, exc)
    if not trusted and out:
        log.warning("no trusted study key pinned: studies on %r are used UNVERIFIED; anyone who "
                    "can write that topic can change what this device does (docs/security.md)",
                    topics.studies)
    return out, refused


def read_studies_topic(kafka: KafkaSettings, topics: TopicSettings, timeout_s: float = 10,
                       trusted: TrustedKeys | None = None,
                       ) -> dict[str, tuple[Study, StudyStatus]]:
    """Replay the compacted studies topic: {id: (study, status)}, the last value per key winning.

    A tombstone (null value) removes the key; a malformed value is logged and skipped; with
    ``trusted`` keys, a study whose last value does not verify is left out (logged, counted).
    Raises TimeoutError if the topic cannot be found or read within ``timeout_s``.
    """
    return _replay(kafka, topics, timeout_s, trusted)[0]


def find_study(study_id: str, kafka: KafkaSettings, topics: TopicSettings,
               timeout_s: float = 10, trusted: TrustedKeys | None = None,
               ) -> tuple[Study, StudyStatus]:
    """(study, status) from the topic; raises UnknownStudy, or SignatureError when refused."""
    out, refused = _replay(kafka, topics, timeout_s, trusted)
    if study_id in refused:
        raise refused[study_id]
    found = out.get(study_id)
    if found is None:
        raise UnknownStudy(f"study {study_id!r} is not on the studies topic {topics.studies!r}")
    return found


def find_open_study(study_id: str, kafka: KafkaSettings, topics: TopicSettings,
                    timeout_s: float = 10, trusted: TrustedKeys | None = None) -> Study:
    """The study a device contributes to; raises UnknownStudy, StudyClosed or SignatureError."""
    study, status = find_study(study_id, kafka, topics, timeout_s, trusted)
    if status is StudyStatus.CLOSED:
        raise StudyClosed(f"study {study_id!r} is closed and accepts no more records")
    return study
