"""A two-server study through the leader's fold with a real helper (its own redis-server) and the
leader's Redis: both sides' rounds hold exactly n records with equal count and checksum, their
sums combine to the records' exact sum; what the helper refuses is excluded on both sides and
dead-lettered; a fold killed after prepare or after its EXEC, and a helper out of reach for a
while, still end with every record folded once on each side (docs/architecture.md, "Why each
record is folded once on both sides")."""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
from scipy.stats import chisquare

from aggregator.batch import Message, Polled
from aggregator.fold import Folder
from aggregator.service import Aggregator
from aggregator.settings import AggregatorSettings
from aggregator.two_server import MODE, HelperLink, HelperUnavailable, journal_entry
from ipdp import state
from ipdp.credentials import CREDENTIALS_HEADER
from ipdp.embedded.children import free_port
from ipdp.errors import ConfigurationError
from ipdp.fixed_point import combine, decode, fold
from ipdp.helper_client import HelperClient
from ipdp.helper_protocol import id_checksum
from ipdp.kafka_io import kafka_producer
from ipdp.metrics import EVERY_METRIC
from ipdp.redis_io import redis_client
from ipdp.sealing import open_share
from ipdp.study import Study
from ipdp.two_server_wire import decode_two_server_batch
from ipdp.wire import RejectReason, encode_record
from producer.contributor import Contributor
from tests.helper.conftest import TOKEN, helper_key_file, owner, running_helper  # noqa: F401
from tests.helper.devices import fixed_point_of, make_records
from tests.helper.test_helper import _nibbles
from tests.pipeline import read_records, wait_for

N = 100


class Crash(Exception):
    """Stands for the process dying at that point: nothing after it runs."""


@pytest.fixture
def helper(fresh_redis, helper_key_file, owner, monkeypatch):  # noqa: F811
    """A real helper on a fixed loopback port over its own redis-server; ``restart()`` serves it
    again on the same port, ``stop()`` takes it away."""
    key_file, key = helper_key_file

    class Helper:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        public = key.public
        public_b64 = key.public_b64
        private = key.private
        _served = None

        def start(self):
            self._served = running_helper(fresh_redis.settings().url, key_file, owner,
                                          monkeypatch, port=self.port)
            self._served.__enter__()

        def stop(self):
            if self._served is not None:
                self._served.__exit__(None, None, None)
                self._served = None

        def round(self, study: Study, round_no: int):
            with HelperClient(self.url, TOKEN, retry_s=5) as client:
                return client.round_share(study.study_id, round_no)

    h = Helper()
    h.start()
    yield h
    h.stop()


def two_server_study(redis_settings, helper, owner, n: int = N, **kw) -> Study:  # noqa: F811
    study = Study(study_id=f"two-{uuid.uuid4().hex[:6]}", d=3, n=n, epsilon=1.0, delta=0.01,
                  two_server={"helper_id": "helper-a", "helper_url": helper.url,
                              "helper_key": helper.public_b64}, **kw)
    state.register_study(redis_client(redis_settings), study, owner)
    return study


#: The helper links the test's folders hold, closed after each test (a link keeps its
#: connections to the helper open between folds, as an aggregator's does until it stops).
_LINKS: list[HelperLink] = []


@pytest.fixture(autouse=True)
def _close_links():
    yield
    while _LINKS:
        _LINKS.pop().close()


def link(token: str = TOKEN, **kwargs) -> HelperLink:
    _LINKS.append(HelperLink(token, **kwargs))
    return _LINKS[-1]


def leader_folder(redis_settings, group: str = "g-two", retry_s: float = 5.0) -> Folder:
    return Folder(redis_client(redis_settings), group=group, topic="t",
                  replay_window_s=3600, max_future_skew_s=60, max_message_bytes=1 << 20,
                  helpers=link(retry_s=retry_s))


