"""Fold a validated batch into Redis: one transaction per study, then one checkpoint.

A batch is the messages one poll returned: per partition, a contiguous run of offsets. A
container message (wire version 2) folds all its records or none: its offset is one unit.

Offsets are kept at two levels, as Kafka Streams keeps state per task:

- the **group's checkpoint** (``state.offsets_key``): per partition, where to read next. It is
  moved forward (never back) after every study of the batch has committed, in one atomic
  script that also counts the batch's stateless refusals;
- each **study's offsets** (``state.StudyKeys.offsets``): per partition, the offset below which
  this study's records are folded. They are written in the study's transaction, with its
  statistics, its replay ids and its counts — every key of it in the study's hash slot.

A study's transaction is a checkpoint in the quixstreams sense — read under WATCH, decide,
MULTI/EXEC — and touches nothing another study's does, so aggregators folding different
studies never invalidate each other's transactions, and the whole thing runs on Redis Cluster.
A crash between two studies' commits leaves the checkpoint where it was: the batch is read
again, the study that committed skips its records (its offsets say they are folded), the other
folds them. A zombie that lost its partitions finds every study's offsets moved and folds
nothing. A resume to another log (aggregator/logs.py) bumps the partition's epoch, which
retires every study's offsets of the old log at once.

:meth:`Folder.fold` reads as its phases: find the checkpoint, check the batch (no Redis state),
dead-letter what the checks refused, fold each study, move the checkpoint. One study's fold has
phases of its own: :meth:`Folder._read` (under WATCH) returns a :class:`StudyState`,
:func:`decide` turns it and the study's rows into a :class:`StudyFold` without touching Redis,
its refusals are dead-lettered, :func:`write_fold` queues the fold's writes after MULTI, EXEC.

A two-server study (version-3 records, aggregator/two_server.py) folds the same way with its
helper as the second party of a two-phase commit whose commit point is the study's own EXEC:
:meth:`Folder._fold_two_server_study` prepares the records at the helper, decides
(:func:`decide_two_server`), and writes its ring-sum rounds together with a journal entry
naming the helper commit it owes (:func:`write_two_server_fold`); the commit follows, and
:meth:`Folder.resend_pending` sends every entry a crash left again (docs/architecture.md, "Why
each record is folded once on both sides").

Refusals are arrays (:class:`~aggregator.batch.Refused`) from the checks to the dead-letter topic:
the checkpoint script counts them per (partition, reason) by one binary search in a blob of
offsets, the study's transaction per reason, and the dead letters go out in containers
(ipdp.dead_letters). A refusal costs no more than a fold (docs/security.md, "Against a flood").
Dead letters are delivered before the commit that counts them, so a crash between the two sends
them again (at least once) and counts them once (exactly once, with the offsets).

Lua scripts go with ``EVAL`` (``execute_command``), which Redis caches by SHA, on one Redis as
on a cluster: redis-py's cluster pipeline has neither ``eval`` nor EVALSHA script loading
(redis-py issue #2914), and an unknown SHA inside MULTI would fail that one command at EXEC
while the others still apply. Every key a script touches is passed as a key, so a cluster
routes it to that slot.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import redis

from aggregator.batch import REASONS, Message, Polled, Refused, Rejection
from aggregator.credentials import CredentialCheck, tokens_of_rows
from aggregator.replay import ReplayIds, id_prefixes
from aggregator.studies import StudyLookup
from aggregator.two_server import (
    MODE,
    HelperLink,
    HelperUnavailable,
    RingRound,
    TwoServerRows,
    check_two_server,
    fill_ring_rounds,
    journal_entry,
    parse_journal,
    study_hashes_of,
    version_3_rows,
)
from aggregator.validate import Validator, ValidRows, split_containers
from ipdp import metrics, state
from ipdp.helper_client import HelperRefused, Prepared
from ipdp.signing import TrustedKeys
from ipdp.study import Study, StudyStatus
from ipdp.wire import RejectReason

log = logging.getLogger(__name__)

#: One study's reads, in one round trip (each redis-py command costs CPU of its own).
#: KEYS[1] = study hash, KEYS[2] = open round, KEYS[3] = the study's offsets; ARGV = offset
#: fields -> { {status, wire hash}, {round, count, A, b}, {offset per field} }
_READ_STUDY_LUA = """
return {redis.call('HMGET', KEYS[1], 'status', 'hash'),
        redis.call('HMGET', KEYS[2], 'round', 'count', 'A', 'b'),
        redis.call('HMGET', KEYS[3], unpack(ARGV))}
"""

#: A two-server study's reads (KEYS and ARGV as above): its definition's status and hash, and
#: its open round's ring sum.
_READ_TWO_SERVER_LUA = """
return {redis.call('HMGET', KEYS[1], 'status', 'hash'),
        redis.call('HMGET', KEYS[2], 'round', 'count', 'sum', 'checksum'),
        redis.call('HMGET', KEYS[3], unpack(ARGV))}
