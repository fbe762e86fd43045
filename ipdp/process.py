"""What every long-running ipdp process does the same way: logging and graceful stop."""

from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger(__name__)


def setup_logging(level: str | None = None) -> None:
    """Plain timestamped lines to stderr; level from IPDP_LOG_LEVEL (default INFO)."""
    logging.basicConfig(
        level=(level or os.environ.get("IPDP_LOG_LEVEL", "INFO")).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("kafka").setLevel(logging.WARNING)


def install_signal_handlers(stop_event: threading.Event) -> None:
    """SIGTERM and SIGINT finish the unit of work in progress, then stop."""

    def handler(signum, _frame) -> None:
        log.info("signal %d: stopping after the current step", signum)
        stop_event.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
