"""Run ipdp roles as real child processes (`python -m ipdp.cli ROLE run`) and read their /metrics.

Used by the observability tests: each child gets the runtime's IPDP_* variables, the test's
topic names, its own consumer group and an IPDP_METRICS_PORT on a free loopback port.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from ipdp.embedded import free_port
from ipdp.settings import TopicSettings

REPO = Path(__file__).resolve().parent.parent


def topic_env(topics: TopicSettings) -> dict[str, str]:
    """IPDP_TOPIC_* for every topic setting (the fixture's names are unique per test)."""
    return {f"IPDP_TOPIC_{name.upper()}": str(getattr(topics, name))
            for name in TopicSettings.model_fields}


def service_env(runtime, topics: TopicSettings, **extra: str) -> dict[str, str]:
    """os.environ + the runtime's IPDP_* + the test's topics + extra (IPDP_* names)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IPDP_")}
    env.update(runtime.env())
    env.update(topic_env(topics))
    env.update({"IPDP_METRICS_HOST": "127.0.0.1", **extra})
    return env


@dataclass
class Child:
    """One running role, with its metrics port and log file."""

    role: str
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.role} exited with status {self.proc.returncode}:\n"
                                 f"{self.log_tail()}")

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of its /metrics: (sample name, sorted labels) → value."""
        return scrape(self.url)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the metrics page at ``url``: (sample name, sorted labels) → value."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def start(role_argv: list[str], env: dict[str, str], log_dir: Path, name: str,
          module: str = "ipdp.cli") -> Child:
    """Start `python -m MODULE ROLE_ARGV...` with IPDP_METRICS_PORT on a free port."""
    port = free_port()
    log_path = log_dir / f"{name}.log"
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *role_argv], cwd=REPO,
            env={**env, "IPDP_METRICS_PORT": str(port)},
            stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
            start_new_session=True)
    return Child(name, proc, port, log_path)


def stop(child: Child, timeout: float = 20.0) -> None:
    """SIGTERM (the roles finish their step and exit), SIGKILL after `timeout`."""
    if child.proc.poll() is None:
        child.proc.send_signal(signal.SIGTERM)
        try:
            child.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait(timeout=timeout)


def wait_metrics_up(child: Child, timeout: float = 60.0) -> None:
    """Until the child's /metrics answers (it serves before connecting to the backends)."""
    deadline = time.monotonic() + timeout
    while True:
        child.check_alive()
        try:
            child.scrape()
            return
        except (urllib.error.URLError, ConnectionError, OSError):
            if time.monotonic() > deadline:
                raise AssertionError(f"{child.role}: no /metrics on port {child.port} within "
                                     f"{timeout:.0f} s:\n{child.log_tail()}") from None
            time.sleep(0.1)


@contextlib.contextmanager
def pipeline(runtime, topics: TopicSettings, log_dir: Path, group: str,
             **extra_env: str) -> Iterator[dict[str, Child]]:
    """An aggregator and a trainer as child processes, stopped when the block ends."""
    env = service_env(runtime, topics, IPDP_AGGREGATOR_GROUP=group,
                      IPDP_TRAINER_GROUP=f"{group}-trainer", IPDP_TRAINER_BLOCK_MS="200",
                      **extra_env)
    children: dict[str, Child] = {}
    try:
        for role in ("aggregator", "trainer"):
            children[role] = start([role, "run"], env, log_dir, role)
        for child in children.values():
            wait_metrics_up(child)
        yield children
    finally:
        for child in children.values():
            stop(child)


def value(samples: dict, name: str, **labels: str) -> float:
    """One sample's value, 0.0 if the series does not exist (yet)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: dict, name: str) -> float:
    """Sum of a sample name over all its label sets."""
    return sum(v for (n, _), v in samples.items() if n == name)
