"""A two-server round end to end at the trainer: the leader's closed round in a real leader Redis
(built here from shares the test computes), the helper's round by driving a real helper service
(prepare + commit), the trainer over the real broker. It combines and publishes, or refuses with
the metric and publishes nothing, or leaves the round pending until the helper is full."""

from __future__ import annotations

import json
import math
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import redis
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from helper.store import id_checksum
from ipdp import state
from ipdp.cli.models import model_line
from ipdp.embedded.children import free_port
from ipdp.fixed_point import decode, encode, fold, split
from ipdp.helper_client import HelperClient
from ipdp.helper_protocol import TWO_SERVER_VERSION
from ipdp.metrics import EVERY_METRIC
from ipdp.model_message import ModelMessage, PrivacyReport, model_value, parse_model_value
from ipdp.sealing import HelperKey, generate_helper_key_files, seal_share
from ipdp.settings import TrustSettings
from ipdp.signing import SigningKey
from ipdp.study import Study, StudyStatus, TwoServer, study_message
from ipdp.subscriber import ModelSubscriber
from ipdp.two_server import perturb_two_server
from tests.helper.conftest import TOKEN, running_helper
from trainer.errors import DeferralReason, RoundPending
from trainer.service import Trainer
from trainer.settings import TrainerSettings
from trainer.solver import solve_constrained
from trainer.two_server import HelperShares

N, D = 200, 3


@dataclass
class Rounds:
    """A running helper, the leader's Redis, and a two-server study both know."""

    study: Study
    owner: SigningKey
    key: HelperKey
    leader: redis.Redis
    helper_url: str

    def client(self) -> HelperClient:
        return HelperClient(self.helper_url, TOKEN, retry_s=30)


@dataclass
class Built:
    """One round's records as the servers fold them."""

    ids: list[bytes]
    values: np.ndarray
    leader: np.ndarray
    records: list[bytes]


@pytest.fixture
def rounds(fresh_redis, redis_settings, tmp_path, monkeypatch) -> Iterator[Rounds]:
    owner = SigningKey(Ed25519PrivateKey.generate())
    key = generate_helper_key_files(tmp_path / "helper")
    with running_helper(fresh_redis.settings().url, str(tmp_path / "helper.key"), owner,
                        monkeypatch) as url:
        study = Study(study_id=f"combine-{uuid.uuid4().hex[:8]}", d=D, n=N, epsilon=1.0,
                      delta=0.01, two_server=TwoServer(helper_id="helper-1", helper_url=url,
                                                       helper_key=key.public_b64))
        leader = redis.Redis.from_url(redis_settings.url)
        state.register_study(leader, study, owner)
        try:
            yield Rounds(study, owner, key, leader, url)
        finally:
            leader.close()


def build(rounds: Rounds, k: int, rng: np.random.Generator, crafted: np.ndarray | None = None
          ) -> Built:
    """k honest records of the study (perturbed, encoded and split as a device does), or k
    records of the ``crafted`` encoded values, sealed for the helper."""
    study, two = rounds.study, rounds.study.two_server_calibration
    if crafted is None:
        q = rng.normal(0, 1, (k, D))
        q *= rng.uniform(0, 1, (k, 1)) / np.linalg.norm(q, axis=1, keepdims=True)
        p = q * rng.uniform(-1, 1, (k, 1))
        values, clamped = encode(*perturb_two_server(q, p, two), two.encoding)
        assert clamped == 0
    else:
        values = np.broadcast_to(crafted, (k, two.encoding.entries)).copy()
    leader, helper = split(values)
    now = time.time_ns() // 1_000_000
    ids, records = [], []
    for i in range(k):
        record_id = uuid.uuid4().bytes
        header = (struct.pack("<B3xI", TWO_SERVER_VERSION, D) + study.hash + record_id
                  + struct.pack("<q", now))
        sealed = seal_share(rounds.key.public, helper[i].astype("<u8").tobytes(), header)
        records.append(header + leader[i].astype("<u8").tobytes() + sealed
                       + struct.pack("<I", 0))
        ids.append(record_id)
    return Built(ids, values, leader, records)


def fold_at_helper(rounds: Rounds, built: Built, round_no: int, rows: slice = slice(None)) -> None:
    """Prepare and commit ``rows`` of the records at the helper, into ``round_no``."""
    value = study_message(rounds.study, StudyStatus.OPEN, rounds.owner)
    job = uuid.uuid4().hex
    with rounds.client() as client:
        prepared = client.prepare(job, value, built.records[rows], D)
        assert prepared.mask.all(), prepared.refused
        client.commit(job, {round_no: built.ids[rows]})


