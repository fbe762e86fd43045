"""A two-server study that requires device credentials, with a real helper over its own
redis-server and the leader's Redis: the helper checks each record's credential against its own
pinned issuer keys and counts each credential's slots at commit, whatever the leader decided
(docs/security.md, "Device credentials")."""

from __future__ import annotations

import os
import time
import uuid

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from aggregator.batch import Polled
from aggregator.fold import Folder
from helper.store import seen_key, slots_key
from ipdp import state
from ipdp.credentials import (
    credential_id,
    credentials_header,
    issue_batch,
    issue_credential,
    slot_id,
    token_text,
)
from ipdp.helper_client import HelperClient, HelperRefused
from ipdp.redis_io import redis_client
from ipdp.signing import SigningKey, TrustedKeys
from ipdp.study import Study, StudyStatus, study_message
from ipdp.wire import RejectReason
from tests.aggregator.test_two_server_fold import (  # noqa: F401
    N,
    _close_links,
    _without,
    assert_rounds_agree,
    link,
)
from tests.helper.conftest import TOKEN, helper_key_file, owner, running_helper  # noqa: F401
from tests.helper.devices import make_records

#: The helper's record window in the slot-count test: short, so that its replay set forgets an
#: id within the test while the id's credential is still valid.
WINDOW_S = 6


def slots_members(fresh_redis, study_id: str) -> list[bytes]:
    """The slots the helper's Redis counts as used for the study."""
    return redis_client(fresh_redis.settings()).zrange(slots_key(study_id), 0, -1)


def _key() -> SigningKey:
    return SigningKey(Ed25519PrivateKey.generate())


@pytest.fixture
def issuers() -> tuple[SigningKey, SigningKey]:
    """The issuer both servers pin, and one only the leader pins."""
    return _key(), _key()


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def _helper(fresh_redis, helper_key_file, owner, monkeypatch, issuer,  # noqa: F811
            **settings):
    key_file, key = helper_key_file
    monkeypatch.setenv("IPDP_TRUSTED_CREDENTIAL_KEYS", issuer.public_b64)
    return key, running_helper(fresh_redis.settings().url, key_file, owner, monkeypatch,
                               **settings)


def _study(url: str, public_b64: str, records_per_device: int) -> Study:
    return Study(study_id=f"two-{uuid.uuid4().hex[:6]}", d=3, n=N, epsilon=1.0, delta=0.01,
                 require_credentials=True, records_per_device=records_per_device,
                 two_server={"helper_id": "helper-a", "helper_url": url,
                             "helper_key": public_b64})


