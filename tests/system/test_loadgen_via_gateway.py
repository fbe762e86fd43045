"""`ipdp loadgen --via URL` against a gateway with its default limits, every role a process.

The gateway's per-address limits are on (its defaults), so 300 simulated devices sharing one
address are refused with 429 many times over: the load generator must send each refused record
again after the gateway's Retry-After, until every one is accepted and the round closes. One
record per request meets the request limit first; five per request (a batch uploader) the
record limit.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from gateway.settings import GatewaySettings
from ipdp.embedded import free_port
from ipdp.subscriber import ModelSubscriber
from producer.gateway_client import GatewayClient
from tests import proc_services as ps
from tests.pipeline import create, wait_for

DEVICES = 300


@pytest.mark.parametrize("per_request", [1, 5])
def test_loadgen_via_a_default_gateway_gets_every_record_accepted_and_the_round_closed(
        runtime, kafka_settings, redis_settings, topics, tmp_path, per_request):
    defaults = GatewaySettings()
    assert defaults.rate_limit_per_s > 0, "the gateway's default has a per-address rate limit"
    study = create(kafka_settings, redis_settings, topics, study_id=f"lg-429-{per_request}", d=4,
                   n=DEVICES, epsilon=1.0, delta=0.01)
    port = free_port()
    env = ps.service_env(runtime, topics, IPDP_GATEWAY_PORT=str(port))
    gateway = ps.start(["gateway"], env, tmp_path, "gateway")
    url = f"http://127.0.0.1:{port}"
    try:
        with ps.pipeline(runtime, topics, tmp_path, group=f"agg-{topics.records}"):
            with GatewayClient(url, timeout_s=5) as client:
                client.wait_ready(60, alive=lambda: gateway.proc.poll() is None)
            run = subprocess.run(
                [sys.executable, "-m", "ipdp.cli", "loadgen", "--via", url, "--study",
                 study.study_id, "--devices", str(DEVICES), "--per-request", str(per_request),
                 "--seed", "5", "--no-progress"],
                check=False, cwd=ps.REPO, env=env, capture_output=True, text=True, timeout=600)
            assert run.returncode == 0, run.stdout + run.stderr
            assert f"records sent  {DEVICES}\n" in run.stdout
            assert "errors        0\n" in run.stdout
            retried = re.search(r"^retried +(\d+) request", run.stdout, re.MULTILINE)
            assert retried and int(retried.group(1)) > 0, run.stdout
            # The limit was met: the gateway refused some requests, and each was sent again.
            refused = ps.value(ps.scrape(f"{url}/metrics"), "ipdp_gateway_refusals_total",
                               reason="rate_limited")
            assert refused > 0, "the gateway never refused: the test did not meet its limit"

            def models():
                return list(ModelSubscriber(kafka_settings, topics, study_id=study.study_id,
                                            from_beginning=True))

            wait_for(lambda: len(models()) >= 1, 120, "the round's model")
            assert [(m.round, m.n) for m in models()] == [(1, DEVICES)]
    finally:
        ps.stop(gateway)
