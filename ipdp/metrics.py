"""Every Prometheus metric ipdp exports, in one place (docs/operations.md lists them).

Names follow Prometheus conventions: base units in the name, `_total` on counters.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from ipdp.settings import MetricsSettings

log = logging.getLogger(__name__)

RECORDS_CONSUMED = Counter(
    "ipdp_records_consumed_total", "Records read from the records topic.", ["partition"])
RECORDS_FOLDED = Counter(
    "ipdp_records_folded_total", "Records folded into sufficient statistics.", ["study"])
RECORDS_DEAD_LETTERED = Counter(
    "ipdp_records_dead_lettered_total", "Records sent to the dead-letter topic.", ["reason"])
FOLD_BATCH_RECORDS = Histogram(
    "ipdp_fold_batch_records", "Records per atomic fold commit.",
    buckets=(1, 10, 50, 100, 500, 1000, 2000, 5000, 10000, 50000))
FOLD_SECONDS = Histogram(
    "ipdp_fold_seconds", "Decode + validate + fold + atomic Redis commit, per batch.",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
FOLD_CONFLICTS = Counter(
    "ipdp_fold_conflicts_total", "Fold transactions retried because another writer raced.")
CONSUMER_LAG = Gauge(
    "ipdp_consumer_lag_records", "Records behind the end of the partition.", ["partition"])
PARTITIONS_PAUSED = Gauge(
    "ipdp_partitions_paused",
    "Partitions this aggregator holds paused: their log does not match Redis's offsets.")
PARTITION_PAUSES = Counter(
    "ipdp_partition_pauses_total",
    "Partitions paused because their log was replaced or truncated, or the offset vanished.",
    ["reason"])
ROUND_RECORDS = Gauge(
    "ipdp_round_records", "Records folded into the open round.", ["study"])
ROUND_TARGET = Gauge("ipdp_round_target_records", "Records per round (n).", ["study"])
ROUND_PROGRESS = Gauge(
    "ipdp_round_progress_ratio", "Open round's count / n.", ["study"])
ROUNDS_CLOSED = Counter("ipdp_rounds_closed_total", "Rounds closed at n records.", ["study"])
MODELS_PUBLISHED = Counter(
    "ipdp_models_published_total", "Models published to the models topic.", ["study"])
ROUNDS_REFUSED = Counter(
    "ipdp_rounds_refused_total",
    "Closed rounds the trainer refused to publish (not exactly n records, or unsolvable).",
    ["study"])
SOLVE_SECONDS = Histogram(
    "ipdp_solve_seconds", "Time to solve one round's constrained problem.",
    buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5))
ROUND_TO_MODEL_SECONDS = Histogram(
    "ipdp_round_to_model_seconds", "From the round's closing fold to the published model.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
LOADGEN_RECORDS_SENT = Counter(
    "ipdp_loadgen_records_sent_total", "Records the load generator produced.", ["study"])
LOADGEN_SEND_ERRORS = Counter(
    "ipdp_loadgen_send_errors_total", "Records the load generator failed to produce.", ["study"])
GATEWAY_REQUESTS = Counter(
    "ipdp_gateway_requests_total", "HTTP requests the gateway answered.", ["route", "status"])
GATEWAY_RECORDS_ACCEPTED = Counter(
    "ipdp_gateway_records_accepted_total",
    "Records the gateway answered 202 for (Kafka acknowledged them).")
GATEWAY_RECORDS_REJECTED = Counter(
    "ipdp_gateway_records_rejected_total",
    "Records in requests the gateway refused, by the request's reason.", ["reason"])
GATEWAY_KAFKA_SECONDS = Histogram(
    "ipdp_gateway_kafka_produce_seconds",
    "From handing a request's container(s) to the producer to Kafka's acks=all acknowledgement.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
STUDIES_REFUSED = Counter(
    "ipdp_studies_refused_total",
    "Study definitions refused because their signature does not verify under a trusted key.",
    ["reader"])
MODELS_REFUSED = Counter(
    "ipdp_models_refused_total",
    "Model messages dropped because their signature does not verify under a trusted key.")
TOPIC_VALUES_MALFORMED = Counter(
    "ipdp_topic_values_malformed_total",
    "Studies-topic or models-topic values skipped because they cannot be read (too large, not "
    "UTF-8 JSON, nested too deeply, not an object, invalid fields or numbers).",
    ["topic", "reader", "reason"])
BACKEND_ERRORS = Counter(
    "ipdp_backend_errors_total", "Errors talking to Kafka or Redis.", ["backend", "operation"])
BACKEND_RETRIES = Counter(
    "ipdp_backend_retries_total", "Retries after a Kafka or Redis error.", ["backend"])


def serve(settings: MetricsSettings) -> int | None:
    """Start the /metrics HTTP endpoint when a port is configured; returns the port."""
    if not settings.port:
        return None
    start_http_server(settings.port, addr=settings.host)
    log.info("metrics on http://%s:%d/metrics", settings.host, settings.port)
    return settings.port
