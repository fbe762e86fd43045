"""A worker's connection table: who may hold a connection, and whom a newcomer displaces.

Caps apply per client address and per network prefix (an IPv4 /24 and an IPv6 /64 by default:
what one host, or one site, controls), so a few addresses cannot take a worker's connections.
When the table is full, a newcomer is not refused: it evicts the connection that has given the
least, in this order,

1. *silent*: has sent nothing since it opened (the oldest first);
2. *partial*: has sent bytes but never a complete request head (the fewest bytes first);
3. *idle*: has completed requests and now waits between two (the fewest bytes first).

A connection whose request is being read or answered is never evicted; with every connection
busy, the newcomer is refused. (What becomes of an evicted or refused connection is the
server's: gateway.server.HttpServer.hold.) So connections opened to be held cost their holder a turn
each, while a device that sends its request at once is served (docs/security.md).
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from functools import lru_cache
from typing import Protocol

__all__ = ["CAPS", "ConnectionTable", "Holder", "prefix_of"]

#: The caps :meth:`ConnectionTable.open` may refuse a connection by, as it names them.
CAPS = ("max_connections_per_client", "max_connections_per_prefix", "max_connections")


class Holder(Protocol):
    """What the table needs of a connection: the bytes it sent, and a way to close it."""

    received: int

    def evict(self) -> None: ...


@lru_cache(maxsize=1 << 16)
def prefix_of(host: str, v4_bits: int, v6_bits: int) -> str:
    """The network prefix ``host`` belongs to, as text (an IPv4-mapped IPv6 address counts as
    IPv4; a host that is not an IP address is its own prefix). Kept for the addresses seen
    last: a flood re-opens its connections from the same few."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    bits = v4_bits if address.version == 4 else v6_bits
    return str(ipaddress.ip_network((address, bits), strict=False))


class ConnectionTable:
    """The open connections of one worker, by address, prefix and eviction tier."""

    def __init__(self, max_connections: int, per_client: int, per_prefix: int,
                 v4_prefix_bits: int = 24, v6_prefix_bits: int = 64) -> None:
        self.max_connections, self.per_client, self.per_prefix = (
            max_connections, per_client, per_prefix)
        self.v4_bits, self.v6_bits = v4_prefix_bits, v6_prefix_bits
        self._clients: Counter[str] = Counter()
        self._prefixes: Counter[str] = Counter()
        #: Each connection's (address, prefix).
        self._keys: dict[Holder, tuple[str, str]] = {}
        # The eviction tiers (dicts as ordered sets: oldest first). A busy connection is in none.
        self._silent: dict[Holder, None] = {}
        self._partial: dict[Holder, None] = {}
        self._idle: dict[Holder, None] = {}
        self.evicted = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self._keys)

    def open(self, connection: Holder, host: str, proxy: bool = False) -> str | None:
        """Enter a new connection from ``host``; None, or the cap that refuses it (the caller
        closes it). When the table is full, another connection is evicted to make room. A
        trusted ``proxy`` carries many clients' connections and caps each client's itself: only
        the table's size applies to it."""
        prefix = prefix_of(host, self.v4_bits, self.v6_bits)
        refused = None
        if not proxy and self._clients[host] >= self.per_client:
            refused = "max_connections_per_client"
        elif not proxy and self._prefixes[prefix] >= self.per_prefix:
            refused = "max_connections_per_prefix"
        elif len(self._keys) >= self.max_connections and not self._evict_one():
            refused = "max_connections"
        if refused is not None:
            self.refused += 1
            return refused
        self._clients[host] += 1
        self._prefixes[prefix] += 1
        self._keys[connection] = (host, prefix)
        self._silent[connection] = None
        return None

    def close(self, connection: Holder) -> None:
        """Forget a closed connection (one the table refused is not in it)."""
        keys = self._keys.pop(connection, None)
        if keys is None:
            return
        self._silent.pop(connection, None)
        self._partial.pop(connection, None)
        self._idle.pop(connection, None)
        for counter, key in zip((self._clients, self._prefixes), keys, strict=True):
            counter[key] -= 1
            if not counter[key]:
                del counter[key]

    def sent_bytes(self, connection: Holder) -> None:
        """A silent connection sent its first bytes (not yet a whole request head)."""
        if connection in self._silent:
            del self._silent[connection]
            self._partial[connection] = None

    def busy(self, connection: Holder) -> None:
        """A request head arrived whole: the connection is not evictable until it is answered."""
        self._silent.pop(connection, None)
        self._partial.pop(connection, None)
        self._idle.pop(connection, None)

    def idle(self, connection: Holder) -> None:
        """The connection's requests are answered; it waits for the next one."""
        if connection in self._keys:
            self._idle[connection] = None

    def _evict_one(self) -> bool:
        if self._silent:
            victim = next(iter(self._silent))
        elif self._partial or self._idle:
            tier = self._partial or self._idle
            victim = min(tier, key=lambda connection: connection.received)
        else:
            return False
        self.close(victim)
        victim.evict()
        self.evicted += 1
        return True
