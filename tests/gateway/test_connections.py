"""The connection table's policy (gateway.connections), on its own: the prefixes it counts by,
its caps, and whom a newcomer evicts when it is full. tests/gateway/test_limits.py runs the same
policy in the real server over sockets."""

from __future__ import annotations

from gateway.connections import ConnectionTable, prefix_of


class Held:
    def __init__(self, received: int = 0) -> None:
        self.received, self.evicted = received, False

    def evict(self) -> None:
        self.evicted = True


def test_prefixes_are_ipv4_slash_24_and_ipv6_slash_64_by_default_and_configurable():
    assert prefix_of("192.0.2.77", 24, 64) == "192.0.2.0/24"
    assert prefix_of("::ffff:192.0.2.77", 24, 64) == "192.0.2.0/24"  # IPv4-mapped: IPv4
    assert prefix_of("2001:db8:1:2:aaaa::1", 24, 64) == "2001:db8:1:2::/64"
    assert prefix_of("2001:db8:1:2:aaaa::1", 24, 48) == "2001:db8:1::/48"
    assert prefix_of("192.0.2.77", 16, 64) == "192.0.0.0/16"
    assert prefix_of("", 24, 64) == ""  # not an IP address (a Unix socket): its own prefix


def test_caps_per_address_and_per_prefix_refuse_the_newcomer():
    table = ConnectionTable(max_connections=100, per_client=2, per_prefix=3)
    assert table.open(Held(), "10.0.0.1") is None and table.open(Held(), "10.0.0.1") is None
    assert table.open(Held(), "10.0.0.1") == "max_connections_per_client"  # its third
    assert table.open(Held(), "10.0.0.2") is None
    assert table.open(Held(), "10.0.0.3") == "max_connections_per_prefix"  # the /24's 4th
    assert table.open(Held(), "10.0.1.1") is None  # another /24
    # An IPv6 host holds a /64: its addresses share one prefix.
    assert all(table.open(Held(), f"2001:db8::{i}") is None for i in range(1, 4))
    assert table.open(Held(), "2001:db8::ffff:4") == "max_connections_per_prefix"
    assert table.open(Held(), "2001:db8:0:1::1") is None  # another /64
    assert table.refused == 3
    # A trusted proxy carries many clients: only the table's size applies to it.
    assert all(table.open(Held(), "10.0.0.1", proxy=True) is None for _ in range(5))


def test_a_closed_connection_gives_its_place_back():
    table = ConnectionTable(max_connections=100, per_client=1, per_prefix=1)
    first = Held()
    assert table.open(first, "10.0.0.1") is None
    assert table.open(Held(), "10.0.0.1") is not None
    table.close(first)
    assert len(table) == 0 and table.open(Held(), "10.0.0.1") is None


def test_a_full_table_evicts_silent_then_partial_then_idle_and_never_busy():
    table = ConnectionTable(max_connections=4, per_client=10, per_prefix=10)
    busy, idle, partial, silent = Held(500), Held(300), Held(40), Held()
    for i, connection in enumerate((busy, idle, partial, silent)):
        assert table.open(connection, f"10.0.{i}.1") is None
    table.busy(busy)
    table.busy(idle)
    table.idle(idle)
    table.sent_bytes(partial)
    # Each newcomer evicts the connection that has given the least.
    newcomers = [Held() for _ in range(3)]
    assert table.open(newcomers[0], "10.1.0.1") is None and silent.evicted and not partial.evicted
    table.busy(newcomers[0])
    assert table.open(newcomers[1], "10.1.0.2") is None and partial.evicted and not idle.evicted
    table.busy(newcomers[1])
    assert table.open(newcomers[2], "10.1.0.3") is None and idle.evicted
    table.busy(newcomers[2])
    # Every connection is busy now: the next one is refused, and nobody is evicted.
    assert table.open(Held(), "10.1.0.4") == "max_connections" and not busy.evicted
    assert (table.evicted, table.refused, len(table)) == (3, 1, 4)


def test_among_silent_connections_the_oldest_goes_first_and_partial_ones_by_bytes():
    table = ConnectionTable(max_connections=3, per_client=10, per_prefix=10)
    old, new, many, few = Held(), Held(), Held(2000), Held(10)
    for i, connection in enumerate((old, new, many)):
        table.open(connection, f"10.0.0.{i}")
    table.sent_bytes(many)
    assert table.open(few, "10.0.0.9") is None and old.evicted and not new.evicted
    table.sent_bytes(few)
    table.busy(new)
    assert table.open(Held(), "10.0.0.10") is None and few.evicted and not many.evicted