def assert_rounds_agree(redis_settings, helper, study: Study, rounds: int, batch) -> None:
    """Rounds 1..rounds hold exactly n on both sides with equal checksums, and their sums
    combine to the exact sum of the records with those ids."""
    r = redis_client(redis_settings)
    keys = state.StudyKeys(study.study_id)
    at = {bytes(i): j for j, i in enumerate(batch.ids)}
    seen: set[bytes] = set()
    for round_no in range(1, rounds + 1):
        leader = r.hgetall(keys.closed(round_no))
        assert leader[b"mode"] == MODE.encode() and int(leader[b"count"]) == study.n
        share = helper.round(study, round_no)
        assert share is not None and share.count == study.n
        assert share.checksum == leader[b"checksum"]
        journal_ids = _ids_of_round(leader[b"checksum"], batch.ids, seen)
        assert len(journal_ids) == study.n
        total = combine(np.frombuffer(leader[b"sum"], "<u8").astype(np.uint64), share.sum)
        exact = fold(batch.values[[at[i] for i in journal_ids]])
        assert np.array_equal(total, exact)
        fp = fixed_point_of(study)
        np.testing.assert_array_equal(decode(total, fp)[0], decode(exact, fp)[0])
    assert helper.round(study, rounds + 1) is None
    assert not r.hlen(keys.helper_pending)


def _ids_of_round(checksum: bytes, ids: list[bytes], taken: set[bytes]) -> list[bytes]:
    """The ids, in order and not yet in an earlier round, whose checksum is the round's: the
    leader fills rounds in batch order, so they are the next n of ``ids`` not refused."""
    free = [i for i in ids if i not in taken]
    for k in range(1, len(free) + 1):
        if id_checksum(free[:k]) == checksum:
            taken.update(free[:k])
            return free[:k]
    raise AssertionError("no prefix of the remaining ids has the round's checksum")


def messages(records: list[bytes], partition: int = 0, start: int = 0) -> list[Message]:
    return [Message(partition, start + i, v) for i, v in enumerate(records)]


def test_a_two_server_study_through_kafka_and_the_aggregator_folds_equal_rounds_on_both_sides(
        kafka_settings, redis_settings, topics, env_topics, helper, owner,  # noqa: F811
        monkeypatch):
    monkeypatch.setenv("IPDP_HELPER_LEADER_TOKEN", TOKEN)
    study = Study(study_id=f"two-{uuid.uuid4().hex[:6]}", d=3, n=N, epsilon=1.0, delta=0.01,
                  two_server={"helper_id": "helper-a", "helper_url": helper.url,
                              "helper_key": helper.public_b64})
    producer = kafka_producer(kafka_settings)
    try:
        state.create_study(redis_client(redis_settings), producer, topics, study, owner)
        device = Contributor(study, producer, topics.records, records_per_device=250)
        rng = np.random.default_rng(5)
        x = np.clip(rng.normal(0, 0.4, (250, 3)), -0.5, 0.5)
        device.submit_many(x, np.clip(x.sum(axis=1), -1, 1))
        device.flush()
    finally:
        producer.close()
    values = [m.value for m in read_records(kafka_settings, topics.records, 250)]
    sent, rejects = decode_two_server_batch(values, study.d)
    assert rejects == []
    opened = np.stack([np.frombuffer(open_share(helper.private, s, h.tobytes()), "<u8")
                       for s, h in zip(sent.sealed, sent.header, strict=True)])

    agg = Aggregator(kafka_settings, redis_settings, topics,
                     AggregatorSettings(group=f"agg-{topics.records}", replay_window_s=3600,
                                        max_future_skew_s=60))
    worker = threading.Thread(target=agg.run, daemon=True)
    worker.start()
    try:
        r = redis_client(redis_settings)
        wait_for(lambda: r.exists(state.StudyKeys(study.study_id).closed(2))
                 and helper.round(study, 2) is not None, 40, "two rounds closed on both sides")
        wait_for(lambda: int(r.hget(state.StudyKeys(study.study_id).counts, "folded") or 0)
                 == 250, 20, "every record folded")
    finally:
        agg.stop_event.set()
        worker.join(timeout=30)

    assert_rounds_agree(redis_settings, helper, study, 2, SimpleNamespace(
        ids=[bytes(i) for i in sent.record_id], values=combine(sent.leader, opened)))
    assert [int(x) for x in r.hmget(state.StudyKeys(study.study_id).open, "round", "count")] \
        == [3, 50]
    assert r.xlen(state.ROUNDS_STREAM) == 2

    # The leader's store holds no plain record and no plain partial sum: every key of the study
    # read back, its round sums (two closed, one open holding 50) pass a chi-square test of
    # uniform nibbles, which the same rounds' plain sums fail, and no value holds the plain
    # encoding of a record.
    keys = state.StudyKeys(study.study_id)
    stored = b"".join(r.dump(k) or b"" for k in r.scan_iter(f"ipdp:{{{study.study_id}}}*"))
    plain = combine(sent.leader, opened)
    assert not any(row.tobytes() in stored for row in plain)
    sums = b"".join(r.hget(k, "sum") for k in (keys.closed(1), keys.closed(2), keys.open))
    assert chisquare(_nibbles(sums)).pvalue > 1e-4
    # Plain sums of three groups of the same sizes (any grouping is as far from uniform).
    plain_sums = b"".join(fold(plain[part]).astype("<u8").tobytes()
                          for part in (slice(0, N), slice(N, 2 * N), slice(2 * N, None)))
    assert chisquare(_nibbles(plain_sums)).pvalue < 1e-12


