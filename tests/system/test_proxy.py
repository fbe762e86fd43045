"""compose's TLS proxy, run by Debian's nginx with the shipped configuration, in front of a real
gateway: TLS, the forwarded client address, the rate limit per device, a spoofed header refused,
and no /metrics on the public port.

compose/nginx/ipdp.conf is used as shipped but for the upstream (compose's `gateway:8080` → the
test's gateway), the listen address and the certificate's paths; the certificate is self-signed,
made here. Each device is a loopback address of its own (127.0.0.x); nginx reaches the gateway
from 127.0.0.1, the one trusted proxy.
"""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import os
import pwd
import re
import signal
import ssl
import subprocess
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ipdp.embedded import free_port
from tests.gateway.conftest import running_gateway
from tests.gateway.test_gateway import known, records
from tests.pipeline import create, wait_for
from tests.tooling import require_tool

NGINX_CONF = Path(__file__).resolve().parents[2] / "compose" / "nginx" / "ipdp.conf"
PROXY = "127.0.0.1"
#: Requests each device may send at once; then one every 10 s (none within this test).
BURST = 3


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, and its key (PEM files)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ipdp test proxy")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address(PROXY))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def shipped_config(upstream_port: int, listen_port: int, cert: Path, key: Path) -> str:
    """compose/nginx/ipdp.conf with the test's addresses and certificate."""
    text = NGINX_CONF.read_text()
    for old, new in (("server gateway:8080;", f"server {PROXY}:{upstream_port};"),
                     ("listen 443 ssl;", f"listen {PROXY}:{listen_port} ssl;"),
                     ("/etc/nginx/certs/tls.crt", str(cert)),
                     ("/etc/nginx/certs/tls.key", str(key))):
        assert text.count(old) == 1, f"compose/nginx/ipdp.conf no longer has {old!r}"
        text = text.replace(old, new)
    return text


class Nginx:
    """Debian's nginx in the foreground, with the shipped server block in a minimal main file."""

    def __init__(self, binary: str, server_block: str, directory: Path) -> None:
        self.directory = directory
        (directory / "ipdp.conf").write_text(server_block)
        # As root, nginx's workers take the user the main file names (nobody by default),
        # which could not read this test's directory.
        user = f"user {pwd.getpwuid(os.geteuid()).pw_name};" if os.geteuid() == 0 else ""
        temp = " ".join(f"{kind}_temp_path {directory / kind};"
                        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        (directory / "nginx.conf").write_text(
            f"{user}\ndaemon off;\nworker_processes 1;\npid {directory / 'nginx.pid'};\n"
            f"error_log {directory / 'error.log'} warn;\n"
            "events { worker_connections 256; }\n"
            f"http {{ access_log off; {temp} include {directory / 'ipdp.conf'}; }}\n")
        self.argv = [binary, "-p", str(directory), "-e", str(directory / "error.log"),
                     "-c", str(directory / "nginx.conf")]
        check = subprocess.run([*self.argv, "-t"], capture_output=True, text=True, check=False)
        assert check.returncode == 0, check.stderr
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful: finish the requests in flight
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


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
    binary = require_tool("nginx", "tests/system/test_proxy.py (compose's TLS proxy)")
    study = create(kafka_settings, redis_settings, topics, study_id="proxy", d=3, n=1000,
                   epsilon=1.0, delta=0.01)
    cert, key = self_signed(tmp_path)
    tls = ssl.create_default_context(cafile=str(cert))
    path = f"/studies/{study.study_id}/records"
    with running_gateway(kafka_settings, topics, rate_limit_per_s=0.1, rate_limit_burst=BURST,
                         trusted_proxies=PROXY) as url:
        known(url, study.study_id)
        gateway_port = int(url.rsplit(":", 1)[1])
        port = free_port()
        nginx = Nginx(binary, shipped_config(gateway_port, port, cert, key), tmp_path)
        try:
            def listening() -> bool:
                assert nginx.proc.poll() is None, (tmp_path / "error.log").read_text()
                try:
                    return request(port, "GET", "/healthz", device="127.0.0.2", tls=tls)[0] == 200
                except OSError:
                    return False

            wait_for(listening, 30, "nginx to answer over TLS")
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
        finally:
            nginx.stop()
