"""A two-server study's closed round at the trainer: the helper's share, the comparison with the
leader's round, the combination, the dither and the checks a sum allows (docs/architecture.md,
"The trainer of a two-server round"; docs/privacy.md, Step 9 (the two-server mechanism) and Step 15 (the trainer's
checks of the sum)).

The leader's closed round ``ipdp:{S}:closed:<r>`` holds ``sum`` (8·L bytes, little-endian
uint64: the sum mod 2⁶⁴ of the leader shares), ``count``, ``checksum`` (32 bytes,
helper.store.id_checksum of the folded ids), ``closed_ms`` and ``mode`` = ``two-server``. The
helper answers its part of the same round (ipdp.helper_client.HelperClient.round_share)
once it holds n records. Both must agree on count and checksum; then the sum of the two sums is
the round's sum of encoded records, decoded with ipdp.fixed_point, and b gets the trainer's
dither V ~ U[−h_b/2, h_b/2)^d from a generator seeded by the kernel's CSPRNG. Nothing here logs
or returns a statistic of the round beyond (A, b̂ + V) to the solver: a refusal names the bound
a sum failed, never the sum's value.
"""

from __future__ import annotations

import http.client
import math
import ssl
import threading
import time

import numpy as np
from pydantic import BaseModel, ConfigDict

from ipdp.calibration import eigenvalue_bound
from ipdp.fixed_point import combine, decode
from ipdp.grid_noise import dither, system_generator
from ipdp.helper_client import HelperClient, HelperRefused, RoundShare
from ipdp.study import Study
from ipdp.two_server import TwoServerCalibration
from trainer.errors import DeferralReason, RefusalReason, RoundPending, RoundRefused

__all__ = ["HelperShares", "SumBounds", "check_sum", "checked_text", "combine_round",
           "dithered_sum", "smallest_eigenvalue_bound", "sum_bounds"]

TWO_SERVER_MODE = b"two-server"

FLOAT_SLACK = 2.0**-46
"""Relative room left for floating point in the checks: decoding rounds each entry by 2⁻⁵³
relative, and LAPACK's symmetric eigensolver returns each eigenvalue within a small multiple of
d·2⁻⁵³·‖A‖₂ of the decoded matrix's (LAPACK Users' Guide, "Error bounds for the symmetric
eigenproblem"); 2⁻⁴⁶·d·‖A‖_F is 128 times that."""


class SumBounds(BaseModel):
    """What an honest round's decoded sum satisfies on the events the proof already pays for
    (Step 15 (the trainer's checks of the sum))."""

    model_config = ConfigDict(frozen=True)

    eigenvalue: float
    """λ_min(A) ≥ β₀ − n·e: Step 4's bound for the other records' noise, less n roundings."""
    trace: float
    """trace(A) ≤ n·(H_q² + e): every ‖q̃ᵢ‖² ≤ H_q² (Step 13), each trace rounded by at most e."""
    linear_norm: float
    """‖b̂ + V‖ ≤ n·P_b + √d·h_b·r√x: clipped, rounded labels and the noise inside Step 12's box."""
    honest_refusal: float
    """An honest round fails a check with probability at most γ₂ + clamp_q + box + clamp_p."""


def smallest_eigenvalue_bound(two: TwoServerCalibration, gamma: float | None = None) -> float:
    """β₀(γ) − n·e: λ_min(A) of an honest round is at least this except with probability γ
    (default the calibration's γ₂) plus clamp_q (Step 15 (the trainer's checks of the sum)).

    A ⪰ Σ_{i<n} Âᵢ − e·I because the n-th record's Âₙ = aaᵀ + Eₙ ⪰ −e·I (Step 10), and
    λ_min(Σ_{i<n} Âᵢ) ≥ β₀ − (n − 1)e on Step 4's event and Step 13's (every ‖q̃ᵢ‖² ≤ H_q²).
    At γ₂ it is the calibration's β′ − Δ_in − e."""
    gamma = two.delta_split["gamma_2"] if gamma is None else gamma
    beta0 = eigenvalue_bound(two.sigma_u2, two.n, two.d, gamma) if two.sigma_u2 > 0.0 else 0.0
    return beta0 - two.n * two.rounding


