"""Capped exponential backoff with full jitter, shared by every retry loop."""

from __future__ import annotations

import random


class Backoff:
    """Delays initial·2^k, capped at `maximum`, each drawn uniformly from [delay/2, delay]."""

    def __init__(self, initial: float, maximum: float) -> None:
        self.initial, self.maximum = initial, maximum
        self.attempt = 0

    def next(self) -> float:
        """The next delay in seconds."""
        delay = min(self.maximum, self.initial * 2**self.attempt)
        self.attempt += 1
        return random.uniform(delay / 2, delay)

    def reset(self) -> None:
        """After a success."""
        self.attempt = 0
