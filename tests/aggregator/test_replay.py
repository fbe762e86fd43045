"""Replay state: a record id is folded at most once inside the window — within a batch, across
batches and rounds, across aggregators, after an aggregator or a Redis restart — while Redis
keeps 8 bytes per id in time buckets that are dropped whole."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from aggregator.batch import Message
from aggregator.fold import Folder
from ipdp import state
from ipdp.redis_io import redis_client
from ipdp.study import Study
from ipdp.wire import RECORD_ID_BYTES, RejectReason
from tests.aggregator.test_hostile_input import honest

WINDOW_S = 3600
SKEW_S = 60


def folder_for(redis_settings, group: str | None = None, clock=time.time, **kw) -> Folder:
    kw = {"replay_window_s": WINDOW_S, "max_future_skew_s": SKEW_S, "max_message_bytes": 1 << 16,
          **kw}
    return Folder(redis_client(redis_settings), group=group or f"g-{uuid.uuid4().hex[:8]}",
                  topic="t", clock=clock, **kw)


def study_in(redis_settings, n: int = 10**5) -> Study:
    study = Study(study_id=f"replay-{uuid.uuid4().hex[:6]}", d=3, n=n, epsilon=1.0, delta=0.01)
    state.register_study(redis_client(redis_settings), study)
    return study


def reasons(result) -> list[RejectReason]:
    return [x.reason for x in result.rejected]


def folded(redis_settings, study: Study) -> int:
    counts = state.StudyKeys(study.study_id).counts
    return int(redis_client(redis_settings).hget(counts, "folded") or 0)


def test_a_replay_is_rejected_within_a_batch_across_batches_and_across_rounds(redis_settings):
    study = study_in(redis_settings, n=200)
    good, _, _ = honest(study, 500, seed=11)
    folder = folder_for(redis_settings)
    first = folder.fold([Message(0, i, v) for i, v in enumerate(good[:250] + [good[1]])])
    assert first.folded == {study.study_id: 250} and reasons(first) == [RejectReason.REPLAYED]
    assert first.closed_rounds == [(study.study_id, 1)]
    # Round 2 is open; replays of round-1 records and of this round's are refused.
    batch = good[250:400] + [good[0], good[199], good[249], good[399]]
    later = folder.fold([Message(1, i, v) for i, v in enumerate(batch)])
    assert later.folded == {study.study_id: 150}
    assert reasons(later) == [RejectReason.REPLAYED] * 4
    assert later.closed_rounds == [(study.study_id, 2)]
    # Round 3: every earlier id is still remembered.
    third = folder.fold([Message(2, i, v) for i, v in enumerate(good)])
    assert third.folded == {study.study_id: 100}
    assert [x.message.offset for x in third.rejected] == list(range(400))
    assert folded(redis_settings, study) == 500


def test_a_restarted_aggregator_and_a_second_one_reject_what_another_folded(redis_settings):
    study = study_in(redis_settings)
    good, _, _ = honest(study, 6, seed=12)
    a = folder_for(redis_settings, group="one")
    assert a.fold([Message(0, i, v) for i, v in enumerate(good[:3])]).folded == {
        study.study_id: 3}
    # A new process (empty memory) reads the ids from Redis.
    restarted = folder_for(redis_settings, group="one")
    again = restarted.fold([Message(1, 0, good[0]), Message(1, 1, good[3])])
    assert again.folded == {study.study_id: 1} and reasons(again) == [RejectReason.REPLAYED]
    # The first process picks up what the other folded since it last looked.
    back = a.fold([Message(2, 0, good[3]), Message(2, 1, good[4])])
    assert back.folded == {study.study_id: 1} and reasons(back) == [RejectReason.REPLAYED]
    assert folded(redis_settings, study) == 5


def test_a_fold_racing_another_is_redone_and_rejects_the_record_the_other_folded(
        redis_settings):
    """The check and the append are one WATCH/MULTI/EXEC: a concurrent append voids the EXEC."""
    study = study_in(redis_settings)
    good, _, _ = honest(study, 2, seed=13)
    a, b = folder_for(redis_settings), folder_for(redis_settings)
    raced = []

    def meanwhile(_rejections):  # runs after a's check, before its EXEC
        if not raced:
            raced.append(b.fold([Message(7, 0, good[0])]))

    # a's batch repeats a record, so its dead-letter hook runs inside the study's transaction.
    result = a.fold([Message(0, 0, good[0]), Message(0, 1, good[1]), Message(0, 2, good[1])],
                    meanwhile)
    assert raced[0].folded == {study.study_id: 1}
    assert result.conflicts >= 1
    assert result.folded == {study.study_id: 1} and sorted(
        (x.message.offset, x.reason.value) for x in result.rejected) == [
        (0, "replayed"), (2, "replayed")]
    assert folded(redis_settings, study) == 2


def test_a_replay_is_rejected_after_redis_restarts_from_its_append_only_file(fresh_redis):
    rs = fresh_redis.settings()
    study = study_in(rs)
    good, _, _ = honest(study, 4, seed=14)
    folder = folder_for(rs)
    assert folder.fold([Message(0, i, v) for i, v in enumerate(good[:3])]).folded == {
        study.study_id: 3}
    fresh_redis.restart()
    result = folder.fold([Message(1, 0, good[1]), Message(1, 1, good[3])])  # the same process
    assert reasons(result) == [RejectReason.REPLAYED]
    result = folder_for(rs).fold([Message(2, 0, good[2]), Message(2, 1, good[3])])  # a new one
    assert reasons(result) == [RejectReason.REPLAYED] * 2
    assert folded(rs, study) == 4


def test_a_bucket_is_dropped_once_window_plus_skew_has_passed_and_its_records_are_stale(
        redis_settings):
    study = study_in(redis_settings)
    clock = [5_000_000.0]
    folder = folder_for(redis_settings, clock=lambda: clock[0], replay_window_s=48,
                        max_future_skew_s=4)  # buckets of 48 / 24 = 2 s
    r = redis_client(redis_settings)
    t0 = int(clock[0] * 1000)
    early, _, _ = honest(study, 2, seed=15, created_ms=t0)
    assert folder.fold([Message(0, 0, early[0])]).folded == {study.study_id: 1}
    (first,) = [int(k) for k in r.hkeys(state.StudyKeys(study.study_id).replay)]
    assert first - 2000 <= t0 < first
    clock[0] += 47  # inside the window: kept, and the record is not stale yet
    late, _, _ = honest(study, 1, seed=16, created_ms=int(clock[0] * 1000))
    assert reasons(folder.fold([Message(0, 1, early[0]), Message(0, 2, late[0])])) == [
        RejectReason.REPLAYED]
    assert r.exists(state.StudyKeys(study.study_id).replay_bucket(first))
    # At window + skew past its end the bucket is still kept: one span more is the margin for
    # an aggregator whose clock is behind the one that drops it.
    clock[0] = first / 1000 + 48 + 4
    kept, _, _ = honest(study, 1, seed=21, created_ms=int(clock[0] * 1000))
    assert folder.fold([Message(0, 3, kept[0])]).folded == {study.study_id: 1}
    assert r.exists(state.StudyKeys(study.study_id).replay_bucket(first))
    clock[0] = first / 1000 + 48 + 4 + 2  # the bucket's end is window + skew + a span old
    now, _, _ = honest(study, 1, seed=20, created_ms=int(clock[0] * 1000))
    dropping = folder.fold([Message(0, 4, early[1]), Message(0, 5, now[0])])
    assert reasons(dropping) == [RejectReason.STALE]
    assert not r.exists(state.StudyKeys(study.study_id).replay_bucket(first))
    assert first not in [int(k) for k in r.hkeys(state.StudyKeys(study.study_id).replay)]
    # The forgotten record is stale by its own time, so it is still never folded twice.
    assert reasons(folder.fold([Message(0, 6, early[0])])) == [RejectReason.STALE]
    assert folded(redis_settings, study) == 4


def test_the_sorted_set_of_earlier_versions_is_read_until_it_expires(redis_settings):
    """Upgrading keeps every id an earlier version remembered for the rest of its window."""
    study = study_in(redis_settings)
    clock = [7_000_000.0]
    folder = folder_for(redis_settings, clock=lambda: clock[0], replay_window_s=10,
                        max_future_skew_s=2)
    t0 = int(clock[0] * 1000)
    good, _, _ = honest(study, 2, seed=17, created_ms=t0)
    r = redis_client(redis_settings)
    legacy = state.StudyKeys(study.study_id).seen
    r.zadd(legacy, {good[0][RECORD_ID_BYTES]: t0})  # folded by the previous version
    result = folder.fold([Message(0, 0, good[0]), Message(0, 1, good[1])])
    assert result.folded == {study.study_id: 1} and reasons(result) == [RejectReason.REPLAYED]
    clock[0] += 14  # past window + skew + a span: the old set is trimmed away at the next fold
    fresh, _, _ = honest(study, 1, seed=18, created_ms=int(clock[0] * 1000))
    assert folder.fold([Message(0, 2, fresh[0])]).folded == {study.study_id: 1}
    assert not r.exists(legacy)


@pytest.mark.parametrize("k", [20_000])
def test_redis_keeps_at_most_16_bytes_per_remembered_id(redis_settings, k):
    study = study_in(redis_settings)
    folder = folder_for(redis_settings)
    values, _, _ = honest(study, k, seed=19)
    for s in range(0, k, 5000):
        folder.fold([Message(0, s + i, v) for i, v in enumerate(values[s:s + 5000])])
    r = redis_client(redis_settings)
    study_keys = state.StudyKeys(study.study_id)
    keys = [study_keys.replay] + [study_keys.replay_bucket(int(e))
                                  for e in r.hkeys(study_keys.replay)]
    used = sum(r.memory_usage(key, samples=0) for key in keys)
    assert folded(redis_settings, study) == k
    assert used / k <= 16
    assert np.isfinite(used)


def test_the_remembered_ids_answer_membership_exactly_across_merged_runs():
    from aggregator.replay import _Bucket, _StudyIds

    rng = np.random.default_rng(21)
    mine, remembered = _StudyIds(), set()
    for size in (5, 3, 10, 1, 40, 2, 2, 100, 7, 1):
        new = rng.integers(0, 2**63, size=size, dtype=np.uint64)
        mine.add(new)
        remembered |= set(new.tolist())
        # Each run is more than twice the next: a few runs, whatever the order of the batches.
        assert all(len(a) > 2 * len(b) for a, b in zip(mine.runs, mine.runs[1:]))
        assert all(np.all(np.diff(run.astype(np.float64)) >= 0) for run in mine.runs)
    present = np.array(sorted(remembered)[::3], dtype=np.uint64)
    absent = rng.integers(0, 2**63, size=50, dtype=np.uint64)
    query = np.sort(np.concatenate([present, absent, [np.uint64(0), np.uint64(2**64 - 1)]]))
    np.testing.assert_array_equal(mine.contains(query),
                                  [x in remembered for x in query.tolist()])
    assert sum(len(run) for run in mine.runs) == 171
    # Rebuilt from the buckets as read: one sorted run of every id.
    mine.buckets = {1: _Bucket(ids=[np.array([9, 4], np.uint64)]),
                    2: _Bucket(ids=[np.array([7], np.uint64), np.array([1], np.uint64)])}
    mine.rebuild()
    assert [run.tolist() for run in mine.runs] == [[1, 4, 7, 9]]
    mine.buckets = {}
    mine.rebuild()
    assert mine.runs == [] and not mine.contains(np.array([1], np.uint64)).any()


def test_an_id_is_remembered_by_its_first_eight_bytes_little_endian():
    from aggregator.replay import id_prefixes

    ids = np.zeros((2, 16), np.uint8)
    ids[0, 0], ids[1, 7], ids[1, 8] = 1, 1, 255
    assert id_prefixes(ids).tolist() == [1, 2**56]


@pytest.mark.parametrize(("window_s", "bucket_ms"), [(10, 1000), (24, 1000), (48, 2000),
                                                     (3600, 150_000)])
def test_a_bucket_spans_a_24th_of_the_window_and_at_least_a_second(window_s, bucket_ms):
    from aggregator.replay import ReplayIds

    replay = ReplayIds(None, replay_window_s=window_s, max_future_skew_s=60)
    assert (replay.bucket_ms, replay.window_ms, replay.skew_ms) == (bucket_ms, window_s * 1000,
                                                                   60_000)


# ReplayIds on its own, against the real Redis: what each process remembers must agree with what
# Redis holds, and a read must ship only what was appended since this process last looked.
# Window 10 s and skew 2 s: buckets of a second, dropped once 13 s past their end.
SMALL_WINDOW_S, SMALL_SKEW_S = 10, 2
T0_MS = 9_000_000_000


class RecordingClient:
    """A real Redis client that keeps each script reply, to see what a read shipped."""

    def __init__(self, r) -> None:
        self.r, self.replies = r, []

    def execute_command(self, *args):
        reply = self.r.execute_command(*args)
        self.replies.append(reply)
        return reply


def replay_ids():
    from aggregator.replay import ReplayIds

    return ReplayIds(None, replay_window_s=SMALL_WINDOW_S, max_future_skew_s=SMALL_SKEW_S)


def record_ids(rng, k: int) -> np.ndarray:
    return rng.integers(0, 256, size=(k, 16), dtype=np.uint8)


def new_study_keys() -> state.StudyKeys:
    return state.StudyKeys(f"replay-ids-{uuid.uuid4().hex[:8]}")


def test_a_read_ships_only_the_blobs_appended_since_this_process_last_read(redis_settings):
    r, keys, rng = redis_client(redis_settings), new_study_keys(), np.random.default_rng(31)
    reader, writer, pipe = replay_ids(), replay_ids(), RecordingClient(r)
    b0, b1, b2, b3, fresh = (record_ids(rng, k) for k in (40, 3, 2, 5, 6))
    writer.add(r, keys, b0, T0_MS)
    assert reader.seen(pipe, keys, np.concatenate([b0, fresh])).tolist() == [True] * 40 + [
        False] * 6
    writer.add(r, keys, b1, T0_MS)
    assert reader.seen(pipe, keys, b1).all()
    _, _, start, blobs = pipe.replies[-1]
    assert (start, blobs) == (1, [b1[:, :8].tobytes()])
    # Two folds between reads: both blobs arrive, and only they.
    writer.add(r, keys, b2, T0_MS)
    writer.add(r, keys, b3, T0_MS)
    everything = np.concatenate([b0, b1, b2, b3, fresh])
    assert reader.seen(pipe, keys, everything).tolist() == [True] * 50 + [False] * 6
    _, _, start, blobs = pipe.replies[-1]
    assert (start, blobs) == (2, [b2[:, :8].tobytes(), b3[:, :8].tobytes()])
    # What was shipped is merged into the runs already held, not rebuilt from every bucket.
    assert [len(run) for run in reader._studies[keys.study_id].runs] == [40, 10]
    # The next read, with nothing appended, ships nothing.
    assert reader.seen(pipe, keys, everything).tolist() == [True] * 50 + [False] * 6
    assert pipe.replies[-1][2:] == [4, []]


def test_a_bucket_that_no_longer_holds_what_a_process_read_is_read_again_whole(redis_settings):
    """A bucket whose history Redis lost (a failover to a replica that missed writes) and that
    another fold appended to since: the process forgets what it held of it and reads it anew."""
    r, keys, rng = redis_client(redis_settings), new_study_keys(), np.random.default_rng(32)
    reader, writer, pipe = replay_ids(), replay_ids(), RecordingClient(r)
    first, lost, replacement, later, fresh = (record_ids(rng, k) for k in (4, 5, 3, 2, 6))
    writer.add(r, keys, first, T0_MS)
    writer.add(r, keys, lost, T0_MS + 1000)  # the second bucket
    assert reader.seen(pipe, keys, np.concatenate([first, lost])).all()
    second = keys.replay_bucket(T0_MS // 1000 * 1000 + 2000)
    assert r.llen(second) == 1
    r.delete(second)
    r.rpush(second, replacement[:, :8].tobytes())
    everything = np.concatenate([first, lost, replacement, fresh])
    expected = [True] * 4 + [False] * 5 + [True] * 3 + [False] * 6
    assert reader.seen(pipe, keys, everything).tolist() == expected
    assert replay_ids().seen(r, keys, everything).tolist() == expected  # a new process agrees
    assert pipe.replies[-1][4:] == [0, [replacement[:, :8].tobytes()]]
    # Read anew, the bucket is again known blob by blob: the next read ships only the append.
    writer.add(r, keys, later, T0_MS + 1000)
    assert reader.seen(pipe, keys, later).all()
    assert pipe.replies[-1][4:] == [1, [later[:, :8].tobytes()]]


def test_a_bucket_another_process_dropped_is_forgotten_and_the_next_one_still_read(
        redis_settings):
    r, keys, rng = redis_client(redis_settings), new_study_keys(), np.random.default_rng(33)
    reader = replay_ids()
    old, kept, appended = (record_ids(rng, k) for k in (4, 3, 2))
    # Processes that have not read the study yet append to it (and drop nothing).
    replay_ids().add(r, keys, old, T0_MS)
    assert reader.seen(r, keys, old).all()
    t1 = T0_MS + 20_000  # the first bucket is past window + skew + a span
    replay_ids().add(r, keys, kept, t1)
    assert reader.seen(r, keys, kept).all()
    dropper = replay_ids()
    dropper.seen(r, keys, kept)
    dropper.add(r, keys, appended, t1)  # drops the first bucket, appends to the second
    assert len(r.hkeys(keys.replay)) == 1
    everything = np.concatenate([old, kept, appended])
    expected = [False] * 4 + [True] * 5
    assert reader.seen(r, keys, everything).tolist() == expected
    assert replay_ids().seen(r, keys, everything).tolist() == expected


def test_new_blobs_of_two_known_buckets_read_at_once_are_all_remembered(redis_settings):
    r, keys, rng = redis_client(redis_settings), new_study_keys(), np.random.default_rng(34)
    reader, writer = replay_ids(), replay_ids()
    a, b, c, d = (record_ids(rng, k) for k in (3, 4, 5, 6))
    writer.add(r, keys, a, T0_MS)
    writer.add(r, keys, b, T0_MS + 1000)
    assert reader.seen(r, keys, np.concatenate([a, b])).all()
    writer.add(r, keys, c, T0_MS)
    writer.add(r, keys, d, T0_MS + 1000)
    assert reader.seen(r, keys, np.concatenate([a, b, c, d])).all()


def test_a_bucket_read_in_many_small_pieces_remembers_every_id(redis_settings):
    """More reads than a bucket keeps separate pieces of: they are joined, and every id stays."""
    r, keys, rng = redis_client(redis_settings), new_study_keys(), np.random.default_rng(35)
    reader, writer = replay_ids(), replay_ids()
    pieces = [record_ids(rng, 2) for _ in range(70)]
    for piece in pieces:
        writer.add(r, keys, piece, T0_MS)
        assert reader.seen(r, keys, piece).all()
    fresh = record_ids(rng, 5)
    assert reader.seen(r, keys, np.concatenate([*pieces, fresh])).tolist() == [True] * 140 + [
        False] * 5
    assert replay_ids().seen(r, keys, np.concatenate(pieces)).all()


def test_ids_of_the_earlier_sorted_set_and_of_the_buckets_are_both_found(redis_settings):
    r, keys, rng = redis_client(redis_settings), new_study_keys(), np.random.default_rng(36)
    legacy, bucketed, fresh = (record_ids(rng, k) for k in (3, 4, 5))
    r.zadd(keys.seen, {row.tobytes(): T0_MS for row in legacy})
    replay_ids().add(r, keys, bucketed, T0_MS)
    assert replay_ids().seen(r, keys, np.concatenate([legacy, bucketed, fresh])).tolist() == (
        [True] * 7 + [False] * 5)


def test_the_remembered_runs_merge_like_a_binary_counter():
    """The last run is merged into the new one while it is at most twice its size."""
    from aggregator.replay import _StudyIds

    mine, lengths = _StudyIds(), []
    rng = np.random.default_rng(37)
    for size in (4, 2, 2, 1, 1, 8):
        mine.add(rng.integers(0, 2**63, size=size, dtype=np.uint64))
        lengths.append([len(run) for run in mine.runs])
    assert lengths == [[4], [6], [6, 2], [9], [9, 1], [18]]


def test_the_replay_script_refuses_an_unknown_mode_and_appends_nothing(redis_settings):
    import redis

    r, keys, rng = redis_client(redis_settings), new_study_keys(), np.random.default_rng(38)
    script = replay_ids()._lua
    with pytest.raises(redis.ResponseError, match="unknown mode"):
        r.execute_command("EVAL", script, 3, keys.replay, keys.replay_bucket(T0_MS), keys.seen,
                          T0_MS, record_ids(rng, 2)[:, :8].tobytes(), 0, "ADD")
    assert not r.exists(keys.replay) and not r.exists(keys.replay_bucket(T0_MS))


# What the fold writes for a study's state beyond its replay ids (docs/architecture.md, "Redis
# keys"; docs/accounting.md on the round limit): the closing fold, a closed or deleted study's
# refusals, counted once, and the checkpoint and announcements a restart reads.


def test_the_fold_that_closes_the_last_round_closes_the_study_and_dead_letters_the_rest(
        redis_settings):
    study = Study(study_id=f"last-{uuid.uuid4().hex[:6]}", d=3, n=200, epsilon=1.0, delta=0.01,
                  max_rounds=1)
    state.register_study(redis_client(redis_settings), study)
    keys, r = state.StudyKeys(study.study_id), redis_client(redis_settings)
    clock = 6_000_000.5
    values, q, p = honest(study, 202, seed=21, created_ms=int(clock * 1000))
    dead: list = []
    folder = folder_for(redis_settings, clock=lambda: clock)
    result = folder.fold([Message(0, i, v) for i, v in enumerate(values)],
                         lambda refused: dead.extend(refused.rejections()))
    assert result.folded == {study.study_id: 200}
    assert result.closed_rounds == [(study.study_id, 1)]
    # What the round gauges show: the last round, holding nothing more.
    assert result.open_rounds == {study.study_id: (1, 0, 200)}
    # The two records past round 1 (its round limit): closed_study, naming the study and why.
    assert [(x.message.offset, x.reason) for x in result.rejected] == [
        (200, RejectReason.CLOSED_STUDY), (201, RejectReason.CLOSED_STUDY)]
    for x in result.rejected:
        assert x.detail.startswith(f"study {study.study_id} closed after 1 rounds")
        assert x.detail.endswith("(max_rounds or its privacy budget)")
    assert [(x.message.offset, x.reason) for x in dead] == [
        (200, RejectReason.CLOSED_STUDY), (201, RejectReason.CLOSED_STUDY)]
    # The study is closed in the same transaction: no open round is left behind.
    assert r.hget(keys.study, "status") == b"closed"
    assert not r.exists(keys.open)
    closed = r.hgetall(keys.closed(1))
    assert int(closed[b"count"]) == 200
    assert int(closed[b"closed_ms"]) == int(clock * 1000)
    a, b = state.unpack_stats(closed[b"A"], closed[b"b"], study.d)
    np.testing.assert_allclose(a, q[:200].T @ q[:200])
    np.testing.assert_allclose(b, p[:200].sum(axis=0))
    assert r.hgetall(keys.counts) == {b"folded": b"200", b"rounds_closed": b"1",
                                      b"rejected:closed_study": b"2"}


def closed_after_round_one(redis_settings, seed: int) -> tuple[Study, Folder, list[bytes]]:
    """A study whose round limit is 1, closed by folding its first 200 records; 3 more records
    of it, not yet sent."""
    study = Study(study_id=f"closed-{uuid.uuid4().hex[:6]}", d=3, n=200, epsilon=1.0,
                  delta=0.01, max_rounds=1)
    state.register_study(redis_client(redis_settings), study)
    values, _, _ = honest(study, 203, seed=seed)
    folder = folder_for(redis_settings)
    closing = folder.fold([Message(0, i, v) for i, v in enumerate(values[:200])])
    assert closing.closed_rounds == [(study.study_id, 1)]
    return study, folder, values[200:]


def test_records_sent_to_a_closed_study_are_dead_lettered_and_counted_once(redis_settings):
    study, folder, late_values = closed_after_round_one(redis_settings, seed=22)
    keys, r = state.StudyKeys(study.study_id), redis_client(redis_settings)
    late = [Message(1, i, v) for i, v in enumerate(late_values)]
    dead: list = []
    result = folder.fold(late, lambda refused: dead.extend(refused.rejections()))
    assert result.folded == {} and result.closed_rounds == [] and result.open_rounds == {}
    assert [(x.message.offset, x.reason, x.detail) for x in result.rejected] == [
        (i, RejectReason.CLOSED_STUDY, f"study {study.study_id} is closed") for i in range(3)]
    assert [(x.message.offset, x.reason) for x in dead] == [
        (i, RejectReason.CLOSED_STUDY) for i in range(3)]
    # A crash after the study's transaction, before the group's checkpoint: the batch is read
    # again; the study's offsets say its records are done, so they are not counted twice.
    r.hdel(folder.offsets_key, "1")
    again = folder_for(redis_settings, group=folder.group).fold(late)
    assert again.rejected == [] and folder.committed_offsets() == {0: 200, 1: 3}
    assert r.hgetall(keys.counts) == {b"folded": b"200", b"rounds_closed": b"1",
                                      b"rejected:closed_study": b"3"}
    assert r.hget(keys.study, "status") == b"closed"
    assert not r.exists(keys.open) and not r.exists(keys.closed(2))


def _found_then_deleted_and_reused(redis_settings, kafka_settings, topics):
    """(study, reused, folder): a folder that has looked ``study`` up (a stale record of it folds
    nothing but keeps the study known), then the study deleted and a new one (n = 500)
    registered under its id."""
    from ipdp.kafka_io import kafka_producer

    study = study_in(redis_settings)
    r = redis_client(redis_settings)
    folder = folder_for(redis_settings)
    old, _, _ = honest(study, 1, seed=23, created_ms=int(time.time() * 1000) - 2 * WINDOW_S * 1000)
    assert reasons(folder.fold([Message(0, 0, old[0])])) == [RejectReason.STALE]
    producer = kafka_producer(kafka_settings)
    try:
        state.delete_study(r, producer, topics, study.study_id)
    finally:
        producer.close()
    reused = Study(study_id=study.study_id, d=3, n=500, epsilon=1.0, delta=0.01)
    state.register_study(r, reused)
    return study, reused, folder


def test_records_of_a_study_deleted_since_the_aggregator_found_it_are_unknown_study(
        redis_settings, kafka_settings, topics):
    """Also once its id names a new study (docs/operations.md, "Studies"): the old study's
    records never fold into the new one."""
    study, reused, folder = _found_then_deleted_and_reused(redis_settings, kafka_settings, topics)
    keys, r = state.StudyKeys(study.study_id), redis_client(redis_settings)
    values, _, _ = honest(study, 2, seed=24)
    result = folder.fold([Message(0, 1, values[0]), Message(0, 2, values[1])])
    assert result.folded == {} and result.open_rounds == {}
    assert [(x.message.offset, x.reason) for x in result.rejected] == [
        (1, RejectReason.UNKNOWN_STUDY), (2, RejectReason.UNKNOWN_STUDY)]
    assert all(x.detail.startswith(f"study {study.study_id} is ") for x in result.rejected)
    # The new study is left as it was (open, empty), and the old one is forgotten.
    assert r.hmget(keys.study, ["status", "hash"]) == [b"open", reused.hash]
    assert not r.exists(keys.open) and r.hget(keys.counts, "folded") is None
    more, _, _ = honest(study, 1, seed=25)
    assert reasons(folder.fold([Message(0, 3, more[0])])) == [RejectReason.UNKNOWN_STUDY]
    # Forgotten: that refusal is the checks' (counted in the group's hash), not the study's.
    assert r.hgetall(state.rejected_key(folder.group, "t")) == {b"stale": b"1",
                                                                 b"unknown_study": b"1"}


def test_a_study_closed_while_a_fold_decides_refuses_the_records_it_had_taken(
        redis_settings, kafka_settings, topics):
    """The study's status is watched: a close between the read and the EXEC voids the EXEC."""
    from ipdp.kafka_io import kafka_producer

    study = study_in(redis_settings)
    keys, r = state.StudyKeys(study.study_id), redis_client(redis_settings)
    good, _, _ = honest(study, 2, seed=26)
    producer = kafka_producer(kafka_settings)
    closed: list = []

    def meanwhile(_refused):  # runs after the study's read, before its EXEC
        if not closed:
            closed.append(state.close_study(r, producer, topics, study.study_id))

    try:
        # The repeated record is refused in the transaction, so the hook runs inside it.
        result = folder_for(redis_settings).fold(
            [Message(0, 0, good[0]), Message(0, 1, good[1]), Message(0, 2, good[1])], meanwhile)
    finally:
        producer.close()
    assert closed and result.conflicts >= 1 and result.folded == {}
    assert reasons(result) == [RejectReason.CLOSED_STUDY] * 3
    assert folded(redis_settings, study) == 0 and not r.exists(keys.open)


