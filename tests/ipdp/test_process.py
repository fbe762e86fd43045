"""ipdp.process: a worker stops with the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.gateway.test_process import _running

# A parent that forks a multiprocessing child and dies before the child asks to stop with it:
# the child must still stop (the parent it compares with is the one that started it, not the
# process that adopted it), although it inherited a SIGTERM handler that ignores the signal, as
# a granian worker inherits its main process's.
_ORPHAN = textwrap.dedent("""
    import multiprocessing as mp, os, signal, sys, time

    def child():
        started_by = mp.parent_process().pid
        while os.getppid() == started_by:  # wait until the parent is gone
            time.sleep(0.01)
        from ipdp.process import stop_with_parent
        stop_with_parent()
        time.sleep(60)

    if __name__ == "__main__":
        signal.signal(signal.SIGTERM, lambda *_: None)
        worker = mp.get_context("fork").Process(target=child)
        worker.start()
        with open(sys.argv[1], "w") as f:
            f.write(str(worker.pid))
        os._exit(0)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_whose_parent_died_before_it_asked_stops_at_once(tmp_path):
    script = tmp_path / "orphan.py"
    script.write_text(_ORPHAN)
    pid_file = tmp_path / "worker.pid"
    subprocess.run([sys.executable, str(script), str(pid_file)], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=True, timeout=60,
                   cwd=Path(__file__).parents[2])
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 20
    try:
        while _running(pid):
            assert time.monotonic() < deadline, "the orphaned worker kept running"
            time.sleep(0.1)
    finally:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