def test_valid_credentials_fold_and_one_only_the_leader_pins_is_refused_by_the_helper(
        redis_settings, fresh_redis, helper_key_file, owner, issuers,  # noqa: F811
        monkeypatch):
    issuer, leader_only = issuers
    key, serving = _helper(fresh_redis, helper_key_file, owner, monkeypatch, issuer)
    with serving as url:
        class Helper:
            def round(self, study, round_no):
                with HelperClient(url, TOKEN, retry_s=5) as client:
                    return client.round_share(study.study_id, round_no)

        study = _study(url, key.public_b64, records_per_device=2)
        state.register_study(redis_client(redis_settings), study, owner)
        t = now_ms()
        # 50 devices of one batch (version 2), two slots each; then one device whose credential
        # (version 1) only the leader's issuer keys verify, at rows 10 and 11.
        tokens = [tok for tok in issue_batch(issuer, study.hash, t, t + 600_000, N // 2)
                  for _ in range(2)]
        stranger = issue_credential(leader_only, study.hash, t, t + 600_000)
        tokens[10:10] = [stranger, stranger]
        ids = [slot_id(credential_id(tok), s % 2) for s, tok in enumerate(tokens)]
        ids[10:12] = [slot_id(credential_id(stranger), s) for s in range(2)]
        batch = make_records(study, key.public, N + 2, np.random.default_rng(3), record_ids=ids)
        polled = Polled(np.zeros(N + 2, np.int64), np.arange(N + 2, dtype=np.int64),
                        batch.records, headers=[[credentials_header([(tok, 1)])]
                                                for tok in tokens])
        folder = Folder(redis_client(redis_settings), group="g-two", topic="t",
                        replay_window_s=3600, max_future_skew_s=60, max_message_bytes=1 << 20,
                        credential_keys=TrustedKeys([issuer.private.public_key(),
                                                     leader_only.private.public_key()]),
                        helpers=link(retry_s=5.0))
        result = folder.fold(polled)

        assert result.folded == {study.study_id: N}
        assert [(x.reason, x.detail, x.message.offset) for x in result.rejected] == [
            (RejectReason.HELPER_REFUSED, "credential_untrusted", 10),
            (RejectReason.HELPER_REFUSED, "credential_untrusted", 11)]
        assert_rounds_agree(redis_settings, Helper(), study, 1,
                            _without(_without(batch, 10), 10))
        # Both sides' round 1 is full; neither holds the refused records.
        assert int(redis_client(redis_settings).hget(
            state.StudyKeys(study.study_id).open, "count")) == 0
        assert sorted(slots_members(fresh_redis, study.study_id)) == sorted(
            ids[:10] + ids[12:])


def test_a_credential_cannot_exceed_its_slots_at_the_helper_whatever_the_leader_sends(
        fresh_redis, helper_key_file, owner, issuers, monkeypatch):  # noqa: F811
    issuer, stranger = issuers
    key, serving = _helper(fresh_redis, helper_key_file, owner, monkeypatch, issuer,
                           replay_window_s=WINDOW_S, max_future_skew_s=0)
    with serving as url, HelperClient(url, TOKEN, retry_s=5) as leader:
        study = _study(url, key.public_b64, records_per_device=1)
        value = study_message(study, StudyStatus.OPEN, owner)
        rng = np.random.default_rng(4)
        t = now_ms()
        # Valid for the whole window (the longest the helper accepts), so its slot outlives
        # the replay set's memory of a record created early in the window.
        device, other, third = (issue_credential(issuer, study.hash, t - 1000,
                                                 t + WINDOW_S * 1000 - 1000) for _ in range(3))
        slot = slot_id(credential_id(device), 0)

        def job(records: list[bytes], tokens: list[bytes | None]):
            job_id = uuid.uuid4().hex
            return job_id, leader.prepare(job_id, value, records, study.d, tokens)

        first = make_records(study, key.public, 1, rng, created_ms=t - 5000, record_ids=[slot])
        job_id, prepared = job(first.records, [device])
        assert prepared.mask.tolist() == [True] and prepared.refused == {}
        leader.commit(job_id, {1: [slot]})

        # The same slot again, a record of another id, none, a stranger's and a garbled one.
        again = make_records(study, key.public, 5, rng,
                             record_ids=[slot, os.urandom(16), *(slot_id(os.urandom(16), 0)
                                                          for _ in range(3))])
        _, prepared = job(again.records, [device, device, None,
                                          issue_credential(stranger, study.hash, t, t + 1000),
                                          device[:-1]])
        assert prepared.mask.tolist() == [False] * 5
        assert prepared.refused == {0: "credential_reused", 1: "credential_bad_slot",
                                    2: "credential_missing", 3: "credential_untrusted",
                                    4: "credential_invalid"}

        # Once the record window has passed the first record's creation time, the helper's
        # replay set forgets its id at the next commit; its slot is still counted.
        time.sleep(max(0.0, (t + 1100 - now_ms()) / 1000))
        other_record = make_records(study, key.public, 1, rng,
                                    record_ids=[slot_id(credential_id(other), 0)])
        job_id, prepared = job(other_record.records, [other])
        leader.commit(job_id, {1: [slot_id(credential_id(other), 0)]})
        r = redis_client(fresh_redis.settings())
        assert r.zscore(seen_key(study.study_id), slot) is None
        late = make_records(study, key.public, 1, rng, record_ids=[slot])
        _, prepared = job(late.records, [device])
        assert prepared.refused == {0: "credential_reused"}

        # Two jobs prepared with one slot before either commits: the second commit is refused.
        third_slot = slot_id(credential_id(third), 0)
        twice = [job(make_records(study, key.public, 1, rng, record_ids=[third_slot]).records,
                     [third]) for _ in range(2)]
        assert [p.mask.tolist() for _, p in twice] == [[True], [True]]
        leader.commit(twice[0][0], {1: [third_slot]})
        with pytest.raises(HelperRefused) as refused:
            leader.commit(twice[1][0], {1: [third_slot]})
        assert (refused.value.status, refused.value.reason) == (409, "credential_reused")
        assert sorted(slots_members(fresh_redis, study.study_id)) == sorted(
            [slot, slot_id(credential_id(other), 0), third_slot])

        # One credential per record, or none at all.
        status, answer = leader.request("PUT", "/jobs/mismatch", {
            "study": value.decode(), "records": ["AAAA", "AAAA"],
            "credentials": [token_text(device)]})
        assert (status, answer["error"]) == (400, "bad_request")
