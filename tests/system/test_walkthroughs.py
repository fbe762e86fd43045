"""README.md's and docs/tutorial.md's walkthroughs, run exactly as a user types them.

Each page's blocks marked `<!-- run: shell -->` run in order in ONE bash process (so `&`, `%1`,
`wait` and sourced variables behave as in a terminal), after the blocks marked
`<!-- run: file NAME -->` have been saved as NAME. The shell starts in an empty directory with
the project's `ipdp` and `python` first on PATH and no IPDP_* variables: whatever the page does
not set up itself is missing. Every process the page starts carries a marker in its environment;
none may be left once the page's last line has run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import _require_binaries
from tests.tooling import kill_processes_with, processes_with

REPO = Path(__file__).resolve().parents[2]
PAGE_TIMEOUT_S = 420
BLOCK = re.compile(r"<!-- run: (shell|file (\S+)) -->\s*```(\w+)\n(.*?)```", re.DOTALL)

#: README table commands that the walkthrough does not run, and the test that runs each for real.
RUN_ELSEWHERE = {
    "ipdp demo": "tests/system/test_demo.py",
    "ipdp gateway": "tests/gateway/test_process.py",
    "ipdp helper": "tests/helper/test_process.py",
    "ipdp keys": "tests/system/test_cli.py",
    "ipdp study delete": "tests/system/test_study_mistakes.py",
    "ipdp bench accuracy": "tests/bench/test_bench_commands.py",
    "ipdp bench throughput": "tests/bench/test_bench_commands.py",
    "ipdp bench devices": "tests/bench/test_devices.py",
    "ipdp bench credentials": "tests/bench/test_bench_commands.py",
    "ipdp bench flood": "tests/bench/test_bench_commands.py",
    "ipdp bench two-server": "tests/bench/test_two_server.py",
    "ipdp dead-letters": "tests/aggregator/test_resent.py",
    "ipdp credentials": "tests/aggregator/test_credentials.py",
    "ipdp soak": "tests/bench/test_bench_commands.py",
    "ipdp audit": "tests/bench/test_bench_commands.py",
}


def page_script(page: Path, workdir: Path) -> str:
    """Write the page's files into `workdir`; return its shell blocks, in order, as one script."""
    shell = []
    for m in BLOCK.finditer(page.read_text(encoding="utf-8")):
        if m[1] == "shell":
            assert m[3] == "sh", f"{page.name}: a `run: shell` block must be ```sh"
            shell.append(m[4])
        else:
            (workdir / m[2]).write_text(m[4], encoding="utf-8")
    assert shell, f"{page.name} has no `<!-- run: shell -->` block"
    return "".join(shell)


def run_page(page: Path, tmp_path: Path) -> str:
    _require_binaries()
    script = page_script(page, tmp_path)
    marker = f"IPDP_WALKTHROUGH_MARK={uuid.uuid4().hex}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("IPDP_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env[marker.split("=")[0]] = marker.split("=")[1]
    # Output goes to files, not pipes: a background job left running by a failing page would
    # hold a pipe open and keep the test waiting for its end.
    out_path, err_path = tmp_path / "page.stdout", tmp_path / "page.stderr"
    try:
        with open(out_path, "w") as out, open(err_path, "w") as err:
            done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=tmp_path,
                                  env=env, stdout=out, stderr=err, text=True,
                                  timeout=PAGE_TIMEOUT_S, check=False)
    finally:
        deadline = time.monotonic() + 15
        while processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = list(processes_with(marker).values())
        kill_processes_with(marker)
    done.stdout = out_path.read_text(encoding="utf-8", errors="replace")
    done.stderr = err_path.read_text(encoding="utf-8", errors="replace")
    assert done.returncode == 0, (f"{page.name} failed (exit {done.returncode})\n--- stdout\n"
                                  f"{done.stdout}\n--- stderr\n{done.stderr[-6000:]}")
    assert not left, f"{page.name} left processes behind: {left}"
    return done


#: A log line at ERROR (ipdp.process.setup_logging's format).
ERROR_LINE = re.compile(r"^\S+ \S+ ERROR ", re.MULTILINE)