def test_a_record_the_helper_refuses_is_excluded_on_both_sides_and_dead_lettered(
        redis_settings, helper, owner):  # noqa: F811
    study = two_server_study(redis_settings, helper, owner)
    batch = make_records(study, helper.public, N + 2, np.random.default_rng(1))
    bad = bytearray(batch.records[3])
    bad[-20] ^= 1  # inside the sealed share: it does not open at the helper
    records = batch.records[:3] + [bytes(bad)] + batch.records[4:]
    before = EVERY_METRIC.get_sample_value("ipdp_helper_calls_total",
                                           {"call": "prepare", "outcome": "ok"}) or 0
    letters = []
    result = leader_folder(redis_settings).fold(messages(records), letters.append)
    assert result.folded == {study.study_id: N + 1}
    assert [(x.reason, x.detail, x.message.offset) for x in result.rejected] == [
        (RejectReason.HELPER_REFUSED, "bad_seal", 3)]
    assert [x.message.offset for refused in letters for x in refused] == [3]
    assert state.rejected_counts(redis_client(redis_settings), "g-two", "t") == {
        "helper_refused": 1}
    assert EVERY_METRIC.get_sample_value("ipdp_helper_calls_total",
                                         {"call": "prepare", "outcome": "ok"}) == before + 1
    assert_rounds_agree(redis_settings, helper, study, 1, _without(batch, 3))
    # The refused id is in neither side's round 2 (one record so far).
    r = redis_client(redis_settings)
    assert int(r.hget(state.StudyKeys(study.study_id).open, "count")) == 1
    assert r.hget(state.StudyKeys(study.study_id).open, "checksum") == id_checksum(
        [batch.ids[-1]])


def _without(batch, i: int) -> SimpleNamespace:
    return SimpleNamespace(ids=batch.ids[:i] + batch.ids[i + 1:],
                           values=np.delete(batch.values, i, axis=0))


def test_a_fold_killed_after_prepare_or_after_its_exec_folds_every_record_once_on_both_sides(
        redis_settings, helper, owner):  # noqa: F811
    study = two_server_study(redis_settings, helper, owner)
    batch = make_records(study, helper.public, 3 * N, np.random.default_rng(2))
    # A record repeated at the end makes the dead-letter hook run after prepare, before EXEC.
    first = messages(batch.records[:N + 10] + [batch.records[0]])
    second = messages(batch.records[N + 10:], start=len(first))

    def crash_before_exec(_refused):
        raise Crash

    with pytest.raises(Crash):
        leader_folder(redis_settings).fold(first, crash_before_exec)
    r = redis_client(redis_settings)
    assert not r.exists(state.StudyKeys(study.study_id).open)  # nothing written on the leader
    restarted = leader_folder(redis_settings)
    assert restarted.resend_pending(every_study=True) == 0
    result = restarted.fold(first)  # a new job: the helper saw nothing committed
    assert result.folded == {study.study_id: N + 10}
    assert [x.reason for x in result.rejected] == [RejectReason.REPLAYED]

    # Killed between the leader's EXEC and the helper's commit.
    crashing = leader_folder(redis_settings)

    def commit_then_die(*_args):
        raise Crash

    crashing.helpers.commit = commit_then_die
    with pytest.raises(Crash):
        crashing.fold(second)
    journal = r.hgetall(state.StudyKeys(study.study_id).helper_pending)
    assert len(journal) == 1  # the commit the EXEC recorded as owed
    assert helper.round(study, 2) is None and helper.round(study, 3) is None
    restarted = leader_folder(redis_settings)
    assert restarted.resend_pending(every_study=True) == 0  # at start: the commit is sent
    again = restarted.fold(first + second)  # polled again from the checkpoint
    assert again.folded == {study.study_id: 0} or again.folded == {}
    assert_rounds_agree(redis_settings, helper, study, 3, batch)


