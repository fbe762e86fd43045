"""The helper behind its shipped TLS edge: compose/helper/nginx/helper.conf on Debian's nginx
(bench/edge.py) in front of a real helper and its redis-server, reached by the leader's client
over https:// with the CA it is given (IPDP_HELPER_CA_FILE). A job is prepared and committed and
its round read through the edge; a certificate the leader cannot verify stops its aggregator
and leaves its trainer's round pending."""

from __future__ import annotations

import ssl
import threading
import time
from urllib.parse import urlsplit

import numpy as np
import pytest

from aggregator.two_server import HelperLink
from bench.edge import HELPER_NGINX_CONF, Edge, self_signed
from helper.store import id_checksum
from ipdp.embedded.children import free_port
from ipdp.errors import ConfigurationError
from ipdp.fixed_point import combine, fold
from ipdp.helper_client import HelperClient, HelperRefused
from ipdp.study import Study
from tests.helper.conftest import TOKEN, running_helper
from tests.helper.devices import make_records
from tests.tooling import require_tool
from trainer.errors import DeferralReason, RoundPending
from trainer.two_server import HelperShares


@pytest.fixture
def edge(rig, tmp_path):
    require_tool("nginx", "running the helper's shipped TLS edge")
    url = urlsplit(rig.url)
    with Edge((url.hostname, url.port), tmp_path / "edge", shipped=HELPER_NGINX_CONF) as running:
        yield running


def test_a_round_is_prepared_committed_and_read_through_the_helpers_tls_edge(rig, edge):
    study = rig.study
    batch = make_records(study, rig.key.public, study.n, np.random.default_rng(41))
    with HelperClient(edge.url, TOKEN, ca_file=str(edge.cert), retry_s=5) as client:
        prepared = client.prepare("tls-job", rig.study_value(), batch.records, study.d)
        assert prepared.mask.all() and prepared.refused == {}
        client.commit("tls-job", {0: batch.ids})
        share = client.round_share(study.study_id, 0)
        # The edge keeps the helper's metrics to the helper's own network, token or not.
        assert client.request("GET", "/metrics")[0] == 403
    assert share is not None and share.count == study.n
    assert share.checksum == id_checksum(batch.ids)
    assert np.array_equal(combine(fold(batch.leader), share.sum), fold(batch.values))
    with HelperClient(edge.url, "not-the-token", ca_file=str(edge.cert), retry_s=5) as wrong, \
            pytest.raises(HelperRefused) as refused:
        wrong.round_share(study.study_id, 0)
    assert refused.value.status == 401


def test_a_helper_certificate_the_leader_cannot_verify_is_refused_and_stops_the_aggregator(rig, edge, tmp_path):
    other_ca, _ = self_signed(tmp_path, "127.0.0.1")  # the right name, another issuer
    for ca_file in (None, str(other_ca)):  # the system's trust store, or the wrong CA
        with HelperClient(edge.url, TOKEN, ca_file=ca_file, retry_s=60) as client, \
                pytest.raises(ssl.SSLCertVerificationError):
            client.request("GET", "/healthz")
    study = Study(study_id="two-tls", d=3, n=100, epsilon=1.0, delta=0.01,
                  two_server={"helper_id": "helper-a", "helper_url": edge.url,
                              "helper_key": rig.key.public_b64})
    link = HelperLink(TOKEN, ca_file=str(other_ca), retry_s=60)
    try:
        with pytest.raises(ConfigurationError, match="IPDP_HELPER_CA_FILE"):
            link.prepare(study, "tls-job", rig.study_value(study=study),
                         make_records(study, rig.key.public, 1, np.random.default_rng(5)).records)
    finally:
        link.close()
    # The trainer leaves the round pending, saying why.
    shares = HelperShares(TOKEN, 60.0, threading.Event(), ca_file=str(other_ca))
    try:
        with pytest.raises(RoundPending, match="IPDP_HELPER_CA_FILE") as pending:
            shares.fetch(study, 0)
        assert pending.value.reason == DeferralReason.HELPER_ERROR
    finally:
        shares.close()


def test_the_leader_sends_again_while_the_edge_answers_502_for_a_helper_not_up(
        fresh_redis, helper_key_file, owner, monkeypatch, tmp_path):
    """The edge answers 502 (an HTML page) while nothing listens behind it, as while the helper
    restarts: the client sends the request again, and is answered once the helper is up."""
    require_tool("nginx", "running the helper's shipped TLS edge")
    port = free_port()
    with Edge(("127.0.0.1", port), tmp_path / "edge", shipped=HELPER_NGINX_CONF) as edge:
        with HelperClient(edge.url, TOKEN, ca_file=str(edge.cert), retry_s=0.2) as client:
            assert client.request("GET", "/healthz") == (502, {
                "error": "http_502", "detail": "an answer that is not the helper's JSON "
                "(text/html), from the helper's edge or another server at its address"})
        answers: list[tuple[int, dict]] = []
        waiting = HelperClient(edge.url, TOKEN, ca_file=str(edge.cert), retry_s=60)
        refused = edge.error_log().count("Connection refused")
        thread = threading.Thread(
            target=lambda: answers.append(waiting.request("GET", "/studies/s/rounds/0")))
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while edge.error_log().count("Connection refused") < refused + 2:  # two 502s
                assert time.monotonic() < deadline and not answers, edge.error_log()
                time.sleep(0.05)
            with running_helper(fresh_redis.settings().url, helper_key_file[0], owner,
                                monkeypatch, port=port):
                thread.join(timeout=60)
        finally:
            waiting.close()
    assert answers and answers[0][0] == 409, answers  # the helper's round_not_full
