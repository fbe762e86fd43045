"""A two-server study's records on the leader: the checks the leader makes without reading a
record, the ring sums of its rounds, the journal of helper commits it owes, and its calls to the
study's helper (docs/architecture.md, "The helper" and "Why each record is folded once on both
sides").

A version-3 record (ipdp.two_server_wire) carries the leader's share in clear and the helper's
sealed. The leader checks what it can see: the layout, the study hash, the record window, the
credential where the study requires one; the replay checks and the fold are
aggregator/fold.py's, in the study's transaction. It cannot check norms: it never sees a record.
A round on the leader is a ring sum (uint64 words, mod 2⁶⁴) of the leader shares, its count and
the XOR of SHA-256 of its record ids (:func:`ipdp.helper_protocol.id_checksum`), the values the
helper keeps for the same round, so the trainer combines a round only when both agree.
"""

from __future__ import annotations

import http.client
import json
import logging
import ssl
from dataclasses import dataclass

import numpy as np

from aggregator.batch import Polled
from aggregator.credentials import CredentialCheck
from aggregator.studies import Resolved
from ipdp import metrics
from ipdp.errors import ConfigurationError, IpdpError
from ipdp.fixed_point import entries
from ipdp.fixed_point import fold as ring_sum
from ipdp.helper_client import HelperClient, HelperRefused, Prepared
from ipdp.helper_protocol import CHECKSUM_BYTES, TWO_SERVER_VERSION, id_checksum
from ipdp.study import Study
from ipdp.two_server_wire import decode_two_server_batch
from ipdp.wire import HEADER_SIZE, STUDY_HASH_BYTES, MalformedRecord, RecordWindow, RejectReason

__all__ = ["MODE", "HelperLink", "HelperUnavailable", "RingFilled", "RingRound", "TwoServerRows",
           "check_two_server", "fill_ring_rounds", "journal_entry", "parse_journal",
           "version_3_rows"]

log = logging.getLogger(__name__)

#: The ``mode`` field of a two-server study's closed round.
MODE = "two-server"

#: Rows refused for one reason and detail: (rows of the Polled, reason, detail).
RefusedRows = tuple[np.ndarray, RejectReason, str]


def version_3_rows(values: list, candidates: list[int]) -> np.ndarray:
    """The positions among ``candidates`` (the rows the version-1 decoder refused: a version-3
    record is 100 + 16·L bytes, never 48 + 16·d) whose value starts with byte 3: two-server
    records, for :func:`check_two_server`. A batch without refusals costs nothing here."""
    return np.array([i for i in candidates
                     if isinstance(v := values[i], bytes | bytearray | memoryview) and len(v)
                     and v[0] == TWO_SERVER_VERSION], np.int64)