def test_the_readme_walkthrough_runs_as_written(tmp_path):
    done = run_page(REPO / "README.md", tmp_path)
    out = done.stdout
    # Quiet when healthy: nothing a user would take for a fault.
    for text in (done.stdout, done.stderr):
        assert "Traceback" not in text and not ERROR_LINE.search(text), text[-6000:]
    assert re.search(r"^export IPDP_KAFKA_BOOTSTRAP=127\.0\.0\.1:\d+$", out, re.MULTILINE)
    assert "σ_u²" in out  # ipdp calibrate
    assert "created study s1" in out
    assert re.search(r"^s1 +open +squared +14 +2000 ", out, re.MULTILINE)  # ipdp study list
    assert re.search(r"^records sent +2000$", out, re.MULTILINE)  # ipdp loadgen
    assert re.search(r"^s1  round 1  n=2000  ‖w‖=", out, re.MULTILINE)  # ipdp models --wait 1
    assert re.search(r"^rounds published +1$", out, re.MULTILINE)  # ipdp study show
    assert "closed study s1" in out
    assert out.rstrip().endswith("# stopped")  # ipdp up's last word after SIGTERM


def test_the_tutorial_runs_as_written(tmp_path):
    done = run_page(REPO / "docs" / "tutorial.md", tmp_path)
    out = done.stdout
    # Signed and pinned: no command of the page has a trust warning to print.
    assert re.search(r"^signed by key \S+$", out, re.MULTILINE)  # ipdp study create
    for warning in ("UNSIGNED", "UNVERIFIED", "no trusted"):
        assert warning not in out + done.stderr, done.stderr[-6000:]
    # --check-csv: the sample read as the devices will, before the study is created.
    assert re.search(r"^rent +5000 number\(s\), [1-9]\d* outside \[0, 2500\]", done.stderr,
                     re.MULTILINE)
    assert re.search(r"^contributed record [0-9a-f]{32}$", out, re.MULTILINE)
    assert re.search(r"^records sent +199$", out, re.MULTILINE)
    assert re.search(r"^study tutorial round 1: n=200 w=\[", out, re.MULTILINE)
    # The study's δ = 0.01, the norm check's thousandth of it included (docs/privacy.md).
    assert "central (ε, δ) = (1.0, 0.01), mode rigorous" in out
    assert re.search(r"^tutorial  round 1  n=200 ", out, re.MULTILINE)  # ipdp models
    # Your own data: a schema study, a CSV through loadgen, the exported model predicting.
    assert "created study rents" in out
    assert re.search(r"^rows read +5000 \(0 skipped", out, re.MULTILINE)
    assert re.search(r"^clipped +area 0, rooms 0, distance 0, rent [1-9]\d* ", out, re.MULTILINE)
    assert re.search(r"^rents  round 1  n=5000 .*\n  rent = [\d.]+\n +[+-] [\d.]+ × area$", out,
                     re.MULTILINE)
    assert "features ['area', 'rooms', 'distance']" in out
    assert re.search(r"^predicted rents \[ *\d+\. +\d+\.\]$", out, re.MULTILINE)
    assert out.rstrip().endswith("# stopped")


def readme_table_commands() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    table = text[text.index("## The commands"):text.index("## Walkthrough")]
    out = []
    for cell in re.findall(r"^\| (`ipdp [^|]*`(?: / `[^|]*`)*) \|", table, re.MULTILINE):
        for cmd in re.findall(r"`([^`]+)`", cell):
            cmd = cmd if cmd.startswith("ipdp ") else f"ipdp {cmd}"
            words = [w for w in cmd.split() if not w.startswith(("-", "[")) and w != "\\|"]
            out.append(" ".join(words[:3] if words[1] in ("study", "bench") else words[:2]))
    return out


def test_every_readme_table_command_is_run_for_real_by_the_suite():
    walked = page_script(REPO / "README.md", Path("/nonexistent"))
    commands = readme_table_commands()
    assert "ipdp up" in commands and "ipdp study close" in commands
    for cmd in commands:
        if re.search(rf"^{re.escape(cmd)}( |$)", walked, re.MULTILINE):
            continue
        assert cmd in RUN_ELSEWHERE, f"{cmd} is in README's table but no test runs it"
        words = cmd.split()[1:]
        source = (REPO / RUN_ELSEWHERE[cmd]).read_text(encoding="utf-8")
        argv = ", ".join(f'"{w}"' for w in words)
        assert f'"-m", "ipdp.cli", {argv}' in source or f"ipdp({argv}" in source, (
            f"{RUN_ELSEWHERE[cmd]} does not run `{cmd}` as a command")


@pytest.mark.parametrize("page", ["README.md", "docs/tutorial.md"])
def test_the_runner_refuses_a_page_without_runnable_blocks(page, tmp_path):
    text = (REPO / page).read_text(encoding="utf-8").replace("<!-- run: shell -->", "")
    fake = tmp_path / "page.md"
    fake.write_text(text, encoding="utf-8")
    with pytest.raises(AssertionError, match="has no `<!-- run: shell -->` block"):
        page_script(fake, tmp_path)