def test_the_committed_offsets_are_the_partitions_not_their_epochs(redis_settings):
    study = study_in(redis_settings)
    good, _, _ = honest(study, 3, seed=27)
    folder = folder_for(redis_settings)
    r = redis_client(redis_settings)
    # What aggregator.logs.resume_partition adds when partition 0 moves to another log.
    r.hincrby(folder.offsets_key, "0:epoch", 1)
    assert folder.fold([Message(0, i, v) for i, v in enumerate(good)]).folded == {
        study.study_id: 3}
    assert folder.committed_offsets() == {0: 3}
    # The study's offsets name the partition's epoch, so the old log's offsets skip nothing.
    assert r.hgetall(state.StudyKeys(study.study_id).offsets(folder.group, "t")) == {
        b"0:1": b"3"}


def test_a_restart_announces_every_studys_unannounced_rounds_and_counts_them_all(
        redis_settings):
    studies = [study_in(redis_settings, n=200) for _ in range(2)]
    r = redis_client(redis_settings)
    for partition, study in enumerate(studies):
        values, _, _ = honest(study, 200, seed=28 + partition)
        assert folder_for(redis_settings).fold(
            [Message(partition, i, v) for i, v in enumerate(values)]).closed_rounds == [
            (study.study_id, 1)]
    # The state a crash after each fold's EXEC and before its XADD leaves behind.
    r.delete(state.ROUNDS_STREAM)
    for study in studies:
        r.sadd(state.StudyKeys(study.study_id).unannounced, 1)
    assert folder_for(redis_settings).announce_pending() == 2
    assert sorted((e[b"study"].decode(), e[b"round"]) for _, e in
                  r.xrange(state.ROUNDS_STREAM)) == sorted((s.study_id, b"1") for s in studies)


