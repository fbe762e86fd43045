"""Which address a request comes from: its peer's, or the one a trusted proxy forwarded.

The rate limit and the per-client connection cap key on a client address. Behind a TLS proxy
every peer is the proxy, so the proxy says whom it serves in ``X-Forwarded-For``. Anyone can send
that header, so it is believed only when the peer is one of ``IPDP_GATEWAY_TRUSTED_PROXIES``,
and then only as far as trusted proxies wrote it: each proxy appends the address it saw, so the
client is the rightmost address that no trusted proxy holds; whatever lies left of it is the
client's own claim. A peer that is not a trusted proxy is the client, whatever it sends.

The HTTP server (the connection caps) and the app (the rate limit) both ask this module.
"""

from __future__ import annotations

import ipaddress
from functools import cache

__all__ = ["FORWARDED_FOR", "TrustedProxies", "trusted_proxies"]

#: The header a trusted proxy names its client in (lower case, as ASGI gives header names).
FORWARDED_FOR = b"x-forwarded-for"


class TrustedProxies:
    """The peers whose ``X-Forwarded-For`` is believed: addresses and networks (CIDR)."""

    def __init__(self, spec: str) -> None:
        """``spec``: comma-separated IPv4/IPv6 addresses or networks (``10.0.0.5,10.1.0.0/16``);
        empty: none (the header is never believed). ValueError for anything else."""
        self.networks = tuple(ipaddress.ip_network(part.strip(), strict=False)
                              for part in spec.split(",") if part.strip())
        self._known: dict[str, bool] = {}

    def __bool__(self) -> bool:
        return bool(self.networks)

    def __contains__(self, host: str) -> bool:
        """Whether ``host`` (an address as text) is a trusted proxy; anything else is not."""
        known = self._known.get(host)
        if known is None:
            try:
                address = ipaddress.ip_address(host)
            except ValueError:
                known = False
            else:
                known = any(address in network for network in self.networks)
            if len(self._known) < 65_536:  # bounded: peers are many, proxies few
                self._known[host] = known
        return known

    def client(self, peer: str, forwarded_for: bytes | None) -> str:
        """The client's address: ``peer``'s, unless ``peer`` is a trusted proxy that forwarded
        one. A header that does not parse (or names only trusted proxies) leaves the peer's:
        a trusted proxy writes a well-formed one, so such a request shares the proxy's
        allowance rather than getting one of its own."""
        if not forwarded_for or peer not in self:
            return peer
        for hop in reversed(forwarded_for.decode("latin-1").split(",")):
            hop = hop.strip()
            try:
                ipaddress.ip_address(hop)
            except ValueError:
                return peer
            if hop not in self:
                return hop
        return peer


@cache
def trusted_proxies(spec: str) -> TrustedProxies:
    """The :class:`TrustedProxies` of a setting's value, parsed once per process."""
    return TrustedProxies(spec)