"""

#: The group's checkpoint. KEYS[1] = offsets hash, KEYS[2] = rejected-counts hash;
#: ARGV = n, n × (partition, next offset), then per (partition, reason) of the stateless
#: refusals: partition, reason, their offsets (sorted, int64 little-endian, packed). Counts the
#: refusals at or past their partition's stored offset (those below were counted by the fold
#: that moved it; a binary search finds the first), then moves each offset forward, never back.
_CHECKPOINT_LUA = """
local n = tonumber(ARGV[1])
local stored = {}
for i = 0, n - 1 do
  local p, nxt = ARGV[2 + 2 * i], tonumber(ARGV[3 + 2 * i])
  local cur = tonumber(redis.call('HGET', KEYS[1], p) or '-1')
  stored[p] = cur
  if nxt > cur then
    redis.call('HSET', KEYS[1], p, nxt)
  end
end
local counted = 0
for i = 2 + 2 * n, #ARGV, 3 do
  local at, offsets = stored[ARGV[i]], ARGV[i + 2]
  local lo, hi = 0, #offsets / 8
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if struct.unpack('<i8', offsets, 8 * mid + 1) < at then lo = mid + 1 else hi = mid end
  end
  local k = #offsets / 8 - lo
  if k > 0 then
    redis.call('HINCRBY', KEYS[2], ARGV[i + 1], k)
    counted = counted + k
  end
end
return counted
"""


@dataclass
class FoldResult:
    """What one fold did; counts are exact (they were written in the transactions)."""

    folded: dict[str, int] = field(default_factory=dict)
    refused: Refused = field(default_factory=Refused.none)
    closed_rounds: list[tuple[str, int]] = field(default_factory=list)
    open_rounds: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """study → (round, count, n) after the fold."""
    skipped: int = 0
    """Messages below the checkpoint (already folded by an earlier owner)."""
    reseek: dict[int, int] = field(default_factory=dict)
    """partition → offset to seek to, when the batch started past the checkpoint."""
    conflicts: int = 0

    @property
    def rejected(self) -> list[Rejection]:
        """The refusals one by one, as objects (stateless ones first, then per study)."""
        return self.refused.rejections()


@dataclass(frozen=True)
class Spans:
    """Each partition's run in a batch sorted by (partition, offset)."""

    first: dict[int, int]
    last: dict[int, int]

    @classmethod
    def of(cls, batch: Polled) -> Spans:
        starts = np.flatnonzero(np.r_[True, batch.partition[1:] != batch.partition[:-1]])
        ends = np.r_[starts[1:], len(batch)] - 1
        partitions = batch.partition[starts].tolist()
        return cls(dict(zip(partitions, batch.offset[starts].tolist(), strict=True)),
                   dict(zip(partitions, batch.offset[ends].tolist(), strict=True)))


@dataclass(frozen=True)
class Checkpoint:
    """The group's stored position of each partition of a batch."""

    offset: dict[int, int]
    """partition → next offset to read (absent: never read)."""
    field: dict[int, str]
    """partition → its field in a study's offsets hash, ``<partition>:<epoch>`` (the epoch is 0
    until a resume moves the partition to another log); named once per batch."""


@dataclass(frozen=True)
class OpenRound:
    """A study's round that is filling: its number, how many records it holds, and A, b."""

    round_no: int
    count: int
    a: np.ndarray
    b: np.ndarray


@dataclass(frozen=True)
class ClosedRound:
    round_no: int
    a: np.ndarray
    b: np.ndarray


@dataclass(frozen=True, kw_only=True)
class StudyState:
    """What one study's fold reads under WATCH."""

    status: StudyStatus | None
    open_round: OpenRound
    folded_below: dict[int, int]
    """partition → offset below which this study's records are folded."""
    replayed: np.ndarray
    """Per valid row: its id was folded within the replay window."""


@dataclass(frozen=True, kw_only=True)
class RoundsFilled:
    """Records added to a study's rounds in order: how many were taken, the rounds they closed,
    the round left open, and whether the last closed round was the study's last."""

    taken: int
    closed: list[ClosedRound]
    open_round: OpenRound
    study_closed: bool


@dataclass(frozen=True, kw_only=True)
class StudyFold:
    """What one study's transaction writes, decided from its rows and its :class:`StudyState`."""

    study: Study
    was_open: bool
    """The study was open when read; a closed or unknown one folds nothing."""
    folded_ids: np.ndarray
    closed: list[ClosedRound]
    open_round: OpenRound
    study_closed: bool
    """This fold closed the study (its last round)."""
    next_offsets: dict[str, int]
    """Fields of the study's offsets hash → next offset."""
    refused: Refused


def _first_of_each_id(ids: np.ndarray) -> np.ndarray:
    """Whether each 16-byte id (rows of uint8) is the first occurrence of its value."""
    first = np.ones(len(ids), bool)
    prefixes = id_prefixes(ids)
    ranked = np.sort(prefixes)
    if len(ids) < 2 or not (ranked[1:] == ranked[:-1]).any():
        return first  # distinct prefixes: distinct ids, without a bytes sort
    first[:] = False
    first[np.unique(np.ascontiguousarray(ids).view("V16").ravel(), return_index=True)[1]] = True
    return first


def _per_row(by_partition: dict[int, int], partition: np.ndarray) -> np.ndarray:
    """``by_partition``'s offset for each row's partition (-1 where it has none)."""
    if not by_partition:
        return np.full(len(partition), -1, np.int64)
    keys = np.array(sorted(by_partition), np.int64)
    values = np.array([by_partition[k] for k in keys.tolist()], np.int64)
    at = np.minimum(np.searchsorted(keys, partition), len(keys) - 1)
    return np.where(keys[at] == partition, values[at], -1)


