"""Stopping `ipdp demo` (each mode) and `ipdp up` with SIGTERM, SIGINT or a second Ctrl-C, at
each phase: every process they started is gone, the runtime directory (the study owner's
private key with it) is removed, and no traceback is printed.

Each case runs the command with its own TMPDIR (where the runtime directory goes) and a marker
in its environment, which every child inherits: after the stop, no live process may carry it
and TMPDIR must be empty. Every signal is sent at every phase over the cases below, not every
combination of mode, phase and signal (each case starts a whole runtime)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from tests.conftest import _require_binaries
from tests.tooling import kill_processes_with, processes_with

#: What a stopped command may take before the test calls it hung (a guard, not a measurement).
EXIT_GUARD_S = 60

#: The line each phase begins with (on stderr for the demo, on stdout for `ipdp up`).
PHASES = {
    "starting": "runtime: kafka",  # the runtime answers; the services are being started
    "sending": "simulating ",
    "waiting": "sent ",  # "... waiting for the model"
    "web-starting": "study demo-",  # the study exists; the services are being started
    "serving": "open this page",
    "up-starting": None,  # as soon as the runtime directory exists
    "up-ready": "# Ctrl-C",
}

SIGNALS = {"SIGTERM": [signal.SIGTERM], "SIGINT": [signal.SIGINT],
           "SIGINT twice": [signal.SIGINT, signal.SIGINT]}

CASES = [
    (["demo"], "starting", "SIGTERM"),
    (["demo"], "starting", "SIGINT"),
    (["demo"], "sending", "SIGINT twice"),
    (["demo"], "waiting", "SIGTERM"),
    (["demo"], "waiting", "SIGINT twice"),
    (["demo", "--via-gateway", "--n", "5000"], "starting", "SIGINT twice"),
    (["demo", "--via-gateway", "--n", "5000"], "sending", "SIGTERM"),
    (["demo", "--via-gateway", "--n", "5000"], "sending", "SIGINT"),
    (["demo", "--via-gateway", "--n", "5000"], "waiting", "SIGINT"),
    (["demo", "--web"], "web-starting", "SIGTERM"),
    (["demo", "--web"], "serving", "SIGINT twice"),
    (["up"], "up-starting", "SIGINT twice"),
    (["up"], "up-ready", "SIGTERM"),
    (["up"], "up-ready", "SIGINT"),
]


class Lines:
    """Every line a stream printed, read by a thread; `wait_for` a line's beginning; `close`
    once every process that could write to it is gone."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._stream = stream
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()

    def close(self) -> None:
        self._reader.join(timeout=EXIT_GUARD_S)  # the stream's end: its writers are gone
        self._stream.close()

    def _read(self, stream) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()

    def wait_for(self, start: str, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(
                lambda: any(line.startswith(start) for line in self.lines), timeout)

    def text(self) -> str:
        with self._changed:
            return "".join(self.lines)


@pytest.mark.integration
@pytest.mark.parametrize(("argv", "phase", "signals"), CASES,
                         ids=[f"{' '.join(a[:2])}-{p}-{s}" for a, p, s in CASES])
def test_a_signal_stops_every_child_and_removes_the_runtime_directory(
        tmp_path, argv, phase, signals):
    _require_binaries()
    if "--web" in argv:
        from gateway.web import checkout_web_dir

        if not (checkout_web_dir() / "demo" / "index.html").is_file():
            pytest.skip("producer/web is not built (cd producer/web && npm ci && npm run build)")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    marker = f"IPDP_STOP_TEST_MARK={uuid.uuid4().hex}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("IPDP_")}
    env.update(TMPDIR=str(tmp), **dict([marker.split("=")]))
    proc = subprocess.Popen([sys.executable, "-m", "ipdp.cli", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    out, err = Lines(proc.stdout), Lines(proc.stderr)
    try:
        start = PHASES[phase]
        if start is not None:
            stream = out if argv[0] == "up" else err
            assert stream.wait_for(start, 120), \
                f"{start!r} never printed\n{out.text()}\n{err.text()[-3000:]}"
        else:
            deadline = time.monotonic() + 120
            while not any(tmp.iterdir()) and time.monotonic() < deadline:
                time.sleep(0.02)
        for i, sig in enumerate(SIGNALS[signals]):
            if i:
                time.sleep(0.3)  # the second Ctrl-C lands while the first one's stop runs
            proc.send_signal(sig)
        try:
            status = proc.wait(timeout=EXIT_GUARD_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {EXIT_GUARD_S} s after the signal:\n{err.text()[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    left = processes_with(marker)
    kill_processes_with(marker)
    out.close()
    err.close()
    stderr = err.text()
    assert "Traceback" not in stderr, stderr[-3000:]
    # `up` and `demo --web` end with 0 after a signal, a stopped demo with 130; a second
    # SIGINT that lands after the first one's stop, while Python finalises (its handlers reset
    # to the system's), ends the process by that signal.
    expected = (0, 130, -signal.SIGINT) if signals == "SIGINT twice" else (0, 130)
    assert status in expected, (status, stderr[-3000:])
    assert left == {}, "processes left behind"
    assert list(tmp.iterdir()) == [], "the runtime directory was left behind"