def test_a_helper_out_of_reach_for_a_while_folds_nothing_wrong_and_the_leader_catches_up(
        redis_settings, helper, owner):  # noqa: F811
    study = two_server_study(redis_settings, helper, owner)
    batch = make_records(study, helper.public, 2 * N + 1, np.random.default_rng(3))
    folder = leader_folder(redis_settings, retry_s=0.5)
    r = redis_client(redis_settings)
    helper.stop()
    with pytest.raises(HelperUnavailable):
        folder.fold(messages(batch.records[:N]))
    assert not r.exists(state.StudyKeys(study.study_id).open)
    assert folder.committed_offsets() == {}  # the batch is polled again
    helper.start()
    assert folder.fold(messages(batch.records[:N])).folded == {study.study_id: N}

    # Out of reach between the leader's EXEC and the helper's commit: the journal owes it.
    def helper_gone(_refused):
        helper.stop()

    tail = batch.records[N:] + [batch.records[N]]
    result = folder.fold(messages(tail, start=N), helper_gone)
    assert result.folded == {study.study_id: N + 1}
    assert len(r.hgetall(state.StudyKeys(study.study_id).helper_pending)) == 1
    assert folder.resend_pending() == 1  # still out of reach: the entry stays
    assert EVERY_METRIC.get_sample_value("ipdp_helper_commits_pending") == 1
    helper.start()
    assert folder.resend_pending() == 0
    assert EVERY_METRIC.get_sample_value("ipdp_helper_commits_pending") == 0
    assert_rounds_agree(redis_settings, helper, study, 2, batch)


def test_a_two_server_study_without_the_leaders_token_stops_with_a_configuration_error(
        redis_settings, helper, owner):  # noqa: F811
    study = two_server_study(redis_settings, helper, owner)
    batch = make_records(study, helper.public, 2, np.random.default_rng(4))
    folder = Folder(redis_client(redis_settings), group="g-none", topic="t",
                    replay_window_s=3600, max_future_skew_s=60, max_message_bytes=1 << 20)
    with pytest.raises(ConfigurationError, match="IPDP_HELPER_LEADER_TOKEN"):
        folder.fold(messages(batch.records))
    wrong = Folder(redis_client(redis_settings), group="g-none", topic="t",
                   replay_window_s=3600, max_future_skew_s=60, max_message_bytes=1 << 20,
                   helpers=link("not-the-token"))
    with pytest.raises(ConfigurationError, match="refused the leader's token"):
        wrong.fold(messages(batch.records))
    assert not redis_client(redis_settings).exists(state.StudyKeys(study.study_id).open)


def test_the_leader_refuses_on_its_own_what_it_can_see_without_asking_the_helper(
        redis_settings, helper, owner):  # noqa: F811
    study = two_server_study(redis_settings, helper, owner)
    one_server = Study(study_id=f"one-{uuid.uuid4().hex[:6]}", d=3, n=N, epsilon=1.0,
                       delta=0.01)
    state.register_study(redis_client(redis_settings), one_server)
    rng = np.random.default_rng(6)
    good = make_records(study, helper.public, 2, rng)
    stale = make_records(study, helper.public, 1, rng, created_ms=int(time.time() * 1000)
                         - 7_200_000)
    unknown = make_records(Study(study_id="nowhere", d=3, n=N, epsilon=2.0, delta=0.01,
                                 two_server={"helper_id": "helper-a", "helper_url": helper.url,
                                             "helper_key": helper.public_b64}),
                           helper.public, 1, rng)
    for_one_server = make_records(one_server, helper.public, 1, rng)
    version_1 = encode_record(study.hash, bytes(16), int(time.time() * 1000), np.zeros(3),
                              np.zeros(3))
    records = [good.records[0], stale.records[0], good.records[1][:-1], unknown.records[0],
               for_one_server.records[0], version_1, good.records[1]]
    calls = EVERY_METRIC.get_sample_value("ipdp_helper_calls_total",
                                          {"call": "prepare", "outcome": "ok"}) or 0
    folder = leader_folder(redis_settings)
    result = folder.fold(messages(records))
    assert result.folded == {study.study_id: 2}
    assert [(x.message.offset, x.reason) for x in result.rejected] == [
        (1, RejectReason.STALE), (2, RejectReason.UNDECODABLE),
        (3, RejectReason.UNKNOWN_STUDY), (4, RejectReason.UNSUPPORTED_VERSION),
        (5, RejectReason.UNSUPPORTED_VERSION)]
    # A replay of a folded record is the leader's to refuse: the helper is not asked.
    again = folder.fold(messages([good.records[0]], partition=1))
    assert [x.reason for x in again.rejected] == [RejectReason.REPLAYED]
    assert EVERY_METRIC.get_sample_value("ipdp_helper_calls_total",
                                         {"call": "prepare", "outcome": "ok"}) == calls + 1


