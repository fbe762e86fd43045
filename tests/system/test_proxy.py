"""compose's TLS proxy, run by Debian's nginx with the shipped configuration, in front of a real
gateway: TLS, the forwarded client address, the rate limit per device, a spoofed header refused,
and no /metrics on the public port.

compose/nginx/ipdp.conf is used as shipped but for the upstream (compose's `gateway:8080` → the
test's gateway), the listen address and the certificate's paths (bench/edge.py); the certificate
is self-signed. Each device is a loopback address of its own (127.0.0.x); nginx reaches the gateway
from 127.0.0.1, the one trusted proxy.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import pwd
import re
import ssl
import subprocess

from bench.edge import NGINX_CONF, Edge, self_signed, shipped_config
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


#: The shipped caps (compose/nginx/ipdp.conf): requests in progress per address and per prefix.
PER_ADDRESS, PER_PREFIX = 256, 1024


async def _stall(edge: Edge, source: str, real_ip: str | None) -> tuple:
    """A POST whose head is sent and whose body never comes, from ``source`` (through the
    edge's realip, as ``real_ip`` when given): the open streams."""
    reader, writer = await asyncio.open_connection(
        edge.address, edge.port, ssl=edge.tls(), server_hostname=edge.address,
        local_addr=(source, 0))
    claimed = f"X-Real-IP: {real_ip}\r\n" if real_ip else ""
    writer.write(f"POST /studies/s/records HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
                 f"Content-Type: application/octet-stream\r\n{claimed}\r\n".encode() + b"\0" * 10)
    await writer.drain()
    return reader, writer


async def _status(reader: asyncio.StreamReader, timeout_s: float) -> bytes | None:
    """The status line's code if an answer came within ``timeout_s``."""
    try:
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    except TimeoutError:
        return None
    return line.split()[1] if line.startswith(b"HTTP/") else line


async def _caps(edge: Edge, clients: dict[str, str], *, named: bool) -> None:
    """Fill address a1 to its cap, and a1–a4's prefix to its cap; then a5 (and ``mapped``),
    in that prefix, is refused and ``other``, in another, is not. ``named``: the clients are
    named by X-Real-IP, else they are the connections' source addresses."""
    held: list = []

    async def hold(name: str, count: int) -> list:
        where = (PROXY, clients[name]) if named else (clients[name], None)
        opened = await asyncio.gather(*(_stall(edge, *where) for _ in range(count)))
        held.extend(opened)
        await asyncio.sleep(0.3)  # every head read before the next connection's
        return opened

    try:
        first = await hold("a1", PER_ADDRESS)
        answers = await asyncio.gather(*(_status(r, 0.5) for r, _ in first))
        assert answers == [None] * PER_ADDRESS, "a stalled body was answered"
        (over,) = await hold("a1", 1)
        assert await _status(over[0], 5) == b"429", "the address's cap"
        for name in ("a2", "a3", "a4"):
            await hold(name, PER_ADDRESS)
        for name in ("a5", "mapped"):
            if name not in clients:
                continue
            (refused,) = await hold(name, 1)
            assert await _status(refused[0], 5) == b"429", f"the prefix's cap ({name})"
        (other,) = await hold("other", 1)
        assert await _status(other[0], 0.5) is None, "another prefix is not capped"
    finally:
        for _, writer in held:
            writer.close()


async def _address_cap(edge: Edge, address: str) -> None:
    """PER_ADDRESS stalled bodies from ``address`` are held, the next is refused 429."""
    held = await asyncio.gather(*(_stall(edge, address, None) for _ in range(PER_ADDRESS)))
    try:
        await asyncio.sleep(0.3)
        answers = await asyncio.gather(*(_status(r, 0.5) for r, _ in held))
        assert answers == [None] * PER_ADDRESS, "a stalled body was answered"
        over = await _stall(edge, address, None)
        held.append(over)
        assert await _status(over[0], 5) == b"429", "the address's cap"
    finally:
        for _, writer in held:
            writer.close()


def test_the_shipped_edge_caps_requests_in_progress_per_address_and_per_ipv4_24_and_ipv6_64(
        kafka_settings, topics, tmp_path):
    """256 stalled bodies from one address, a 257th refused 429; 1024 from one /24 (or /64), the
    next from a fifth address of it refused while another prefix is served. IPv6 clients are
    named to the edge by X-Real-IP from 127.0.0.1 (nginx's realip, added to this test's edge
    only): loopback has one IPv6 address."""
    require_tool("nginx", "tests/system/test_proxy.py (the edge's caps)")
    ipv4 = {"a1": "127.0.5.1", "a2": "127.0.5.2", "a3": "127.0.5.3", "a4": "127.0.5.4",
            "a5": "127.0.5.5", "other": "127.0.6.1"}
    ipv6 = {"a1": "2001:db8:0:1::1", "a2": "2001:db8:0:1:ffff::2", "a3": "2001:db8:0:1::3",
            "a4": "2001:db8:0:1::4", "a5": "2001:db8:0:1::5", "other": "2001:db8:0:2::1"}
    # An IPv4-mapped IPv6 address counts in its IPv4 /24.
    mapped = {"a1": "::ffff:127.0.7.1", "a2": "127.0.7.2", "a3": "::ffff:127.0.7.3",
              "a4": "127.0.7.4", "mapped": "::ffff:127.0.7.5", "other": "::ffff:127.0.9.1"}
    with running_gateway(kafka_settings, topics, trusted_proxies=PROXY) as url, \
            Edge((PROXY, int(url.rsplit(":", 1)[1])), tmp_path, address=PROXY,
                 worker_connections=4096,
                 extra=f"set_real_ip_from {PROXY};\nreal_ip_header X-Real-IP;\n") as edge:
        asyncio.run(_caps(edge, ipv4, named=False))
        asyncio.run(_caps(edge, ipv6, named=True))
        asyncio.run(_caps(edge, mapped, named=True))
    # A client on a real IPv6 socket (loopback's one address, so the address's cap only).
    with running_gateway(kafka_settings, topics, trusted_proxies=PROXY) as url, \
            Edge((PROXY, int(url.rsplit(":", 1)[1])), tmp_path / "v6", address="::1") as edge:
        asyncio.run(_address_cap(edge, "::1"))


def test_composes_main_nginx_file_holds_the_flood_and_loads_the_shipped_server_block(tmp_path):
    """compose/nginx/nginx.conf, with its user, pid and log paths moved into this test's
    directory, passes `nginx -t` with the shipped server block, and gives each worker room for
    the benchmark's flood and the device connections beside it."""
    binary = require_tool("nginx", "tests/system/test_proxy.py (compose's main nginx file)")
    main = (NGINX_CONF.parent / "nginx.conf").read_text()
    workers = re.search(r"^\s*worker_connections\s+(\d+);", main, re.MULTILINE)
    assert workers and int(workers[1]) >= 2 * 16 * 256, "the flood and the devices beside it"
    assert "/etc/nginx/nginx.conf" in (NGINX_CONF.parents[1] / "docker-compose.yml").read_text()
    cert, key = self_signed(tmp_path, PROXY)
    temp = " ".join(f"{kind}_temp_path {tmp_path / kind};"
                    for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    (tmp_path / "ipdp.conf").write_text(
        shipped_config((PROXY, 8080), (PROXY, 8443), cert, key) + temp + "\n")
    user = f"user {pwd.getpwuid(os.geteuid()).pw_name};" if os.geteuid() == 0 else ""
    for old, new in (("user  nginx;", user),
                     ("/var/log/nginx/error.log", str(tmp_path / "error.log")),
                     ("/var/log/nginx/access.log", str(tmp_path / "access.log")),
                     ("/var/run/nginx.pid", str(tmp_path / "nginx.pid")),
                     ("/etc/nginx/conf.d/*.conf", str(tmp_path / "ipdp.conf"))):
        assert main.count(old) == 1, f"compose/nginx/nginx.conf no longer has {old!r}"
        main = main.replace(old, new)
    (tmp_path / "nginx.conf").write_text(main)
    check = subprocess.run([binary, "-t", "-p", str(tmp_path), "-e", str(tmp_path / "error.log"),
                            "-c", str(tmp_path / "nginx.conf")],
                           capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stderr
