"""Replay detection: which record ids were folded within the replay window, at 8 bytes per id.

Redis holds, per study, time buckets by fold time: ``ipdp:{<id>}:replay:<end>`` is a list with
one blob per fold (the first 8 bytes of every record id that fold accepted, packed), and
``ipdp:{<id>}:replay`` indexes them (bucket end → blobs). A bucket spans ``window / 24`` (at least
a second) of fold time and is dropped whole once its end is ``window + skew`` and one more span
in the past: a record is accepted only if it was created at most ``skew`` after its fold, so by
then every record of the bucket is refused as stale anyway, even by an aggregator whose clock
is up to a span behind the one that drops it. Nothing is kept per id but its 8 bytes.

Membership is decided here, with numpy, on this process's copy of the study's ids: under the
fold's WATCH of the index, one script call reads the index and ships what other folds appended
since this process last looked (and checks the copy is still a prefix of each bucket), then the
batch is looked up in a few sorted arrays (the script goes with EVAL, as aggregator/fold.py
says why). The fold's MULTI appends the batch's blob; a concurrent fold of the same study
changes the index, so the EXEC fails and the fold is redone on fresh state. Truncating an id to
64 bits makes a fresh id look replayed with probability ≈ (ids in the window) / 2⁶⁴ per check
(docs/operations.md); a replay is never missed.
"""

from __future__ import annotations

import hashlib
import importlib.resources
from dataclasses import dataclass, field

import numpy as np
import redis

from ipdp import state

BUCKETS_PER_WINDOW = 24
MIN_BUCKET_MS = 1000


def id_prefixes(ids: np.ndarray) -> np.ndarray:
    """The first 8 bytes of each 16-byte id (rows of uint8) as little-endian uint64."""
    return np.ascontiguousarray(ids[:, :8]).view("<u8").ravel()


@dataclass
class _Bucket:
    blobs: int = 0
    digest: str = ""
    ids: list[np.ndarray] = field(default_factory=list)


@dataclass
class _StudyIds:
    """One study's remembered ids in this process: per bucket as read, and all of them as a few
    sorted runs (each at most half the size of the one before, merged like a binary counter)."""

    buckets: dict[int, _Bucket] = field(default_factory=dict)
    runs: list[np.ndarray] = field(default_factory=list)

    def rebuild(self) -> None:
        parts = [a for b in self.buckets.values() for a in b.ids]
        self.runs = [np.sort(np.concatenate(parts))] if parts else []

    def add(self, new: np.ndarray) -> None:
        run = np.sort(new)
        while self.runs and len(self.runs[-1]) <= 2 * len(run):
            # Timsort finds the two sorted halves and merges them in linear time.
            run = np.sort(np.concatenate([self.runs.pop(), run]), kind="stable")
        self.runs.append(run)

    def contains(self, q: np.ndarray) -> np.ndarray:
        """Membership of each of ``q``, which must be sorted: sorted keys walk each run from
        left to right, about twice as fast as random probes into a large run."""
        hit = np.zeros(len(q), bool)
        for run in self.runs:
            pos = np.minimum(np.searchsorted(run, q), len(run) - 1)
            hit |= run[pos] == q
        return hit


class ReplayIds:
    """The replay state of every study this aggregator folds."""

    def __init__(self, r: redis.Redis, *, replay_window_s: int, max_future_skew_s: int) -> None:
        self.window_ms = replay_window_s * 1000
        self.skew_ms = max_future_skew_s * 1000
        self.bucket_ms = max(MIN_BUCKET_MS, self.window_ms // BUCKETS_PER_WINDOW)
        self._lua = importlib.resources.files("aggregator").joinpath("replay.lua").read_text()
        self._studies: dict[str, _StudyIds] = {}

    def seen(self, pipe, keys: state.StudyKeys, ids: np.ndarray) -> np.ndarray:
        """Whether each 16-byte id (rows of uint8) was folded within the window; ``pipe`` is in
        its WATCH phase (commands run at once) with the study's ``keys.replay``, the index every
        fold of the study changes, watched."""
        mine = self._studies.setdefault(keys.study_id, _StudyIds())
        # One call reads the index and what is new in the buckets this process knows of; when
        # the index names another bucket (a new span, or another aggregator's), a second call
        # reads them all. The ids themselves are shipped only while the legacy sorted set
        # exists (the script says so when asked without them).
        ends = sorted(mine.buckets)
        while True:
            args: list = [b""]
            for end in ends:
                b = mine.buckets.get(end, _Bucket())
                args += [end, b.blobs, b.digest]
            reply = pipe.execute_command(
                "EVAL", self._lua, 2 + len(ends), keys.seen, keys.replay,
                *(keys.replay_bucket(e) for e in ends), *args, "read")
            current = sorted(int(e) for e in reply[1])
            if set(current) <= set(ends):
                break
            ends = current
        changed = False
        for end in [e for e in mine.buckets if e not in current]:
            del mine.buckets[end]
            changed = True
        new = []
        for i, end in enumerate(ends):
            if end not in current:  # dropped since this process last looked
                continue
            start, blobs = reply[2 + 2 * i], reply[3 + 2 * i]
            b = mine.buckets.setdefault(end, _Bucket())
            if start == 0 and b.blobs:  # what we hold is no longer this bucket's prefix
                b.ids, b.blobs, b.digest = [], 0, ""
                changed = True
            if blobs:
                got = np.frombuffer(b"".join(blobs), "<u8")
                b.ids.append(got)
                if len(b.ids) > 64:
                    b.ids = [np.concatenate(b.ids)]
                b.blobs += len(blobs)
                b.digest = hashlib.sha1(blobs[-1]).hexdigest()  # Redis compares it with SHA1HEX
                new.append(got)
        if changed:
            mine.rebuild()
        elif new:
            mine.add(np.concatenate(new) if len(new) > 1 else new[0])
        prefixes = id_prefixes(ids)
        order = np.argsort(prefixes)
        hit = np.empty(len(prefixes), bool)
        hit[order] = mine.contains(prefixes[order])
        if reply[0] and len(ids):  # the legacy sorted set still exists: check it as well
            flags = pipe.execute_command("EVAL", self._lua, 2, keys.seen, keys.replay,
                                         np.ascontiguousarray(ids).tobytes(), "read")
            hit |= np.frombuffer(flags[0], np.uint8) == ord("1")
        return hit

    def add(self, pipe, keys: state.StudyKeys, ids: np.ndarray, now_ms: int) -> None:
        """Queue (inside MULTI) the append of ``ids`` and the drop of expired buckets."""
        end = (now_ms // self.bucket_ms + 1) * self.bucket_ms
        # One span more than the stale check needs: the margin for aggregators' clocks.
        cutoff = now_ms - self.window_ms - self.skew_ms - self.bucket_ms
        expired = [e for e in self._studies.get(keys.study_id, _StudyIds()).buckets
                   if e <= cutoff]
        pipe.execute_command(
            "EVAL", self._lua, 3 + len(expired), keys.replay, keys.replay_bucket(end), keys.seen,
            *(keys.replay_bucket(e) for e in expired),
            end, id_prefixes(ids).tobytes(), cutoff, *expired, "add")