def fill_rounds(study: Study, open_round: OpenRound, q: np.ndarray, p: np.ndarray
                ) -> RoundsFilled:
    """Add the records (q̃, p̃ rows) to ``open_round`` in order, closing a round at exactly n
    records and opening the next, until the records run out or the study's last round closes."""
    round_no, count = open_round.round_no, open_round.count
    a, b = open_round.a.copy(), open_round.b.copy()
    closed: list[ClosedRound] = []
    pos, m, n = 0, len(q), study.n
    while pos < m:
        take = min(n - count, m - pos)
        seg = slice(pos, pos + take)
        a += q[seg].T @ q[seg]
        b += p[seg].sum(axis=0)
        count += take
        pos += take
        if count == n:
            closed.append(ClosedRound(round_no, a, b))
            if study.round_limit is not None and round_no >= study.round_limit:
                return RoundsFilled(taken=pos, closed=closed, study_closed=True,
                                    open_round=OpenRound(round_no, 0, a, b))
            round_no, count = round_no + 1, 0
            a, b = np.zeros((study.d, study.d)), np.zeros(study.d)
    return RoundsFilled(taken=pos, closed=closed, study_closed=False,
                        open_round=OpenRound(round_no, count, a, b))


def decide(rows: Polled, valid: ValidRows, seen: StudyState, spans: Spans,
           checkpoint: Checkpoint) -> StudyFold:
    """The decide phase of one study (no Redis): which of its valid rows fold, into which
    rounds, and which are refused for the study's state (closed, or an id seen before)."""
    study = valid.study
    not_yet_folded = rows.offset[valid.row] >= _per_row(seen.folded_below,
                                                        rows.partition[valid.row])
    todo, replayed = valid.take(not_yet_folded), seen.replayed[not_yet_folded]
    next_offsets = {checkpoint.field[x]: spans.last[x] + 1
                    for x in np.unique(rows.partition[todo.row]).tolist()}
    if seen.status != StudyStatus.OPEN:
        reason = RejectReason.UNKNOWN_STUDY if seen.status is None else RejectReason.CLOSED_STUDY
        return StudyFold(
            study=study, was_open=False, folded_ids=todo.record_id[:0], closed=[],
            open_round=seen.open_round, study_closed=False, next_offsets=next_offsets,
            refused=Refused.of(rows, todo.row, reason, f"study {study.study_id} is "
                               f"{seen.status and seen.status.value}"))
    first_sight = _first_of_each_id(todo.record_id) & ~replayed
    seen_before = Refused.of(rows, todo.row[~first_sight], *_seen_before(study))
    fresh = todo.take(first_sight)
    filled = fill_rounds(study, seen.open_round, fresh.q, fresh.p)
    past_last_round = Refused.of(
        rows, fresh.row[filled.taken:], RejectReason.CLOSED_STUDY,
        f"study {study.study_id} closed after {study.round_limit} rounds (max_rounds or its "
        "privacy budget)")
    return StudyFold(
        study=study, was_open=True, folded_ids=fresh.record_id[:filled.taken],
        closed=filled.closed, open_round=filled.open_round, study_closed=filled.study_closed,
        next_offsets=next_offsets, refused=Refused.join([seen_before, past_last_round]))


def _seen_before(study: Study) -> tuple[RejectReason, str]:
    """Why a record whose id was folded before is refused."""
    if study.require_credentials:  # a record id is a credential's slot: seeing it is a reuse
        return RejectReason.CREDENTIAL_REUSED, "the credential's slot was already folded"
    return RejectReason.REPLAYED, "record id already seen within the replay window"


def write_fold(pipe, fold: StudyFold, keys: state.StudyKeys, replay: ReplayIds, *, group: str,
               topic: str, now_ms: int) -> None:
    """The write phase of one study: queue (after MULTI) everything ``fold`` decided; every
    key is in the study's hash slot."""
    for c in fold.closed:
        a_raw, b_raw = state.pack_stats(c.a, c.b)
        pipe.hset(keys.closed(c.round_no), mapping={
            "A": a_raw, "b": b_raw, "count": fold.study.n, "closed_ms": now_ms})
        pipe.sadd(keys.unannounced, c.round_no)
    if fold.study_closed:
        pipe.delete(keys.open)
        pipe.hset(keys.study, "status", StudyStatus.CLOSED.value)
    elif len(fold.folded_ids):
        a_raw, b_raw = state.pack_stats(fold.open_round.a, fold.open_round.b)
        pipe.hset(keys.open, mapping={"round": fold.open_round.round_no,
                                      "count": fold.open_round.count, "A": a_raw, "b": b_raw})
    _write_bookkeeping(pipe, fold, keys, replay, group=group, topic=topic, now_ms=now_ms)


def _write_bookkeeping(pipe, fold: StudyFold | TwoServerFold, keys: state.StudyKeys,
                       replay: ReplayIds, *, group: str, topic: str, now_ms: int) -> None:
    """What every study's transaction writes besides its rounds: the ids it folded, its counts
    and its offsets."""
    if len(fold.folded_ids):
        replay.add(pipe, keys, fold.folded_ids, now_ms)
    counts = {"folded": len(fold.folded_ids), "rounds_closed": len(fold.closed)}
    counts.update((f"{state.REJECTED_FIELD}{reason.value}", k)
                  for reason, k in fold.refused.counts().items())
    for name, k in counts.items():
        if k:
            pipe.hincrby(keys.counts, name, k)
    if fold.next_offsets:
        pipe.hset(keys.offsets(group, topic), mapping=fold.next_offsets)


