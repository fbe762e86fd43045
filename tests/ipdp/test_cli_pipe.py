"""A command whose reader leaves early (`ipdp … | head -1`) ends quietly, as Unix tools do."""

from __future__ import annotations

import subprocess
import sys

# stdout is a pipe whose reading end is already closed, and unbuffered (-u), so the command's
# first print raises BrokenPipeError inside the command, as `| head` does to a long output.
CLOSED_PIPE = """
import os, sys
r, w = os.pipe()
os.close(r)
os.dup2(w, 1)
from ipdp.cli.main import main
sys.exit(main(["calibrate", "--epsilon", "1", "--delta", "0.01", "--n", "2048", "--d", "14"]))
"""


def test_a_closed_pipe_ends_the_command_without_a_traceback():
    run = subprocess.run([sys.executable, "-u", "-c", CLOSED_PIPE], capture_output=True,
                         text=True, timeout=120, check=False)
    assert run.returncode == 141, run.stderr
    assert "Traceback" not in run.stderr and "BrokenPipeError" not in run.stderr, run.stderr
