"""Settings of `ipdp helper run` (IPDP_HELPER_*)."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from ipdp.settings import LeaderTokenSettings
from ipdp.wire import RecordWindow


class HelperSettings(LeaderTokenSettings):
    """The helper's HTTP service, its own Redis, its key and the leader's credential
    (``leader_token``, shared with the leader: ipdp.settings.LeaderTokenSettings)."""

    model_config = SettingsConfigDict(env_prefix="IPDP_HELPER_", extra="ignore")

    host: str = Field("127.0.0.1", description="Address to listen on (0.0.0.0 in a container).")
    port: int = Field(8090, ge=1, le=65535, description="TCP port.")
    redis_url: str = Field(
        "redis://127.0.0.1:6380/0", description="The helper's own Redis (redis:// or rediss://), "
        "never the leader's: it holds the opened shares and the rounds' sums of shares.")
    redis_password: SecretStr | None = Field(
        None, description="Its Redis's password (`requirepass`); overrides the URL's. The "
        "leader's IPDP_REDIS_* settings are never read here.")
    key_file: str | None = Field(
        None, description="The helper's X25519 PREFIX.key (`ipdp keys generate --helper`): "
        "devices seal the helper's share of each record to its public key. Required.")
    replay_window_s: int = Field(
        86_400, ge=1, description="Record ids are remembered this long; an older record is "
        "refused as stale (the leader's IPDP_AGGREGATOR_REPLAY_WINDOW_S or less).")
    max_future_skew_s: int = Field(
        300, ge=0, description="Largest accepted clock lead of a device.")
    max_body_bytes: int = Field(
        64 << 20, ge=1024, description="Largest request body (a job's records); a longer one is "
        "refused with 413.")

    def window(self) -> RecordWindow:
        """The record window these settings define, in milliseconds."""
        return RecordWindow(self.replay_window_s * 1000, self.max_future_skew_s * 1000)
