"""A real helper (its app on granian's embeddable server, on a free loopback port, in a thread)
over a private redis-server; tests/helper/test_process.py runs `ipdp helper run` itself."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from helper.app import create_app
from helper.service import load_service
from helper.settings import HelperSettings
from ipdp.embedded.children import free_port
from ipdp.helper_client import HelperClient
from ipdp.sealing import HelperKey
from ipdp.signing import SigningKey
from ipdp.study import Study, StudyStatus, study_message
from tests.granian_thread import served

TOKEN = "leader-token-for-tests"


@dataclass
class HelperRig:
    """A running helper and what a test needs around it."""

    url: str
    redis_url: str
    key: HelperKey
    owner: SigningKey
    study: Study

    def study_value(self, status: StudyStatus = StudyStatus.OPEN, study: Study | None = None,
                    signed: bool = True) -> bytes:
        return study_message(study or self.study, status, self.owner if signed else None)

    def client(self, token: str = TOKEN, **kw) -> HelperClient:
        return HelperClient(self.url, token, **kw)


def make_study(**kw) -> Study:
    """A small study the calibration accepts (paper mode needs n ≥ 16·log(8/δ))."""
    return Study(**{"study_id": "two-server", "d": 3, "n": 100, "epsilon": 1.0, "delta": 0.1,
                    "mode": "paper", **kw})


@contextmanager
def running_helper(redis_url: str, key_file: str, owner: SigningKey, monkeypatch,
                   port: int | None = None, **settings) -> Iterator[str]:
    """Serve the helper on 127.0.0.1 (on ``port``, a free one if None) until the block ends;
    yields its base URL."""
    monkeypatch.setenv("IPDP_TRUSTED_STUDY_KEYS", owner.public_b64)
    hs = HelperSettings(host="127.0.0.1", port=port or free_port(), redis_url=redis_url,
                        key_file=key_file, leader_token=TOKEN, **settings)
    with served(create_app(*load_service(hs)), hs.host, hs.port) as url:
        with HelperClient(url, TOKEN, retry_s=30) as client:
            client.request("GET", "/healthz")
        yield url


@pytest.fixture
def helper_key_file(tmp_path) -> tuple[str, HelperKey]:
    from ipdp.sealing import generate_helper_key_files

    key = generate_helper_key_files(tmp_path / "helper")
    return str(tmp_path / "helper.key"), key


@pytest.fixture
def owner() -> SigningKey:
    return SigningKey(Ed25519PrivateKey.generate())


@pytest.fixture
def rig(fresh_redis, helper_key_file, owner, monkeypatch) -> Iterator[HelperRig]:
    key_file, key = helper_key_file
    url = fresh_redis.settings().url
    with running_helper(url, key_file, owner, monkeypatch) as base:
        yield HelperRig(base, url, key, owner, make_study())

