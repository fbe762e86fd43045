"""Settings every process reads: Kafka, Redis, topics, metrics. One pydantic-settings model per
concern, env prefix ``IPDP_``; each role adds its own model in its room (aggregator/settings.py,
trainer/settings.py, producer/loadgen.py). RecordWindowSettings keeps the aggregator's names: the
aggregator defines the window (it remembers record ids that long), the gateway applies it too.

The environment-variable names are the contract with compose/ and docs/operations.md;
``tests/system/test_compose.py`` checks that every ``IPDP_*`` name used there exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal, Self

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ipdp.errors import ConfigurationError

if TYPE_CHECKING:
    from ipdp.signing import TrustedKeys
    from ipdp.wire import RecordWindow


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
    end_offsets_exact: bool = Field(
        True, description="The brokers answer ListOffsets(latest) with the log's end, as Apache "
        "Kafka does. The embedded tansu broker answers the last batch's base offset + 1 (its "
        "runtime sets false): readers of a topic to its end then wait for one quiet poll, and "
        "the aggregator fetches the record below a stored offset before it calls a log "
        "truncated.")

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


class LeaderTokenSettings(BaseSettings):
    """The secret a two-server study's leader and helper share (docs/architecture.md, "The
    helper"): the leader's aggregator and trainer present it, the helper expects it."""

    model_config = SettingsConfigDict(env_prefix="IPDP_HELPER_", extra="ignore")

    leader_token: SecretStr | None = Field(
        None, description="The bearer token the leader's aggregator and trainer present at the "
        "helper on every route but /healthz (compared there in constant time). Required by the "
        "helper, and by the leader for a two-server study.")
    leader_token_file: str | None = Field(
        None, description="A file holding the leader token instead (a compose secret, "
        "/run/secrets/...): its text without the trailing newline. Not with leader_token.")
    ca_file: str | None = Field(
        None, description="The leader's side: PEM file of the CA(s) that signed an https:// "
        "helper's certificate (default: the system's trust store).")

    @model_validator(mode="after")
    def _read_token_file(self) -> Self:
        """The token from ``leader_token_file``. A missing or unreadable file, or both set, is a
        ConfigurationError naming the variables: not a ValueError, which pydantic would report
        with the input, the token included."""
        if self.leader_token_file is None:
            return self
        if self.leader_token is not None:
            raise ConfigurationError("IPDP_HELPER_LEADER_TOKEN and IPDP_HELPER_LEADER_TOKEN_FILE "
                                     "are both set: set one")
        try:
            text = Path(self.leader_token_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigurationError(f"IPDP_HELPER_LEADER_TOKEN_FILE={self.leader_token_file} "
                                     f"cannot be read: {exc.strerror}") from None
        self.leader_token = SecretStr(text.rstrip("\r\n"))
        return self


class RedisSettings(BaseSettings):
    """How to reach Redis. ``url`` may carry credentials; ``username``/``password`` override it."""

    model_config = SettingsConfigDict(env_prefix="IPDP_REDIS_", extra="ignore")

    url: str = Field("redis://127.0.0.1:6379/0", description="redis:// or rediss:// URL.")
    cluster: bool = Field(
        False, description="The URL names one node of a Redis Cluster: discover the others and "
        "route every command to its slot's primary.")
    username: str | None = Field(None, description="ACL user (Redis 6+).")
    password: SecretStr | None = None
    socket_timeout_s: float = Field(10.0, gt=0)
    ssl_ca_certs: str | None = Field(
        None, description="rediss://: PEM file of the CA(s) that signed Redis's certificate "
        "(default: the system's trust store).")
    ssl_certfile: str | None = Field(None, description="rediss://: client certificate (mutual TLS).")
    ssl_keyfile: str | None = Field(None, description="rediss://: the client certificate's key.")


class TopicSettings(BaseSettings):
    """Topic names and the partition count used when ipdp creates the topics."""

    model_config = SettingsConfigDict(env_prefix="IPDP_TOPIC_", extra="ignore")

    records: str = "ipdp.records"
    models: str = "ipdp.models"
    dead_letter: str = "ipdp.dead-letter"
    studies: str = "ipdp.studies"
    records_partitions: int = Field(4, ge=1)
    replication_factor: int = Field(1, ge=1)
    max_value_bytes: int = Field(
        1 << 20, ge=1024, description="Largest studies-topic or models-topic value a reader "
        "parses; a larger one is skipped as malformed.")


class RecordWindowSettings(BaseSettings):
    """When a record may have been created: what the aggregator folds and the gateway admits
    (ipdp.wire.RecordWindow). AggregatorSettings extends it, so both read the same
    IPDP_AGGREGATOR_* variables."""

    model_config = SettingsConfigDict(env_prefix="IPDP_AGGREGATOR_", extra="ignore")

    replay_window_s: int = Field(
        86_400, ge=1, description="Record ids are remembered this long; older records are rejected."
    )
    max_future_skew_s: int = Field(300, ge=0, description="Largest accepted clock lead of a device.")

    def window(self) -> RecordWindow:
        """The window these settings define, in milliseconds."""
        from ipdp.wire import RecordWindow

        return RecordWindow(self.replay_window_s * 1000, self.max_future_skew_s * 1000)


class MetricsSettings(BaseSettings):
    """Prometheus exposition. Port 0 turns the HTTP endpoint off."""

    model_config = SettingsConfigDict(env_prefix="IPDP_METRICS_", extra="ignore")

    port: int | None = Field(
        None, ge=0, le=65535,
        description="Unset: the role's own default (ipdp.metrics.DEFAULT_PORTS); 0: no endpoint.")
    # Like every ipdp listener outside a container: this machine only unless set otherwise
    # (compose sets 0.0.0.0, and publishes no metrics port).
    host: str = "127.0.0.1"


class TrustSettings(BaseSettings):
    """Who may define a study and publish a model: Ed25519 keys (ipdp.signing, docs/security.md).

    Keys are comma-separated lists of standard base64 public keys and/or ``.pub`` file paths.
    With no trusted study key, unsigned studies are accepted and every reader says so in its log.
    """

    model_config = SettingsConfigDict(env_prefix="IPDP_", extra="ignore")

    trusted_study_keys: str | None = Field(
        None, description="Study owners' public keys that devices and the aggregator accept.")
    trusted_model_keys: str | None = Field(
        None, description="Trainer public keys that model subscribers accept.")
    study_signing_key: str | None = Field(
        None, description="PREFIX.key that `ipdp study create|close` signs with.")
    trusted_credential_keys: str | None = Field(
        None, description="Device-credential issuers' public keys that the gateway, the "
        "aggregator and a two-server study's helper accept (ipdp.credentials); none: every "
        "record of a study that requires credentials is refused.")

    def study_keys(self) -> TrustedKeys:
        """The pinned study-owner keys (none: unsigned studies are accepted, with a warning)."""
        from ipdp.signing import parse_trusted_keys

        return parse_trusted_keys(self.trusted_study_keys)

    def credential_keys(self) -> TrustedKeys:
        """The pinned device-credential issuer keys."""
        from ipdp.signing import parse_trusted_keys

        return parse_trusted_keys(self.trusted_credential_keys)

    def model_keys(self) -> TrustedKeys:
        """The pinned trainer keys model subscribers accept."""
        from ipdp.signing import parse_trusted_keys

        return parse_trusted_keys(self.trusted_model_keys)

