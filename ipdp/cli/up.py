"""`ipdp up`: the embedded broker and redis-server, until SIGINT or SIGTERM.

Prints the `export IPDP_…` lines other commands read; `--env-file PATH` also writes them to PATH
once both servers answer, so a script can wait for the file and source it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ipdp.settings import TopicSettings

#: Each server's share of a stop before it is SIGKILLed: both together well within 10 s.
STOP_TIMEOUT_S = 3.0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register `up`."""
    p = sub.add_parser(
        "up", help="Start the embedded Kafka-protocol broker and redis-server.",
        description="Starts tansu and redis-server on free loopback ports, creates the topics, "
        "prints the `export IPDP_...` lines and runs until SIGINT (Ctrl-C) or SIGTERM, which "
        "stop both servers. A redis-server that dies is restarted on its port and data "
        "directory (its append-only file holds every acknowledged write); exit status 0 after "
        "a clean stop, 1 if the broker died or redis-server could not be restarted.")
    p.add_argument("--dir", dest="directory", default=None, metavar="PATH",
                   help="Keep logs and Redis's AOF here (default: a temporary directory, removed "
                   "at exit).")
    p.add_argument("--env-file", dest="env_file", default=None, metavar="PATH",
                   help="Also write the export lines to PATH once the servers are ready.")
    p.add_argument("--kafka-port", dest="kafka_port", type=int, default=0, metavar="PORT",
                   help="Broker port (default: a free one).")
    p.add_argument("--redis-port", dest="redis_port", type=int, default=0, metavar="PORT",
                   help="Redis port (default: a free one).")
    p.set_defaults(func=cmd_up)


def cmd_up(args: argparse.Namespace) -> int:
    """Entry point of `ipdp up`."""
    return run_up(directory=args.directory, kafka_port=args.kafka_port,
                  redis_port=args.redis_port, env_file=args.env_file)


def run_up(
    wait_forever: bool = True,
    *,
    directory: str | os.PathLike[str] | None = None,
    kafka_port: int = 0,
    redis_port: int = 0,
    redis_password: str | None = None,
    topics: TopicSettings | None = None,
    out: IO[str] | None = None,
    env_file: str | os.PathLike[str] | None = None,
) -> int:
    """``ipdp up``: start the runtime, print how to reach it, block until SIGINT/SIGTERM.

    Returns 0 after a clean shutdown, 1 if the servers could not start, the broker died
    underneath us or a dead redis-server could not be restarted (a dead redis-server is
    restarted on its port and data directory, the broker left running). With ``wait_forever=False`` it shuts down right after printing (a smoke check).
    """
    from ipdp.embedded.children import tail
    from ipdp.embedded.runtime import EmbeddedRuntime
    from ipdp.errors import IpdpError

    out = out if out is not None else sys.stdout
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)
        stop.set()

    in_main = threading.current_thread() is threading.main_thread()
    previous: dict[int, Any] = {}
    if in_main:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    rt = EmbeddedRuntime(
        directory,
        topics=topics,
        redis_password=redis_password,
        kafka_port=kafka_port,
        redis_port=redis_port,
        stop_timeout_s=STOP_TIMEOUT_S,
    )
    rc = 0
    try:
        try:
            rt.start()
        except (IpdpError, RuntimeError) as exc:
            print(f"ipdp up: {exc}", file=sys.stderr, flush=True)
            return 1
        print(f"# ipdp embedded runtime in {rt.directory}", file=out)
        print(f"# kafka (tansu) {rt.broker.bootstrap}  pid {rt.broker.pid}", file=out)
        print(f"# redis         {rt.redis.url}  pid {rt.redis.pid}", file=out)
        t = rt.topics
        print(
            f"# topics        {t.records} ({t.records_partitions} partitions), {t.models}, "
            f"{t.dead_letter}, {t.studies} (compacted)",
            file=out,
        )
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in rt.env().items())
        print(exports, end="", file=out)
        if env_file is not None:
            _write_atomically(Path(env_file), exports)
        print("# Ctrl-C (SIGINT) or SIGTERM stops both servers.", file=out, flush=True)
        out.flush()
        if wait_forever:
            while not stop.wait(0.5):
                if not rt.broker.running:
                    # Memory storage: the log is gone, and a new broker would hand the aggregator
                    # an empty one (it pauses every partition as log_replaced). Stop loudly.
                    print(f"# {rt.broker.name} exited unexpectedly; last lines of "
                          f"{rt.broker.log_path}:\n{tail(rt.broker.log_path)}",
                          file=sys.stderr, flush=True)
                    rc = 1
                    break
                try:
                    status = rt.revive_redis()
                except (IpdpError, RuntimeError) as exc:
                    print(f"# redis-server could not be restarted: {exc}", file=sys.stderr,
                          flush=True)
                    rc = 1
                    break
                if status is not None:
                    print(f"# redis-server exited unexpectedly (status {status}); restarted it "
                          f"on {rt.redis.url} from {rt.redis.data_dir}, pid {rt.redis.pid}",
                          file=sys.stderr, flush=True)
    finally:
        rt.stop()
        if env_file is not None:
            Path(env_file).unlink(missing_ok=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received or not wait_forever:
        print("# stopped", file=out, flush=True)
    return rc


def _write_atomically(path: Path, text: str) -> None:
    """Readers see no file or the whole file, never half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
