"""`ipdp trainer run`: close round → solve → publish.

The trainer blocks on the Redis stream `ipdp:rounds`, to which the aggregator appends an entry in
the same transaction that closes a round — no polling of the statistics. Each entry is read
through a Redis consumer group and acknowledged only after the model is on the models topic
(acks=all) and the closed round's statistics are deleted, in one MULTI/EXEC. Before it is sent,
the model's JSON is stored in the closed round (field ``model``, the first one stored wins), so a
trainer killed anywhere in between re-reads its pending entry on restart and sends that same
model again: at least once, the same bytes under the same key, which consumers drop as a repeat
(a two-server round's dither is drawn once, and published_ms is not taken again).

A two-server study's round (trainer.two_server) needs the helper's share too: while the helper
cannot give it (its round not yet full, or unreachable) the entry stays pending, unacknowledged,
and is read again after IPDP_TRAINER_HELPER_RETRY_S; a round the two servers disagree on, or
whose sum fails a check, is refused like a round that does not hold n records.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import redis
from kafka.errors import KafkaError

from ipdp import accounting, metrics, state
from ipdp.accounting import compose
from ipdp.errors import MalformedValue, SignatureError, UnknownStudy
from ipdp.kafka_io import kafka_producer
from ipdp.model_message import ModelMessage, PrivacyReport, model_key, model_value
from ipdp.process import Backoff, install_signal_handlers, pause_after_failure
from ipdp.redis_io import check_redis, redis_client
from ipdp.settings import (
    KafkaSettings,
    LeaderTokenSettings,
    MetricsSettings,
    RedisSettings,
    TopicSettings,
    TrustSettings,
)
from ipdp.signing import load_signing_key
from ipdp.study import Study
from trainer.errors import DeferralReason, RefusalReason, RoundPending, RoundRefused
from trainer.settings import TrainerSettings
from trainer.solver import solve_constrained
from trainer.two_server import HelperShares, checked_text, combine_round, sum_bounds

log = logging.getLogger(__name__)

PUBLISH_TIMEOUT_S = 30.0
CLAIM_IDLE_MS = 60_000

#: Store the round's model unless one is stored (or the round is gone); the stored model, or nil.
_STORE_MODEL_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return false
end
redis.call('HSETNX', KEYS[1], 'model', ARGV[1])
return redis.call('HGET', KEYS[1], 'model')
"""


def train_round(study: Study, a: np.ndarray, b: np.ndarray, count: int, round_no: int,
                closed_ms: int) -> tuple[ModelMessage, float]:
    """Solve w = argmin_{‖w‖≤η} ½wᵀ(A + Δ_in I)w − bᵀw for one closed round of exactly n records.

    For a two-server study (a, b) are trainer.two_server.combine_round's, checked and dithered,
    and the report is the two-server calibration's. Returns the model and the solve's duration
    in seconds. The duration depends on the data (the eigendecomposition and the secular
    equation), so it goes to the operator's metric and log, never into the published message:
    only w and the report are released (docs/privacy.md).
    """
    if count != study.n:
        raise RoundRefused(RefusalReason.NOT_N, f"study {study.study_id} round {round_no} holds "
                           f"{count} records, not n={study.n}; no model is published")
    cal = study.calibration
    started = time.perf_counter()
    solution = solve_constrained(a + cal.delta_in * np.eye(study.d), b, study.eta)
    solve_s = time.perf_counter() - started
    # The study's guarantee after rounds 1 … round_no for a device in each once (at the
    # budget's δ when the study has a budget).
    composed = compose(cal.epsilon, cal.delta, round_no, study.budget_delta)
    two = study.two_server_calibration
    privacy = (PrivacyReport.from_calibration(cal, composed) if two is None else
               PrivacyReport.from_two_server(two, composed, checked_text(two, sum_bounds(two))))
    return ModelMessage(
        study_id=study.study_id, round=round_no, n=count, d=study.d, loss=study.loss,
        weights=solution.w.tolist(), constraint_active=solution.constrained,
        privacy=privacy, schema=study.schema_,
        round_closed_ms=closed_ms, published_ms=int(time.time() * 1000),
    ), solve_s