@dataclass(frozen=True, kw_only=True)
class TwoServerState:
    """What a two-server study's fold reads under WATCH (as :class:`StudyState`)."""

    status: StudyStatus | None
    open_round: RingRound
    folded_below: dict[int, int]
    replayed: np.ndarray


@dataclass(frozen=True, kw_only=True)
class TwoServerFold:
    """What a two-server study's transaction writes (as :class:`StudyFold`, rounds as ring
    sums), and the helper commit it owes: ``assignment``, round → ids."""

    study: Study
    was_open: bool
    folded_ids: np.ndarray
    closed: list[RingRound]
    open_round: RingRound
    study_closed: bool
    next_offsets: dict[str, int]
    refused: Refused
    assignment: dict[int, np.ndarray]


@dataclass(frozen=True)
class HelperVerdict:
    """The helper's answer for a two-server study's rows (positions of its TwoServerRows)."""

    asked: np.ndarray
    """Per row: it was in the job (the leader would have folded it when it asked)."""
    accepted: np.ndarray
    """Per row: the helper accepted it (False where not asked)."""
    reason: dict[int, str]
    """Row → the helper's reason, for the rows asked and refused."""

    @classmethod
    def of(cls, asked: np.ndarray, prepared: Prepared) -> HelperVerdict:
        at = np.flatnonzero(asked)
        accepted = np.zeros(len(asked), bool)
        accepted[at] = prepared.mask
        return cls(asked, accepted, {int(at[i]): why for i, why in prepared.refused.items()})


def decide_two_server(rows: Polled, valid: TwoServerRows, seen: TwoServerState, spans: Spans,
                      checkpoint: Checkpoint, verdict: HelperVerdict) -> TwoServerFold:
    """The decide phase of a two-server study: as :func:`decide` (offsets, status, replays),
    then the helper's ``verdict``: the rows it refused, of those the leader would fold, are
    refused here too (``helper_refused``, the helper's reason as detail), and the rest go into
    the rounds the leader's open round decides. A row the leader did not ask about (its id
    looked seen before when it asked) is refused as seen before."""
    study = valid.study
    not_yet_folded = rows.offset[valid.row] >= _per_row(seen.folded_below,
                                                        rows.partition[valid.row])
    todo, replayed = valid.take(not_yet_folded), seen.replayed[not_yet_folded]
    todo_at = np.flatnonzero(not_yet_folded)  # positions in ``valid``, as the verdict has them
    next_offsets = {checkpoint.field[x]: spans.last[x] + 1
                    for x in np.unique(rows.partition[todo.row]).tolist()}
    if seen.status != StudyStatus.OPEN:
        reason = RejectReason.UNKNOWN_STUDY if seen.status is None else RejectReason.CLOSED_STUDY
        return TwoServerFold(
            study=study, was_open=False, folded_ids=todo.record_id[:0], closed=[],
            open_round=seen.open_round, study_closed=False, next_offsets=next_offsets,
            refused=Refused.of(rows, todo.row, reason, f"study {study.study_id} is "
                               f"{seen.status and seen.status.value}"), assignment={})
    first_sight = _first_of_each_id(todo.record_id) & ~replayed & verdict.asked[todo_at]
    seen_before = Refused.of(rows, todo.row[~first_sight], *_seen_before(study))
    fresh, fresh_at = todo.take(first_sight), todo_at[first_sight]
    helper_ok = verdict.accepted[fresh_at]
    accepted = fresh.take(helper_ok)
    by_reason: dict[str, list[int]] = {}
    for j in np.flatnonzero(~helper_ok).tolist():
        by_reason.setdefault(verdict.reason[int(fresh_at[j])], []).append(j)
    helper_refused = [Refused.of(rows, fresh.row[np.array(at, np.int64)],
                                 RejectReason.HELPER_REFUSED, why)
                      for why, at in sorted(by_reason.items())]
    filled = fill_ring_rounds(study, seen.open_round, accepted.leader, accepted.record_id)
    past_last_round = Refused.of(
        rows, accepted.row[filled.taken:], RejectReason.CLOSED_STUDY,
        f"study {study.study_id} closed after {study.round_limit} rounds (max_rounds or its "
        "privacy budget)")
    return TwoServerFold(
        study=study, was_open=True, folded_ids=accepted.record_id[:filled.taken],
        closed=filled.closed, open_round=filled.open_round, study_closed=filled.study_closed,
        next_offsets=next_offsets,
        refused=Refused.join([seen_before, *helper_refused, past_last_round]),
        assignment=filled.assignment)


