"""Why the trainer publishes no model for a closed round: refused for good, or not yet."""

from __future__ import annotations

import enum

from ipdp.errors import IpdpError


class RefusalReason(enum.StrEnum):
    """The ``reason`` label of ``ipdp_rounds_refused_total``."""

    NOT_N = "not_n"
    """The round does not hold exactly n records."""
    UNSOLVABLE = "unsolvable"
    """The solver refused the statistics (not finite, or no unique minimiser)."""
    UNTRUSTED_STUDY = "untrusted_study"
    """The study's stored text does not verify against the pinned keys."""
    MALFORMED_ROUND = "malformed_round"
    """A two-server round whose stored fields are not the protocol's."""
    COUNT_MISMATCH = "count_mismatch"
    """The leader's and the helper's counts of a two-server round differ."""
    CHECKSUM_MISMATCH = "checksum_mismatch"
    """The two servers folded different sets of record ids."""
    EIGENVALUE = "eigenvalue"
    """λ_min(A) of a two-server sum is below what the noise guarantees (Step 15)."""
    TRACE = "trace"
    """trace(A) of a two-server sum exceeds what clipping and noise allow (Step 15)."""
    LINEAR_NORM = "linear_norm"
    """‖b‖ of a two-server sum exceeds what clipping and noise allow (Step 15)."""


class DeferralReason(enum.StrEnum):
    """The ``reason`` label of ``ipdp_rounds_deferred_total``."""

    HELPER_NOT_FULL = "helper_not_full"
    """The helper's round did not hold n records within IPDP_TRAINER_HELPER_WAIT_S."""
    HELPER_UNREACHABLE = "helper_unreachable"
    """The helper did not answer within IPDP_TRAINER_HELPER_WAIT_S."""
    HELPER_ERROR = "helper_error"
    """The helper answered with an error (a wrong token: 401)."""
    NO_TOKEN = "no_token"
    """IPDP_HELPER_LEADER_TOKEN is not set in the trainer's environment."""


class RoundRefused(IpdpError):
    """A closed round that must not produce a model; ``reason`` says which rule refused it."""

    def __init__(self, reason: RefusalReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class RoundPending(IpdpError):
    """A two-server round whose helper share cannot be had yet: its entry stays pending."""

    def __init__(self, reason: DeferralReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