def test_two_aggregators_folding_one_study_at_once_fold_each_record_once_on_both_sides(
        redis_settings, helper, owner):  # noqa: F811
    study = two_server_study(redis_settings, helper, owner)
    batch = make_records(study, helper.public, 2 * N, np.random.default_rng(7))
    a, b = leader_folder(redis_settings), leader_folder(redis_settings)
    raced = []

    def meanwhile(_refused):  # inside a's transaction: after its reads, before its EXEC
        if not raced:  # b folds the rest, and one record a holds too, first
            raced.append(b.fold(messages(batch.records[N:] + [batch.records[5]], partition=1)))

    mine = batch.records[:N] + [batch.records[0]]  # the repeat makes a's hook run
    result = a.fold(messages(mine), meanwhile)
    assert raced[0].folded == {study.study_id: N + 1} and raced[0].conflicts == 0
    assert result.conflicts == 1 and result.folded == {study.study_id: N - 1}
    assert sorted(x.reason.value for x in result.rejected) == ["replayed", "replayed"]
    order = [*range(N, 2 * N), 5, *(i for i in range(N) if i != 5)]
    assert_rounds_agree(redis_settings, helper, study, 2, SimpleNamespace(
        ids=[batch.ids[i] for i in order], values=batch.values[order]))


def test_a_two_server_study_closes_after_its_last_round_on_both_sides(
        redis_settings, helper, owner):  # noqa: F811
    study = two_server_study(redis_settings, helper, owner, max_rounds=1)
    batch = make_records(study, helper.public, N + 5, np.random.default_rng(8))
    folder = leader_folder(redis_settings)
    result = folder.fold(messages(batch.records))
    assert result.folded == {study.study_id: N} and result.closed_rounds == [(study.study_id, 1)]
    past_last = (f"study {study.study_id} closed after 1 rounds (max_rounds or its privacy "
                 "budget)")
    assert [(x.reason, x.detail, x.message.offset) for x in result.rejected] == [
        (RejectReason.CLOSED_STUDY, past_last, N + i) for i in range(5)]
    assert_rounds_agree(redis_settings, helper, study, 1, batch)
    r = redis_client(redis_settings)
    assert r.hget(state.StudyKeys(study.study_id).study, "status") == b"closed"
    later = make_records(study, helper.public, 1, np.random.default_rng(9))
    assert [x.reason for x in folder.fold(messages(later.records, partition=1)).rejected] == [
        RejectReason.CLOSED_STUDY]


def prepare_calls() -> float:
    """Jobs the helper answered (how often the leader asked it anything)."""
    return EVERY_METRIC.get_sample_value("ipdp_helper_calls_total",
                                         {"call": "prepare", "outcome": "ok"}) or 0


