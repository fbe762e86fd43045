"""Capped exponential backoff with full jitter, shared by every retry loop."""

from __future__ import annotations

import logging
import random
import threading

from ipdp import metrics

log = logging.getLogger(__name__)


class Backoff:
    """Delays initial·2^k, capped at `maximum`, each drawn uniformly from [delay/2, delay]."""

    def __init__(self, initial: float, maximum: float) -> None:
        self.initial, self.maximum = initial, maximum
        self.attempt = 0

    def next(self) -> float:
        """The next delay in seconds."""
        delay = min(self.maximum, self.initial * 2**self.attempt)
        self.attempt += 1
        return random.uniform(delay / 2, delay)

    def reset(self) -> None:
        """After a success."""
        self.attempt = 0


def pause_after_failure(backoff: Backoff, stop_event: threading.Event, backend: str,
                        operation: str, exc: Exception) -> None:
    """Count a failed Kafka or Redis call and its retry, log it, then wait out the next delay
    (returning early if the process is asked to stop)."""
    metrics.BACKEND_ERRORS.labels(backend, operation).inc()
    metrics.BACKEND_RETRIES.labels(backend).inc()
    delay = backoff.next()
    log.warning("%s %s failed (%s); retrying in %.1f s", backend, operation, exc, delay)
    stop_event.wait(delay)
