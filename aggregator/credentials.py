"""The aggregator's credential check: records of a study that requires credentials are folded
only with a valid credential whose slots include their record id (ipdp.credentials).

Runs after the stateless checks, on the rows of one study, and only for such studies. Each
message's ``credentials`` header is read once (a container's records share it) and each distinct
token of a poll checked once (ipdp.credentials.CredentialVerifier: a version-1 token's signature
once per process, a version-2 batch's once for all its devices, then a few hashes per device);
the record ids of a credential are compared with its slots' ids in one numpy comparison
(ipdp.credentials.admit_slots, the check a two-server study's helper makes too). A slot used
twice is refused by the fold's replay check (``credential_reused``), where the fold is
exactly-once.
"""

from __future__ import annotations

from aggregator.batch import Polled, decode_headers
from ipdp.credentials import (
    CredentialRefused,
    CredentialVerifier,
    admit_slots,
    tokens_of_header,
)
from ipdp.signing import TrustedKeys
from ipdp.study import Study
from ipdp.wire import RecordBatch, RejectReason


class CredentialCheck:
    """Admits the rows of a credential-requiring study that carry a valid credential."""

    def __init__(self, trusted: TrustedKeys, *, replay_window_s: int,
                 max_future_skew_s: int) -> None:
        # A credential valid longer than the replay window could be used again once the
        # window has forgotten its slots, so the verifier refuses it.
        self.verifier = CredentialVerifier(trusted, max_validity_ms=replay_window_s * 1000,
                                           skew_ms=max_future_skew_s * 1000)

    def admit(self, study: Study, batch: RecordBatch, polled: Polled, now_ms: int,
              refused: list) -> RecordBatch:
        """The rows of ``batch`` (rows of ``polled``) whose credential admits them; the others
        are appended to ``refused`` as (rows of ``polled``, reason, detail), one entry per
        refused credential."""
        ok, refusals, _expires = admit_slots(
            self.verifier, tokens_of_rows(polled, batch.index.tolist()), batch.record_id,
            study.hash, study.records_per_device, now_ms)
        refused += [(batch.index[hit], reason, detail) for hit, reason, detail in refusals]
        return batch if ok.all() else batch.take(ok)


def tokens_of_rows(polled: Polled, rows: list[int]) -> list:
    """Per row of ``polled`` its token, None (no header) or the CredentialRefused of its
    header."""
    parsed: dict[int, list | CredentialRefused | None] = {}
    out = []
    for i in rows:
        block = None if polled.headers is None else polled.headers[i]
        tokens = parsed.get(id(block), parsed)
        if tokens is parsed:
            try:
                tokens = tokens_of_header(decode_headers(block))
            except CredentialRefused as refusal:
                tokens = refusal
            parsed[id(block)] = tokens
        at = max(int(polled.index[i]), 0)
        if tokens is None or isinstance(tokens, CredentialRefused):
            out.append(tokens)
        elif at < len(tokens):
            out.append(tokens[at])
        else:
            out.append(CredentialRefused(RejectReason.CREDENTIAL_INVALID,
                                         f"no credential for record {at} of its message"))
    return out