def test_records_sent_to_a_study_its_owner_closed_are_dead_lettered_and_its_open_round_stays(
        kafka_settings, redis_settings, topics, helper, owner):  # noqa: F811
    study = two_server_study(redis_settings, helper, owner)
    half = N // 2
    batch = make_records(study, helper.public, half + 3, np.random.default_rng(10))
    folder = leader_folder(redis_settings)
    r = redis_client(redis_settings)
    keys = state.StudyKeys(study.study_id)
    first = folder.fold(messages(batch.records[:half]))
    assert first.open_rounds == {study.study_id: (1, half, N)}
    # The study's offsets: per partition (field <partition>:<epoch>), the offset below which
    # its records are folded.
    assert r.hgetall(keys.offsets("g-two", "t")) == {b"0:0": str(half).encode()}
    open_round = r.hgetall(keys.open)
    producer = kafka_producer(kafka_settings)
    try:
        state.close_study(r, producer, topics, study.study_id, owner)
    finally:
        producer.close()
    calls = prepare_calls()
    letters = []
    result = folder.fold(messages(batch.records[half:], start=half), letters.append)
    refusals = [(RejectReason.CLOSED_STUDY, f"study {study.study_id} is closed", half + i)
                for i in range(3)]
    assert [(x.reason, x.detail, x.message.offset) for x in result.rejected] == refusals
    assert [(x.reason, x.detail, x.message.offset) for refused in letters
            for x in refused] == refusals
    assert result.folded == {} and result.open_rounds == {} and result.closed_rounds == []
    assert prepare_calls() == calls  # the helper is not asked about a closed study's records
    assert r.hgetall(keys.open) == open_round
    assert r.hget(keys.study, "status") == b"closed"
    counts = r.hgetall(keys.counts)
    assert (counts[b"folded"], counts[b"rejected:closed_study"]) == (str(half).encode(), b"3")
    assert r.hgetall(keys.offsets("g-two", "t")) == {b"0:0": str(half + 3).encode()}


def test_records_of_a_study_deleted_and_created_again_under_its_id_are_refused_as_unknown(
        kafka_settings, redis_settings, topics, helper, owner):  # noqa: F811
    study = two_server_study(redis_settings, helper, owner)
    rng = np.random.default_rng(11)
    stale = make_records(study, helper.public, 1, rng,
                         created_ms=int(time.time() * 1000) - 7_200_000)
    batch = make_records(study, helper.public, 3, rng)
    folder = leader_folder(redis_settings)
    # The folder now knows the study: its records pass the checks without a look-up.
    assert [x.reason for x in folder.fold(messages(stale.records)).rejected] == [
        RejectReason.STALE]
    r = redis_client(redis_settings)
    producer = kafka_producer(kafka_settings)
    try:
        state.delete_study(r, producer, topics, study.study_id)
    finally:
        producer.close()
    again = Study(study_id=study.study_id, d=3, n=N, epsilon=2.0, delta=0.01,
                  two_server={"helper_id": "helper-a", "helper_url": helper.url,
                              "helper_key": helper.public_b64})
    state.register_study(r, again, owner)
    result = folder.fold(messages(batch.records[:2], start=1))
    assert [(x.reason, x.message.offset) for x in result.rejected] == [
        (RejectReason.UNKNOWN_STUDY, 1), (RejectReason.UNKNOWN_STUDY, 2)]
    assert all(x.detail.startswith(f"study {study.study_id} is ") for x in result.rejected)
    assert result.folded == {}
    keys = state.StudyKeys(study.study_id)
    assert r.hget(keys.study, "status") == b"open" and not r.exists(keys.open)
    # The deleted study is forgotten: its next record is refused by the look-up, a refusal the
    # group counts (the two above were counted in the study's transaction).
    later = folder.fold(messages(batch.records[2:], start=3))
    assert [x.reason for x in later.rejected] == [RejectReason.UNKNOWN_STUDY]
    assert r.hgetall(state.rejected_key("g-two", "t")) == {b"stale": b"1",
                                                           b"unknown_study": b"1"}
    assert state.rejected_counts(r, "g-two", "t") == {"stale": 1, "unknown_study": 3}


