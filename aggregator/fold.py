"""Fold a validated batch into Redis in one atomic transaction.

A batch is the messages one poll returned: per partition, a contiguous run of offsets. A
container message (wire version 2) folds all its records or none: its offset is one unit. The fold
is a checkpoint in the quixstreams sense — the statistics it produces and the offsets it consumed
are written in the same MULTI/EXEC, guarded by WATCH on every key it read — so a crash either
loses the whole fold (and the restarted aggregator re-reads the same offsets from Redis) or
keeps all of it. A zombie that lost its partitions finds the offsets moved and folds nothing.
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
    Validator,
    ValidRows,
    in_order,
    split_containers,
)
from ipdp import metrics, registry, state
from ipdp.errors import MalformedValue, SignatureError
from ipdp.signing import TrustedKeys
from ipdp.study import Study, StudyStatus
from ipdp.wire import MalformedRecord, RejectReason

log = logging.getLogger(__name__)

#: A study refused for its signature is looked up again after this many seconds.
REFUSAL_RETRY_S = 30.0

#: Every read a fold makes before its replay check, in one round trip (redis-py costs ~60-90 µs
#: of CPU per command): KEYS[1] = offsets hash, then per study its hash and its open round's;
#: ARGV = partitions. -> { offsets, then per study: status, {round, count, A, b} }
_READ_LUA = """
local out = {redis.call('HMGET', KEYS[1], unpack(ARGV))}
for k = 2, #KEYS, 2 do
  out[#out + 1] = redis.call('HGET', KEYS[k], 'status')
  out[#out + 1] = redis.call('HMGET', KEYS[k + 1], 'round', 'count', 'A', 'b')
end
return out
"""


@dataclass
class FoldResult:
    """What one committed fold did; counts are exact (they were written in the same EXEC)."""

    folded: dict[str, int] = field(default_factory=dict)
    rejected: list[Rejection] = field(default_factory=list)
    closed_rounds: list[tuple[str, int]] = field(default_factory=list)
    open_rounds: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """study → (round, count, n) after the fold."""
    skipped: int = 0
    """Messages below the committed offset (already folded by an earlier owner)."""
    reseek: dict[int, int] = field(default_factory=dict)
    """partition → offset to seek to, when the batch started past the committed offset."""
    conflicts: int = 0


def _first_of_each_id(ids: np.ndarray, prefixes: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Whether each 16-byte id (rows of uint8) is the first occurrence of its value;
    ``order`` sorts ``prefixes``, the ids' first 8 bytes as integers."""
    first = np.ones(len(ids), bool)
    ranked = prefixes[order]
    if len(ids) < 2 or not (ranked[1:] == ranked[:-1]).any():
        return first  # distinct prefixes: distinct ids, without a bytes sort
    first[:] = False
    first[np.unique(np.ascontiguousarray(ids).view("V16").ravel(), return_index=True)[1]] = True
    return first


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
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.r = r
        self.trusted = trusted
        self._refused: dict[bytes, tuple[float, str]] = {}
        self.offsets_key = state.offsets_key(group, topic)
        self.clock = clock
        self._studies: dict[bytes, Study] = {}
        self.validator = Validator(self._study, self._registered, replay_window_s=replay_window_s,
                                   max_future_skew_s=max_future_skew_s,
                                   max_message_bytes=max_message_bytes,
                                   credentials=CredentialCheck(
                                       credential_keys or TrustedKeys(),
                                       replay_window_s=replay_window_s,
                                       max_future_skew_s=max_future_skew_s))
        self.replay = ReplayIds(r, replay_window_s=replay_window_s,
                                max_future_skew_s=max_future_skew_s)
        self._read = r.register_script(_READ_LUA)

    def committed_offsets(self) -> dict[int, int]:
        """partition → next offset to fold, as stored with the statistics."""
        raw = self.r.hgetall(self.offsets_key)
        return {int(k): int(v) for k, v in raw.items()}

    def fold(
        self,
        messages: Polled | Sequence[Message],
        dead_letter: Callable[[list[Rejection]], None] | None = None,
    ) -> FoldResult:
        """Validate and fold `messages`; `dead_letter` is called before the commit (at least once)."""
        now_ms = int(self.clock() * 1000)
        polled = in_order(messages if isinstance(messages, Polled) else Polled.of(messages))
        if len(polled) == 0:
            return FoldResult()
        # Sorted by (partition, offset): each partition's first and last offsets bound its run.
        starts = np.flatnonzero(np.r_[True, polled.partition[1:] != polled.partition[:-1]])
        ends = np.r_[starts[1:], len(polled)] - 1
        partitions = polled.partition[starts].tolist()
        first = dict(zip(partitions, polled.offset[starts].tolist(), strict=True))
        last = dict(zip(partitions, polled.offset[ends].tolist(), strict=True))
        rows, container_rejects = split_containers(polled)
        stateless_rejects, valid = self.validator.validate(rows, now_ms)
        if container_rejects:
            stateless_rejects = sorted(
                container_rejects + stateless_rejects,
                key=lambda x: (x.message.partition, x.message.offset, x.index or 0))
        watched = [self.offsets_key]
        for v in valid:
            sid = v.study.study_id
            watched += [state.open_key(sid), state.study_key(sid),
                        self.replay.watch_key(sid)]
        sent: set[tuple[str, RejectReason]] = set()
        conflicts = 0
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(*watched)
                    result = self._fold_watched(
                        pipe, rows, partitions, first, last, stateless_rejects, valid, now_ms)
                    if result is None:
                        pipe.unwatch()
                        return FoldResult(reseek=self._reseek(partitions, first),
                                          conflicts=conflicts)
                    fresh = [x for x in result.rejected if (x.source, x.reason) not in sent]
                    if dead_letter and fresh:
                        dead_letter(fresh)
                    sent.update((x.source, x.reason) for x in fresh)
                    pipe.execute()
                    result.conflicts = conflicts
                    return result
                except redis.WatchError:
                    conflicts += 1
                    continue

    def _reseek(self, partitions: list[int], first: dict[int, int]) -> dict[int, int]:
        """Where to re-read every partition of a discarded batch: Redis's offset, else its start."""
        committed = self.committed_offsets()
        return {p: committed.get(p, first[p]) for p in partitions}

    def _fold_watched(self, pipe, rows: Polled, partitions, first, last, stateless_rejects,
                      valid, now_ms):
        """Reads under WATCH, then queues the writes; returns None when the batch must be re-read."""
        reply = self._read(
            keys=[self.offsets_key] + [k for v in valid for k in (
                state.study_key(v.study.study_id), state.open_key(v.study.study_id))],
            args=partitions, client=pipe)
        committed = reply[0]
        start: dict[int, int] = {}
        for p, raw in zip(partitions, committed, strict=True):
            if raw is None:
                start[p] = first[p]
            elif int(raw) < first[p]:
                log.warning("partition %d: batch starts at %d but Redis has %d; re-seeking",
                            p, first[p], int(raw))
                return None
            else:
                start[p] = int(raw)
        result = FoldResult()
        part_sorted = np.array(partitions)
        start_of = np.array([start[p] for p in partitions])

        def keep(row: np.ndarray) -> np.ndarray:
            """Rows at or past the committed offset of their partition."""
            return rows.offset[row] >= start_of[np.searchsorted(part_sorted, rows.partition[row])]

        result.rejected = [x for x in stateless_rejects
                           if x.message.offset >= start[x.message.partition]]
        result.skipped = sum(
            max(0, min(start[p], last[p] + 1) - first[p]) for p in partitions)
        writes: list[Callable[[], None]] = []
        for i, v in enumerate(valid):
            mask = keep(v.row)
            if not mask.any():
                continue
            self._fold_study(pipe, rows, v, mask, now_ms, result, writes,
                             status=reply[1 + 2 * i], raw=reply[2 + 2 * i])
        pipe.multi()
        for w in writes:
            w()
        # Never move an offset back: a batch wholly below it (a zombie's) must not make the next
        # owner re-read records that are already folded.
        advanced = {str(p): last[p] + 1 for p in partitions if last[p] + 1 > start[p]}
        if advanced:
            pipe.hset(self.offsets_key, mapping=advanced)
        if result.rejected:
            counts: dict[str, int] = {}
            for x in result.rejected:
                counts[x.reason.value] = counts.get(x.reason.value, 0) + 1
            for reason, c in counts.items():
                pipe.hincrby(state.REJECTED, reason, c)
        return result

    def _fold_study(self, pipe, rows: Polled, v: ValidRows, mask, now_ms, result: FoldResult,
                    writes, *, status: bytes | None, raw: list) -> None:
        """Fold one study's rows; ``status`` and ``raw`` (its open round's round, count, A, b)
        were read under the fold's WATCH."""
        study = v.study
        sid = study.study_id
        if mask.all():
            row, ids, q, p = v.row, v.record_id, v.q, v.p
        else:
            row, ids, q, p = v.row[mask], v.record_id[mask], v.q[mask], v.p[mask]
        if status is None or status.decode() != StudyStatus.OPEN:
            reason = RejectReason.UNKNOWN_STUDY if status is None else RejectReason.CLOSED_STUDY
            detail = f"study {sid} is {status and status.decode()}"
            result.rejected += [rows.rejection(i, reason, detail) for i in row.tolist()]
            return
        prefixes = id_prefixes(ids)
        order = np.argsort(prefixes)  # one sort for both checks below
        fresh = _first_of_each_id(ids, prefixes, order)
        fresh &= ~self.replay.seen(pipe, sid, ids, order)
        # With credentials a record id is a credential's slot: seeing it again is a reuse.
        reused = (RejectReason.CREDENTIAL_REUSED, "the credential's slot was already folded") \
            if study.require_credentials else \
            (RejectReason.REPLAYED, "record id already seen within the replay window")
        result.rejected += [rows.rejection(i, *reused) for i in row[~fresh].tolist()]
        if not fresh.all():
            q, p, ids, row = q[fresh], p[fresh], ids[fresh], row[fresh]
        keep_ids = ids

        round_no = int(raw[0]) if raw[0] is not None else 1
        count = int(raw[1]) if raw[1] is not None else 0
        a, b = state.unpack_stats(raw[2], raw[3], study.d)
        n = study.n
        pos, m = 0, len(q)
        closed: list[tuple[int, np.ndarray, np.ndarray]] = []
        study_closed = False
        while pos < m:
            take = min(n - count, m - pos)
            seg = slice(pos, pos + take)
            a += q[seg].T @ q[seg]
            b += p[seg].sum(axis=0)
            count += take
            pos += take
            if count == n:
                closed.append((round_no, a, b))
                if study.round_limit is not None and round_no >= study.round_limit:
                    study_closed = True
                    break
                round_no, count = round_no + 1, 0
                a, b = np.zeros((study.d, study.d)), np.zeros(study.d)
        folded = pos
        result.rejected += [rows.rejection(i, RejectReason.CLOSED_STUDY,
                                           f"study {sid} closed after {study.round_limit} "
                                           "rounds (max_rounds or its privacy budget)")
                            for i in row[folded:].tolist()]
        result.folded[sid] = folded
        result.closed_rounds += [(sid, r) for r, _, _ in closed]
        result.open_rounds[sid] = (round_no, 0 if study_closed else count, n)
        folded_ids = keep_ids[:folded]
        final = (round_no, count, a, b)
        closed_ms = now_ms

        def write() -> None:
            for r_no, ca, cb in closed:
                a_raw, b_raw = state.pack_stats(ca, cb)
                pipe.hset(state.closed_key(sid, r_no), mapping={
                    "A": a_raw, "b": b_raw, "count": n, "closed_ms": closed_ms})
                pipe.xadd(state.ROUNDS_STREAM, {"study": sid, "round": r_no})
            r_no, c, fa, fb = final
            if study_closed:
                pipe.delete(state.open_key(sid))
                pipe.hset(state.study_key(sid), "status", StudyStatus.CLOSED.value)
            else:
                a_raw, b_raw = state.pack_stats(fa, fb)
                pipe.hset(state.open_key(sid), mapping={"round": r_no, "count": c,
                                                        "A": a_raw, "b": b_raw})
            self.replay.add(pipe, sid, folded_ids, now_ms)
            pipe.hincrby(state.counts_key(sid), "folded", folded)
            if closed:
                pipe.hincrby(state.counts_key(sid), "rounds_closed", len(closed))

        writes.append(write)

    def _study(self, key: bytes) -> Study | None:
        """The study with wire hash ``key`` (cached), None if unknown; a study whose signature
        does not verify, or whose stored definition cannot be read, is refused (MalformedRecord ``untrusted_study``), re-checked after
        REFUSAL_RETRY_S so that a study re-signed by its owner is taken up without a restart."""
        study = self._studies.get(key)
        if study is not None:
            return study
        refused = self._refused.get(key)
        if refused is not None and time.monotonic() - refused[0] < REFUSAL_RETRY_S:
            raise MalformedRecord(RejectReason.UNTRUSTED_STUDY, refused[1])
        try:
            found = registry.study_by_hash(self.r, key, self.trusted)
        except (SignatureError, MalformedValue) as exc:
            metrics.STUDIES_REFUSED.labels("aggregator").inc()
            log.error("refusing records of study hash %s: %s", key.hex(), exc)
            self._refused[key] = (time.monotonic(), str(exc))
            raise MalformedRecord(RejectReason.UNTRUSTED_STUDY, str(exc)) from None
        if found is None:
            return None
        self._refused.pop(key, None)
        study = self._studies[key] = found[0]
        study.round_limit  # noqa: B018 - the budget's accounting, once, outside any fold
        return study

    def _registered(self, study_id: str) -> bool:
        return bool(self.r.exists(state.study_key(study_id)))

