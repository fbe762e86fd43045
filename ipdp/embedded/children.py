"""Child processes that never outlive us: the plumbing under the embedded servers.

Each child runs in its own process group (a Ctrl-C in the terminal does not reach it directly, so
shutdown order stays ours), gets ``PR_SET_PDEATHSIG`` = SIGKILL on Linux (it dies with the thread
that started it, even if we are SIGKILLed), writes its output to a log file (never to an
inherited pipe that could keep CI waiting), and is stopped by an ``atexit`` hook if nobody
called ``stop()``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import logging
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Self

log = logging.getLogger(__name__)

LOCALHOST = "127.0.0.1"


#: Where free_port looks first: below the kernel's ephemeral range, which Linux's default puts
#: at 32768-60999 (read from /proc where it can be).
_LISTEN_PORTS = (20000, 32768)
_handed_out: set[int] = set()
_handed_lock = threading.Lock()
_rng = random.SystemRandom()


@functools.cache
def _ephemeral_low() -> int:
    """The start of the kernel's ephemeral port range (read once)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _LISTEN_PORTS[1]


def _listen_range() -> tuple[int, int]:
    """The ports free_port draws from: [low, high)."""
    return _LISTEN_PORTS[0], min(_LISTEN_PORTS[1], _ephemeral_low())


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port that was free on ``host`` a moment ago, for a server about to bind it.

    Taken below the kernel's ephemeral range when there is room: a port the kernel picks for
    ``bind(0)`` comes from the range it also gives outgoing connections, so a client connecting
    anywhere (to Kafka, to Redis) could take it as its local port before the server binds it,
    and the server would fail with "Address already in use". A port is not handed out twice by
    one process; the kernel's pick is the fallback."""
    low, high = _listen_range()
    with _handed_lock:
        for _ in range(64 if high - low >= 1000 else 0):
            port = _rng.randrange(low, high)
            if port in _handed_out:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            break
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        if len(_handed_out) >= 4096:
            _handed_out.clear()
        _handed_out.add(port)
        return port


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    """Whether something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


_PR_SET_PDEATHSIG = 1
_LIVE: set[Any] = set()  # started servers / runtimes, stopped at interpreter exit
# Re-entrant: a signal handler that stops everything may interrupt a register() in its thread.
_LIVE_LOCK = threading.RLock()


def register(obj: Any) -> None:
    with _LIVE_LOCK:
        _LIVE.add(obj)


def unregister(obj: Any) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(obj)


@atexit.register
def stop_all_children() -> None:
    """Stop every started server, runtime and other registered owner of children (at
    interpreter exit, and from a command's signal handler)."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    # Clients of the servers first (``stop_first``: the services of a demo), then owners of
    # other children (a runtime stops its own servers and removes its directory).
    for obj in sorted(live, key=lambda o: (not getattr(o, "stop_first", False),
                                           not getattr(o, "owns_children", False))):
        with contextlib.suppress(Exception):
            obj.stop()


def _make_preexec(parent_pid: int):
    """Child-side setup: die with the parent on Linux (PR_SET_PDEATHSIG = SIGKILL).

    Note the kernel sends the signal when the *thread* that forked the child exits, so this is
    only armed when the server is started from the main thread.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not (
        threading.main_thread()
    ):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:  # runs in the child between fork and exec: keep it tiny
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def spawn(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``argv`` as a child that never outlives us (see the module docstring), its output
    appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as logf:
        logf.write(f"\n--- {time.strftime('%Y-%m-%dT%H:%M:%S')} {shlex.join(argv)}\n".encode())
        logf.flush()
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own session and process group
            # Only prctl() runs in the child; see _make_preexec.
            preexec_fn=_make_preexec(os.getpid()),  # noqa: PLW1509
            env={**os.environ, **(env or {})},
            close_fds=True,
        )


def _terminate(proc: subprocess.Popen | None, timeout: float, name: str) -> None:
    """SIGTERM the child's process group, SIGKILL it after ``timeout`` seconds, reap it; the
    warning that it had to be killed names it (``name``)."""
    if proc is None:
        return
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %s) ignored SIGTERM for %.1fs; sending SIGKILL", name,
                        proc.pid, timeout)
    # Whatever is left in the group (e.g. a Redis AOF-rewrite child) goes too.
    _signal_group(proc, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout)


def terminate_all(procs: dict[str, subprocess.Popen], timeout: float) -> None:
    """SIGTERM every child's process group at once, SIGKILL what is left after ``timeout``
    seconds in all, reap them; ``procs`` maps a name, which the warning for a child that had to
    be killed gives, to each child."""
    for proc in procs.values():
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for name, proc in procs.items():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %s) ignored SIGTERM for %.1fs; sending SIGKILL", name,
                        proc.pid, timeout)
    for proc in procs.values():
        _signal_group(proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session=True → pgid == pid
    except ProcessLookupError:
        pass
    except PermissionError:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


def tail(path: Path | None, lines: int = 30) -> str:
    if path is None or not path.exists():
        return "(no log file)"
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 16384))
        text = f.read().decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-lines:])


class ChildServer:
    """Shared start/stop/restart plumbing for the two child servers."""

    name = "server"
    proc: subprocess.Popen | None
    port: int
    host: str
    log_path: Path | None
    startup_timeout_s: float
    stop_timeout_s: float

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _argv(self) -> list[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _env(self) -> dict[str, str]:
        return {}

    def _probe(self) -> None:
        """Raise if the server is not answering yet."""
        raise NotImplementedError  # pragma: no cover

    def _prepare(self) -> None:
        pass

    def start(self):
        if self.running:
            return self
        fixed_port = bool(self.port)
        attempts = 1 if fixed_port else 3
        for attempt in range(attempts):
            if not fixed_port:
                self.port = free_port(self.host)
            self._prepare()
            self.proc = spawn(self._argv(), self.log_path, self._env())
            register(self)
            try:
                self._wait_ready()
                return self
            except _EarlyExit:
                code = self.proc.returncode
                conflict = self._port_conflict()
                self.stop()
                if conflict and attempt + 1 < attempts:
                    log.info("%s lost port %s to another process; retrying", self.name, self.port)
                    continue
                if not fixed_port:
                    self.port = 0
                raise RuntimeError(
                    f"{self.name} exited during startup (exit code {code}). "
                    f"Last lines of {self.log_path}:\n{tail(self.log_path)}"
                ) from None
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _port_conflict(self) -> bool:
        text = tail(self.log_path, 10).lower()
        return "address already in use" in text or "addrinuse" in text

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        last: BaseException | None = None
        while True:
            if self.proc.poll() is not None:
                raise _EarlyExit()
            try:
                self._probe()
                return
            except Exception as exc:  # noqa: BLE001 - keep polling until the deadline
                last = exc
            if self.proc.poll() is not None:
                raise _EarlyExit()
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"{self.name} did not become ready on {self.host}:{self.port} within "
            f"{self.startup_timeout_s:.0f}s (last error: {last!r}). "
            f"Last lines of {self.log_path}:\n{tail(self.log_path)}"
        )

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``stop_timeout_s``. Idempotent."""
        _terminate(self.proc, self.stop_timeout_s, self.name)
        unregister(self)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def restart(self):
        """Stop and start again on the same port (and, for Redis, the same data directory)."""
        self.stop()
        self._wait_port_free()
        return self.start()

    def _wait_port_free(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                # Servers set SO_REUSEADDR, so TIME_WAIT leftovers do not block a rebind.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((self.host, self.port))
                    return
                except OSError:
                    pass
            time.sleep(0.05)


class _EarlyExit(Exception):
    pass
