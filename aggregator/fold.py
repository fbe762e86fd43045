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

The phases of one study's fold are explicit: :meth:`Folder._read` (under WATCH) returns a
:class:`StudyState`, :func:`decide` turns it and the study's rows into a :class:`StudyFold`
without touching Redis, :func:`write_fold` queues that fold's writes after MULTI.

Lua scripts go with ``EVAL`` (``execute_command``), which Redis caches by SHA, on one Redis as
on a cluster: redis-py's cluster pipeline has neither ``eval`` nor EVALSHA script loading
(redis-py issue #2914), and an unknown SHA inside MULTI would fail that one command at EXEC
while the others still apply. Every key a script touches is passed as a key, so a cluster
routes it to that slot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import redis

from aggregator.credentials import CredentialCheck
from aggregator.replay import ReplayIds, id_prefixes
from aggregator.validate import (
    Message,
    Polled,
    Rejection,
    Resolved,
    Validator,
    ValidRows,
    rejection,
    split_containers,
)
from ipdp import metrics, state
from ipdp.errors import MalformedValue, SignatureError
from ipdp.signing import TrustedKeys
from ipdp.study import Study, StudyStatus
from ipdp.wire import MalformedRecord, RejectReason

log = logging.getLogger(__name__)

#: A study refused for its signature is looked up again after this many seconds.
REFUSAL_RETRY_S = 30.0
#: Most unknown study hashes (and ids) remembered at once.
UNKNOWN_CACHE_LIMIT = 100_000

#: One study's reads, in one round trip (each redis-py command costs CPU of its own).
#: KEYS[1] = study hash, KEYS[2] = open round, KEYS[3] = the study's offsets; ARGV = offset
#: fields -> { status, {round, count, A, b}, {offset per field} }
_READ_STUDY_LUA = """
return {redis.call('HGET', KEYS[1], 'status'),
        redis.call('HMGET', KEYS[2], 'round', 'count', 'A', 'b'),
        redis.call('HMGET', KEYS[3], unpack(ARGV))}
"""

#: The group's checkpoint. KEYS[1] = offsets hash, KEYS[2] = rejected-counts hash;
#: ARGV = n, n × (partition, next offset), then per stateless refusal (partition, offset,
#: reason). Counts the refusals at or past their partition's stored offset (those below were
#: counted by the fold that moved it), then moves each offset forward, never back.
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
  if tonumber(ARGV[i + 1]) >= stored[ARGV[i]] then
    redis.call('HINCRBY', KEYS[2], ARGV[i + 2], 1)
    counted = counted + 1
  end
end
return counted
"""


@dataclass
class FoldResult:
    """What one fold did; counts are exact (they were written in the transactions)."""

    folded: dict[str, int] = field(default_factory=dict)
    rejected: list[Rejection] = field(default_factory=list)
    closed_rounds: list[tuple[str, int]] = field(default_factory=list)
    open_rounds: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """study → (round, count, n) after the fold."""
    skipped: int = 0
    """Messages below the checkpoint (already folded by an earlier owner)."""
    reseek: dict[int, int] = field(default_factory=dict)
    """partition → offset to seek to, when the batch started past the checkpoint."""
    conflicts: int = 0


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
class StudyState:
    """What one study's fold reads under WATCH."""

    status: StudyStatus | None
    round_no: int
    count: int
    a: np.ndarray
    b: np.ndarray
    folded_below: dict[int, int]
    """partition → offset below which this study's records are folded."""
    replayed: np.ndarray
    """Per valid row: its id was folded within the replay window."""


@dataclass(frozen=True)
class ClosedRound:
    round_no: int
    a: np.ndarray
    b: np.ndarray


@dataclass
class StudyFold:
    """What one study's transaction writes, decided from its rows and its :class:`StudyState`."""

    study: Study
    folded_ids: np.ndarray
    closed: list[ClosedRound]
    round_no: int
    count: int
    a: np.ndarray
    b: np.ndarray
    study_closed: bool
    """This fold closed the study (its last round)."""
    was_open: bool
    """The study was open when read; a closed or unknown one folds nothing."""
    offsets: dict[str, int]
    """Fields of the study's offsets hash → next offset."""
    rejected: list[Rejection]


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


def decide(rows: Polled, v: ValidRows, seen: StudyState, spans: Spans,
           checkpoint: Checkpoint) -> StudyFold:
    """The decide phase of one study (no Redis): which rows fold, into which rounds, and what
    is refused for the study's state."""
    study, sid = v.study, v.study.study_id
    todo = rows.offset[v.row] >= _per_row(seen.folded_below, rows.partition[v.row])
    row, ids, q, p = v.row[todo], v.record_id[todo], v.q[todo], v.p[todo]
    offsets = {checkpoint.field[x]: spans.last[x] + 1
               for x in np.unique(rows.partition[row]).tolist()}
    if seen.status != StudyStatus.OPEN:
        reason = RejectReason.UNKNOWN_STUDY if seen.status is None else RejectReason.CLOSED_STUDY
        detail = f"study {sid} is {seen.status and seen.status.value}"
        return StudyFold(study, ids[:0], [], seen.round_no, seen.count, seen.a, seen.b, False,
                         False, offsets, [rejection(rows, i, reason, detail) for i in row.tolist()])
    fresh = _first_of_each_id(ids) & ~seen.replayed[todo]
    # With credentials a record id is a credential's slot: seeing it again is a reuse.
    reused = ((RejectReason.CREDENTIAL_REUSED, "the credential's slot was already folded")
              if study.require_credentials else
              (RejectReason.REPLAYED, "record id already seen within the replay window"))
    rejected = [rejection(rows, i, *reused) for i in row[~fresh].tolist()]
    row, ids, q, p = row[fresh], ids[fresh], q[fresh], p[fresh]
    round_no, count, a, b = seen.round_no, seen.count, seen.a, seen.b
    closed: list[ClosedRound] = []
    study_closed = False
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
                study_closed = True
                break
            round_no, count = round_no + 1, 0
            a, b = np.zeros((study.d, study.d)), np.zeros(study.d)
    rejected += [rejection(rows, i, RejectReason.CLOSED_STUDY,
                                f"study {sid} closed after {study.round_limit} "
                                "rounds (max_rounds or its privacy budget)")
                 for i in row[pos:].tolist()]
    return StudyFold(study, ids[:pos], closed, round_no, 0 if study_closed else count, a, b,
                     study_closed, True, offsets, rejected)


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
        a_raw, b_raw = state.pack_stats(fold.a, fold.b)
        pipe.hset(keys.open, mapping={"round": fold.round_no, "count": fold.count,
                                      "A": a_raw, "b": b_raw})
    if len(fold.folded_ids):
        replay.add(pipe, keys, fold.folded_ids, now_ms)
    counts = {"folded": len(fold.folded_ids), "rounds_closed": len(fold.closed)}
    for x in fold.rejected:
        name = f"{state.REJECTED_FIELD}{x.reason.value}"
        counts[name] = counts.get(name, 0) + 1
    for name, k in counts.items():
        if k:
            pipe.hincrby(keys.counts, name, k)
    if fold.offsets:
        pipe.hset(keys.offsets(group, topic), mapping=fold.offsets)


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
    ) -> None:
        self.r = r
        self.unknown_ttl_s = unknown_study_ttl_s
        self._unknown: dict[bytes, float] = {}
        self._known_ids: set[str] = set()
        self._unknown_ids: dict[str, float] = {}
        self.group, self.topic = group, topic
        self.trusted = trusted
        self._refused: dict[bytes, tuple[float, str]] = {}
        self.offsets_key = state.offsets_key(group, topic)
        self.rejected_key = state.rejected_key(group, topic)
        self.clock = clock
        self._studies: dict[bytes, Study] = {}
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
        dead_letter: Callable[[list[Rejection]], None] | None = None,
    ) -> FoldResult:
        """Validate and fold `messages` (a Polled in (partition, offset) order, as the fetch
        makes it); `dead_letter` is called before each commit (at least once per rejection)."""
        now_ms = int(self.clock() * 1000)
        batch = messages if isinstance(messages, Polled) else Polled.of(messages)
        if len(batch) == 0:
            return FoldResult()
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
        rows, container_rejects = split_containers(batch, self.validator.max_message_bytes)
        decoded = self.validator.decode(rows)
        studies = self._resolve(decoded.study_hashes)
        registered = self._registered(Validator.unmatched_headers(rows, decoded, studies)) \
            if None in studies.values() else {}
        stateless, valid = self.validator.validate(rows, decoded, studies, registered, now_ms)
        stateless = sorted(container_rejects + stateless,
                           key=lambda x: (x.message.partition, x.message.offset, x.index or 0))
        if dead_letter and stateless:
            dead_letter(stateless)
        result.rejected = list(stateless)
        for v in sorted(valid, key=lambda v: v.study.study_id):
            self._fold_study(rows, v, spans, checkpoint, now_ms, dead_letter, result)
        if spans.first:
            self.r.execute_command(
                "EVAL", _CHECKPOINT_LUA, 2, self.offsets_key, self.rejected_key,
                len(spans.last), *(x for p, last in spans.last.items() for x in (p, last + 1)),
                *(y for x in stateless for y in (x.message.partition, x.message.offset,
                                                 x.reason.value)))
        return result

    def _fold_study(self, rows: Polled, v: ValidRows, spans: Spans, checkpoint: Checkpoint,
                    now_ms: int, dead_letter, result: FoldResult) -> None:
        """One study's transaction: read under WATCH, decide, write, EXEC (redone on conflict)."""
        keys = state.StudyKeys(v.study.study_id)
        sent: set[tuple[str, RejectReason]] = set()
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(keys.study, keys.open, keys.replay,
                               keys.offsets(self.group, self.topic))
                    fold = decide(rows, v, self._read(pipe, keys, rows, v, checkpoint), spans,
                                  checkpoint)
                    fresh = [x for x in fold.rejected if (x.source, x.reason) not in sent]
                    if dead_letter and fresh:
                        dead_letter(fresh)
                    sent.update((x.source, x.reason) for x in fresh)
                    pipe.multi()
                    write_fold(pipe, fold, keys, self.replay, group=self.group,
                               topic=self.topic, now_ms=now_ms)
                    pipe.execute()
                    break
                except redis.WatchError:
                    result.conflicts += 1
        announce(self.r, keys, [c.round_no for c in fold.closed])
        sid = keys.study_id
        result.rejected += fold.rejected
        if fold.was_open:
            result.folded[sid] = len(fold.folded_ids)
            result.closed_rounds += [(sid, c.round_no) for c in fold.closed]
            result.open_rounds[sid] = (fold.round_no, fold.count, fold.study.n)

    def _read(self, pipe, keys: state.StudyKeys, rows: Polled, v: ValidRows,
              checkpoint: Checkpoint) -> StudyState:
        """The read phase of one study, under WATCH."""
        partitions = np.unique(rows.partition[v.row]).tolist()
        status, (round_no, count, a_raw, b_raw), below = pipe.execute_command(
            "EVAL", _READ_STUDY_LUA, 3, keys.study, keys.open,
            keys.offsets(self.group, self.topic), *(checkpoint.field[p] for p in partitions))
        a, b = state.unpack_stats(a_raw, b_raw, v.study.d)
        return StudyState(
            None if status is None else StudyStatus(status.decode()),
            int(round_no) if round_no is not None else 1,
            int(count) if count is not None else 0, a, b,
            {p: int(x) for p, x in zip(partitions, below, strict=True) if x is not None},
            self.replay.seen(pipe, keys, v.record_id))

    def _resolve(self, hashes: list[bytes]) -> dict[bytes, Resolved]:
        """Each study hash's study, refusal (a study whose signature does not verify, or whose
        stored definition cannot be read, looked up again after REFUSAL_RETRY_S so a study
        re-signed by its owner is taken up without a restart) or None. Studies are cached for good (a study never changes); a hash no study
        has is remembered as unknown for ``unknown_study_ttl_s``, so made-up hashes cost no
        Redis lookup each; the hashes not cached are looked up in one HMGET."""
        now = time.monotonic()
        out: dict[bytes, Resolved] = {}
        ask = []
        for h in hashes:
            if (study := self._studies.get(h)) is not None:
                out[h] = study
            elif (refused := self._refused.get(h)) and now - refused[0] < REFUSAL_RETRY_S:
                out[h] = MalformedRecord(RejectReason.UNTRUSTED_STUDY, refused[1])
            elif (since := self._unknown.get(h)) is not None and now - since < self.unknown_ttl_s:
                out[h] = None
            else:
                ask.append(h)
        if ask:
            for h, sid in zip(ask, self.r.hmget(state.STUDY_HASHES, ask), strict=True):
                out[h] = None if sid is None else self._load(h, sid.decode())
                if out[h] is None:
                    _remember(self._unknown, h, now, self.unknown_ttl_s)
        return out

    def _load(self, key: bytes, study_id: str) -> Resolved:
        try:
            found = state.load_study(self.r, study_id, self.trusted)
        except (SignatureError, MalformedValue) as exc:
            metrics.STUDIES_REFUSED.labels("aggregator").inc()
            log.error("refusing records of study hash %s: %s", key.hex(), exc)
            self._refused[key] = (time.monotonic(), str(exc))
            return MalformedRecord(RejectReason.UNTRUSTED_STUDY, str(exc))
        if found is None:
            return None
        self._refused.pop(key, None)
        study = self._studies[key] = found[0]
        study.round_limit  # noqa: B018 - the budget's accounting, once, outside any fold
        return study

    def _registered(self, names: set[str]) -> dict[str, bool]:
        """Whether each study id is registered (a registered one stays so; an unregistered one
        is remembered as such for ``unknown_study_ttl_s``)."""
        now = time.monotonic()
        out = {x: True for x in names if x in self._known_ids}
        ask = sorted(x for x in names if x not in out and not (
            (since := self._unknown_ids.get(x)) is not None and now - since < self.unknown_ttl_s))
        out.update((x, False) for x in names if x not in out and x not in ask)
        if ask:
            with self.r.pipeline(transaction=False) as pipe:
                for x in ask:
                    pipe.exists(state.StudyKeys(x).study)
                for x, exists in zip(ask, pipe.execute(), strict=True):
                    out[x] = bool(exists)
                    if exists:
                        self._known_ids.add(x)
                    else:
                        _remember(self._unknown_ids, x, now, self.unknown_ttl_s)
        return out


def _remember(cache: dict, key, now: float, ttl_s: float) -> None:
    """Note ``key`` as unknown at ``now``; past UNKNOWN_CACHE_LIMIT entries the expired ones
    go first, then all (a flood of made-up hashes must not grow memory without bound)."""
    if len(cache) >= UNKNOWN_CACHE_LIMIT:
        for k in [k for k, t in cache.items() if now - t >= ttl_s]:
            del cache[k]
        if len(cache) >= UNKNOWN_CACHE_LIMIT:
            cache.clear()
    cache[key] = now