def test_each_transaction_redone_for_a_race_is_counted_once(redis_settings):
    """FoldResult.conflicts feeds ipdp_fold_conflicts_total: one per voided EXEC, per study."""
    studies = sorted((study_in(redis_settings) for _ in range(2)), key=lambda s: s.study_id)
    records = [honest(s, 2, seed=31 + i)[0] for i, s in enumerate(studies)]
    other = folder_for(redis_settings)
    raced: set[int] = set()

    def meanwhile(refused):  # inside each study's transaction: another aggregator folds first
        partition = refused.rejections()[0].message.partition
        if partition not in raced:
            raced.add(partition)
            assert other.fold([Message(7, partition, records[partition][0])]).folded == {
                studies[partition].study_id: 1}

    # Each study's batch repeats a record, so the hook runs inside that study's transaction.
    result = folder_for(redis_settings).fold(
        [Message(p, i, v) for p, values in enumerate(records)
         for i, v in enumerate([values[0], values[1], values[1]])], meanwhile)
    assert raced == {0, 1} and result.conflicts == 2
    assert result.folded == {s.study_id: 1 for s in studies}
    assert [(x.message.partition, x.message.offset, x.reason) for x in result.rejected] == [
        (p, i, RejectReason.REPLAYED) for p in (0, 1) for i in (0, 2)]
    assert all(x.detail.startswith("record id already seen") and x.detail.endswith(
        "within the replay window") for x in result.rejected)


