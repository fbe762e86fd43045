"""Settings of `ipdp gateway` (IPDP_GATEWAY_*)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class GatewaySettings(BaseSettings):
    """The HTTP ingest service."""

    model_config = SettingsConfigDict(env_prefix="IPDP_GATEWAY_", extra="ignore")

    host: str = Field("127.0.0.1", description="Address to listen on (0.0.0.0 in a container).")
    port: int = Field(8080, ge=0, le=65535, description="TCP port; 0 picks a free one.")
    workers: int = Field(1, ge=1, description="uvicorn worker processes (each its own producer).")
    max_body_bytes: int = Field(
        4 << 20, ge=64, description="Largest request body; a longer one is refused with 413.")
    max_message_bytes: int = Field(
        1 << 20, ge=64,
        description="Largest Kafka message the gateway writes; at most the aggregator's "
        "IPDP_AGGREGATOR_MAX_MESSAGE_BYTES. A request above it is split into several containers.")
    kafka_timeout_s: float = Field(
        10.0, gt=0, description="How long a request waits for Kafka's acknowledgement before 503.")
    rate_limit_per_s: float = Field(
        0.0, ge=0, description="Requests per second per client address; 0 turns the limit off.")
    rate_limit_burst: int = Field(
        20, ge=1, description="Requests a client may send at once before the rate applies.")
    web_dir: str | None = Field(
        None, description="Directory served at /web/ (the browser contributor's page). Unset: "
        "this checkout's producer/web/dist once built; empty: no page.")
