"""What a process and its live descendants use (a gateway's granian workers and their Kafka
producer processes, say), through psutil: CPU time for the benchmarks' per-request costs,
resident memory for the gateway's memory tests."""

from __future__ import annotations

import psutil

__all__ = ["cpu_seconds", "rss_bytes"]


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time so far of ``pid`` and its live descendants."""
    total = 0.0
    for proc in _tree(pid):
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:  # exited since it was listed
            continue
        total += times.user + times.system
    return total


def rss_bytes(pid: int) -> int:
    """Resident bytes of ``pid`` and its live descendants."""
    total = 0
    for proc in _tree(pid):
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total
