"""compose's TLS proxy, run by Debian's nginx with the shipped configuration, in front of a real
gateway: TLS, the forwarded client address, the rate limit per device, a spoofed header refused,
and no /metrics on the public port.

compose/nginx/ipdp.conf is used as shipped but for the upstream (compose's `gateway:8080` → the
test's gateway), the listen address and the certificate's paths (bench/edge.py); the certificate
is self-signed. Each device is a loopback address of its own (127.0.0.x); nginx reaches the gateway
from 127.0.0.1, the one trusted proxy.
"""

from __future__ import annotations

import http.client
import re
import ssl

from bench.edge import Edge
from tests.gateway.conftest import running_gateway
from tests.gateway.test_gateway import known, records
from tests.pipeline import create
from tests.tooling import require_tool

PROXY = "127.0.0.1"
#: Requests each device may send at once; then one every 10 s (none within this test).
BURST = 3


def request(port: int, method: str, path: str, body: bytes | None = None, *, device: str,
            tls: ssl.SSLContext | None, headers: dict[str, str] | None = None,
            ) -> tuple[int, bytes]:
    """One request from the loopback address ``device``: (status, body)."""
    cls = http.client.HTTPSConnection if tls else http.client.HTTPConnection
    kwargs = {"context": tls} if tls else {}
    conn = cls(PROXY, port, timeout=15, source_address=(device, 0), **kwargs)
    try:
        conn.request(method, path, body=body, headers={
            "Content-Type": "application/octet-stream", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_the_shipped_proxy_terminates_tls_and_forwards_each_devices_address_only(
        kafka_settings, redis_settings, topics, tmp_path):
    require_tool("nginx", "tests/system/test_proxy.py (compose's TLS proxy)")
    study = create(kafka_settings, redis_settings, topics, study_id="proxy", d=3, n=1000,
                   epsilon=1.0, delta=0.01)
    path = f"/studies/{study.study_id}/records"
    with running_gateway(kafka_settings, topics, rate_limit_per_s=0.1, rate_limit_burst=BURST,
                         trusted_proxies=PROXY) as url:
        known(url, study.study_id)
        gateway_port = int(url.rsplit(":", 1)[1])
        with Edge((PROXY, gateway_port), tmp_path, address=PROXY) as edge:
            port, tls = edge.port, edge.tls()
            assert request(port, "GET", "/healthz", device="127.0.0.2", tls=tls)[0] == 200
            # TLS only: plain HTTP on the TLS port is refused by nginx.
            status, _ = request(port, "GET", "/healthz", device="127.0.0.2", tls=None)
            assert status == 400

            # Device A spends its burst; each further request is refused, whatever address it
            # claims: nginx replaces the header it sent.
            a = [request(port, "POST", path, r, device="127.0.0.3", tls=tls)[0]
                 for r in records(study, BURST)]
            assert a == [202] * BURST
            for i, r in enumerate(records(study, 3, seed=1)):
                status, body = request(port, "POST", path, r, device="127.0.0.3", tls=tls,
                                       headers={"X-Forwarded-For": f"10.9.9.{i}"})
                assert status == 429 and b"rate_limited" in body

            # Device B, through the same proxy, has an allowance of its own: the gateway keys
            # on the forwarded address, not on the proxy's.
            b = [request(port, "POST", path, r, device="127.0.0.4", tls=tls)[0]
                 for r in records(study, BURST, seed=2)]
            assert b == [202] * BURST

            # Straight to the gateway, a peer that is not the proxy is not believed either: its
            # spoofed headers all count against its own address.
            direct = [request(gateway_port, "POST", path, r, device="127.0.0.5", tls=None,
                              headers={"X-Forwarded-For": f"10.8.8.{i}"})[0]
                      for i, r in enumerate(records(study, BURST + 2, seed=3))]
            assert direct == [202] * BURST + [429, 429]

            # /metrics is not on the public port; the gateway still serves it to Prometheus.
            status, _ = request(port, "GET", "/metrics", device="127.0.0.2", tls=tls)
            assert status == 403
            for spelled in ("/metrics/", "//metrics", "/%6detrics", "/metrics?format=text"):
                assert request(port, "GET", spelled, device="127.0.0.2", tls=tls)[0] == 403
            status, text = request(gateway_port, "GET", "/metrics", device="127.0.0.2",
                                   tls=None)
            assert status == 200
            refused = re.search(rb'^ipdp_gateway_refusals_total\{reason="rate_limited"\} (\S+)$',
                                text, re.MULTILINE)
            assert refused and float(refused[1]) >= 5
