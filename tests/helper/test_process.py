"""`ipdp helper run` as an operator runs it: a real process configured by IPDP_* variables,
SIGKILLed between and during the leader's calls, restarted, and sent the same jobs again: the
round ends with each record folded once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from ipdp.embedded.children import free_port
from ipdp.fixed_point import combine, fold
from ipdp.helper_client import HelperClient
from ipdp.study import StudyStatus, study_message
from tests.helper.conftest import TOKEN, make_study
from tests.helper.devices import make_records


class HelperProcess:
    """`python -m ipdp.cli helper run` on a fixed port, started and killed at will: SIGKILL goes
    to its process group (granian's main process and its worker), as a container's end does."""

    def __init__(self, env: dict[str, str], port: int, log_path) -> None:
        self.env, self.port, self.log_path = env, port, log_path
        self.proc: subprocess.Popen | None = None
        self.kills = 0

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ipdp.cli", "helper", "run", "--port", str(self.port)],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_up(self) -> None:
        with HelperClient(f"http://127.0.0.1:{self.port}", TOKEN, retry_s=60) as client:
            assert client.request("GET", "/healthz")[0] == 200, self.log_path.read_text()

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.kills += 1


@pytest.fixture
def helper_env(fresh_redis, helper_key_file, owner, tmp_path) -> dict[str, str]:
    key_file, _ = helper_key_file
    return {**os.environ, "IPDP_HELPER_HOST": "127.0.0.1",
            "IPDP_HELPER_REDIS_URL": fresh_redis.settings().url,
            "IPDP_HELPER_KEY_FILE": key_file, "IPDP_HELPER_LEADER_TOKEN": TOKEN,
            "IPDP_TRUSTED_STUDY_KEYS": owner.public_b64}


def test_sigkill_between_and_during_calls_folds_each_record_once(helper_env, helper_key_file,
                                                                 owner, tmp_path):
    _, key = helper_key_file
    study = make_study(study_id="killed")
    value = study_message(study, StudyStatus.OPEN, owner)
    rng = np.random.default_rng(4)
    jobs = {f"p0:e1:{i}": make_records(study, key.public, 25, rng) for i in range(4)}
    helper = HelperProcess(helper_env, free_port(), tmp_path / "helper.log")
    helper.start()
    helper.wait_up()
    client = HelperClient(f"http://127.0.0.1:{helper.port}", TOKEN, retry_s=60)
    try:
        answers = {}
        for i, (job_id, batch) in enumerate(jobs.items()):
            answers[job_id] = client.prepare(job_id, value, batch.records, study.d)
            if i % 2 == 0:  # killed between prepare and commit, restarted, the job resent
                helper.kill()
                helper.start()
                again = client.prepare(job_id, value, batch.records, study.d)
                assert again.mask.tolist() == answers[job_id].mask.tolist() == [True] * 25
            # Killed 0–50 ms into a commit (before, during or after it applies): the leader
            # resends it to the restarted helper, which has applied it wholly or not at all.
            killer = threading.Timer(rng.uniform(0, 0.05), helper.kill)
            killer.start()
            try:
                client.commit(job_id, {0: batch.ids})
            except OSError:
                pass
            killer.join()
            if helper.proc.poll() is not None:
                helper.start()
            restarter = None
            if i == 3:  # the helper is down when the leader calls: the client waits for it
                helper.kill()
                restarter = threading.Timer(1.0, helper.start)
                restarter.start()
            first = client.commit(job_id, {0: batch.ids})
            if restarter:
                restarter.join()
            assert client.commit(job_id, {0: batch.ids}) == first
        for job_id, batch in jobs.items():  # a leader that replays everything after a crash
            assert client.prepare(job_id, value, batch.records, study.d).mask.all()
            client.commit(job_id, {0: batch.ids})
        share = client.round_share(study.study_id, 0)
    finally:
        client.close()
        if helper.proc.poll() is None:
            helper.proc.send_signal(signal.SIGTERM)
            assert helper.proc.wait(timeout=30) == 0, helper.log_path.read_text()
    assert helper.kills == 7  # two between prepare and commit, four around a commit, one idle
    assert share is not None and share.count == study.n
    values = np.concatenate([b.values for b in jobs.values()])
    leader = np.concatenate([b.leader for b in jobs.values()])
    assert np.array_equal(combine(fold(leader), share.sum), fold(values))


def _run_helper(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ipdp.cli", "helper", "run", "--port",
                           str(free_port())], env=env, capture_output=True, text=True,
                          timeout=60, check=False)


def test_ipdp_helper_run_says_what_it_is_missing(helper_env):
    done = _run_helper({k: v for k, v in helper_env.items()
                        if k != "IPDP_HELPER_LEADER_TOKEN"})
    assert done.returncode == 2
    assert "IPDP_HELPER_LEADER_TOKEN (or _FILE) is required" in done.stderr
    done = _run_helper({**helper_env, "IPDP_TRUSTED_STUDY_KEYS": ""})
    assert done.returncode == 2
    assert "IPDP_TRUSTED_STUDY_KEYS is required" in done.stderr


def test_ipdp_helper_run_refuses_the_leaders_redis(helper_env, fresh_redis):
    import redis

    from ipdp.state import STUDY_HASHES

    redis.Redis.from_url(fresh_redis.settings().url).hset(STUDY_HASHES, b"h" * 16, b"s1")
    done = _run_helper(helper_env)
    assert done.returncode == 2
    assert "points at a leader's Redis" in done.stderr


def test_ipdp_helper_run_reads_its_secrets_from_files_and_its_own_redis_password(
        helper_env, fresh_redis, tmp_path):
    """As compose/helper runs it: the token from a secret file (its trailing newline dropped),
    the helper's Redis behind a password given as IPDP_HELPER_REDIS_PASSWORD, and the leader's
    IPDP_REDIS_* never read."""
    import redis

    redis.Redis.from_url(fresh_redis.settings().url).config_set("requirepass", "helper-redis")
    token_file = tmp_path / "leader-token"
    token_file.write_text(TOKEN + "\n")
    env = {k: v for k, v in helper_env.items() if k != "IPDP_HELPER_LEADER_TOKEN"}
    env.update(IPDP_HELPER_LEADER_TOKEN_FILE=str(token_file),
               IPDP_HELPER_REDIS_PASSWORD="helper-redis", IPDP_REDIS_PASSWORD="the-leaders",
               IPDP_REDIS_USERNAME="the-leaders")
    helper = HelperProcess(env, free_port(), tmp_path / "helper.log")
    helper.start()
    try:
        helper.wait_up()
        with HelperClient(f"http://127.0.0.1:{helper.port}", TOKEN, retry_s=10) as client:
            status, answer = client.request("GET", "/studies/two-server/rounds/0")
        assert (status, answer["error"]) == (409, "round_not_full"), answer
    finally:
        helper.kill()
    both = _run_helper({**env, "IPDP_HELPER_LEADER_TOKEN": TOKEN})
    assert both.returncode == 2
    assert TOKEN not in both.stderr
    assert "IPDP_HELPER_LEADER_TOKEN and IPDP_HELPER_LEADER_TOKEN_FILE are both set" in \
        both.stderr
    missing = _run_helper({**env, "IPDP_HELPER_LEADER_TOKEN_FILE": str(tmp_path / "none")})
    assert missing.returncode == 2
    assert f"IPDP_HELPER_LEADER_TOKEN_FILE={tmp_path / 'none'} cannot be read" in missing.stderr
    wrong = _run_helper({**env, "IPDP_HELPER_REDIS_PASSWORD": "the-leaders"})
    assert wrong.returncode != 0
