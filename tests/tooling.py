"""External programs some tests drive (installed by scripts/install-test-deps.sh), and the
processes a test started, found by a marker in their environment."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

INSTALL_HINT = "run scripts/install-test-deps.sh (apt-get install prometheus docker-compose " \
               "redis-server chromium)"


def unavailable(message: str) -> None:
    """A test cannot run here: it fails under CI (a broken set-up must not look green), and is
    skipped elsewhere."""
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def require_tool(name: str, purpose: str) -> str:
    """Path of `name` on PATH, or :func:`unavailable`."""
    path = shutil.which(name)
    if path:
        return path
    unavailable(f"`{name}` is not on PATH, needed for {purpose}; {INSTALL_HINT}")
    raise AssertionError("unreachable")


def processes_with(marker: str) -> dict[int, str]:
    """Live (not zombie) processes whose environment holds `marker`: {pid: command line}. A
    test puts a marker in the environment of what it starts; every child inherits it."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker.encode() not in (proc / "environ").read_bytes():
                continue
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
    return found


def kill_processes_with(marker: str) -> None:
    """SIGKILL every process :func:`processes_with` finds: never leave them to the next test."""
    for pid in processes_with(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