def test_a_zombie_folding_the_same_batch_meanwhile_does_not_make_its_refusals_count_twice(
        redis_settings):
    """Two aggregators of one group with the same batch (one lost the partition without
    knowing): the study's offsets are watched, so the slower one's EXEC is voided and its redo
    finds the records done; a refusal is counted once."""
    study = study_in(redis_settings)
    keys, r = state.StudyKeys(study.study_id), redis_client(redis_settings)
    good, _, _ = honest(study, 1, seed=33)
    live = folder_for(redis_settings)
    assert live.fold([Message(0, 0, good[0])]).folded == {study.study_id: 1}
    batch = [Message(1, 0, good[0])]  # folded before: refused as replayed
    zombie = folder_for(redis_settings, group=live.group)
    zombie_result: list = []

    def meanwhile(_refused):
        if not zombie_result:
            zombie_result.append(zombie.fold(batch))

    result = live.fold(batch, meanwhile)
    assert reasons(zombie_result[0]) == [RejectReason.REPLAYED]
    assert result.conflicts == 1 and result.rejected == []
    assert int(r.hget(keys.counts, "rejected:replayed")) == 1
    assert live.committed_offsets() == {0: 1, 1: 1}


def test_a_batch_that_closes_rounds_of_two_studies_reports_both(redis_settings):
    studies = sorted((study_in(redis_settings, n=200) for _ in range(2)),
                     key=lambda s: s.study_id)
    batch = [Message(p, i, v) for p, s in enumerate(studies)
             for i, v in enumerate(honest(s, 200, seed=34 + p)[0])]
    result = folder_for(redis_settings).fold(batch)
    assert result.closed_rounds == [(s.study_id, 1) for s in studies]
    assert result.open_rounds == {s.study_id: (2, 0, 200) for s in studies}
    r = redis_client(redis_settings)
    assert sorted((e[b"study"].decode(), e[b"round"]) for _, e in
                  r.xrange(state.ROUNDS_STREAM)) == [(s.study_id, b"1") for s in studies]


