"""What one client address may send to the records route: requests and records per second.

Two token buckets per address, refilled together: a request takes one request token at admission
(before its body is read), and its records, once their count is known, take that many record
tokens (at least one). By default an address gets what a few devices behind one NAT send
(``rate_limit_*``, ``record_limit_*``). A relay that uploads other devices' records in batches
gets a larger record allowance, and no request limit, only when its address is listed in
``relay_addresses``. docs/security.md ("Against a flood") says why, and the defaults.
Above either allowance the request is answered 429 with Retry-After; a request holding more
records than the address may ever send at once, 413.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import OrderedDict
from dataclasses import dataclass

from gateway.refusals import Refusal
from gateway.settings import GatewaySettings
from ipdp.wire import RejectReason

__all__ = ["Allowance", "Bucket", "ClientLimits"]


@dataclass(frozen=True)
class Allowance:
    """Token-bucket rates (per second) and bursts; ``requests_per_s`` 0: requests unlimited."""

    requests_per_s: float
    request_burst: float
    records_per_s: float
    record_burst: float
    #: The settings a refusal names, so the client's operator knows which one applies.
    records_setting: str


class Bucket:
    """One address's tokens: requests and records left, and when they were last refilled."""

    __slots__ = ("allowance", "records", "refilled", "requests")

    def __init__(self, allowance: Allowance, now: float) -> None:
        self.allowance, self.refilled = allowance, now
        self.requests, self.records = allowance.request_burst, allowance.record_burst

    def take_request(self, now: float) -> None:
        """Refill both buckets to ``now`` and take one request; Refusal (429) if none is left."""
        a, elapsed = self.allowance, now - self.refilled
        self.refilled = now
        # Comparisons, not min() and max(): a builtin call per bound is a measurable share of
        # the device path's cost here (this runs on every request).
        records = self.records + elapsed * a.records_per_s
        self.records = records if records < a.record_burst else a.record_burst  # noqa: FURB136
        if not a.requests_per_s:
            return
        requests = self.requests + elapsed * a.requests_per_s
        if requests > a.request_burst:  # noqa: PLR1730 - see above
            requests = a.request_burst
        if requests < 1.0:
            self.requests = requests
            raise Refusal(RejectReason.RATE_LIMITED,
                          f"more than {a.requests_per_s:g} requests per second from this client",
                          headers={"Retry-After": _seconds(1.0 / a.requests_per_s)})
        self.requests = requests - 1.0

    def take_records(self, k: int) -> None:
        """Take the tokens of a request's k records (a request counts as one at least);
        Refusal 429 if fewer are left, 413 if more than the burst could ever hold."""
        if k < 1:  # noqa: PLR1730 - as in take_request
            k = 1
        if k <= self.records:
            self.records -= k
            return
        a = self.allowance
        if k > a.record_burst:
            raise Refusal(RejectReason.TOO_LARGE,
                          f"{k} records in one request; this client may send at most "
                          f"{a.record_burst:g} at once ({a.records_setting}_BURST)", records=k)
        raise Refusal(RejectReason.RATE_LIMITED,
                      f"more than {a.records_per_s:g} records per second from this client "
                      f"({a.records_setting}_PER_S)", records=k,
                      headers={"Retry-After": _seconds((k - self.records) / a.records_per_s)})


def _seconds(wait_s: float) -> str:
    """A Retry-After value: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(wait_s)))


class ClientLimits:
    """The bucket of every client address, devices' and relays'.

    Remembers at most ``max_clients`` addresses (least recently seen dropped first), so a flood
    of addresses costs bounded memory; a dropped client starts again with full buckets. Whether
    an address is a relay is decided once, when its bucket is made.
    """

    def __init__(self, device: Allowance, relay: Allowance,
                 relay_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...],
                 max_clients: int = 100_000) -> None:
        self.device, self.relay, self.relay_networks = device, relay, relay_networks
        self.max_clients = max_clients
        self._buckets: OrderedDict[str, Bucket] = OrderedDict()

    @classmethod
    def of(cls, settings: GatewaySettings) -> ClientLimits:
        """The limits ``settings`` (IPDP_GATEWAY_*) describe."""
        device = Allowance(settings.rate_limit_per_s, settings.rate_limit_burst,
                           settings.record_limit_per_s, settings.record_limit_burst,
                           "IPDP_GATEWAY_RECORD_LIMIT")
        relay = Allowance(0.0, 0.0, settings.relay_record_limit_per_s,
                          settings.relay_record_limit_burst, "IPDP_GATEWAY_RELAY_RECORD_LIMIT")
        return cls(device, relay, settings.relay_networks())

    def take_request(self, client: str, now: float | None = None) -> Bucket:
        """The bucket of ``client`` (its address), one request taken; Refusal (429) if it
        has none left."""
        now = time.monotonic() if now is None else now
        bucket = self._buckets.get(client)
        if bucket is None:
            bucket = self._buckets[client] = Bucket(self._allowance(client), now)
            if len(self._buckets) > self.max_clients:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(client)
        bucket.take_request(now)
        return bucket

    def _allowance(self, client: str) -> Allowance:
        if self.relay_networks:
            try:
                address = ipaddress.ip_address(client)
            except ValueError:  # "unknown", or a Unix socket's path
                return self.device
            # A dual-stack listener sees an IPv4 client as ::ffff:a.b.c.d.
            if address.version == 6 and address.ipv4_mapped is not None:
                address = address.ipv4_mapped
            if any(address in network for network in self.relay_networks):
                return self.relay
        return self.device
