"""What the benchmarks that run whole processes on the embedded runtime set up alike: their own
topics, their studies registered on them, and the environment their `ipdp` processes read."""

from __future__ import annotations

import os
from collections.abc import Iterable

from ipdp import state
from ipdp.embedded import EmbeddedRuntime
from ipdp.kafka_io import ensure_topics, kafka_producer
from ipdp.redis_io import redis_client
from ipdp.settings import TopicSettings
from ipdp.study import Study


def register_studies(rt: EmbeddedRuntime, prefix: str, studies: Iterable[Study],
                     **topic_settings) -> TopicSettings:
    """Topics ``<prefix>.records``, ``.models``, ``.dlq`` and ``.studies`` (and any other
    TopicSettings field given), created on ``rt``'s broker, with ``studies`` registered."""
    topics = TopicSettings(records=f"{prefix}.records", models=f"{prefix}.models",
                           dead_letter=f"{prefix}.dlq", studies=f"{prefix}.studies",
                           **topic_settings)
    ensure_topics(rt.kafka_settings(), topics)
    r = redis_client(rt.redis_settings())
    producer = kafka_producer(rt.kafka_settings())
    try:
        for study in studies:
            state.create_study(r, producer, topics, study)
    finally:
        producer.close()
    return topics


def service_env(rt: EmbeddedRuntime, topics: TopicSettings, **settings: str) -> dict[str, str]:
    """The environment of an `ipdp` process on ``rt`` and ``topics``: no metrics endpoint,
    warnings only, plus ``settings`` (IPDP_* names)."""
    return {**os.environ, **rt.env(), "IPDP_METRICS_PORT": "0", "IPDP_LOG_LEVEL": "WARNING",
            "IPDP_TOPIC_RECORDS": topics.records, "IPDP_TOPIC_MODELS": topics.models,
            "IPDP_TOPIC_DEAD_LETTER": topics.dead_letter, "IPDP_TOPIC_STUDIES": topics.studies,
            **settings}
