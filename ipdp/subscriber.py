"""Reading published models: every message on the models topic, each (study, round) once.

The trainer publishes at least once (docs/architecture.md), so a model can appear twice; a
:class:`ModelSubscriber` drops the repeat. It assigns every partition itself (no consumer group),
so any number of subscribers each see the whole topic, and none waits for a group rebalance.

A subscriber that pins trainer keys (``trusted_keys``, or IPDP_TRUSTED_MODEL_KEYS) yields only
models whose signature verifies under one of them; anything else is dropped, logged and counted
(``.refused``, ``ipdp_models_refused_total``), never shown.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from typing import Self

from ipdp.errors import SignatureError
from ipdp.kafka_io import assign_all, kafka_consumer, read_to_end
from ipdp.metrics import MODELS_REFUSED
from ipdp.model_message import ModelMessage, parse_model_value
from ipdp.settings import KafkaSettings, TopicSettings, TrustSettings
from ipdp.signing import TrustedKeys, parse_trusted_keys, warn_once
from ipdp.topic_values import skip_malformed

log = logging.getLogger(__name__)

__all__ = ["ModelSubscriber"]

class ModelSubscriber:
    """Iterate over published models.

    ``study_id`` restricts to one study. ``from_beginning`` starts at the first retained message
    (else at the end: only new models). ``follow=False`` stops at the end offsets taken when
    iteration starts; ``follow=True`` waits for new models until :meth:`stop` (or the iterator is
    closed); both yield models in topic order. ``.duplicates_dropped`` counts repeats of a (study, round) already yielded;
    ``.invalid`` counts values that cannot be read as a ModelMessage (skipped, logged with their
    offset, counted in ``ipdp_topic_values_malformed_total``; ipdp.topic_values).
    ``trusted_keys`` pins trainer public keys (base64 lines, ``.pub`` paths or a TrustedKeys;
    None: IPDP_TRUSTED_MODEL_KEYS); ``.refused`` counts messages dropped for their signature.
    """

    def __init__(self, kafka: KafkaSettings, topics: TopicSettings, study_id: str | None = None,
                 from_beginning: bool = True, *, follow: bool = False,
                 poll_timeout_ms: int = 500, metadata_timeout_s: float = 10.0,
                 trusted_keys: TrustedKeys | str | Iterable[str] | None = None):
        self.kafka = kafka
        self.topic = topics.models
        self.max_value_bytes = topics.max_value_bytes
        self.study_id = study_id
        self.from_beginning = from_beginning
        self.follow = follow
        self.poll_timeout_ms = poll_timeout_ms
        self.metadata_timeout_s = metadata_timeout_s
        if trusted_keys is None:
            trusted_keys = TrustSettings().model_keys()
        elif not isinstance(trusted_keys, TrustedKeys):
            trusted_keys = parse_trusted_keys(trusted_keys)
        self.trusted = trusted_keys
        if not self.trusted:  # once per process: callers that poll re-create us
            warn_once(log, ("models", self.topic),
                      "no trusted model key pinned: models are shown UNVERIFIED; anyone who can "
                      "write %r can publish one. Pin the trainer's public key: "
                      "IPDP_TRUSTED_MODEL_KEYS=PREFIX.pub, or --trust (docs/security.md)",
                      self.topic)
        #: The models-topic value (signed envelope or plain JSON) of the model last yielded:
        #: what `ipdp models --export` writes, so that the file can be verified again.
        self.last_value: bytes | None = None
        self.duplicates_dropped = 0
        self.invalid = 0
        self.refused = 0
        self._seen: set[tuple[str, int]] = set()
        self._stop = threading.Event()
        self._consumer = None

    def stop(self) -> None:
        """Make a following iteration return after its current poll (thread-safe)."""
        self._stop.set()

    def close(self) -> None:
        """Stop and close the consumer (from the iterating thread; elsewhere use :meth:`stop`)."""
        self.stop()
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self):
        consumer = kafka_consumer(self.kafka, group_id=None, enable_auto_commit=False,
                                  bootstrap_timeout_ms=int(self.metadata_timeout_s * 1000))
        try:
            tps = assign_all(consumer, self.topic, self.metadata_timeout_s, label="models topic")
        except TimeoutError:
            consumer.close()
            raise
        if self.from_beginning:
            consumer.seek_to_beginning(*tps)
        else:
            consumer.seek_to_end(*tps)
            # tansu's end offset can sit inside the last batch (see read_to_end): skip what is
            # already there so that only models published from now on are seen.
            for _ in read_to_end(consumer, tps, poll_ms=self.poll_timeout_ms, stop=self._stop):
                pass
        return consumer, tps

    def _accept(self, message) -> ModelMessage | None:
        if message.value is None:
            return None
        try:
            msg = parse_model_value(message.value, self.trusted, self.max_value_bytes)
        except SignatureError as exc:
            self.refused += 1
            MODELS_REFUSED.inc()
            log.error("dropping model message at %s[%s] offset %s: %s", message.topic,
                      message.partition, message.offset, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - no value on the topic may stop the reader
            self.invalid += 1
            skip_malformed("models", "subscriber", message, exc)
            return None
        if self.study_id is not None and msg.study_id != self.study_id:
            return None
        ident = (msg.study_id, msg.round)
        if ident in self._seen:
            self.duplicates_dropped += 1
            return None
        self._seen.add(ident)
        self.last_value = bytes(message.value)
        return msg

    def _follow(self, consumer) -> Iterator:
        while not self._stop.is_set():
            for msgs in consumer.poll(timeout_ms=self.poll_timeout_ms).values():
                yield from msgs

    def __iter__(self) -> Iterator[ModelMessage]:
        consumer, tps = self._open()
        self._consumer = consumer
        try:
            if self.follow:
                records = self._follow(consumer)
            else:
                records = read_to_end(consumer, tps, poll_ms=self.poll_timeout_ms,
                                      stop=self._stop)
            for m in records:
                msg = self._accept(m)
                if msg is not None:
                    yield msg
        finally:
            consumer.close()
            self._consumer = None