def study_hashes_of(rows: Polled, v3: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows long enough to carry a header, their 16-byte study hashes as a V16 column)."""
    whole = np.array([i for i in v3.tolist() if len(rows.values[i]) >= HEADER_SIZE], np.int64)
    hashes = np.frombuffer(b"".join(bytes(rows.values[i][STUDY_HASH_BYTES]) for i in
                                    whole.tolist()), "V16")
    return whole, hashes


@dataclass
class TwoServerRows:
    """One two-server study's rows that passed the leader's stateless checks, in (partition,
    offset, index) order: ``row`` points into the Polled, ``leader`` holds their shares."""

    study: Study
    row: np.ndarray
    record_id: np.ndarray
    """(k, 16) uint8."""
    leader: np.ndarray
    """(k, L) uint64."""

    def __len__(self) -> int:
        return len(self.row)

    def take(self, keep: np.ndarray) -> TwoServerRows:
        """The rows where (or at the positions) ``keep``."""
        return TwoServerRows(self.study, self.row[keep], self.record_id[keep], self.leader[keep])


def check_two_server(rows: Polled, v3: np.ndarray, studies: dict[bytes, Resolved],
                     unmatched, *, window: RecordWindow, credentials: CredentialCheck,
                     now_ms: int) -> tuple[list[RefusedRows], list[TwoServerRows]]:
    """The leader's stateless checks of the version-3 rows ``v3`` of ``rows``: the study their
    hash names (``studies``; ``unmatched(rows, picked, hash)`` says why none does), that it is
    a two-server study, the layout at its d (decode_two_server_batch), the record window and,
    where the study requires them, credentials. Returns the refusals and, per study, the rows
    that passed."""
    refused: list[RefusedRows] = []
    whole, hashes = study_hashes_of(rows, v3)
    short = np.setdiff1d(v3, whole)
    if len(short):
        refused.append((short, RejectReason.UNDECODABLE,
                        f"a version-3 record has at least {HEADER_SIZE} bytes"))
    valid: list[TwoServerRows] = []
    if not len(whole):
        return refused, valid
    uniq, inverse = np.unique(hashes, return_inverse=True)
    for u, key in enumerate(uniq):
        picked = whole[inverse.ravel() == u]
        found = studies[bytes(key)]
        if isinstance(found, MalformedRecord):
            refused.append((picked, found.reason, found.detail))
        elif found is None:
            refused += unmatched(rows, picked, bytes(key))
        elif found.two_server is None:
            detail = (f"version {TWO_SERVER_VERSION} is a two-server study's record; study "
                      f"{found.study_id} has one server (version 1)")
            refused.append((picked, RejectReason.UNSUPPORTED_VERSION, detail))
        else:
            part = _check_study_rows(rows, picked, found, window, credentials, now_ms, refused)
            if len(part):
                valid.append(TwoServerRows(found, part.index, part.record_id, part.leader))
    return refused, valid


def _check_study_rows(rows: Polled, picked: np.ndarray, study: Study, window: RecordWindow,
                      credentials: CredentialCheck, now_ms: int, refused: list[RefusedRows]):
    """Layout, window and credentials of one two-server study's rows: the batch that passes,
    its ``index`` the rows of ``rows``."""
    batch, rejects = decode_two_server_batch([rows.values[i] for i in picked.tolist()], study.d)
    batch.index = picked[batch.index]
    by_cause: dict[tuple[RejectReason, str], list[int]] = {}
    for j, err in rejects:
        by_cause.setdefault((err.reason, err.detail), []).append(int(picked[j]))
    refused += [(np.array(at, np.int64), reason, detail)
                for (reason, detail), at in by_cause.items()]
    ok = np.ones(len(batch), bool)
    for bad, reason, detail in window.failures(batch.created_ms, now_ms):
        hit = bad & ok
        if hit.any():
            refused.append((batch.index[hit], reason, detail))
        ok &= ~bad
    if not ok.all():
        batch = batch.take(ok)
    if study.require_credentials and len(batch):
        batch = credentials.admit(study, batch, rows, now_ms, refused)
    return batch


@dataclass(frozen=True)
class RingRound:
    """A two-server study's round on the leader: its number, count, ring sum of the leader
    shares and id checksum."""

    round_no: int
    count: int
    sum: np.ndarray
    """(L,) uint64, the sum mod 2⁶⁴."""
    checksum: bytes
    """XOR of SHA-256(id) over the round's ids (ipdp.helper_protocol.id_checksum)."""

    @classmethod
    def empty(cls, round_no: int, d: int) -> RingRound:
        return cls(round_no, 0, np.zeros(entries(d), np.uint64), bytes(CHECKSUM_BYTES))

    @classmethod
    def stored(cls, round_no, count, sum_raw, checksum, d: int) -> RingRound:
        """The open round as Redis holds it (None fields: round 1, empty)."""
        empty = cls.empty(int(round_no) if round_no is not None else 1, d)
        if not count:
            return empty
        return cls(empty.round_no, int(count), np.frombuffer(sum_raw, "<u8").astype(np.uint64),
                   bytes(checksum))

    def packed(self) -> dict:
        """The round's hash fields (without ``round``)."""
        return {"count": self.count, "sum": self.sum.astype("<u8").tobytes(),
                "checksum": self.checksum}


@dataclass(frozen=True, kw_only=True)
class RingFilled:
    """Records added to a two-server study's rounds in order (as aggregator.fold.RoundsFilled),
    and which ids went into which round: the helper commit the fold owes."""

    taken: int
    closed: list[RingRound]
    open_round: RingRound
    study_closed: bool
    assignment: dict[int, np.ndarray]
    """round → (k, 16) uint8 record ids."""


def fill_ring_rounds(study: Study, open_round: RingRound, leader: np.ndarray,
                     ids: np.ndarray) -> RingFilled:
    """Add the records (leader shares, ids) to ``open_round`` in order, closing a round at
    exactly n records and opening the next, until they run out or the study's last round
    closes. The leader alone assigns rounds: its open round's count decides."""
    current = open_round
    closed: list[RingRound] = []
    assignment: dict[int, np.ndarray] = {}
    pos, m, n = 0, len(leader), study.n
    while pos < m:
        take = min(n - current.count, m - pos)
        seg = slice(pos, pos + take)
        assignment[current.round_no] = ids[seg]
        current = RingRound(current.round_no, current.count + take,
                            current.sum + ring_sum(leader[seg]),
                            id_checksum(ids[seg], current.checksum))
        pos += take
        if current.count == n:
            closed.append(current)
            if study.round_limit is not None and current.round_no >= study.round_limit:
                return RingFilled(taken=pos, closed=closed, study_closed=True,
                                  open_round=current, assignment=assignment)
            current = RingRound.empty(current.round_no + 1, study.d)
    return RingFilled(taken=pos, closed=closed, study_closed=False, open_round=current,
                      assignment=assignment)