def sum_bounds(two: TwoServerCalibration) -> SumBounds:
    """The bounds the trainer holds a two-server sum to: Step 15 (the trainer's checks of the
    sum)."""
    box = two.box_radius * math.sqrt(two.grid_variance) * two.linear_step  # r√x·h_b
    split = two.delta_split
    return SumBounds(
        eigenvalue=smallest_eigenvalue_bound(two),
        trace=two.n * (two.record_bound + two.rounding),
        linear_norm=two.n * two.linear_p_bound + math.sqrt(two.d) * box,
        honest_refusal=split["gamma_2"] + split["clamp_q"] + split["box"] + split["clamp_p"])


def checked_text(two: TwoServerCalibration, bounds: SumBounds) -> list[str]:
    """What the trainer checked of a published two-server round, for its privacy report."""
    return [
        f"count and record-id checksum equal on the leader and the helper (n = {two.n})",
        ("A = Σ q̃q̃ᵀ symmetric by construction (the records carry its upper triangle) and "
        f"λ_min(A) ≥ {bounds.eigenvalue:.6g}"),
        f"trace(A) ≤ {bounds.trace:.6g}",
        f"‖b‖ ≤ {bounds.linear_norm:.6g}",
        (f"an honest round fails these with probability ≤ {bounds.honest_refusal:.3g}, within δ "
        "(docs/privacy.md, Step 15)"),
    ]


