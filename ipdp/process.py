"""What every long-running ipdp process does the same way: logging, graceful stop, and backing
off after a failed Kafka or Redis call."""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)


def setup_logging(level: str | None = None) -> None:
    """Plain timestamped lines to stderr; level from IPDP_LOG_LEVEL (default INFO)."""
    logging.basicConfig(
        level=(level or os.environ.get("IPDP_LOG_LEVEL", "INFO")).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("kafka").setLevel(logging.WARNING)
    logging.getLogger("kafka.cluster").addFilter(_not_cancelled_at_close)
    logging.getLogger("kafka.net.selector").addFilter(_not_a_slow_task)


def _not_cancelled_at_close(record: logging.LogRecord) -> bool:
    """False for kafka-python's error about a metadata request that closing a client cancelled
    (its close shuts the connections before the metadata refresh): a clean stop, not a fault."""
    return not (record.levelno == logging.ERROR and isinstance(record.args, tuple)
                and any(type(arg).__name__ == "Cancelled" for arg in record.args))


def _not_a_slow_task(record: logging.LogRecord) -> bool:
    """False for kafka-python's warning that one step of its IO loop took over 0.1 s: its own
    debugging aid, which a busy host's scheduler trips with nothing wrong."""
    return not (record.levelno == logging.WARNING and "threshold). It is blocking the event "
                "loop" in record.getMessage())


def install_signal_handlers(stop_event: threading.Event) -> None:
    """SIGTERM and SIGINT finish the unit of work in progress, then stop."""

    def handler(signum, _frame) -> None:
        log.info("signal %d: stopping after the current step", signum)
        stop_event.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)

@dataclass
class Backoff:
    """Delays initial·2^k, capped at `maximum`, each drawn uniformly from [delay/2, delay]."""

    initial: float
    maximum: float
    attempt: int = 0

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
    from ipdp import metrics  # here: every command imports this module for setup_logging

    metrics.BACKEND_ERRORS.labels(backend, operation).inc()
    metrics.BACKEND_RETRIES.labels(backend).inc()
    delay = backoff.next()
    log.warning("%s %s failed (%s); retrying in %.1f s", backend, operation, exc, delay)
    stop_event.wait(delay)


_PR_SET_PDEATHSIG = 1


def stop_with_parent(signum: int = signal.SIGTERM) -> bool:
    """Ask Linux to send this process ``signum`` when its parent dies (PR_SET_PDEATHSIG), so a
    server's worker never outlives a supervisor killed without a chance to stop it; False where
    that is not available (another OS), or when the parent is already gone (then ``signum`` is
    sent at once).

    The parent is the process that started this one: for a multiprocessing child (granian's
    workers are) the pid multiprocessing recorded at the start, not ``os.getppid()`` now, which
    after an early death of the parent already names whoever adopted the orphan. Called from
    the main thread, ``signum`` gets its default action (stop) until the server installs its
    own handler: a forked worker inherits its parent's handler, which would swallow it."""
    import ctypes
    import multiprocessing
    import sys
    import threading

    if not sys.platform.startswith("linux"):
        return False
    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, signal.SIG_DFL)
    started_by = multiprocessing.parent_process()
    parent = started_by.pid if started_by is not None else os.getppid()
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    if prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signum)
        return False
    return True
