"""A shipped edge run by Debian's nginx on loopback: compose/nginx/ipdp.conf in front of a
gateway, for `ipdp bench flood --attack connections` and the tests that check the edge
(tests/system/test_proxy.py, tests/system/test_conformance.py), or compose/helper/nginx/helper.conf
in front of a helper (tests/system/test_compose.py).

The shipped server block is used as it is but for the upstream's one server (compose's
`gateway:8080` or `helper:8090` → the given address), the listen address and the certificate's
paths; the certificate is self-signed, made here for the listen address. nginx runs in the foreground from a minimal main file of its
own, in a directory of its own.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import pwd
import re
import shutil
import signal
import socket
import ssl
import subprocess
import time
from pathlib import Path
from typing import Self

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ipdp.embedded.children import free_port

__all__ = ["HELPER_NGINX_CONF", "NGINX_CONF", "Edge", "self_signed", "shipped_config"]

NGINX_CONF = Path(__file__).resolve().parents[1] / "compose" / "nginx" / "ipdp.conf"
HELPER_NGINX_CONF = Path(__file__).resolve().parents[1] / "compose" / "helper" / "nginx" / \
    "helper.conf"
_UPSTREAM_SERVER = re.compile(r"^(\s*server )[\w.-]+:\d+;$", re.MULTILINE)


def self_signed(directory: Path, address: str) -> tuple[Path, Path]:
    """A certificate for ``address`` and localhost, and its key (PEM files in ``directory``)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ipdp edge")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address(address))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def _host(address: str) -> str:
    """``address`` as nginx writes it in `server` and `listen` ([…] around IPv6)."""
    return f"[{address}]" if ":" in address else address


def shipped_config(upstream: tuple[str, int], listen: tuple[str, int], cert: Path,
                   key: Path, shipped: Path = NGINX_CONF) -> str:
    """The ``shipped`` server block with the given upstream, listen address and certificate."""
    text = shipped.read_text()
    text, servers = _UPSTREAM_SERVER.subn(rf"\g<1>{_host(upstream[0])}:{upstream[1]};", text)
    if servers != 1:
        raise ValueError(f"{shipped.name} no longer has one upstream server")
    for old, new in (("listen 443 ssl;", f"listen {_host(listen[0])}:{listen[1]} ssl;"),
                     ("/etc/nginx/certs/tls.crt", str(cert)),
                     ("/etc/nginx/certs/tls.key", str(key))):
        if text.count(old) != 1:
            raise ValueError(f"{shipped.name} no longer has {old!r} once")
        text = text.replace(old, new)
    return text


class Edge:
    """Debian's nginx in the foreground with the ``shipped`` server block (the gateway's unless
    given), listening on TLS at ``address``:``port`` (a free port unless given) in front of the
    server at ``upstream``.

    ``worker_connections`` sizes nginx's one worker (the main file's setting; the official
    image's default is 1024 per worker): a connection flood is held there until
    client_header_timeout, so it must fit with room to spare.
    """

    def __init__(self, upstream: tuple[str, int], directory: Path, *,
                 address: str = "127.0.0.1", port: int | None = None,
                 worker_connections: int = 1024, extra: str = "",
                 shipped: Path = NGINX_CONF) -> None:
        binary = shutil.which("nginx")
        if binary is None:
            raise FileNotFoundError("nginx is not on PATH (apt-get install nginx)")
        self.directory, self.address = directory, address
        directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.cert, key = self_signed(directory, address)
        (directory / "ipdp.conf").write_text(
            shipped_config(upstream, (address, self.port), self.cert, key, shipped) + extra)
        # As root, nginx's workers take the user the main file names (nobody by default),
        # which could not read this directory.
        user = f"user {pwd.getpwuid(os.geteuid()).pw_name};" if os.geteuid() == 0 else ""
        temp = " ".join(f"{kind}_temp_path {directory / kind};"
                        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        (directory / "nginx.conf").write_text(
            f"{user}\ndaemon off;\nworker_processes 1;\npid {directory / 'nginx.pid'};\n"
            f"worker_rlimit_nofile {2 * worker_connections + 64};\n"
            f"error_log {directory / 'error.log'} warn;\n"
            f"events {{ worker_connections {worker_connections}; }}\n"
            f"http {{ access_log off; {temp} include {directory / 'ipdp.conf'}; }}\n")
        self.argv = [binary, "-p", str(directory), "-e", str(directory / "error.log"),
                     "-c", str(directory / "nginx.conf")]
        check = subprocess.run([*self.argv, "-t"], capture_output=True, text=True, check=False)
        if check.returncode != 0:
            raise RuntimeError(f"nginx -t: {check.stderr}")
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)

    @property
    def url(self) -> str:
        return f"https://{_host(self.address)}:{self.port}"

    def tls(self) -> ssl.SSLContext:
        """A client context that trusts the edge's certificate."""
        return ssl.create_default_context(cafile=str(self.cert))

    def error_log(self) -> str:
        try:
            return (self.directory / "error.log").read_text(errors="replace")
        except OSError:
            return ""

    def wait_listening(self, timeout_s: float = 30.0) -> None:
        """Until the edge accepts a TLS handshake."""
        deadline = time.monotonic() + timeout_s
        context = self.tls()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited {self.proc.returncode}: {self.error_log()}")
            try:
                with socket.create_connection((self.address, self.port), timeout=2) as raw, \
                        context.wrap_socket(raw, server_hostname=self.address):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nginx not listening within {timeout_s} s: "
                                       f"{self.error_log()}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # fast: nothing in flight is wanted
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> Self:
        try:
            self.wait_listening()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
