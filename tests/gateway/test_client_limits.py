"""gateway.limits on its own: which allowance an address gets, and the buckets' arithmetic
(time is given, so nothing here waits)."""

from __future__ import annotations

import pytest

from gateway.limits import ClientLimits
from gateway.refusals import Refusal
from gateway.settings import GatewaySettings
from ipdp.wire import RejectReason

SETTINGS = GatewaySettings(rate_limit_per_s=2.0, rate_limit_burst=2, record_limit_per_s=4.0,
                           record_limit_burst=8, relay_addresses="192.0.2.0/24, 2001:db8::7",
                           relay_record_limit_per_s=100.0, relay_record_limit_burst=1000)


def refusal(call) -> Refusal:
    with pytest.raises(Refusal) as caught:
        call()
    return caught.value


@pytest.mark.parametrize(("address", "relay"), [
    ("192.0.2.9", True), ("::ffff:192.0.2.9", True), ("2001:db8::7", True),
    ("192.0.3.9", False), ("2001:db8::8", False), ("unknown", False), ("/tmp/gw.sock", False)])
def test_an_address_is_a_relay_only_inside_a_listed_network(address, relay):
    limits = ClientLimits.of(SETTINGS)
    assert (limits.take_request(address, now=0.0).allowance is limits.relay) == relay


def test_a_device_address_takes_requests_and_records_and_is_told_when_to_come_back():
    limits = ClientLimits.of(SETTINGS)
    for _ in range(2):
        limits.take_request("198.51.100.1", now=0.0).take_records(3)
    late = refusal(lambda: limits.take_request("198.51.100.1", now=0.0))
    assert (late.reason, late.headers) == (RejectReason.RATE_LIMITED, {"Retry-After": "1"})
    # Half a second later a request token is back; the 2 records left plus 2 refilled are not
    # enough for 7: 3 more come in 0.75 s, answered as 1 s.
    bucket = limits.take_request("198.51.100.1", now=0.5)
    short = refusal(lambda: bucket.take_records(7))
    assert (short.status, short.reason, short.records) == (429, RejectReason.RATE_LIMITED, 7)
    assert short.headers == {"Retry-After": "1"} and "RECORD_LIMIT_PER_S" in short.detail
    bucket.take_records(4)  # a refused request took no records
    never = refusal(lambda: limits.take_request("198.51.100.2", now=0.0).take_records(9))
    assert (never.status, never.reason) == (413, RejectReason.TOO_LARGE)
    assert "RECORD_LIMIT_BURST" in never.detail


def test_a_relay_counts_records_not_requests():
    limits = ClientLimits.of(SETTINGS)
    for _ in range(50):
        limits.take_request("192.0.2.1", now=0.0).take_records(0)  # a request counts as one record
    bucket = limits.take_request("192.0.2.1", now=0.0)
    bucket.take_records(950)
    assert refusal(lambda: bucket.take_records(1)).reason is RejectReason.RATE_LIMITED
    assert "RELAY_RECORD_LIMIT_PER_S" in refusal(lambda: bucket.take_records(1)).detail


def test_a_malformed_relay_address_stops_the_gateway_at_start():
    with pytest.raises(ValueError):
        GatewaySettings(relay_addresses="192.0.2.0/24, not-an-address")