class Trainer:
    """Publishes one model per closed round."""

    def __init__(self, kafka: KafkaSettings, redis_settings: RedisSettings, topics: TopicSettings,
                 settings: TrainerSettings, trust: TrustSettings | None = None,
                 helper_token: str | None = None, helper_ca_file: str | None = None) -> None:
        self.topics, self.settings = topics, settings
        self.signing_key = load_signing_key(settings.signing_key) if settings.signing_key else None
        if self.signing_key is None:
            log.warning("trainer: no IPDP_TRAINER_SIGNING_KEY — models are published UNSIGNED; "
                        "consumers cannot tell them from anyone else's (docs/security.md)")
        else:
            log.info("trainer: signing models with key %s", self.signing_key.key_id)
        self.trusted = (trust or TrustSettings()).study_keys()
        self.redis = redis_client(redis_settings)
        check_redis(self.redis)
        state.upgrade_layout(self.redis)
        self.producer = kafka_producer(kafka)
        self.stop_event = threading.Event()
        self.published = 0
        self.helpers = HelperShares(helper_token, settings.helper_wait_s, self.stop_event,
                                    ca_file=helper_ca_file)
        self.pending_retry_at: float | None = None
        # Every model's report composes its study's rounds: pay dp-accounting's import (about a
        # second) now, not between the first round's close and its model.
        accounting.preload()
        try:
            self.redis.xgroup_create(state.ROUNDS_STREAM, settings.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def run(self, *, idle_exit_s: float | None = None) -> int:
        """Publish models until stopped; returns how many this process published."""
        backoff = Backoff(self.settings.retry_initial_s, self.settings.retry_max_s)
        pending_first = True
        idle_since = time.monotonic()
        while not self.stop_event.is_set():
            if self.pending_retry_at is not None and time.monotonic() >= self.pending_retry_at:
                # Deferred two-server rounds are this consumer's pending entries: read them again.
                self.pending_retry_at, pending_first = None, True
            try:
                entries = self._next_entries(pending_first)
                pending_first = False
                for entry_id, fields in entries:
                    self._handle(entry_id, fields)
                backoff.reset()
            except (redis.ConnectionError, redis.TimeoutError, KafkaError) as exc:
                backend = "kafka" if isinstance(exc, KafkaError) else "redis"
                pause_after_failure(backoff, self.stop_event, backend, "rounds", exc)
                pending_first = True
                continue
            if entries:
                idle_since = time.monotonic()
            elif idle_exit_s is not None and time.monotonic() - idle_since > idle_exit_s:
                break
        self.producer.close()
        self.helpers.close()
        self.redis.close()  # not left to the garbage collector, which may finalise its socket first
        return self.published

    def publish(self, message: ModelMessage) -> None:
        """Put the model on the models topic and wait for Kafka's acknowledgement (acks=all)."""
        self.producer.send(self.topics.models, key=model_key(message.study_id, message.round),
                           value=model_value(message, self.signing_key)).get(
                               timeout=PUBLISH_TIMEOUT_S)

    def _next_entries(self, pending_first: bool):
        group, consumer = self.settings.group, self.settings.consumer
        if pending_first:
            # Our own unacknowledged entries (we died mid-publish), then other dead consumers'.
            mine = self.redis.xreadgroup(group, consumer, {state.ROUNDS_STREAM: "0"}, count=100)
            entries = mine[0][1] if mine else []
            claimed = self.redis.xautoclaim(state.ROUNDS_STREAM, group, consumer,
                                            min_idle_time=CLAIM_IDLE_MS, count=100)
            entries += claimed[1]
            if entries:
                return entries
        got = self.redis.xreadgroup(group, consumer, {state.ROUNDS_STREAM: ">"}, count=10,
                                    block=self.settings.block_ms)
        return got[0][1] if got else []

    def _refuse(self, entry_id: bytes, sid: str, round_no: int, exc: Exception,
                reason: RefusalReason) -> None:
        """Publish nothing for this round, say why in the log and in Redis, and move on."""
        log.error("study %s round %d: %s", sid, round_no, exc)
        metrics.ROUNDS_REFUSED.labels(sid, reason.value).inc()
        self.redis.hset(state.StudyKeys(sid).published, str(round_no), f"refused: {exc}")
        self.redis.xack(state.ROUNDS_STREAM, self.settings.group, entry_id)

    def _defer(self, sid: str, round_no: int, exc: RoundPending) -> None:
        """Publish nothing yet and leave the entry pending: it is read again after
        helper_retry_s (or by the next trainer to start)."""
        if exc.reason == DeferralReason.NO_TOKEN:
            log.error("%s", exc)
        else:
            log.warning("%s; trying again in %g s", exc, self.settings.helper_retry_s)
        metrics.ROUNDS_DEFERRED.labels(sid, exc.reason.value).inc()
        if self.pending_retry_at is None:
            self.pending_retry_at = time.monotonic() + self.settings.helper_retry_s

    def _handle(self, entry_id: bytes, fields: dict) -> None:
        sid, round_no = fields[b"study"].decode(), int(fields[b"round"])
        metrics.start_at_zero(metrics.MODELS_PUBLISHED, (sid,))
        metrics.start_at_zero(metrics.MODELS_CONSTRAINED, (sid,))
        metrics.start_at_zero(metrics.ROUNDS_REFUSED, *((sid, r.value) for r in RefusalReason))
        keys = state.StudyKeys(sid)
        raw = self.redis.hgetall(keys.closed(round_no))
        stored = raw.get(b"model") or self._solve(entry_id, sid, round_no, raw)
        if stored is None:
            return
        message = ModelMessage.model_validate_json(stored)
        self.publish(message)
        # The study's keys in one transaction (one hash slot); the stream's acknowledgement after
        # it: a crash in between redelivers the entry, whose round is then found published.
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys.closed(round_no))
            pipe.hset(keys.published, str(round_no), message.published_ms)
            pipe.execute()
        self.redis.xack(state.ROUNDS_STREAM, self.settings.group, entry_id)
        self.published += 1
        metrics.MODELS_PUBLISHED.labels(sid).inc()
        if message.constraint_active:
            metrics.MODELS_CONSTRAINED.labels(sid).inc()
        metrics.ROUND_TO_MODEL_SECONDS.observe(
            max(0.0, (message.published_ms - message.round_closed_ms) / 1000))
        log.info("study %s round %d: model published (‖w‖=%.4g)", sid, round_no,
                 float(np.linalg.norm(message.weights)))

    def _solve(self, entry_id: bytes, sid: str, round_no: int, raw: dict) -> bytes | None:
        """The round's model JSON, solved and stored in the closed round; None when there is
        nothing to publish now (the round already published, refused or deferred)."""
        keys = state.StudyKeys(sid)
        if not raw:
            log.info("study %s round %d already published", sid, round_no)
            self.redis.xack(state.ROUNDS_STREAM, self.settings.group, entry_id)
            return None
        try:
            found = state.load_study(self.redis, sid, self.trusted)
        except (SignatureError, MalformedValue) as exc:
            metrics.STUDIES_REFUSED.labels("trainer").inc()
            self._refuse(entry_id, sid, round_no, exc, RefusalReason.UNTRUSTED_STUDY)
            return None
        if found is None:
            raise UnknownStudy(f"closed round for unknown study {sid}")
        study = found[0]
        if study.two_server is None:
            a, b = state.unpack_stats(raw[b"A"], raw[b"b"], study.d)
        else:
            metrics.start_at_zero(metrics.ROUNDS_DEFERRED,
                                  *((sid, r.value) for r in DeferralReason))
        try:
            if study.two_server is not None:
                a, b = combine_round(study, raw, self.helpers.fetch(study, round_no), round_no)
            message, solve_s = train_round(study, a, b, int(raw[b"count"]), round_no,
                                           int(raw[b"closed_ms"]))
        except RoundPending as exc:
            self._defer(sid, round_no, exc)
            return None
        except RoundRefused as exc:
            self._refuse(entry_id, sid, round_no, exc, exc.reason)
            return None
        except ValueError as exc:
            self._refuse(entry_id, sid, round_no, exc, RefusalReason.UNSOLVABLE)
            return None
        metrics.SOLVE_SECONDS.observe(solve_s)
        log.info("study %s round %d: solved in %.2f ms", sid, round_no, solve_s * 1000)
        stored = self.redis.eval(_STORE_MODEL_LUA, 1, keys.closed(round_no),
                                 message.model_dump_json())
        if stored is None:  # another trainer published it since the round was read
            log.info("study %s round %d already published", sid, round_no)
            self.redis.xack(state.ROUNDS_STREAM, self.settings.group, entry_id)
        return stored


def cmd_run(args) -> int:
    """Entry point of `ipdp trainer run`."""
    metrics.serve(MetricsSettings(), "trainer")
    metrics.start_studies_reader_at_zero("trainer", topic_values=False)
    metrics.start_backends_at_zero(("kafka", "rounds"), ("redis", "rounds"))
    # The leader's credential at a two-server study's helper: the variable the helper reads.
    leader = LeaderTokenSettings()
    token = leader.leader_token
    trainer = Trainer(KafkaSettings(), RedisSettings(), TopicSettings(), TrainerSettings(),
                      helper_token=None if token is None else token.get_secret_value(),
                      helper_ca_file=leader.ca_file)
    install_signal_handlers(trainer.stop_event)
    published = trainer.run(idle_exit_s=args.idle_exit)
    log.info("trainer stopped after publishing %d models", published)
    return 0
