"""What a well-formed record of a known study must also satisfy to be folded: its norms within
the calibration's two-sided bounds, and its creation time within the replay window.

One definition for the aggregator (aggregator/validate.py), which dead-letters what fails, and
the gateway (gateway/checks.py), which refuses it at once. Each check takes arrays (one row per
record) or Python scalars, and returns ``(where it fails, reason, detail)`` triples in the order
the checks apply: a record takes the reason of its first failure.
"""

from __future__ import annotations

from dataclasses import dataclass

from ipdp.calibration import RecordNormBounds
from ipdp.wire import RejectReason

__all__ = ["RecordWindow", "norm_failures"]


def norm_failures(bounds: RecordNormBounds, sq_q, sq_p) -> list[tuple[object, RejectReason, str]]:
    """The two-sided norm check of docs/privacy.md ("The norm check") on squared norms
    (ipdp.wire.squared_norms: a record at a bound gets one verdict wherever it is checked)."""
    return [
        (sq_q > bounds.q_high**2, RejectReason.NORM_OUT_OF_BOUNDS,
         f"‖q̃‖ exceeds {bounds.q_high:.4g}"),
        (sq_p > bounds.p_high**2, RejectReason.NORM_OUT_OF_BOUNDS,
         f"‖p̃‖ exceeds {bounds.p_high:.4g}"),
        (sq_q < bounds.q_low**2, RejectReason.NORM_OUT_OF_BOUNDS,
         f"‖q̃‖ is below {bounds.q_low:.4g}: less noise than any honest device adds"),
        (sq_p < bounds.p_low**2, RejectReason.NORM_OUT_OF_BOUNDS,
         f"‖p̃‖ is below {bounds.p_low:.4g}: less noise than any honest device adds"),
    ]


@dataclass(frozen=True)
class RecordWindow:
    """The creation times accepted at ``now_ms``: from now − the replay window (an older record's
    id may be forgotten already, so it could be replayed: ``stale``) to now + the largest clock
    lead of a device (``future``). Settings: ipdp.settings.RecordWindowSettings."""

    replay_window_ms: int
    max_future_skew_ms: int

    def failures(self, created_ms, now_ms: int) -> list[tuple[object, RejectReason, str]]:
        """Stale, then future, for one creation time or an array of them."""
        return [
            (created_ms < now_ms - self.replay_window_ms, RejectReason.STALE,
             "created before the replay window"),
            (created_ms > now_ms + self.max_future_skew_ms, RejectReason.FUTURE,
             "created too far in the future"),
        ]