def test_the_checks_refusals_are_counted_once_per_reason_when_another_aggregator_checkpoints_first(
        redis_settings):
    """The checkpoint script counts each (partition, reason) group's refusals at or past the
    stored offset: a zombie of the group that checkpointed the same batch first counted them."""
    study = study_in(redis_settings)
    old, _, _ = honest(study, 2, seed=35,
                       created_ms=int(time.time() * 1000) - 2 * WINDOW_S * 1000)
    # Partition 1 refuses for a reason that sorts before partition 0's, then for the same.
    batch = [Message(0, 0, old[0]), Message(1, 0, b"\x01garbage that is no record at all"),
             Message(1, 1, old[1])]
    live = folder_for(redis_settings)
    zombie = folder_for(redis_settings, group=live.group)
    zombie_result: list = []

    def meanwhile(_refused):  # after the checks, before the checkpoint
        if not zombie_result:
            zombie_result.append(zombie.fold(batch))

    result = live.fold(batch, meanwhile)
    expected = [(0, 0, RejectReason.STALE), (1, 0, RejectReason.UNDECODABLE),
                (1, 1, RejectReason.STALE)]
    for r in (zombie_result[0], result):
        assert [(x.message.partition, x.message.offset, x.reason) for x in r.rejected] == expected
    assert state.rejected_counts(redis_client(redis_settings), live.group, "t") == {
        "stale": 2, "undecodable": 1}
    assert live.committed_offsets() == {0: 1, 1: 2}


