"""`ipdp gateway`: serve the app with uvicorn (uvloop and httptools when installed)."""

from __future__ import annotations

import logging

from gateway.settings import GatewaySettings
from ipdp.settings import KafkaSettings, TopicSettings

log = logging.getLogger(__name__)

__all__ = ["cmd_run", "serve"]


def serve(settings: GatewaySettings) -> None:
    """Run the gateway in the foreground until SIGINT/SIGTERM (uvicorn drains requests first).

    Every worker process builds its own app through the factory, so each has its own Kafka
    producer and studies follower. Access logs are off: the metrics count requests, and a log
    line per request would cost more than the request's own checks.
    """
    import signal

    import uvicorn

    # uvicorn drains, then re-raises the SIGTERM it caught; exit 0 then, like the other roles.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    log.info("gateway: http://%s:%d, %d worker(s), Kafka %s, records topic %s", settings.host,
             settings.port, settings.workers, KafkaSettings().bootstrap, TopicSettings().records)
    uvicorn.run("gateway.app:create_app_from_env", factory=True, host=settings.host,
                port=settings.port, workers=settings.workers, access_log=False,
                log_level="warning", server_header=False)


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)


def cmd_run(args) -> int:
    """Entry point of `ipdp gateway` (flags override the IPDP_GATEWAY_* environment)."""
    overrides = {k: getattr(args, k) for k in ("host", "port", "workers")
                 if getattr(args, k, None) is not None}
    serve(GatewaySettings(**overrides))
    return 0