def close_at_leader(rounds: Rounds, built: Built, round_no: int, *, count: int | None = None,
                    ids: list[bytes] | None = None) -> None:
    """The leader's closed round (its shares' sum, count, id checksum) and its stream entry."""
    keys = state.StudyKeys(rounds.study.study_id)
    rounds.leader.hset(keys.closed(round_no), mapping={
        "sum": fold(built.leader).astype("<u8").tobytes(),
        "count": len(built.ids) if count is None else count,
        "checksum": id_checksum(built.ids if ids is None else ids),
        "closed_ms": time.time_ns() // 1_000_000, "mode": "two-server"})
    rounds.leader.xadd(state.ROUNDS_STREAM, {"study": rounds.study.study_id, "round": round_no})


def trainer_for(kafka_settings, redis_settings, topics, **settings) -> Trainer:
    return Trainer(kafka_settings, redis_settings, topics,
                   TrainerSettings(block_ms=100, **{"helper_wait_s": 2.0, **settings}),
                   TrustSettings(), helper_token=TOKEN)


def counted(metric: str, study: Study, reason: str) -> float:
    return EVERY_METRIC.get_sample_value(metric, {"study": study.study_id,
                                                  "reason": reason}) or 0.0


def models_of(kafka_settings, topics, study: Study) -> list:
    return list(ModelSubscriber(kafka_settings, topics, study.study_id, trusted_keys=[]))


def pending(rounds: Rounds) -> int:
    return int(rounds.leader.xpending(state.ROUNDS_STREAM, "ipdp-trainer")["pending"])


def test_a_combined_round_gives_the_one_server_solve_of_the_same_sums_with_a_two_server_report(
        rounds, kafka_settings, redis_settings, env_topics):
    rng = np.random.default_rng(51)
    built = build(rounds, N, rng)
    fold_at_helper(rounds, built, 1)
    close_at_leader(rounds, built, 1)
    trainer_for(kafka_settings, redis_settings, env_topics).run(idle_exit_s=1.0)

    [model] = models_of(kafka_settings, env_topics, rounds.study)
    two = rounds.study.two_server_calibration
    a, b = decode(fold(built.values), two.encoding)
    h = a + two.delta_in * np.eye(D)
    expected = solve_constrained(h, b, rounds.study.eta).w
    # The published b is b̂ + V, |V_c| ≤ h_b/2; the solution map is 1/λ_min(H)-Lipschitz in b.
    reach = math.sqrt(D) * two.linear_step / 2 / np.linalg.eigvalsh(h)[0]
    assert np.linalg.norm(np.array(model.weights) - expected) <= reach
    assert np.linalg.norm(expected) > 100 * reach
    assert "servers=two-server" in model_line(model)
    report = model.privacy
    assert (report.servers, report.mode, report.proven) == ("two-server", "rigorous", True)
    assert (report.epsilon, report.delta) == (1.0, 0.01)
    assert report.sigma_b2 == two.sigma_b2 and report.delta_split == two.delta_split
    assert report.epsilon_split == two.epsilon_split
    assert "either server alone" in report.protects and "colluding" in report.protects
    assert any("λ_min(A) ≥" in c for c in report.checked)
    assert any("checksum" in c for c in report.checked)
    assert any(c.startswith("per-record norm bounds") for c in report.not_checked)
    assert any("validity proofs" in c for c in report.not_checked)
    keys = state.StudyKeys(rounds.study.study_id)
    assert not rounds.leader.exists(keys.closed(1))
    assert rounds.leader.hget(keys.published, "1").isdigit()
    assert pending(rounds) == 0


@pytest.mark.parametrize("mismatch", ["count", "checksum"])
def test_servers_that_disagree_on_a_round_publish_nothing_and_count_the_refusal(
        rounds, kafka_settings, redis_settings, env_topics, mismatch):
    rng = np.random.default_rng(52)
    built = build(rounds, N, rng)
    fold_at_helper(rounds, built, 1)
    if mismatch == "count":
        close_at_leader(rounds, built, 1, count=N - 1)
    else:
        close_at_leader(rounds, built, 1, ids=[*built.ids[1:], uuid.uuid4().bytes])
    reason = f"{mismatch}_mismatch"
    before = counted("ipdp_rounds_refused_total", rounds.study, reason)
    trainer_for(kafka_settings, redis_settings, env_topics).run(idle_exit_s=1.0)
    assert counted("ipdp_rounds_refused_total", rounds.study, reason) == before + 1
    assert models_of(kafka_settings, env_topics, rounds.study) == []
    published = rounds.leader.hget(state.StudyKeys(rounds.study.study_id).published, "1")
    assert published.startswith(b"refused: ") and b"no model is published" in published
    assert pending(rounds) == 0


@pytest.mark.parametrize(("crafted", "reason"), [
    ("negative diagonal", "eigenvalue"),
    ("large diagonal", "trace"),
    ("large label", "linear_norm"),
])
def test_a_round_whose_sum_fails_a_check_publishes_nothing_and_counts_the_refusal(
        rounds, kafka_settings, redis_settings, env_topics, crafted, reason):
    """Forty devices send records no honest device can (the servers cannot tell: they see
    shares): a matrix with −B on its diagonal, +B on it, or a label of B."""
    rng = np.random.default_rng(53)
    fp = rounds.study.two_server_calibration.encoding
    value = np.zeros(fp.entries, dtype=np.int64)
    diagonal = np.cumsum([0, *range(D, 1, -1)])  # (0,0), (1,1), … in the record's order
    if crafted == "negative diagonal":
        value[diagonal] = -fp.limit
    elif crafted == "large diagonal":
        value[diagonal] = fp.limit
    else:
        value[-D] = fp.limit
    honest, bad = build(rounds, N - 40, rng), build(rounds, 40, rng, value.view(np.uint64))
    both = Built(honest.ids + bad.ids, np.concatenate([honest.values, bad.values]),
                 np.concatenate([honest.leader, bad.leader]), honest.records + bad.records)
    fold_at_helper(rounds, both, 1)
    close_at_leader(rounds, both, 1)
    before = counted("ipdp_rounds_refused_total", rounds.study, reason)
    trainer_for(kafka_settings, redis_settings, env_topics).run(idle_exit_s=1.0)
    assert counted("ipdp_rounds_refused_total", rounds.study, reason) == before + 1
    assert models_of(kafka_settings, env_topics, rounds.study) == []
    published = rounds.leader.hget(state.StudyKeys(rounds.study.study_id).published, "1")
    assert published.startswith(b"refused: ") and b"Step 15" in published


def test_a_round_the_helper_never_fills_stays_pending_and_is_published_once_it_is_full(
        rounds, kafka_settings, redis_settings, env_topics):
    rng = np.random.default_rng(54)
    built = build(rounds, N, rng)
    fold_at_helper(rounds, built, 1, slice(0, N - 1))
    close_at_leader(rounds, built, 1)
    before = counted("ipdp_rounds_deferred_total", rounds.study, "helper_not_full")
    trainer = trainer_for(kafka_settings, redis_settings, env_topics, helper_wait_s=0.3,
                          helper_retry_s=0.5)
    runner = threading.Thread(target=trainer.run)
    runner.start()
    try:
        deadline = time.monotonic() + 20
        while counted("ipdp_rounds_deferred_total", rounds.study, "helper_not_full") < before + 2:
            assert time.monotonic() < deadline, "the trainer never tried the round again"
            time.sleep(0.05)
        # Deferred twice: nothing published, nothing refused, the entry unacknowledged.
        assert models_of(kafka_settings, env_topics, rounds.study) == []
        keys = state.StudyKeys(rounds.study.study_id)
        assert rounds.leader.hget(keys.published, "1") is None
        assert rounds.leader.exists(keys.closed(1)) and pending(rounds) == 1
        fold_at_helper(rounds, built, 1, slice(N - 1, N))
        while rounds.leader.hget(keys.published, "1") is None:
            assert time.monotonic() < deadline, "the pending round was never published"
            time.sleep(0.05)
    finally:
        trainer.stop_event.set()
        runner.join(timeout=30)
    assert [m.round for m in models_of(kafka_settings, env_topics, rounds.study)] == [1]
    assert pending(rounds) == 0


def test_a_trainer_without_the_leaders_token_leaves_the_round_pending_and_says_why(
        rounds, kafka_settings, redis_settings, env_topics, caplog):
    built = build(rounds, N, np.random.default_rng(55))
    fold_at_helper(rounds, built, 1)
    close_at_leader(rounds, built, 1)
    trainer = Trainer(kafka_settings, redis_settings, env_topics,
                      TrainerSettings(block_ms=100, helper_retry_s=600), TrustSettings())
    before = counted("ipdp_rounds_deferred_total", rounds.study, "no_token")
    trainer.run(idle_exit_s=1.0)
    assert counted("ipdp_rounds_deferred_total", rounds.study, "no_token") == before + 1
    assert "IPDP_HELPER_LEADER_TOKEN is required" in caplog.text
    assert models_of(kafka_settings, env_topics, rounds.study) == [] and pending(rounds) == 1


def test_a_helper_that_does_not_answer_leaves_the_round_pending(tmp_path):
    key = generate_helper_key_files(tmp_path / "helper")
    study = Study(study_id="unreachable", d=D, n=N, epsilon=1.0, delta=0.01, two_server=TwoServer(
        helper_id="helper-1", helper_url=f"http://127.0.0.1:{free_port()}",
        helper_key=key.public_b64))
    shares = HelperShares(TOKEN, 0.3, threading.Event())
    try:
        with pytest.raises(RoundPending) as pending_round:
            shares.fetch(study, 1)
    finally:
        shares.close()
    assert pending_round.value.reason == DeferralReason.HELPER_UNREACHABLE


def test_a_model_message_without_the_two_server_fields_reads_as_one_server():
    """Messages published before the report named its servers still parse, as one-server."""
    study = Study(study_id="older", d=D, n=N, epsilon=1.0, delta=0.01)
    text = json.loads(model_value(ModelMessage(
        study_id=study.study_id, round=1, n=N, d=D, loss="squared", weights=[0.1, 0.2, 0.3],
        constraint_active=False, privacy=PrivacyReport.from_calibration(study.calibration),
        round_closed_ms=1, published_ms=2)))
    for name in ("servers", "protects", "checked", "not_checked"):
        del text["privacy"][name]
    older = parse_model_value(json.dumps(text).encode())
    assert (older.privacy.servers, older.privacy.checked) == ("one-server", None)
    assert "servers=" not in model_line(older)