def dithered_sum(total: np.ndarray, two: TwoServerCalibration,
                 generator: np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(A, b̂ + V) from the round's combined sum: Step 9 (the two-server mechanism).

    V ~ U[−h_b/2, h_b/2)^d is the trainer's own randomness (ipdp.grid_noise.dither), from a fresh
    generator seeded with 256 bits of the kernel's CSPRNG (``generator`` only in tests); it is
    never stored, logged or returned apart from b̂ + V."""
    a, b_hat = decode(total, two.encoding)
    generator = system_generator() if generator is None else generator
    return a, b_hat + dither(b_hat.shape, two.linear_step, generator)


def check_sum(a: np.ndarray, b: np.ndarray, bounds: SumBounds, where: str) -> None:
    """Raise RoundRefused when (A, b̂ + V) fails a bound of Step 15; the message names the bound,
    not the value."""
    slack = FLOAT_SLACK * a.shape[0] * float(np.linalg.norm(a))
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise RoundRefused(RefusalReason.MALFORMED_ROUND, f"{where}: the decoded sum is not "
                           "finite; no model is published")
    if float(np.linalg.eigvalsh(a)[0]) < bounds.eigenvalue - slack:
        raise RoundRefused(RefusalReason.EIGENVALUE, (
            f"{where}: λ_min(A) is below {bounds.eigenvalue:.6g}, the least the noise of n honest "
            "records guarantees (docs/privacy.md, Step 15); no model is published"))
    if float(np.trace(a)) > bounds.trace + slack:
        raise RoundRefused(RefusalReason.TRACE, (
            f"{where}: trace(A) exceeds {bounds.trace:.6g}, the most n clipped, noisy records "
            "reach (docs/privacy.md, Step 15); no model is published"))
    if float(np.linalg.norm(b)) > bounds.linear_norm * (1.0 + FLOAT_SLACK):
        raise RoundRefused(RefusalReason.LINEAR_NORM, (
            f"{where}: ‖b‖ exceeds {bounds.linear_norm:.6g}, the most n clipped records and the "
            "round's noise reach (docs/privacy.md, Step 15); no model is published"))


def combine_round(study: Study, raw: dict[bytes, bytes], share: RoundShare, round_no: int,
                  generator: np.random.Generator | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(A, b̂ + V) of a two-server round from the leader's closed-round hash ``raw`` and the
    helper's ``share``, checked; RoundRefused when the servers disagree or a check fails."""
    two = study.two_server_calibration
    where = f"study {study.study_id} round {round_no}"
    width = 8 * two.encoding.entries
    leader_sum, checksum = raw.get(b"sum", b""), raw.get(b"checksum", b"")
    count = raw.get(b"count", b"")
    if (raw.get(b"mode") != TWO_SERVER_MODE or len(leader_sum) != width
            or not count.isdigit() or not raw.get(b"closed_ms", b"").isdigit()
            or share.sum.shape != (two.encoding.entries,)):
        raise RoundRefused(RefusalReason.MALFORMED_ROUND, (
            f"{where}: the closed round or the helper's share is not a two-server round of "
            f"{two.encoding.entries} values; no model is published"))
    count = int(count)
    if count != share.count:
        raise RoundRefused(RefusalReason.COUNT_MISMATCH, (
            f"{where}: the leader folded {count} records, the helper {share.count}; no model is "
            "published"))
    if checksum != share.checksum:
        raise RoundRefused(RefusalReason.CHECKSUM_MISMATCH, (
            f"{where}: the leader and the helper folded different record ids (checksums "
            f"{checksum.hex()[:16]}… and {share.checksum.hex()[:16]}…); no model is published"))
    total = combine(np.frombuffer(leader_sum, dtype="<u8").astype(np.uint64), share.sum)
    a, b = dithered_sum(total, two, generator)
    check_sum(a, b, sum_bounds(two), where)
    return a, b


class HelperShares:
    """The helpers' round shares, one keep-alive client per helper URL (one thread), an
    https:// helper's certificate verified against ``ca_file`` (IPDP_HELPER_CA_FILE; None: the
    system's trust store)."""

    def __init__(self, token: str | None, wait_s: float, stop_event: threading.Event, *,
                 ca_file: str | None = None) -> None:
        self.token = token
        self.ca_file = ca_file
        self.wait_s = wait_s
        self.stop_event = stop_event
        self._clients: dict[str, HelperClient] = {}

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def fetch(self, study: Study, round_no: int) -> RoundShare:
        """The helper's share of the round, waiting up to ``wait_s`` while it answers
        ``round_not_full``; RoundPending when it cannot be had now."""
        where = f"study {study.study_id} round {round_no}"
        if not self.token:
            raise RoundPending(DeferralReason.NO_TOKEN, (
                f"{where}: IPDP_HELPER_LEADER_TOKEN is required for a two-server study: the "
                "bearer token the helper expects from the leader; the round stays pending"))
        url = study.two_server.helper_url
        client = self._clients.get(url)
        if client is None:
            client = HelperClient(url, self.token, timeout_s=max(1.0, min(10.0, self.wait_s)),
                                  retry_s=self.wait_s, ca_file=self.ca_file)
            self._clients[url] = client
        deadline = time.monotonic() + self.wait_s
        pause = 0.05
        while True:
            try:
                share = client.round_share(study.study_id, round_no)
            except HelperRefused as exc:
                raise RoundPending(DeferralReason.HELPER_ERROR, f"{where}: {exc}") from None
            except ssl.SSLCertVerificationError as exc:
                raise RoundPending(DeferralReason.HELPER_ERROR, (
                    f"{where}: the certificate of the helper at {url} does not verify "
                    f"({exc.verify_message}): IPDP_HELPER_CA_FILE must name the CA that signed "
                    "it")) from None
            except (OSError, http.client.HTTPException) as exc:
                raise RoundPending(DeferralReason.HELPER_UNREACHABLE, (
                    f"{where}: the helper at {url} did not answer: {type(exc).__name__}")
                ) from None
            except (KeyError, ValueError) as exc:
                raise RoundPending(DeferralReason.HELPER_ERROR, (
                    f"{where}: the helper's answer is not a round share: {exc}")) from None
            if share is not None:
                return share
            if time.monotonic() + pause > deadline or self.stop_event.wait(pause):
                waited = "until the trainer stopped" if self.stop_event.is_set() else (
                    f"after {self.wait_s:g} s")
                raise RoundPending(DeferralReason.HELPER_NOT_FULL, (
                    f"{where}: the helper's round does not hold n records {waited}; the round "
                    "stays pending"))
            pause = min(1.0, 2.0 * pause)
