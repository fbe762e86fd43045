"""`ipdp gateway`: serve the app with uvicorn (uvloop, and httptools with the gateway's limits)."""

from __future__ import annotations

import functools
import logging

from gateway.protocol import BoundedHttpToolsProtocol
from gateway.settings import GatewaySettings
from ipdp.settings import KafkaSettings, TopicSettings

log = logging.getLogger(__name__)

__all__ = ["cmd_run", "serve", "uvicorn_options"]

#: File descriptors a worker needs besides its client connections (Kafka, logs, the listener).
_SPARE_FDS = 256


def uvicorn_options(settings: GatewaySettings) -> dict:
    """The uvicorn options every gateway server uses (`ipdp gateway` and the tests alike).

    Access logs are off: the metrics count requests, and a log line per request would cost more
    than the request's own checks. uvicorn's proxy headers are off: its middleware rewrites the
    client address of requests that pass through the ASGI app, and the device lane does not
    (gateway.protocol); the client address the rate limit keys on comes from
    gateway.client_address instead, which believes X-Forwarded-For from trusted proxies only.
    """
    return {"host": settings.host, "port": settings.port, "access_log": False,
            "log_level": "warning", "server_header": False, "proxy_headers": False,
            "http": functools.partial(BoundedHttpToolsProtocol, limits=settings),
            "timeout_keep_alive": settings.keep_alive_timeout_s}


def _raise_fd_limit(settings: GatewaySettings) -> None:
    """Lift the soft file-descriptor limit toward the hard one so ``max_connections`` fit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = settings.max_connections + _SPARE_FDS
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < needed:
            log.warning("gateway: ulimit -n is %d, below IPDP_GATEWAY_MAX_CONNECTIONS + %d; "
                        "lower the setting or raise the limit", target, _SPARE_FDS)


def serve(settings: GatewaySettings) -> None:
    """Run the gateway in the foreground until SIGINT/SIGTERM (uvicorn drains requests first).

    Every worker process builds its own app through the factory, so each has its own Kafka
    producer, group commit and studies follower.
    """
    import signal

    import uvicorn

    # uvicorn drains, then re-raises the SIGTERM it caught; exit 0 then, like the other roles.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    _raise_fd_limit(settings)
    log.info("gateway: http://%s:%d, %d worker(s), Kafka %s, records topic %s", settings.host,
             settings.port, settings.workers, KafkaSettings().bootstrap, TopicSettings().records)
    uvicorn.run("gateway.app:create_app_from_env", factory=True, workers=settings.workers,
                **uvicorn_options(settings))


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)


def cmd_run(args) -> int:
    """Entry point of `ipdp gateway` (flags override the IPDP_GATEWAY_* environment)."""
    overrides = {k: getattr(args, k) for k in ("host", "port", "workers")
                 if getattr(args, k, None) is not None}
    serve(GatewaySettings(**overrides))
    return 0
