"""Garbage-collector tuning of a gateway worker, once its producer is connected."""

from __future__ import annotations

import gc

__all__ = ["GC_YOUNG_THRESHOLD", "settle_heap"]

#: Allocations between two collections of the youngest generation (CPython's default: 700).
GC_YOUNG_THRESHOLD = 10_000


def settle_heap() -> None:
    """Keep the garbage collector off the request path once the worker is up.

    Every request leaves a few reference cycles (its task, futures, protocol callbacks), so
    CPython collects often, and each full collection walks every object the worker holds (tens of
    thousands after its imports: numpy, scipy, pydantic, kafka-python) with the event loop
    stopped: that was most of the gateway's p99 latency under load (docs/architecture.md). Everything alive once the producer is connected lives as long as the
    worker, so it is moved out of the collector's sight (:func:`gc.freeze`), and the youngest
    generation is collected less often; cycles are still collected, so memory stays bounded.
    Only for a process that is the gateway's alone (an ``ipdp gateway`` worker).
    """
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, oldest)