def journal_entry(assignment: dict[int, np.ndarray]) -> str:
    """The journal's value for a helper commit: JSON {round: [id hex, …]}."""
    return json.dumps({str(r): [bytes(i).hex() for i in ids] for r, ids in assignment.items()},
                      separators=(",", ":"))


def parse_journal(raw: bytes | str) -> dict[int, list[bytes]]:
    """A journal entry's rounds: round → 16-byte ids."""
    return {int(r): [bytes.fromhex(i) for i in ids] for r, ids in json.loads(raw).items()}


class HelperUnavailable(IpdpError):
    """A study's helper did not answer (connection refused or reset, a timeout, a 5xx) within
    the client's retry time: nothing is decided, the call is made again later."""


class HelperLink:
    """The leader's calls to its two-server studies' helpers: one keep-alive client per helper
    URL (the fold's thread is the only caller at a time), the bearer token the two domains share
    (IPDP_HELPER_LEADER_TOKEN), the CA an https:// helper's certificate is verified against
    (IPDP_HELPER_CA_FILE; None: the system's), and the helper metrics of the leader."""

    def __init__(self, token: str | None, *, timeout_s: float = 30.0,
                 retry_s: float = 5.0, ca_file: str | None = None) -> None:
        self._token = token
        self._ca_file = ca_file
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self._clients: dict[str, HelperClient] = {}

    def client(self, study: Study) -> HelperClient:
        """The client of ``study``'s helper; ConfigurationError without the token."""
        url = study.two_server.helper_url
        if not self._token:
            raise ConfigurationError(
                f"study {study.study_id} is a two-server study: IPDP_HELPER_LEADER_TOKEN is "
                f"required, the bearer token its helper ({url}) expects from the leader")
        if url not in self._clients:
            self._clients[url] = HelperClient(url, self._token, timeout_s=self.timeout_s,
                                              retry_s=self.retry_s, ca_file=self._ca_file)
        return self._clients[url]

    def _call(self, study: Study, call: str, fn, *args):
        client = self.client(study)
        try:
            answer = fn(client, *args)
        except HelperRefused as exc:
            if exc.status >= 500:
                metrics.HELPER_CALLS.labels(call, "unavailable").inc()
                raise HelperUnavailable(f"{call} at {study.two_server.helper_url}: {exc}") \
                    from exc
            metrics.HELPER_CALLS.labels(call, "refused").inc()
            if exc.status == 401:
                raise ConfigurationError(
                    f"the helper of study {study.study_id} ({study.two_server.helper_url}) "
                    "refused the leader's token: IPDP_HELPER_LEADER_TOKEN must be the one the "
                    "helper was given") from exc
            raise
        except ssl.SSLCertVerificationError as exc:
            # Not the helper being away: waiting would not make its certificate verify.
            metrics.HELPER_CALLS.labels(call, "refused").inc()
            raise ConfigurationError(
                f"the certificate of study {study.study_id}'s helper "
                f"({study.two_server.helper_url}) does not verify ({exc.verify_message}): "
                "IPDP_HELPER_CA_FILE must name the CA that signed it") from exc
        except (OSError, http.client.HTTPException, ValueError) as exc:
            client.close()
            metrics.HELPER_CALLS.labels(call, "unavailable").inc()
            raise HelperUnavailable(f"{call} at {study.two_server.helper_url}: "
                                    f"{type(exc).__name__}: {exc}") from exc
        metrics.HELPER_CALLS.labels(call, "ok").inc()
        return answer

    def prepare(self, study: Study, job_id: str, study_value: bytes, records: list[bytes],
                credentials: list[bytes | None] | None = None) -> Prepared:
        """The helper's verdict on a job of ``study``'s records (their helper parts go out,
        with the credentials they were admitted with where the study requires them)."""
        return self._call(study, "prepare", HelperClient.prepare, job_id, study_value, records,
                          study.d, credentials)

    def commit(self, study: Study, job_id: str, rounds: dict[int, list[bytes]]) -> dict:
        """Fold a prepared job's records into ``rounds`` at the helper (idempotent by job)."""
        return self._call(study, "commit", HelperClient.commit, job_id, rounds)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
