"""External programs some tests drive (installed by scripts/install-test-deps.sh)."""

from __future__ import annotations

import os
import shutil

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