def test_a_record_sent_twice_in_a_batch_of_two_is_folded_once(redis_settings):
    study = study_in(redis_settings)
    good, _, _ = honest(study, 1, seed=36)
    result = folder_for(redis_settings).fold([Message(0, 0, good[0]), Message(0, 1, good[0])])
    assert result.folded == {study.study_id: 1}
    assert [(x.message.offset, x.reason) for x in result.rejected] == [
        (1, RejectReason.REPLAYED)]
    assert folded(redis_settings, study) == 1


def test_a_batch_that_adds_a_partition_the_group_never_read_folds_it_from_offset_0(
        redis_settings):
    study = study_in(redis_settings)
    good, _, _ = honest(study, 3, seed=37)
    folder = folder_for(redis_settings)
    assert folder.fold([Message(0, 0, good[0])]).folded == {study.study_id: 1}
    result = folder.fold([Message(0, 1, good[1]), Message(1, 0, good[2])])
    assert result.folded == {study.study_id: 2} and result.skipped == 0
    assert folder.committed_offsets() == {0: 2, 1: 1}


def test_after_a_resume_to_another_log_its_records_fold_though_their_offsets_repeat(
        redis_settings):
    """A new epoch of a partition retires every study's offsets of the old log."""
    study = study_in(redis_settings)
    good, _, _ = honest(study, 4, seed=38)
    folder = folder_for(redis_settings)
    assert folder.fold([Message(0, i, v) for i, v in enumerate(good[:2])]).folded == {
        study.study_id: 2}
    # What aggregator.logs.resume_partition writes for a partition moved to another log.
    r = redis_client(redis_settings)
    r.hset(folder.offsets_key, "0", 0)
    r.hincrby(folder.offsets_key, "0:epoch", 1)
    result = folder.fold([Message(0, i, v) for i, v in enumerate(good[2:])])
    assert result.folded == {study.study_id: 2} and result.skipped == 0
    assert folded(redis_settings, study) == 4


