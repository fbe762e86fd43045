"""The helper's state, in its own Redis: jobs, the replay set, and the rounds' sums of shares.

The key layout is docs/architecture.md's table under "The helper".

An opened share is L uniformly random words, independent of its record (ipdp.fixed_point), and a
sum of shares is as uniform: nothing here reveals a record or a partial sum without the
leader's sums (tests/helper/test_helper.py reads every key and checks it). A job key expires
after the record window; a round key stays until the study's operator deletes it.

Each change is one WATCH/MULTI/EXEC transaction, redone on a conflict: a prepare stores the
job's answer, its accepted ids and their shares together; a commit adds the shares to the
rounds, writes the ids into the replay set (``seen``), drops the shares from the job and
records the commit together. So a job is prepared once and committed once, whatever the leader
resends. The replay set holds *committed* ids only: a prepare refuses as ``replayed`` an id
already committed, and a commit naming one is refused whole (``already_committed``). A job the
leader prepared and never committed (it crashed before its own commit point) blocks nothing:
the leader sends those records again in a new job (docs/architecture.md, "Why each record is
folded once on both sides").

For a study that requires device credentials, each record's id is one of its credential's
records_per_device slot ids (helper.records checks it), and the slots set (``slots``) holds every
committed slot, scored by its credential's expiry: a prepare refuses a slot in it as
``credential_reused``, a commit naming one is refused whole (``credential_reused``), and the
commit that folds a slot adds it, in the same transaction as the replay set and for the same
reason. A slot is kept until its credential has expired by the record window (the replay set
forgets an id by its record's creation time, which a device chooses, so it cannot stand in for
this): no credential ever has more than records_per_device records committed here, whatever the
leader sends. The keys of one job span several studies'
hash slots in the general case, so the helper's Redis is one server, not a cluster.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import redis

from helper.records import CheckedRecords, HelperRefusal
from ipdp.fixed_point import entries, fold
from ipdp.helper_protocol import CHECKSUM_BYTES, id_checksum

__all__ = ["CHECKSUM_BYTES", "HelperStore", "JobConflict", "RoundShare", "UnknownJob",
           "id_checksum", "job_key", "round_key", "seen_key", "slots_key", "study_hash_key"]

_PREFIX = "ipdp-helper"


def job_key(job_id: str) -> str:
    return f"{_PREFIX}:job:{job_id}"


def study_hash_key(study_id: str) -> str:
    return f"{_PREFIX}:{{{study_id}}}:hash"


def seen_key(study_id: str) -> str:
    return f"{_PREFIX}:{{{study_id}}}:seen"


def slots_key(study_id: str) -> str:
    return f"{_PREFIX}:{{{study_id}}}:slots"


def round_key(study_id: str, round_no: int) -> str:
    return f"{_PREFIX}:{{{study_id}}}:round:{round_no}"


def _held(pipe, key: str, ids: list[bytes]) -> list[bool]:
    """Per id, whether the sorted set ``key`` (the committed ids, or the used credential
    slots) holds it: one ZMSCORE, read under the caller's WATCH."""
    return [score is not None for score in pipe.zmscore(key, ids)]


def _refuse_held(pipe, key: str, ids: list[bytes], reason: str, what: str, job_id: str) -> None:
    """Raise JobConflict ``reason`` if the sorted set ``key`` already holds any of a commit's
    ``ids``: another job committed them (``what`` names them in the detail)."""
    held = [i for i, hit in zip(ids, _held(pipe, key, ids), strict=True) if hit]
    if held:
        raise JobConflict(reason, f"{len(held)} {what} of job {job_id!r} were committed in "
                          f"another job, {held[0].hex()} first")


class JobConflict(Exception):
    """A request that contradicts what the helper stored: ``reason`` names it, for a 409."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail


class UnknownJob(Exception):
    """A commit for a job the helper never prepared (or whose key expired)."""


@dataclass(frozen=True)
class RoundShare:
    """A full round as the helper releases it to the leader's trainer."""

    count: int
    n: int
    checksum: bytes
    sum: np.ndarray


