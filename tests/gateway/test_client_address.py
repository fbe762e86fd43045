"""The client address the gateway's limits key on: X-Forwarded-For from trusted proxies only
(the whole path through a real nginx: tests/system/test_proxy.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.client_address import TrustedProxies
from gateway.settings import GatewaySettings


@pytest.mark.parametrize(("peer", "header", "client"), [
    ("127.0.0.1", b"203.0.113.7", "203.0.113.7"),
    ("127.0.0.1", b"198.51.100.1, 203.0.113.7", "203.0.113.7"),
    ("127.0.0.1", b"203.0.113.7, 10.0.0.2", "203.0.113.7"),
    ("127.0.0.1", b"not-an-address", "127.0.0.1"),
    ("127.0.0.1", b"10.0.0.2", "127.0.0.1"),
    ("127.0.0.1", None, "127.0.0.1"),
    ("192.0.2.9", b"203.0.113.7", "192.0.2.9"),
    ("::1", b"2001:db8::1", "2001:db8::1"),
])
def test_the_forwarded_address_is_believed_from_a_trusted_proxy_only(peer, header, client):
    proxies = TrustedProxies("127.0.0.1, 10.0.0.0/24, ::1")
    assert proxies.client(peer, header) == client


def test_trusted_proxies_must_be_addresses_or_networks():
    assert GatewaySettings().trusted_proxies is None
    with pytest.raises(ValidationError):
        GatewaySettings(trusted_proxies="gateway-proxy.internal")
