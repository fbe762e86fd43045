"""Settings every process reads: one pydantic-settings model per concern, env prefix ``IPDP_``.

The environment-variable names here are the contract with compose/ and docs/operations.md;
``tests/test_compose.py`` checks that every ``IPDP_*`` name used there exists here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class KafkaSettings(BaseSettings):
    """How to reach the Kafka cluster (or the embedded Kafka-protocol broker)."""

    model_config = SettingsConfigDict(env_prefix="IPDP_KAFKA_", extra="ignore")

    bootstrap: str = Field("127.0.0.1:9092", description="Comma-separated host:port list.")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    client_id: str = "ipdp"

    def client_kwargs(self) -> dict:
        """Keyword arguments shared by kafka-python's producer, consumer and admin client."""
        kw: dict = {
            "bootstrap_servers": self.bootstrap.split(","),
            "security_protocol": self.security_protocol,
            "client_id": self.client_id,
        }
        if self.sasl_mechanism:
            kw["sasl_mechanism"] = self.sasl_mechanism
            kw["sasl_plain_username"] = self.sasl_username
            kw["sasl_plain_password"] = (
                self.sasl_password.get_secret_value() if self.sasl_password else None
            )
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            if getattr(self, name):
                kw[name] = getattr(self, name)
        return kw


class RedisSettings(BaseSettings):
    """How to reach Redis. ``url`` may carry credentials; ``username``/``password`` override it."""

    model_config = SettingsConfigDict(env_prefix="IPDP_REDIS_", extra="ignore")

    url: str = Field("redis://127.0.0.1:6379/0", description="redis:// or rediss:// URL.")
    username: str | None = Field(None, description="ACL user (Redis 6+).")
    password: SecretStr | None = None
    socket_timeout_s: float = Field(10.0, gt=0)


class TopicSettings(BaseSettings):
    """Topic names and the partition count used when ipdp creates the topics."""

    model_config = SettingsConfigDict(env_prefix="IPDP_TOPIC_", extra="ignore")

    records: str = "ipdp.records"
    models: str = "ipdp.models"
    dead_letter: str = "ipdp.dead-letter"
    studies: str = "ipdp.studies"
    records_partitions: int = Field(4, ge=1)
    replication_factor: int = Field(1, ge=1)


class MetricsSettings(BaseSettings):
    """Prometheus exposition. Port 0 turns the HTTP endpoint off."""

    model_config = SettingsConfigDict(env_prefix="IPDP_METRICS_", extra="ignore")

    port: int = Field(0, ge=0, le=65535)
    host: str = "0.0.0.0"


class AggregatorSettings(BaseSettings):
    """The consume → validate → fold → commit loop."""

    model_config = SettingsConfigDict(env_prefix="IPDP_AGGREGATOR_", extra="ignore")

    group: str = "ipdp-aggregator"
    max_batch: int = Field(5000, ge=1, description="Most records folded in one atomic commit.")
    poll_timeout_ms: int = Field(500, ge=1)
    session_timeout_ms: int = Field(6000, ge=1000)
    replay_window_s: int = Field(
        86_400, ge=1, description="Record ids are remembered this long; older records are rejected."
    )
    max_future_skew_s: int = Field(300, ge=0, description="Largest accepted clock lead of a device.")
    max_message_bytes: int = Field(1 << 20, ge=64)
    retry_initial_s: float = Field(0.2, gt=0)
    retry_max_s: float = Field(10.0, gt=0)


class TrainerSettings(BaseSettings):
    """The close round → solve → publish loop."""

    model_config = SettingsConfigDict(env_prefix="IPDP_TRAINER_", extra="ignore")

    group: str = "ipdp-trainer"
    consumer: str = "trainer-1"
    block_ms: int = Field(1000, ge=1, description="How long one wait on the rounds stream blocks.")
    # Test-only fault injection (tests/test_failures.py): the process exits with status 137, as
    # if SIGKILLed, at a chosen point of publishing a round. Never set in a deployment.
    fault_crash_before_publish: bool = Field(
        False, description="Test only: exit(137) after solving a round, before publishing it.")
    fault_crash_after_publish: bool = Field(
        False, description="Test only: exit(137) after publishing a model, before the Redis ack.")


class LoadgenSettings(BaseSettings):
    """The device simulator."""

    model_config = SettingsConfigDict(env_prefix="IPDP_LOADGEN_", extra="ignore")

    batch: int = Field(2000, ge=1, description="Devices simulated per vectorised step.")
