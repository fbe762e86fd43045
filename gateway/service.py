"""`ipdp gateway`: the gateway's server (gateway.server) on uvloop, in one or more workers.

With ``workers`` > 1 the process opens the listening socket and forks that many workers, which
accept from it in turn; each builds its own app (its own Kafka producer, group commit, studies
follower and connection table). A worker that dies is replaced. SIGTERM or SIGINT stops
accepting, lets the requests in progress be answered, and exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time

from gateway.app import GatewayApp, create_app
from gateway.server import HttpServer
from gateway.settings import GatewaySettings
from ipdp.settings import KafkaSettings, TopicSettings

log = logging.getLogger(__name__)

__all__ = ["cmd_run", "listen", "serve", "serve_app", "worker_app"]

#: File descriptors a worker needs besides its client connections (Kafka, logs, the listener).
_SPARE_FDS = 256
#: How long a replaced worker's successor waits, so a worker that cannot start does not spin.
_RESTART_PAUSE_S = 1.0


def listen(settings: GatewaySettings) -> socket.socket:
    """The listening socket on ``host``:``port`` (IPv4 or IPv6, as the host is written)."""
    family = socket.getaddrinfo(settings.host, settings.port, type=socket.SOCK_STREAM,
                                flags=socket.AI_PASSIVE)[0][0]
    sock = socket.create_server((settings.host, settings.port), family=family, backlog=2048)
    sock.setblocking(False)
    return sock


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop (libuv) where it exists, asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def serve_app(app: GatewayApp, settings: GatewaySettings, sock: socket.socket,
                    stop: asyncio.Event) -> None:
    """Serve ``app`` on ``sock`` until ``stop`` is set, then drain (gateway.server)."""
    await HttpServer(app, settings).serve([sock], stop)


def worker_app(settings: GatewaySettings) -> GatewayApp:
    """The app of an ``ipdp gateway`` worker: the process is the gateway's alone."""
    return create_app(settings, owns_process=True)


def _run_worker(settings: GatewaySettings, sock: socket.socket) -> None:
    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await serve_app(worker_app(settings), settings, sock, stop)

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(main())


def _fork_worker(settings: GatewaySettings, sock: socket.socket) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        _run_worker(settings, sock)
        code = 0
    except BaseException:
        log.exception("gateway: worker %d failed", os.getpid())
    finally:
        logging.shutdown()
        os._exit(code)


def _supervise(settings: GatewaySettings, sock: socket.socket) -> None:
    """Fork the workers, replace any that dies, and stop them all on SIGTERM/SIGINT."""
    stopping = False
    workers: set[int] = set()

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True
        for pid in workers:
            os.kill(pid, signal.SIGTERM)

    for _ in range(settings.workers):
        workers.add(_fork_worker(settings, sock))
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while workers:
        pid, status = os.wait()
        workers.discard(pid)
        if not stopping:
            log.warning("gateway: worker %d exited (status %d); starting another", pid, status)
            time.sleep(_RESTART_PAUSE_S)
            workers.add(_fork_worker(settings, sock))


def _raise_fd_limit(settings: GatewaySettings) -> None:
    """Lift the soft file-descriptor limit toward the hard one so ``max_connections`` fit,
    twice: the connections, and as many refused ones held until their head deadline."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * settings.max_connections + _SPARE_FDS
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < needed:
            log.warning("gateway: ulimit -n is %d, below 2 × IPDP_GATEWAY_MAX_CONNECTIONS + "
                        "%d; lower the setting or raise the limit", target, _SPARE_FDS)


def serve(settings: GatewaySettings) -> None:
    """Run the gateway in the foreground until SIGINT/SIGTERM (requests in progress are
    answered first)."""
    _raise_fd_limit(settings)
    sock = listen(settings)
    log.info("gateway: http://%s:%d, %d worker(s), Kafka %s, records topic %s", settings.host,
             sock.getsockname()[1], settings.workers, KafkaSettings().bootstrap,
             TopicSettings().records)
    try:
        if settings.workers == 1:
            _run_worker(settings, sock)
        else:
            _supervise(settings, sock)
    finally:
        sock.close()


def cmd_run(args) -> int:
    """Entry point of `ipdp gateway` (flags override the IPDP_GATEWAY_* environment)."""
    overrides = {k: getattr(args, k) for k in ("host", "port", "workers")
                 if getattr(args, k, None) is not None}
    serve(GatewaySettings(**overrides))
    return 0
