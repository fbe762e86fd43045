"""An ASGI app served by granian's embeddable server on a loopback port, in a thread: the same
Rust HTTP server `ipdp gateway` and `ipdp helper run` use, inside the test's process."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: granian's own logging config binds its handlers to the sys.stdout of the moment the server
#: is made: inside a test that is pytest's capture of that test, closed when the test ends, and
#: every later granian log line in the process would write to a closed file. Its loggers have
#: no handlers here and propagate to the root logger, which pytest's log capture reads.
PROPAGATE_TO_ROOT = {
    "handlers": {},
    "loggers": {"_granian": {"handlers": [], "propagate": True},
                "granian.access": {"handlers": [], "propagate": True}},
}


@contextmanager
def served(app, host: str, port: int, http1_settings=None) -> Iterator[str]:
    """Serve ``app`` on ``host``:``port`` until the block ends; yields its base URL (the caller
    waits for it to answer)."""
    from granian.constants import HTTPModes, Interfaces
    from granian.log import LogLevels
    from granian.server.embed import Server

    server = Server(app, address=host, port=port, interface=Interfaces.ASGI,
                    http=HTTPModes.http1, http1_settings=http1_settings, websockets=False,
                    log_level=LogLevels.warning, log_dictconfig=PROPAGATE_TO_ROOT)
    loop = asyncio.new_event_loop()
    done = loop.create_task(server.serve())
    thread = threading.Thread(target=loop.run_until_complete, args=(done,), daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{port}"
    finally:
        loop.call_soon_threadsafe(server.stop)
        thread.join(timeout=30)
        loop.close()