def write_two_server_fold(pipe, fold: TwoServerFold, keys: state.StudyKeys, replay: ReplayIds,
                          *, job_id: str, group: str, topic: str, now_ms: int) -> None:
    """The write phase of a two-server study (after MULTI): its ring rounds, its bookkeeping
    and, in the same transaction, the journal entry naming the helper commit it owes."""
    for c in fold.closed:
        pipe.hset(keys.closed(c.round_no), mapping={**c.packed(), "closed_ms": now_ms,
                                                    "mode": MODE})
        pipe.sadd(keys.unannounced, c.round_no)
    if fold.study_closed:
        pipe.delete(keys.open)
        pipe.hset(keys.study, "status", StudyStatus.CLOSED.value)
    elif len(fold.folded_ids):
        pipe.hset(keys.open, mapping={"round": fold.open_round.round_no,
                                      **fold.open_round.packed()})
    if fold.assignment:
        pipe.hset(keys.helper_pending, job_id, journal_entry(fold.assignment))
    _write_bookkeeping(pipe, fold, keys, replay, group=group, topic=topic, now_ms=now_ms)


def announce(r: redis.Redis, keys: state.StudyKeys, rounds: Sequence[int]) -> None:
    """Put closed rounds on the trainer's stream, then forget them as unannounced. A crash in
    between announces them twice; the trainer skips a round already published."""
    if not rounds:
        return
    with r.pipeline(transaction=False) as pipe:
        for round_no in rounds:
            pipe.xadd(state.ROUNDS_STREAM, {"study": keys.study_id, "round": round_no})
        pipe.srem(keys.unannounced, *rounds)
        pipe.execute()


def _refusal_groups(refused: Refused) -> list:
    """The checkpoint script's arguments for ``refused``: per (partition, reason), the partition,
    the reason and the sorted offsets packed as int64."""
    if not len(refused):
        return []
    partition, offset = refused.records.partition, refused.records.offset
    code = refused.reason_codes()
    order = np.lexsort((offset, code, partition))
    partition, offset, code = partition[order], offset[order], code[order]
    starts = np.flatnonzero(np.r_[True, (partition[1:] != partition[:-1])
                                  | (code[1:] != code[:-1])])
    ends = np.r_[starts[1:], len(order)]
    packed = offset.astype("<i8")
    return [x for s, e in zip(starts.tolist(), ends.tolist(), strict=True)
            for x in (int(partition[s]), REASONS[code[s]].value, packed[s:e].tobytes())]