class HelperStore:
    """The helper's Redis: prepare, commit and release (module docstring for the keys)."""

    def __init__(self, r: redis.Redis, *, job_ttl_s: int, forget_after_ms: int) -> None:
        self.r = r
        self.job_ttl_s = job_ttl_s
        self.forget_after_ms = forget_after_ms

    def prepared_answer(self, job_id: str, digest: bytes) -> dict | None:
        """The stored answer of a job prepared with this request, None for a job not prepared
        yet; :class:`JobConflict` for one prepared with another request. Lets a resent job be
        answered without opening its shares again (:meth:`prepare` checks again, atomically)."""
        stored = self.r.hmget(job_key(job_id), "digest", "answer")
        if stored[0] is None:
            return None
        if stored[0] != digest:
            raise JobConflict("job_conflict", f"job {job_id!r} was prepared with another "
                              "request")
        return json.loads(stored[1])

    def prepare(self, job_id: str, *, study_id: str, study_hash: bytes, n: int, d: int,
                digest: bytes, checked: CheckedRecords) -> tuple[dict, bool]:
        """(answer, whether it is new): store the job and its answer, or return the stored
        answer of the same request; a different request under ``job_id`` raises
        :class:`JobConflict`."""
        key, seen, slots = job_key(job_id), seen_key(study_id), slots_key(study_id)
        while True:
            with self.r.pipeline() as pipe:
                try:
                    pipe.watch(key, seen, slots, study_hash_key(study_id))
                    stored = pipe.hmget(key, "digest", "answer")
                    if stored[0] is not None:
                        if stored[0] != digest:
                            raise JobConflict("job_conflict", f"job {job_id!r} was prepared with "
                                              "another request")
                        return json.loads(stored[1]), False
                    known_hash = pipe.get(study_hash_key(study_id))
                    if known_hash is not None and known_hash != study_hash:
                        raise JobConflict("study_mismatch", f"study {study_id!r} has another "
                                          "text than the one this helper folds for it")
                    refusals = list(checked.refusals)
                    candidates = [i for i, reason in enumerate(refusals) if reason is None]
                    if candidates and checked.expires_ms is not None:
                        used = _held(pipe, slots, [checked.ids[i] for i in candidates])
                        for i, hit in zip(candidates, used, strict=True):
                            if hit:
                                refusals[i] = HelperRefusal.CREDENTIAL_REUSED
                        candidates = [i for i in candidates if refusals[i] is None]
                    if candidates:
                        committed = _held(pipe, seen, [checked.ids[i] for i in candidates])
                        for i, hit in zip(candidates, committed, strict=True):
                            if hit:
                                refusals[i] = HelperRefusal.REPLAYED
                    accepted = [i for i, reason in enumerate(refusals) if reason is None]
                    answer = {
                        "job_id": job_id, "study_id": study_id, "accepted": len(accepted),
                        "mask": "".join("0" if reason else "1" for reason in refusals),
                        "refused": [{"index": i, "reason": reason.value}
                                    for i, reason in enumerate(refusals) if reason is not None],
                    }
                    pipe.multi()
                    pipe.set(study_hash_key(study_id), study_hash)
                    pipe.hset(key, mapping={
                        "study": study_id, "n": n, "d": d, "digest": digest,
                        "answer": json.dumps(answer, separators=(",", ":")),
                        "ids": b"".join(checked.ids[i] for i in accepted),
                        "created": np.asarray([checked.created_ms[i] for i in accepted],
                                              dtype="<i8").tobytes(),
                        "shares": b"".join(checked.shares[i] for i in accepted),
                    })
                    if checked.expires_ms is not None:
                        pipe.hset(key, "expires", np.asarray(
                            [checked.expires_ms[i] for i in accepted], dtype="<i8").tobytes())
                    pipe.expire(key, self.job_ttl_s)
                    pipe.execute()
                    return answer, True
                except redis.WatchError:
                    continue

    def commit(self, job_id: str, rounds: list[tuple[int, list[bytes]]], digest: bytes,
               now_ms: int) -> tuple[dict, bool]:
        """(answer, whether it is new): fold the job's accepted shares into ``rounds`` ((round,
        ids) pairs), once: the same request again returns the stored answer; another one raises
        :class:`JobConflict`, as do ids not accepted at prepare, an id another job committed
        (``already_committed``: nothing of this job is folded) and a round that would exceed
        n. The ids enter the replay set here, in the commit's transaction."""
        key = job_key(job_id)
        while True:
            with self.r.pipeline() as pipe:
                try:
                    pipe.watch(key)
                    job = pipe.hgetall(key)
                    if not job:
                        raise UnknownJob(job_id)
                    if b"commit_digest" in job:
                        if job[b"commit_digest"] != digest:
                            raise JobConflict("job_conflict", f"job {job_id!r} was committed "
                                              "with another assignment")
                        return json.loads(job[b"commit_answer"]), False
                    study_id = job[b"study"].decode()
                    n, d = int(job[b"n"]), int(job[b"d"])
                    width = 8 * entries(d)
                    ids = job[b"ids"]
                    row_of = {ids[16 * j:16 * (j + 1)]: j for j in range(len(ids) // 16)}
                    shares = np.frombuffer(job[b"shares"], dtype="<u8").reshape(-1, width // 8)
                    assigned: set[bytes] = set()
                    for _, round_ids in rounds:
                        for record_id in round_ids:
                            if record_id not in row_of:
                                raise JobConflict("not_accepted", f"record {record_id.hex()} "
                                                  f"was not accepted in job {job_id!r}")
                            if record_id in assigned:
                                raise JobConflict("assigned_twice", f"record {record_id.hex()} "
                                                  "is assigned twice")
                            assigned.add(record_id)
                    keys = [round_key(study_id, r) for r, _ in rounds]
                    if len(set(keys)) != len(keys):
                        raise JobConflict("round_twice", "a round is named twice in one commit")
                    seen, slots = seen_key(study_id), slots_key(study_id)
                    pipe.watch(seen, slots, *keys)
                    order = sorted(assigned)
                    expires = (np.frombuffer(job[b"expires"], dtype="<i8")
                               if b"expires" in job else None)
                    if expires is not None:
                        _refuse_held(pipe, slots, order, "credential_reused",
                                     "credential slot(s)", job_id)
                    _refuse_held(pipe, seen, order, "already_committed", "record(s)", job_id)
                    created = np.frombuffer(job[b"created"], dtype="<i8")
                    updates = {}
                    for (round_no, round_ids), rkey in zip(rounds, keys, strict=True):
                        current = pipe.hgetall(rkey)
                        count = int(current.get(b"count", 0))
                        if count + len(round_ids) > n:
                            raise JobConflict("round_over_n", f"round {round_no} holds {count} "
                                              f"of n = {n}: {len(round_ids)} more exceed it")
                        rows = [row_of[i] for i in round_ids]
                        total = fold(shares[rows])
                        if b"sum" in current:
                            total = total + np.frombuffer(current[b"sum"], dtype="<u8")
                        checksum = np.frombuffer(id_checksum(round_ids), np.uint8)
                        if b"checksum" in current:
                            checksum = checksum ^ np.frombuffer(current[b"checksum"], np.uint8)
                        updates[rkey] = {"n": n, "count": count + len(round_ids),
                                         "checksum": checksum.tobytes(),
                                         "sum": total.astype("<u8").tobytes()}
                    answer = {"job_id": job_id, "study_id": study_id,
                              "rounds": [{"round": r, "count": int(updates[k]["count"])}
                                         for (r, _), k in zip(rounds, keys, strict=True)]}
                    pipe.multi()
                    for rkey, mapping in updates.items():
                        pipe.hset(rkey, mapping=mapping)
                    pipe.zadd(seen, {i: int(created[row_of[i]]) for i in order})
                    pipe.zremrangebyscore(seen, "-inf", f"({now_ms - self.forget_after_ms}")
                    if expires is not None:
                        pipe.zadd(slots, {i: int(expires[row_of[i]]) for i in order})
                        pipe.zremrangebyscore(slots, "-inf",
                                              f"({now_ms - self.forget_after_ms}")
                    pipe.hdel(key, "shares")
                    pipe.hset(key, mapping={"commit_digest": digest,
                                            "commit_answer": json.dumps(answer,
                                                                        separators=(",", ":"))})
                    pipe.execute()
                    return answer, True
                except redis.WatchError:
                    continue

    def round_share(self, study_id: str, round_no: int) -> RoundShare | None:
        """The round's count, checksum and sum share if it holds exactly n, else None."""
        got = self.r.hgetall(round_key(study_id, round_no))
        if not got or int(got[b"count"]) != int(got[b"n"]):
            return None
        return RoundShare(count=int(got[b"count"]), n=int(got[b"n"]), checksum=got[b"checksum"],
                          sum=np.frombuffer(got[b"sum"], dtype="<u8").astype(np.uint64))

    def round_count(self, study_id: str, round_no: int) -> int:
        """How many records the round holds (0 for a round never folded)."""
        return int(self.r.hget(round_key(study_id, round_no), "count") or 0)
