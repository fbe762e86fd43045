"""docs/tutorial.md's two programs, copied out of the page and run on the test session's runtime
(tests/system/test_walkthroughs.py runs the whole page, shell included)."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from ipdp import state
from ipdp.redis_io import redis_client
from tests import proc_services as ps
from tests.pipeline import GROUP_JOIN_TIMEOUT_S, contribute, create, services, wait_for

TUTORIAL = Path(__file__).resolve().parents[2] / "docs" / "tutorial.md"


def code_block(marker: str) -> str:
    """The ```python block right after `<!-- run: file MARKER.py -->`."""
    text = TUTORIAL.read_text(encoding="utf-8")
    m = re.search(rf"<!-- run: file {marker}\.py -->\s*```python\n(.*?)```", text, re.DOTALL)
    assert m, f"docs/tutorial.md has no python block marked run: file {marker}.py"
    return m[1]


def test_the_code_blocks_are_about_ten_lines():
    for marker in ("contributor", "consumer"):
        lines = [ln for ln in code_block(marker).splitlines() if ln.strip()]
        assert len(lines) <= 12, (marker, len(lines))


def test_the_tutorial_contributor_and_consumer_run_against_the_real_runtime(
        runtime, kafka_settings, redis_settings, topics, tmp_path):
    study = create(kafka_settings, redis_settings, topics, study_id="tutorial", d=4, n=200,
                   epsilon=1.0, delta=0.01)
    env = ps.service_env(runtime, topics)
    r = redis_client(redis_settings)
    with services(kafka_settings, redis_settings, topics):
        contributor = subprocess.run(
            [sys.executable, "-c", code_block("contributor")], cwd=ps.REPO, env=env,
            capture_output=True, text=True, timeout=120, check=False)
        assert contributor.returncode == 0, contributor.stderr
        assert re.fullmatch(r"contributed record [0-9a-f]{32}\n", contributor.stdout)
        # The tutorial's record is valid: folded, not dead-lettered.
        wait_for(lambda: r.hget(state.StudyKeys("tutorial").counts, "folded") == b"1",
                 GROUP_JOIN_TIMEOUT_S, "the tutorial's record to be folded")
        assert not state.rejected_counts(r, f"agg-{topics.records}", topics.records)

        contribute(study, kafka_settings, topics, study.n - 1, seed=5)  # the other devices
        consumer = subprocess.Popen(
            [sys.executable, "-u", "-c", code_block("consumer")], cwd=ps.REPO, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: queue.Queue[str] = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(ln) for ln in consumer.stdout],
                                  daemon=True)
        reader.start()
        seen: list[str] = []
        try:
            deadline = time.monotonic() + GROUP_JOIN_TIMEOUT_S
            while not any(ln.startswith("  central (ε, δ)") for ln in seen):
                if time.monotonic() > deadline or (consumer.poll() is not None
                                                   and lines.empty()):
                    raise AssertionError("no model line from the tutorial's consumer:\n"
                                         + "".join(seen))
                try:
                    seen.append(lines.get(timeout=0.5))
                except queue.Empty:
                    continue
        finally:
            consumer.terminate()
            consumer.wait(timeout=30)
            reader.join(timeout=30)  # the pipe's end: the consumer is gone
            consumer.stdout.close()
    first = next(ln for ln in seen if ln.startswith("study tutorial round 1:"))
    assert "n=200" in first
    assert re.search(r"central \(ε, δ\) = \(1\.0, 0\.01\), mode rigorous", "".join(seen))
