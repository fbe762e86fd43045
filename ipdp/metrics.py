"""Every Prometheus metric ipdp exports, in one place (docs/operations.md lists them), and the
registry of each role: a role's /metrics shows its own metrics only.

Names follow Prometheus conventions: base units in the name, `_total` on counters.

No metric is in prometheus_client's global registry: each one is registered in the registries
of the roles that update it (:func:`role_registry`), and in :data:`EVERY_METRIC`, which no
endpoint serves (in-process readers, such as the tests, read it).
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Literal

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

from ipdp.errors import MALFORMED_REASONS, ConfigurationError
from ipdp.settings import MetricsSettings

log = logging.getLogger(__name__)

Role = Literal["aggregator", "trainer", "gateway", "loadgen", "helper"]

#: Every ipdp metric; served by no endpoint (see the module docstring).
EVERY_METRIC = CollectorRegistry(auto_describe=True)


def _every(metric):
    EVERY_METRIC.register(metric)
    return metric


def _counter(name: str, documentation: str, labels=()) -> Counter:
    return _every(Counter(name, documentation, labels, registry=None))


def _gauge(name: str, documentation: str, labels=()) -> Gauge:
    return _every(Gauge(name, documentation, labels, registry=None))


def _histogram(name: str, documentation: str, labels=(), *, buckets) -> Histogram:
    return _every(Histogram(name, documentation, labels, registry=None, buckets=buckets))


RECORDS_CONSUMED = _counter(
    "ipdp_records_consumed_total", "Records read from the records topic.", ["partition"])
RECORDS_FOLDED = _counter(
    "ipdp_records_folded_total", "Records folded into sufficient statistics.", ["study"])
RECORDS_DEAD_LETTERED = _counter(
    "ipdp_records_dead_lettered_total", "Records sent to the dead-letter topic.", ["reason"])
FOLD_BATCH_RECORDS = _histogram(
    "ipdp_fold_batch_records", "Records per atomic fold commit.",
    buckets=(1, 10, 50, 100, 500, 1000, 2000, 5000, 10000, 50000))
FOLD_SECONDS = _histogram(
    "ipdp_fold_seconds", "Decode + validate + fold + atomic Redis commit, per batch.",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
FOLD_CONFLICTS = _counter(
    "ipdp_fold_conflicts_total", "Fold transactions retried because another writer raced.")
CONSUMER_LAG = _gauge(
    "ipdp_consumer_lag_records", "Records behind the end of the partition.", ["partition"])
PARTITIONS_PAUSED = _gauge(
    "ipdp_partitions_paused",
    "Partitions this aggregator holds paused: their log does not match Redis's offsets.")
PARTITION_PAUSES = _counter(
    "ipdp_partition_pauses_total",
    "Partitions paused because their log was replaced or truncated, or the offset vanished.",
    ["reason"])
ROUND_RECORDS = _gauge(
    "ipdp_round_records", "Records folded into the open round.", ["study"])
ROUND_TARGET = _gauge("ipdp_round_target_records", "Records per round (n).", ["study"])
ROUND_PROGRESS = _gauge(
    "ipdp_round_progress_ratio", "Open round's count / n.", ["study"])
ROUNDS_CLOSED = _counter("ipdp_rounds_closed_total", "Rounds closed at n records.", ["study"])
MODELS_PUBLISHED = _counter(
    "ipdp_models_published_total", "Models published to the models topic.", ["study"])
MODELS_CONSTRAINED = _counter(
    "ipdp_models_constraint_active_total",
    "Published models whose norm constraint ‖w‖ ≤ η binds (a larger η may fit better).",
    ["study"])
ROUNDS_REFUSED = _counter(
    "ipdp_rounds_refused_total",
    "Closed rounds the trainer refused to publish, by reason (trainer.errors.RefusalReason: "
    "not exactly n records, unsolvable, or a two-server round the servers disagree on or whose "
    "sum fails a check).",
    ["study", "reason"])
ROUNDS_DEFERRED = _counter(
    "ipdp_rounds_deferred_total",
    "Two-server rounds the trainer left pending because the helper's share could not be had "
    "(trainer.errors.DeferralReason); each is read again later.",
    ["study", "reason"])
SOLVE_SECONDS = _histogram(
    "ipdp_solve_seconds", "Time to solve one round's constrained problem.",
    buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5))
ROUND_TO_MODEL_SECONDS = _histogram(
    "ipdp_round_to_model_seconds", "From the round's closing fold to the published model.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
LOADGEN_RECORDS_SENT = _counter(
    "ipdp_loadgen_records_sent_total", "Records the load generator produced.", ["study"])
LOADGEN_SEND_ERRORS = _counter(
    "ipdp_loadgen_send_errors_total", "Records the load generator failed to produce.", ["study"])
LOADGEN_VALUES_CLIPPED = _counter(
    "ipdp_loadgen_values_clipped_total",
    "Values of the CSV rows the load generator sends for a schema study that lie outside their "
    "column's public range, so its devices clip them.", ["study", "column"])
HELPER_REQUESTS = _counter(
    "ipdp_helper_requests_total", "HTTP requests the helper answered.", ["route", "status"])
HELPER_RECORDS = _counter(
    "ipdp_helper_records_total",
    "Records of the jobs the helper prepared, by outcome: accepted, or its reason to refuse.",
    ["study", "outcome"])
HELPER_RECORDS_FOLDED = _counter(
    "ipdp_helper_records_folded_total", "Records whose share the helper folded into a round.",
    ["study"])
HELPER_CALLS = _counter(
    "ipdp_helper_calls_total",
    "The leader's calls to a two-server study's helper, by call (prepare, commit) and outcome "
    "(ok, refused, unavailable).", ["call", "outcome"])
HELPER_RECORDS_REFUSED = _counter(
    "ipdp_helper_records_refused_total",
    "Records of two-server studies the helper refused, which the leader dead-lettered "
    "helper_refused, by the helper's reason.", ["reason"])
HELPER_COMMITS_PENDING = _gauge(
    "ipdp_helper_commits_pending",
    "Helper commits the leader's journal still owes (entries of ipdp:{<id>}:helper-pending) "
    "after the last re-send.")
GATEWAY_REQUESTS = _counter(
    "ipdp_gateway_requests_total", "HTTP requests the gateway answered.", ["route", "status"])
GATEWAY_RECORDS_ACCEPTED = _counter(
    "ipdp_gateway_records_accepted_total",
    "Records the gateway answered 202 for (Kafka acknowledged them).")
GATEWAY_RECORDS_REJECTED = _counter(
    "ipdp_gateway_records_rejected_total",
    "Records in requests the gateway refused, by the request's reason.", ["reason"])
GATEWAY_REFUSALS = _counter(
    "ipdp_gateway_refusals_total",
    "Requests the gateway answered with a 4xx or 503, by reason (a 429 is rate_limited).",
    ["reason"])
GATEWAY_REQUEST_SECONDS = _histogram(
    "ipdp_gateway_request_seconds",
    "POST records: from the request's admission to its answer (Kafka's acknowledgement "
    "included).",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10))
GATEWAY_KAFKA_SECONDS = _histogram(
    "ipdp_gateway_kafka_produce_seconds",
    "From handing a container to the producer to Kafka's acks=all acknowledgement.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
GATEWAY_CONTAINER_RECORDS = _histogram(
    "ipdp_gateway_container_records",
    "Records per Kafka message the gateway's group commit acknowledged (records of many "
    "requests share one container).",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096))
STUDIES_REFUSED = _counter(
    "ipdp_studies_refused_total",
    "Study definitions refused because their signature does not verify under a trusted key.",
    ["reader"])
MODELS_REFUSED = _counter(
    "ipdp_models_refused_total",
    "Model messages dropped because their signature does not verify under a trusted key.")
TOPIC_VALUES_MALFORMED = _counter(
    "ipdp_topic_values_malformed_total",
    "Studies-topic or models-topic values skipped because they cannot be read (too large, not "
    "UTF-8 JSON, nested too deeply, not an object, invalid fields or numbers).",
    ["topic", "reader", "reason"])
BACKEND_ERRORS = _counter(
    "ipdp_backend_errors_total", "Errors talking to Kafka, Redis or a two-server study's helper.",
    ["backend", "operation"])
BACKEND_RETRIES = _counter(
    "ipdp_backend_retries_total", "Retries after a Kafka, Redis or helper error.", ["backend"])



#: Metrics more than one role updates: each of those roles serves them.
_STUDIES = (STUDIES_REFUSED,)
_BACKENDS = (BACKEND_ERRORS, BACKEND_RETRIES)
_ROLE_METRICS: dict[str, tuple] = {
    "aggregator": (RECORDS_CONSUMED, RECORDS_FOLDED, RECORDS_DEAD_LETTERED, FOLD_BATCH_RECORDS,
                   FOLD_SECONDS, FOLD_CONFLICTS, CONSUMER_LAG, PARTITIONS_PAUSED,
                   PARTITION_PAUSES, ROUND_RECORDS, ROUND_TARGET, ROUND_PROGRESS, ROUNDS_CLOSED,
                   HELPER_CALLS, HELPER_RECORDS_REFUSED, HELPER_COMMITS_PENDING,
                   *_STUDIES, *_BACKENDS),
    "trainer": (MODELS_PUBLISHED, MODELS_CONSTRAINED, ROUNDS_REFUSED, ROUNDS_DEFERRED,
                SOLVE_SECONDS, ROUND_TO_MODEL_SECONDS,
                *_STUDIES, *_BACKENDS),
    "gateway": (GATEWAY_REQUESTS, GATEWAY_REFUSALS, GATEWAY_REQUEST_SECONDS,
                GATEWAY_RECORDS_ACCEPTED, GATEWAY_RECORDS_REJECTED,
                GATEWAY_KAFKA_SECONDS, GATEWAY_CONTAINER_RECORDS, TOPIC_VALUES_MALFORMED,
                *_STUDIES),
    "helper": (HELPER_REQUESTS, HELPER_RECORDS, HELPER_RECORDS_FOLDED),
    "loadgen": (LOADGEN_RECORDS_SENT, LOADGEN_SEND_ERRORS, LOADGEN_VALUES_CLIPPED,
                TOPIC_VALUES_MALFORMED, *_STUDIES),
}


def start_at_zero(metric, *label_values: tuple[str, ...]) -> None:
    """Create these labelled series at 0 when a role starts: a series that appears only with
    its first event has no rate or increase for that event, and a dashboard shows nothing
    until it happens (Prometheus's advice: export the label values known in advance)."""
    for values in label_values:
        metric.labels(*values)


def start_studies_reader_at_zero(reader: str, topic_values: bool = True) -> None:
    """The series of a reader of studies (``reader``: the label it counts under); with
    ``topic_values``, of the studies topic's unreadable values too."""
    start_at_zero(STUDIES_REFUSED, (reader,))
    if topic_values:
        start_at_zero(TOPIC_VALUES_MALFORMED,
                      *(("studies", reader, reason) for reason in MALFORMED_REASONS))


def start_backends_at_zero(*operations: tuple[str, str]) -> None:
    """The series of a role's Kafka and Redis errors, by (backend, operation), and retries."""
    start_at_zero(BACKEND_ERRORS, *operations)
    start_at_zero(BACKEND_RETRIES, *{(backend,) for backend, _ in operations})


@cache
def role_registry(role: Role) -> CollectorRegistry:
    """The registry a role's /metrics serves: its own metrics and the process's (CPU, memory,
    file descriptors, garbage collector)."""
    registry = CollectorRegistry(auto_describe=True)
    for metric in (*_ROLE_METRICS[role], PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(metric)
    return registry


#: Each role's metrics port when IPDP_METRICS_PORT is unset (compose sets the same ones), so
#: the roles on one machine do not contend for one; the gateway serves /metrics on its own.
DEFAULT_PORTS: dict[str, int] = {"aggregator": 9100, "trainer": 9101, "loadgen": 9102}


def serve(settings: MetricsSettings, role: Role) -> int | None:
    """Start the role's /metrics HTTP endpoint (on IPDP_METRICS_PORT, else the role's default
    port; 0 turns it off); returns the port, or None without an endpoint.

    A port set in IPDP_METRICS_PORT that is taken is a ConfigurationError (the command's one
    line); a taken default port is one warning and no endpoint, as a second aggregator on
    one machine finds it."""
    port = settings.port if settings.port is not None else DEFAULT_PORTS[role]
    if not port:
        return None
    try:
        start_http_server(port, addr=settings.host, registry=role_registry(role))
    except OSError as exc:
        taken = f"{settings.host}:{port}: {exc.strerror or exc}"
        if settings.port is None:
            log.warning("no /metrics endpoint: the %s's default metrics port %s; set "
                        "IPDP_METRICS_PORT to a free port, or 0 to turn the endpoint off",
                        role, taken)
            return None
        raise ConfigurationError(f"cannot serve metrics on IPDP_METRICS_PORT {taken}; set it "
                                 "to a free port, or 0 to turn the endpoint off") from None
    log.info("metrics on http://%s:%d/metrics", settings.host, port)
    return port