class Folder:
    """Folds batches for one consumer group and records topic into Redis."""

    def __init__(
        self,
        r: redis.Redis,
        *,
        group: str,
        topic: str,
        replay_window_s: int,
        max_future_skew_s: int,
        max_message_bytes: int,
        trusted: TrustedKeys | None = None,
        credential_keys: TrustedKeys | None = None,
        unknown_study_ttl_s: float = 5.0,
        clock: Callable[[], float] = time.time,
        helpers: HelperLink | None = None,
    ) -> None:
        self.r = r
        self.helpers = helpers or HelperLink(None)
        self._two_server_studies: set[str] = set()
        """Two-server studies this process has folded or found a journal entry of."""
        self._reported: set[str] = set()
        """Journal entries whose commit the helper refused, logged once."""
        self.group, self.topic = group, topic
        self.offsets_key = state.offsets_key(group, topic)
        self.rejected_key = state.rejected_key(group, topic)
        self.clock = clock
        self.studies = StudyLookup(r, trusted=trusted, unknown_ttl_s=unknown_study_ttl_s)
        self.validator = Validator(replay_window_s=replay_window_s,
                                   max_future_skew_s=max_future_skew_s,
                                   max_message_bytes=max_message_bytes,
                                   credentials=CredentialCheck(
                                       credential_keys or TrustedKeys(),
                                       replay_window_s=replay_window_s,
                                       max_future_skew_s=max_future_skew_s))
        self.replay = ReplayIds(r, replay_window_s=replay_window_s,
                                max_future_skew_s=max_future_skew_s)

    def committed_offsets(self) -> dict[int, int]:
        """partition → next offset to read, as stored after the last fold."""
        raw = self.r.hgetall(self.offsets_key)
        return {int(k): int(v) for k, v in raw.items() if b":" not in k}

    def announce_pending(self) -> int:
        """Announce every study's closed rounds that a crash left off the trainer's stream."""
        pending = 0
        for sid in sorted({v.decode() for v in self.r.hvals(state.STUDY_HASHES)}):
            keys = state.StudyKeys(sid)
            rounds = sorted(int(x) for x in self.r.smembers(keys.unannounced))
            announce(self.r, keys, rounds)
            pending += len(rounds)
        return pending

    def resend_pending(self, *, every_study: bool = False) -> int:
        """Send again each helper commit the journals of the two-server studies this process
        knows (``every_study``: of every registered study, as at start) still owe; an entry is
        deleted once the helper has folded its job. Returns the entries left owing."""
        if every_study:
            sids = sorted({v.decode() for v in self.r.hvals(state.STUDY_HASHES)})
        else:
            sids = sorted(self._two_server_studies)
        if not sids:
            return 0
        with self.r.pipeline(transaction=False) as pipe:
            for sid in sids:
                pipe.hgetall(state.StudyKeys(sid).helper_pending)
            journals = pipe.execute()
        left = 0
        for sid, journal in zip(sids, journals, strict=True):
            if not journal:
                continue
            self._two_server_studies.add(sid)
            found = state.load_study(self.r, sid, self.studies.trusted)
            if found is None:
                continue
            for job_id, raw in sorted(journal.items()):
                metrics.BACKEND_RETRIES.labels("helper").inc()
                if not self._commit_at_helper(found[0], job_id.decode(), parse_journal(raw)):
                    left += 1
        metrics.HELPER_COMMITS_PENDING.set(left)
        return left

    def _commit_at_helper(self, study: Study, job_id: str, rounds: dict[int, list]) -> bool:
        """Fold job ``job_id`` into ``rounds`` at the helper, then delete its journal entry;
        False (the entry stays, to be sent again) when the helper cannot be reached or refuses
        it."""
        try:
            self.helpers.commit(study, job_id, {r: [bytes(i) for i in ids]
                                                for r, ids in rounds.items()})
        except HelperUnavailable as exc:
            metrics.BACKEND_ERRORS.labels("helper", "commit").inc()
            log.warning("study %s: the helper commit of job %s is owed (%s); sending it again "
                        "later", study.study_id, job_id, exc)
            return False
        except HelperRefused as exc:
            if job_id not in self._reported:
                self._reported.add(job_id)
                log.error("study %s: the helper refused the commit of job %s (%s): rounds %s "
                          "cannot be combined until an operator resolves it; the entry stays in "
                          "%s", study.study_id, job_id, exc, sorted(rounds),
                          state.StudyKeys(study.study_id).helper_pending)
            return False
        self.r.hdel(state.StudyKeys(study.study_id).helper_pending, job_id)
        return True

    def _checkpoint(self, partitions: list[int]) -> Checkpoint:
        fields = [str(p) for p in partitions] + [f"{p}:epoch" for p in partitions]
        raw = self.r.hmget(self.offsets_key, fields)
        k = len(partitions)
        return Checkpoint({p: int(x) for p, x in zip(partitions, raw[:k], strict=True)
                           if x is not None},
                          {p: f"{p}:{int(x) if x is not None else 0}"
                           for p, x in zip(partitions, raw[k:], strict=True)})

    def fold(
        self,
        messages: Polled | Sequence[Message],
        dead_letter: Callable[[Refused], None] | None = None,
    ) -> FoldResult:
        """Validate and fold `messages` (a Polled in (partition, offset) order, as the fetch
        makes it); `dead_letter` is called with each phase's refusals before the commit that
        counts them (so at least once per refusal)."""
        now_ms = int(self.clock() * 1000)
        batch = messages if isinstance(messages, Polled) else Polled.of(messages)
        if len(batch) == 0:
            return FoldResult()
        # 1. Position: the group's checkpoint of each partition; a batch past it is re-read
        #    from it, what lies below it was folded by an earlier owner.
        spans = Spans.of(batch)
        checkpoint = self._checkpoint(list(spans.first))
        if any(spans.first[p] > o for p, o in checkpoint.offset.items()):
            for p, o in checkpoint.offset.items():
                if spans.first[p] > o:
                    log.warning("partition %d: batch starts at %d but Redis has %d; re-seeking",
                                p, spans.first[p], o)
            return FoldResult(reseek={p: checkpoint.offset.get(p, first)
                                      for p, first in spans.first.items()})
        unread = batch.offset >= _per_row(checkpoint.offset, batch.partition)
        result = FoldResult(skipped=int((~unread).sum()))
        if not unread.all():
            batch = batch.take(np.flatnonzero(unread))
        # 2. Check: every check that reads no Redis state.
        rows, stateless, valid, two_server = self._check(batch, now_ms)
        # 3. Dead-letter the checks' refusals, before the checkpoint that counts them.
        if dead_letter and len(stateless):
            dead_letter(stateless)
        refused = [stateless]
        # 4. Fold each study: its own transaction, its own refusals (a two-server study's
        #    with its helper: prepare, the transaction, the helper's commit).
        for v in sorted(valid, key=lambda v: v.study.study_id):
            refused.append(self._fold_study(rows, v, spans, checkpoint, now_ms, dead_letter,
                                            result))
        for w in sorted(two_server, key=lambda w: w.study.study_id):
            refused.append(self._fold_two_server_study(rows, w, spans, checkpoint, now_ms,
                                                       dead_letter, result))
        result.refused = Refused.join(refused)
        # 5. Checkpoint: move the group's offsets and count the checks' refusals, atomically.
        self.r.execute_command(
            "EVAL", _CHECKPOINT_LUA, 2, self.offsets_key, self.rejected_key,
            len(spans.last), *(x for p, last in spans.last.items() for x in (p, last + 1)),
            *_refusal_groups(stateless))
        return result

    def _check(self, batch: Polled, now_ms: int
               ) -> tuple[Polled, Refused, list[ValidRows], list[TwoServerRows]]:
        """Split containers, decode, look the studies up and validate: the batch as one row per
        record, what the checks refused, and what passed them per study: one-server studies'
        rows, then two-server studies' (version 3, aggregator.two_server)."""
        rows, bad_containers = split_containers(batch, self.validator.max_message_bytes)
        decoded = self.validator.decode(rows)
        v3 = version_3_rows(rows.values, [i for i, _, _ in decoded.undecoded])
        v3_hashes: list[bytes] = []
        if len(v3):  # the version-1 decoder refused them: they are two_server's to check
            two_server_rows = set(v3.tolist())
            decoded = replace(decoded, undecoded=[
                x for x in decoded.undecoded if x[0] not in two_server_rows])
            v3_hashes = [bytes(h) for h in np.unique(study_hashes_of(rows, v3)[1])]
        studies = self.studies.resolve(sorted(set(decoded.study_hashes) | set(v3_hashes)))
        registered = {}
        if None in studies.values():
            names = Validator.unmatched_headers(rows, decoded, studies)
            unknown = {h for h in v3_hashes if studies[h] is None}
            if unknown:
                whole, hashes = study_hashes_of(rows, v3)
                hit = np.isin(hashes, np.frombuffer(b"".join(sorted(unknown)), "V16"))
                names |= {x for x in rows.study_headers(whole[hit].tolist()) if x is not None}
            registered = self.studies.registered(names)
        refused, valid = self.validator.validate(rows, decoded, studies, registered, now_ms)
        valid, deleted = self._one_study_per_id(rows, valid)
        v3_refused, two_server = check_two_server(
            rows, v3, studies, lambda r, picked, key: Validator._unmatched(r, picked, key,
                                                                           registered),
            window=self.validator.window, credentials=self.validator.credentials, now_ms=now_ms)
        self._two_server_studies.update(w.study.study_id for w in two_server)
        return (rows, Refused.join([bad_containers, refused, *deleted,
                                    *(Refused.of(rows, *x) for x in v3_refused)]).in_order(),
                valid, two_server)

    def _one_study_per_id(self, rows: Polled, valid: list[ValidRows],
                          ) -> tuple[list[ValidRows], list[Refused]]:
        """Keep, of two studies a batch names by one id (a deleted study and the one created
        under its id since, ipdp.state.delete_study), the one Redis holds now; the other's
        rows are refused (unknown_study) and the study forgotten."""
        by_id: dict[str, list[ValidRows]] = {}
        for v in valid:
            by_id.setdefault(v.study.study_id, []).append(v)
        keep, deleted = [], []
        for sid, group in by_id.items():
            current = (None if len(group) == 1
                       else self.r.hget(state.StudyKeys(sid).study, "hash"))
            for v in group:
                if len(group) == 1 or v.study.hash == current:
                    keep.append(v)
                else:
                    self.studies.forget(v.study)
                    deleted.append(Refused.of(rows, v.row, RejectReason.UNKNOWN_STUDY,
                                              f"study {sid} is deleted"))
        return keep, deleted

    def _fold_study(self, rows: Polled, v: ValidRows, spans: Spans, checkpoint: Checkpoint,
                    now_ms: int, dead_letter, result: FoldResult) -> Refused:
        """One study's transaction: read under WATCH, decide, dead-letter its refusals, write,
        EXEC (redone on conflict). Returns what it refused."""
        keys = state.StudyKeys(v.study.study_id)
        # Per row of ``rows``: the reason it was dead-lettered with (-1: none), so a redone
        # transaction sends only refusals it has not sent.
        sent = np.full(len(rows), -1, np.int64)
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(keys.study, keys.open, keys.replay,
                               keys.offsets(self.group, self.topic))
                    seen = self._read(pipe, keys, rows, v, checkpoint)
                    fold = decide(rows, v, seen, spans, checkpoint)
                    codes = fold.refused.reason_codes()
                    unsent = sent[fold.refused.row] != codes
                    if dead_letter and unsent.any():
                        dead_letter(fold.refused.take(unsent))
                    sent[fold.refused.row] = codes
                    pipe.multi()
                    write_fold(pipe, fold, keys, self.replay, group=self.group,
                               topic=self.topic, now_ms=now_ms)
                    pipe.execute()
                    break
                except redis.WatchError:
                    result.conflicts += 1
        announce(self.r, keys, [c.round_no for c in fold.closed])
        if seen.status is None:  # deleted (ipdp.state.delete_study): look its hash up again
            self.studies.forget(v.study)
        sid = keys.study_id
        if fold.was_open:
            result.folded[sid] = len(fold.folded_ids)
            result.closed_rounds += [(sid, c.round_no) for c in fold.closed]
            result.open_rounds[sid] = (fold.open_round.round_no, fold.open_round.count,
                                       fold.study.n)
        return fold.refused

    def _fold_two_server_study(self, rows: Polled, w: TwoServerRows, spans: Spans,
                               checkpoint: Checkpoint, now_ms: int, dead_letter,
                               result: FoldResult) -> Refused:
        """A two-server study's fold, with the leader as the coordinator of a two-phase commit
        (docs/architecture.md, "Why each record is folded once on both sides"): read the
        study's offsets and replay state, and prepare at the helper, under a new job id, the
        rows the leader would fold (before the transaction, so that no WATCH spans an HTTP call
        and a conflict does not prepare again); read under WATCH; decide; dead-letter; one
        MULTI/EXEC writes the leader's ring rounds, its bookkeeping and the journal entry naming
        the helper commit it owes (the commit point); then the helper's commit, and the entry
        is deleted. A helper that cannot be reached at prepare raises
        :class:`HelperUnavailable` before anything is written."""
        study = w.study
        keys = state.StudyKeys(study.study_id)
        sent = np.full(len(rows), -1, np.int64)
        job_id = uuid.uuid4().hex
        verdict = self._prepare(keys, job_id, rows, w, checkpoint)
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(keys.study, keys.open, keys.replay,
                               keys.offsets(self.group, self.topic))
                    seen = self._read_two_server(pipe, keys, rows, w, checkpoint)
                    fold = decide_two_server(rows, w, seen, spans, checkpoint, verdict)
                    codes = fold.refused.reason_codes()
                    unsent = sent[fold.refused.row] != codes
                    if dead_letter and unsent.any():
                        dead_letter(fold.refused.take(unsent))
                    sent[fold.refused.row] = codes
                    pipe.multi()
                    write_two_server_fold(pipe, fold, keys, self.replay, job_id=job_id,
                                          group=self.group, topic=self.topic, now_ms=now_ms)
                    pipe.execute()
                    break
                except redis.WatchError:
                    result.conflicts += 1
        if fold.assignment:
            self._commit_at_helper(study, job_id, fold.assignment)
        announce(self.r, keys, [c.round_no for c in fold.closed])
        if seen.status is None:
            self.studies.forget(study)
        sid = keys.study_id
        if fold.was_open:
            result.folded[sid] = len(fold.folded_ids)
            result.closed_rounds += [(sid, c.round_no) for c in fold.closed]
            result.open_rounds[sid] = (fold.open_round.round_no, fold.open_round.count, study.n)
        return fold.refused

    def _prepare(self, keys: state.StudyKeys, job_id: str, rows: Polled, w: TwoServerRows,
                 checkpoint: Checkpoint) -> HelperVerdict:
        """Job ``job_id`` at the study's helper: the rows of ``w`` not folded yet, first of
        their id in the batch and not seen within the replay window, as Redis holds the study
        now (a replay costs the helper nothing), with, where the study requires them, the
        credentials they came with, which the helper checks itself. A job the helper refuses
        whole (its study unverifiable there, say) refuses each record with the helper's reason;
        one it cannot answer raises HelperUnavailable."""
        study = w.study
        partitions = np.unique(rows.partition[w.row]).tolist()
        with self.r.pipeline(transaction=False) as pipe:
            pipe.hmget(keys.study, "envelope", "status")
            pipe.hmget(keys.offsets(self.group, self.topic),
                       [checkpoint.field[p] for p in partitions])
            (envelope, status), below = pipe.execute()
        folded_below = {p: int(x) for p, x in zip(partitions, below, strict=True)
                        if x is not None}
        asked = rows.offset[w.row] >= _per_row(folded_below, rows.partition[w.row])
        if status != StudyStatus.OPEN.value.encode():  # the transaction refuses them all
            asked[:] = False
        asked[asked] &= ~self.replay.seen(self.r, keys, w.record_id[asked])
        asked[asked] &= _first_of_each_id(w.record_id[asked])
        at = w.row[asked].tolist()
        records = [rows.values[i] for i in at]
        if not records:
            return HelperVerdict.of(asked, Prepared(np.zeros(0, bool), {}))
        # The rows passed the leader's credential check, so each has its token: the helper
        # checks it against its own pinned issuers.
        tokens = tokens_of_rows(rows, at) if study.require_credentials else None
        try:
            prepared = self.helpers.prepare(study, job_id, envelope or b"", records, tokens)
        except HelperRefused as exc:
            log.warning("study %s: the helper refused job %s whole (%s)", study.study_id,
                        job_id, exc)
            prepared = Prepared(mask=np.zeros(len(records), bool),
                                refused=dict.fromkeys(range(len(records)), exc.reason))
        return HelperVerdict.of(asked, prepared)

    def _read_two_server(self, pipe, keys: state.StudyKeys, rows: Polled, w: TwoServerRows,
                         checkpoint: Checkpoint) -> TwoServerState:
        """The read phase of a two-server study, under WATCH."""
        partitions = np.unique(rows.partition[w.row]).tolist()
        (status, wire_hash), (round_no, count, sum_raw, checksum), below = \
            pipe.execute_command("EVAL", _READ_TWO_SERVER_LUA, 3, keys.study, keys.open,
                                 keys.offsets(self.group, self.topic),
                                 *(checkpoint.field[p] for p in partitions))
        if wire_hash is not None and wire_hash != w.study.hash:
            status = None
        return TwoServerState(
            status=None if status is None else StudyStatus(status.decode()),
            open_round=RingRound.stored(round_no, count, sum_raw, checksum, w.study.d),
            folded_below={p: int(x) for p, x in zip(partitions, below, strict=True)
                          if x is not None},
            replayed=self.replay.seen(pipe, keys, w.record_id))

    def _read(self, pipe, keys: state.StudyKeys, rows: Polled, v: ValidRows,
              checkpoint: Checkpoint) -> StudyState:
        """The read phase of one study, under WATCH."""
        partitions = np.unique(rows.partition[v.row]).tolist()
        (status, wire_hash), (round_no, count, a_raw, b_raw), below = pipe.execute_command(
            "EVAL", _READ_STUDY_LUA, 3, keys.study, keys.open,
            keys.offsets(self.group, self.topic), *(checkpoint.field[p] for p in partitions))
        if wire_hash is not None and wire_hash != v.study.hash:
            status = None  # the id now names another study: this one was deleted
        a, b = state.unpack_stats(a_raw, b_raw, v.study.d)
        return StudyState(
            status=None if status is None else StudyStatus(status.decode()),
            open_round=OpenRound(int(round_no) if round_no is not None else 1,
                                 int(count) if count is not None else 0, a, b),
            folded_below={p: int(x) for p, x in zip(partitions, below, strict=True)
                          if x is not None},
            replayed=self.replay.seen(pipe, keys, v.record_id))
