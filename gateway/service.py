"""`ipdp gateway`: the gateway's ASGI app (gateway.app) on granian, in one or more workers.

granian (a Rust HTTP/1.1 server on hyper, through its public ``Granian`` class) parses the
requests, keeps the connections and forks the workers; each worker builds its own app
(:func:`gateway.app.worker_app`: its own Kafka producer, group commit and studies follower) and
a worker that dies is replaced. SIGTERM or SIGINT stops accepting, lets the requests in progress
be answered (the lifespan's shutdown flushes what is in flight), and exits 0.

Connection policy (connections per address and per network prefix, slow clients, body
spooling, TLS) is the edge's: a public gateway sits behind nginx (compose/nginx/ipdp.conf,
docs/operations.md "The gateway"). The settings here bound what reaches the app: the head's
size and how long it may take.
"""

from __future__ import annotations

import logging

from gateway.settings import GatewaySettings
from ipdp.settings import KafkaSettings, TopicSettings

log = logging.getLogger(__name__)

__all__ = ["cmd_run", "granian_server", "serve"]

#: The app factory every worker imports.
APP_FACTORY = "gateway.app:worker_app"
#: hyper's least read buffer: a request head must fit in it.
_LEAST_BUFFER = 8192


def http1_settings(settings: GatewaySettings):
    """granian's HTTP/1.1 settings from the gateway's: the head's deadline and largest size."""
    from granian.http import HTTP1Settings

    return HTTP1Settings(header_read_timeout=round(settings.header_timeout_s * 1000),
                         keep_alive=True,
                         max_buffer_size=max(_LEAST_BUFFER, settings.max_header_bytes))


def granian_server(settings: GatewaySettings):
    """The granian server of ``settings``: ``workers`` processes on ``host``:``port``."""
    from granian import Granian
    from granian.constants import HTTPModes, Interfaces, Loops
    from granian.log import LogLevels

    return Granian(APP_FACTORY, factory=True, address=settings.host, port=settings.port,
                   interface=Interfaces.ASGI, workers=settings.workers, loop=Loops.uvloop,
                   http=HTTPModes.http1, http1_settings=http1_settings(settings),
                   websockets=False, backlog=2048, respawn_failed_workers=True,
                   log_level=LogLevels.warning, log_access=False)


def serve(settings: GatewaySettings) -> None:
    """Run the gateway in the foreground until SIGINT/SIGTERM (requests in progress are
    answered first)."""
    log.info("gateway: http://%s:%d, %d worker(s), Kafka %s, records topic %s", settings.host,
             settings.port, settings.workers, KafkaSettings().bootstrap, TopicSettings().records)
    granian_server(settings).serve()


def cmd_run(args) -> int:
    """Entry point of `ipdp gateway` (flags override the IPDP_GATEWAY_* environment; the
    workers read the rest of their settings from it)."""
    overrides = {k: getattr(args, k) for k in ("host", "port", "workers")
                 if getattr(args, k, None) is not None}
    serve(GatewaySettings(**overrides))
    return 0