def test_a_batch_polled_again_after_its_study_committed_but_before_the_checkpoint_is_skipped(
        redis_settings, helper, owner):  # noqa: F811
    study = two_server_study(redis_settings, helper, owner)
    batch = make_records(study, helper.public, 6, np.random.default_rng(12))
    bad = bytearray(batch.records[2])
    bad[-20] ^= 1  # the helper refuses it: below the study's offsets, it is not asked again
    # The repeat is the leader's to refuse: the helper is asked about each id once.
    records = batch.records[:2] + [bytes(bad)] + batch.records[3:] + [batch.records[0]]
    r = redis_client(redis_settings)
    keys = state.StudyKeys(study.study_id)
    first = leader_folder(redis_settings).fold(messages(records))
    assert first.folded == {study.study_id: 5}
    assert sorted((x.message.offset, x.reason) for x in first.rejected) == [
        (2, RejectReason.HELPER_REFUSED), (6, RejectReason.REPLAYED)]
    assert {s.labels["outcome"]: s.value for m in EVERY_METRIC.collect()
            if m.name == "ipdp_helper_records" for s in m.samples
            if s.name == "ipdp_helper_records_total"
            and s.labels["study"] == study.study_id} == {"accepted": 5, "bad_seal": 1}
    counts = r.hgetall(keys.counts)
    # The process died after the study's EXEC, before the checkpoint: the group's offsets are
    # as they were before the fold.
    r.delete(state.offsets_key("g-two", "t"))
    calls = prepare_calls()
    letters = []
    again = leader_folder(redis_settings).fold(messages(records), letters.append)
    assert again.rejected == [] and letters == []
    assert again.folded == {study.study_id: 0}
    assert prepare_calls() == calls
    assert r.hgetall(keys.counts) == counts
    assert r.hgetall(keys.offsets("g-two", "t")) == {b"0:0": b"7"}
    assert int(r.hget(keys.open, "count")) == 5


def test_two_studies_closing_a_round_in_one_batch_each_report_it(
        redis_settings, helper, owner):  # noqa: F811
    n = N
    studies = sorted((two_server_study(redis_settings, helper, owner, n=n) for _ in range(2)),
                     key=lambda s: s.study_id)
    rng = np.random.default_rng(13)
    records = [x for s in studies for x in make_records(s, helper.public, n, rng).records]
    before = int(time.time() * 1000)
    result = leader_folder(redis_settings).fold(messages(records))
    after = int(time.time() * 1000)
    assert result.closed_rounds == [(s.study_id, 1) for s in studies]
    assert result.open_rounds == {s.study_id: (2, 0, n) for s in studies}
    r = redis_client(redis_settings)
    for s in studies:
        closed_ms = int(r.hget(state.StudyKeys(s.study_id).closed(1), "closed_ms"))
        assert before <= closed_ms <= after


def _owe(r, study: Study, jobs: list[str], record_id: bytes) -> None:
    """Journal entries for helper commits of jobs the helper never prepared."""
    r.hset(state.StudyKeys(study.study_id).helper_pending,
           mapping={job: journal_entry({1: [record_id]}) for job in jobs})


def test_a_commit_the_helper_refuses_stays_owed_and_is_reported_once_and_one_it_cannot_reach_waits(
        redis_settings, helper, owner, caplog):  # noqa: F811
    quiet, owing = sorted((two_server_study(redis_settings, helper, owner) for _ in range(2)),
                          key=lambda s: s.study_id)
    rng = np.random.default_rng(14)
    folder = leader_folder(redis_settings, retry_s=0.5)
    for at, s in enumerate((quiet, owing)):  # the folder knows both studies (no round closes)
        assert folder.fold(messages(make_records(s, helper.public, 1, rng).records,
                                    start=at)).folded == {s.study_id: 1}
    r = redis_client(redis_settings)
    jobs = sorted(uuid.uuid4().hex for _ in range(2))
    _owe(r, owing, jobs, bytes(16))
    pending = state.StudyKeys(owing.study_id).helper_pending
    # A process that folded neither study sends nothing until it starts over every study.
    assert leader_folder(redis_settings).resend_pending() == 0

    def sample(name, labels):
        return EVERY_METRIC.get_sample_value(name, labels) or 0

    retries = sample("ipdp_backend_retries_total", {"backend": "helper"})
    caplog.set_level(logging.WARNING, logger="aggregator.fold")
    assert folder.resend_pending() == 2
    assert folder.resend_pending() == 2
    assert sample("ipdp_backend_retries_total", {"backend": "helper"}) == retries + 4
    assert EVERY_METRIC.get_sample_value("ipdp_helper_commits_pending") == 2
    assert sorted(r.hkeys(pending)) == [j.encode() for j in jobs]
    errors = [x.getMessage() for x in caplog.records if x.levelno == logging.ERROR]
    assert len(errors) == 2  # once per job, however often it is sent again
    for job, message in zip(jobs, errors, strict=True):
        assert re.fullmatch(
            rf"study {owing.study_id}: the helper refused the commit of job {job} "
            r"\(the helper refused \(404 unknown_job\): .*\): rounds \[1\] cannot be "
            rf"combined until an operator resolves it; the entry stays in {re.escape(pending)}",
            message), message

    caplog.clear()
    unavailable = sample("ipdp_backend_errors_total", {"backend": "helper", "operation": "commit"})
    helper.stop()
    assert folder.resend_pending() == 2
    assert sample("ipdp_backend_errors_total",
                  {"backend": "helper", "operation": "commit"}) == unavailable + 2
    warnings = [x.getMessage() for x in caplog.records if x.levelno == logging.WARNING]
    assert len(warnings) == 2
    for job, message in zip(jobs, warnings, strict=True):
        assert re.fullmatch(rf"study {owing.study_id}: the helper commit of job {job} is owed "
                            r"\(commit at .+\); sending it again later", message), message
    assert sorted(r.hkeys(pending)) == [j.encode() for j in jobs]


