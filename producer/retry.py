"""When a device sends a refused record again: 429 and 503 with ``Retry-After``.

The gateway answers 429 when a client address sends faster than its limit and 503 while Kafka
does not acknowledge (or it is not ready yet); both mean "the same bytes, later" and carry
``Retry-After`` in seconds. A device waits that long, plus a random share of it (jitter, so
devices refused together do not come back together), and gives up after ``max_attempts``
tries. A record sent again is harmless: its record id makes a second copy a replay, which the
aggregator drops.

Every other refusal (400, 404, 409, 413, …) is final: the same bytes would be refused again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["DEVICE_RETRY", "RETRYABLE_STATUSES", "RetryPolicy", "parse_retry_after"]

#: Refusals worth sending the same bytes again for, after ``Retry-After``.
RETRYABLE_STATUSES = frozenset({429, 503})


def parse_retry_after(value: str | None) -> float | None:
    """The delay of a ``Retry-After`` header in seconds (its delta-seconds form), or None when
    absent or not a non-negative number (the HTTP-date form is not sent by the gateway)."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


@dataclass(frozen=True)
class RetryPolicy:
    """How a device retries a 429 or 503: bounded tries, the server's delay, and jitter.

    ``max_attempts`` counts every try, the first included. The wait before try k+1 is the
    answer's ``Retry-After`` (``backoff_s``·2^(k−1) when it has none), at most ``max_wait_s``,
    times a factor drawn uniformly from [1, 1 + ``jitter``].
    """

    max_attempts: int = 8
    backoff_s: float = 0.5
    max_wait_s: float = 60.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be ≥ 1, got {self.max_attempts}")
        if not (self.backoff_s > 0 and self.max_wait_s > 0 and self.jitter >= 0):
            raise ValueError("backoff_s and max_wait_s must be > 0, jitter ≥ 0")

    def wait_s(self, attempt: int, retry_after_s: float | None,
               rng: random.Random | None = None) -> float:
        """Seconds to wait after the ``attempt``-th try (1 for the first) was refused."""
        base = retry_after_s if retry_after_s is not None else self.backoff_s * 2 ** (attempt - 1)
        draw = (rng or random).random()
        return min(base, self.max_wait_s) * (1.0 + self.jitter * draw)


#: A device with one record: up to 8 tries.
DEVICE_RETRY = RetryPolicy()
