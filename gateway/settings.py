"""Settings of `ipdp gateway` (IPDP_GATEWAY_*)."""

from __future__ import annotations

from ipaddress import IPv4Network, IPv6Network

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gateway.client_address import TrustedProxies


class GatewaySettings(BaseSettings):
    """The HTTP ingest service."""

    model_config = SettingsConfigDict(env_prefix="IPDP_GATEWAY_", extra="ignore")

    host: str = Field("127.0.0.1", description="Address to listen on (0.0.0.0 in a container).")
    port: int = Field(8080, ge=1, le=65535, description="TCP port.")
    workers: int = Field(1, ge=1, description="Worker processes sharing the listening socket "
                         "(each its own producer); one that dies is replaced.")
    max_body_bytes: int = Field(
        4 << 20, ge=64, description="Largest request body; a longer one is refused with 413.")
    max_message_bytes: int = Field(
        1 << 20, ge=64,
        description="Largest Kafka message the gateway writes; at most the aggregator's "
        "IPDP_AGGREGATOR_MAX_MESSAGE_BYTES. A request above it is split into several containers.")
    linger_ms: float = Field(
        0.0, ge=0, le=1000,
        description="Group commit: how long the first record of a container waits for others "
        "before the container is produced (it goes at once when full), and then while "
        "containers_in_flight of its study await Kafka. 0: at the event loop's next turn if "
        "nothing holds it. Each request is answered when its container is acknowledged.")
    containers_in_flight: int = Field(
        1, ge=0,
        description="Group commit: how many containers of one study may await Kafka's "
        "acknowledgement at once; a container whose linger is over waits for one of them to "
        "settle (it goes at once when full). 0: no limit.")
    kafka_timeout_s: float = Field(
        10.0, gt=0, description="How long a request waits for Kafka's acknowledgement before 503.")
    rate_limit_per_s: float = Field(
        10.0, ge=0,
        description="Requests per second per client address (429 with Retry-After above it); "
        "0 turns the request limit off (the record limit stays). A device sends one record per "
        "study.")
    rate_limit_burst: int = Field(
        20, ge=1, description="Requests a client may send at once before the rate applies.")
    record_limit_per_s: float = Field(
        20.0, gt=0,
        description="Records per second per client address (429 with Retry-After above it; a "
        "request counts as one record at least): what a few devices behind one address send. "
        "A relay's allowance is relay_record_limit_*.")
    record_limit_burst: int = Field(
        100, ge=1,
        description="Records a client may send at once before the rate applies; a request "
        "holding more is refused with 413.")
    relay_addresses: str | None = Field(
        None,
        description="Comma-separated addresses and CIDR networks of relays (batch uploaders, "
        "load generators; a client address as the rate limit sees it): their records are "
        "limited by relay_record_limit_*, their requests not at all.")
    relay_record_limit_per_s: float = Field(
        100_000.0, gt=0, description="Records per second per relay address.")
    relay_record_limit_burst: int = Field(
        100_000, ge=1,
        description="Records a relay may send at once; keep it at least the records of the "
        "largest body (max_body_bytes over the smallest study's record size).")
    max_header_bytes: int = Field(
        16 * 1024, ge=8192,
        description="Largest request head (request line and headers) the server reads; a "
        "longer one is refused and the connection closed. At least 8192 (the server's least "
        "buffer).")
    header_timeout_s: float = Field(
        10.0, gt=0,
        description="How long a connection may take, from opening or after its previous "
        "answer, to send a whole request head; then it is closed. Slow bodies, idle and "
        "per-address connections are the edge's to bound (docs/operations.md, \"The gateway\").")
    trusted_proxies: str | None = Field(
        None,
        description="Comma-separated addresses or networks (CIDR) of the reverse proxies in "
        "front of the gateway: from those peers only, the client address the rate limit keys "
        "on is the rightmost X-Forwarded-For address that is not a trusted proxy. Unset: the "
        "header is never believed, every client is its peer address.")
    web_dir: str | None = Field(
        None, description="Directory served at /web/ (the browser contributor's page). Unset: "
        "this checkout's producer/web/dist once built; empty: no page.")

    @field_validator("trusted_proxies", "relay_addresses")
    @classmethod
    def _address_lists_parse(cls, value: str | None) -> str | None:
        TrustedProxies(value or "")
        return value

    def relay_networks(self) -> tuple[IPv4Network | IPv6Network, ...]:
        """The networks of ``relay_addresses`` (an address is a network of one), parsed as
        ``trusted_proxies`` is."""
        return TrustedProxies(self.relay_addresses or "").networks