def test_a_batch_past_the_checkpoint_is_sent_back_to_it_with_a_warning(redis_settings, caplog):
    study = study_in(redis_settings)
    good, _, _ = honest(study, 6, seed=39)
    folder = folder_for(redis_settings)
    assert folder.fold([Message(0, 0, good[0]), Message(0, 1, good[1]),
                        Message(1, 0, good[2])]).folded == {study.study_id: 3}
    # Partition 0 starts at its checkpoint, partition 1 past it: the whole batch is re-read
    # (partition 2, never read, from where it starts), and the warning names partition 1.
    with caplog.at_level("WARNING", logger="aggregator.fold"):
        result = folder.fold([Message(0, 2, good[3]), Message(1, 5, good[4]),
                              Message(2, 3, good[5])])
    assert result.reseek == {0: 2, 1: 1, 2: 3} and result.folded == {}
    assert [x.getMessage() for x in caplog.records if x.name == "aggregator.fold"] == [
        "partition 1: batch starts at 5 but Redis has 1; re-seeking"]
    assert folder.fold([Message(0, 2, good[3]), Message(1, 1, good[4])]).folded == {
        study.study_id: 2}


def test_a_batch_naming_a_deleted_study_and_the_new_one_under_its_id_folds_only_the_new(
        redis_settings, kafka_settings, topics):
    study, reused, folder = _found_then_deleted_and_reused(redis_settings, kafka_settings, topics)
    stale_study, _, _ = honest(study, 1, seed=44)
    current, _, _ = honest(reused, 1, seed=45)
    result = folder.fold([Message(0, 1, stale_study[0]), Message(0, 2, current[0])])
    assert result.folded == {study.study_id: 1}
    assert [(x.message.offset, x.reason) for x in result.rejected] == [
        (1, RejectReason.UNKNOWN_STUDY)]
    assert study.study_id in result.rejected[0].detail
    assert result.open_rounds == {study.study_id: (1, 1, 500)}
