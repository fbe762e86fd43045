"""Offsets per study and per partition: folds that share nothing never conflict, a crash
between two studies' commits of one batch folds every record once, and a deployment whose
Redis holds the layout before hash tags resumes from its offsets."""

from __future__ import annotations

import numpy as np
import pytest

from aggregator.batch import Message
from ipdp import state
from ipdp.redis_io import redis_client
from tests.aggregator.test_hostile_input import honest
from tests.aggregator.test_replay import folded, folder_for, study_in
from tests.pipeline import total_stats

ATOL = 1e-9


class Crash(Exception):
    """Stands for the process dying at that point: nothing after it runs."""


def assert_clean(redis_settings, study, q, p) -> None:
    a, b, count = total_stats(redis_settings, study)
    assert count == len(q)
    np.testing.assert_allclose(a, q.T @ q, rtol=0, atol=ATOL)
    np.testing.assert_allclose(b, p.sum(axis=0), rtol=0, atol=ATOL)


def test_folds_of_different_studies_on_different_partitions_never_conflict(redis_settings):
    one, two = study_in(redis_settings), study_in(redis_settings)
    good1, _, _ = honest(one, 3, seed=31)
    good2, _, _ = honest(two, 3, seed=32)
    group = "g-shared"
    a, b = folder_for(redis_settings, group), folder_for(redis_settings, group)
    raced = []

    def meanwhile(_rejections):  # inside a's transaction: after its reads, before its EXEC
        if not raced:
            raced.append(b.fold([Message(1, i, v) for i, v in enumerate(good2)]))

    # A repeated record makes a's dead-letter hook run inside its study's transaction.
    result = a.fold([Message(0, 0, good1[0]), Message(0, 1, good1[1]), Message(0, 2, good1[1]),
                     Message(0, 3, good1[2])], meanwhile)
    assert raced[0].folded == {two.study_id: 3} and raced[0].conflicts == 0
    assert result.folded == {one.study_id: 3} and result.conflicts == 0
    assert a.committed_offsets() == {0: 4, 1: 3}


def test_a_crash_between_two_studies_commits_folds_every_record_once(redis_settings):
    first, second = sorted((study_in(redis_settings), study_in(redis_settings)),
                           key=lambda s: s.study_id)  # folded in study id order
    v1, q1, p1 = honest(first, 6, seed=41)
    v2, q2, p2 = honest(second, 6, seed=42)
    # Interleaved on two partitions; the second study repeats a record, so its dead-letter
    # hook runs inside its transaction: the crash lands after the first study's EXEC and
    # before the second's.
    batch = [Message(i % 2, i // 2, v) for i, v in enumerate(
        [x for pair in zip(v1, v2, strict=True) for x in pair] + [v2[0]])]
    group = "g-crash"

    def crash(rejections):
        if any(x.message.value == v2[0] for x in rejections):
            raise Crash

    with pytest.raises(Crash):
        folder_for(redis_settings, group).fold(batch, crash)
    assert folded(redis_settings, first) == 6 and folded(redis_settings, second) == 0
    restarted = folder_for(redis_settings, group)
    assert restarted.committed_offsets() == {}  # the checkpoint did not move
    result = restarted.fold(batch)
    # The first study's records are skipped: its offsets say they are folded.
    assert result.folded == {first.study_id: 0, second.study_id: 6}
    assert [x.reason.value for x in result.rejected] == ["replayed"]
    assert restarted.committed_offsets() == {0: 7, 1: 6}
    assert_clean(redis_settings, first, q1, p1)
    assert_clean(redis_settings, second, q2, p2)
    assert state.rejected_counts(redis_client(redis_settings), group, "t") == {"replayed": 1}


def _to_old_layout(r, study, group: str, topic: str) -> None:
    """Rename a study's keys and the group's offsets to the names used before hash tags."""
    sid = study.study_id
    prefix = f"ipdp:{{{sid}}}:"
    for key in [k.decode() for k in r.scan_iter(match=prefix.replace("{", "[{]") + "*")]:
        rest = key[len(prefix):]
        kind, _, tail = rest.partition(":")
        if kind == "offsets":
            r.delete(key)  # the old layout had no study offsets
            continue
        old = f"ipdp:{kind}:{sid}:{tail}" if tail else f"ipdp:{kind}:{sid}"
        r.rename(key, old)
    r.rename(state.offsets_key(group, topic), f"ipdp:offsets:{group}:{topic}")
    if r.exists(state.rejected_key(group, topic)):
        r.rename(state.rejected_key(group, topic), "ipdp:rejected")


def test_a_deployment_with_the_old_layout_resumes_from_its_offsets(redis_settings):
    study = study_in(redis_settings, n=200)
    values, q, p = honest(study, 500, seed=51)
    msgs = [Message(0, i, v) for i, v in enumerate(values)]
    group = "g-upgrade"
    r = redis_client(redis_settings)
    assert folder_for(redis_settings, group).fold(msgs[:300]).folded == {study.study_id: 300}
    _to_old_layout(r, study, group, "t")
    assert r.exists(f"ipdp:study:{study.study_id}", f"ipdp:open:{study.study_id}",
                    f"ipdp:closed:{study.study_id}:1", f"ipdp:offsets:{group}:t") == 4

    assert state.upgrade_layout(r, group, "t") >= 5
    assert state.upgrade_layout(r, group, "t") == 0  # idempotent
    folder = folder_for(redis_settings, group)
    assert folder.committed_offsets() == {0: 300}
    result = folder.fold(msgs)  # re-read from the start: what was folded is skipped
    assert result.skipped == 300 and result.folded == {study.study_id: 200}
    assert result.rejected == [] and result.closed_rounds == [(study.study_id, 2)]
    assert folded(redis_settings, study) == 500
    assert_clean(redis_settings, study, q, p)
    # A replay of a record folded before the upgrade is still refused.
    again = folder.fold([Message(1, 0, values[0])])
    assert [x.reason.value for x in again.rejected] == ["replayed"]


def test_a_round_closed_but_not_announced_before_a_crash_is_announced_at_the_next_start(
        redis_settings):
    study = study_in(redis_settings, n=200)
    values, _, _ = honest(study, 200, seed=61)
    r = redis_client(redis_settings)
    assert folder_for(redis_settings).fold(
        [Message(0, i, v) for i, v in enumerate(values)]).closed_rounds == [(study.study_id, 1)]
    assert r.xlen(state.ROUNDS_STREAM) == 1
    # The state a crash after the fold's EXEC and before its XADD leaves behind.
    r.delete(state.ROUNDS_STREAM)
    r.sadd(state.StudyKeys(study.study_id).unannounced, 1)
    assert folder_for(redis_settings).announce_pending() == 1
    assert [(e[b"study"], e[b"round"]) for _, e in r.xrange(state.ROUNDS_STREAM)] == [
        (study.study_id.encode(), b"1")]
    assert not r.exists(state.StudyKeys(study.study_id).unannounced)
    assert r.exists(state.StudyKeys(study.study_id).closed(1))