def test_a_job_the_helper_refuses_whole_refuses_each_record_with_the_helpers_reason(
        redis_settings, helper, owner, caplog):  # noqa: F811
    study = Study(study_id=f"two-{uuid.uuid4().hex[:6]}", d=3, n=N, epsilon=1.0, delta=0.01,
                  two_server={"helper_id": "helper-a", "helper_url": helper.url,
                              "helper_key": helper.public_b64})
    r = redis_client(redis_settings)
    state.register_study(r, study)  # not signed by the owner the helper trusts
    batch = make_records(study, helper.public, 3, np.random.default_rng(15))
    caplog.set_level(logging.WARNING, logger="aggregator.fold")
    letters = []
    result = leader_folder(redis_settings).fold(messages(batch.records), letters.append)
    refusals = [(RejectReason.HELPER_REFUSED, "untrusted_study", i) for i in range(3)]
    assert [(x.reason, x.detail, x.message.offset) for x in result.rejected] == refusals
    assert [(x.reason, x.detail, x.message.offset) for refused in letters
            for x in refused] == refusals
    assert result.folded == {study.study_id: 0}
    assert not r.exists(state.StudyKeys(study.study_id).open)
    assert not r.hlen(state.StudyKeys(study.study_id).helper_pending)
    [message] = [x.getMessage() for x in caplog.records if x.levelno == logging.WARNING]
    assert re.fullmatch(rf"study {study.study_id}: the helper refused job [0-9a-f]{{32}} whole "
                        r"\(the helper refused \(403 untrusted_study\): .*\)", message), message


def test_a_study_closed_while_its_fold_is_under_way_folds_nothing_after_the_close(
        kafka_settings, redis_settings, topics, helper, owner):  # noqa: F811
    study = two_server_study(redis_settings, helper, owner)
    batch = make_records(study, helper.public, 4, np.random.default_rng(16))
    r = redis_client(redis_settings)
    producer = kafka_producer(kafka_settings)
    letters = []

    def close_meanwhile(refused):  # inside the transaction: after its reads, before its EXEC
        letters.append(refused)
        if len(letters) == 1:
            state.close_study(r, producer, topics, study.study_id, owner)

    try:
        # The repeat makes the hook run before EXEC.
        result = leader_folder(redis_settings).fold(
            messages(batch.records + [batch.records[0]]), close_meanwhile)
    finally:
        producer.close()
    assert result.conflicts == 1 and result.folded == {}
    assert [(x.reason, x.message.offset) for x in result.rejected] == [
        (RejectReason.CLOSED_STUDY, i) for i in range(5)]
    keys = state.StudyKeys(study.study_id)
    assert not r.exists(keys.open) and not r.hlen(keys.helper_pending)
    assert r.hget(keys.counts, "rejected:closed_study") == b"5"


def test_a_study_without_credentials_folds_its_records_whatever_credential_header_they_carry(
        redis_settings, helper, owner):  # noqa: F811
    study = two_server_study(redis_settings, helper, owner)
    batch = make_records(study, helper.public, 2, np.random.default_rng(17))
    # Not whole (count, token) runs: a study that requires credentials would refuse it.
    torn = [(CREDENTIALS_HEADER, b"\x01torn")]
    polled = Polled(np.zeros(2, np.int64), np.arange(2, dtype=np.int64), batch.records,
                    headers=[torn, torn])
    result = leader_folder(redis_settings).fold(polled)
    assert result.folded == {study.study_id: 2} and result.rejected == []
