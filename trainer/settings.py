"""Settings of `ipdp trainer run` (IPDP_TRAINER_*)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class TrainerSettings(BaseSettings):
    """The close round → solve → publish loop."""

    model_config = SettingsConfigDict(env_prefix="IPDP_TRAINER_", extra="ignore")

    group: str = "ipdp-trainer"
    consumer: str = "trainer-1"
    block_ms: int = Field(1000, ge=1, description="How long one wait on the rounds stream blocks.")
    retry_initial_s: float = Field(0.2, gt=0)
    retry_max_s: float = Field(10.0, gt=0)
    helper_wait_s: float = Field(
        30.0, gt=0, description="How long the trainer waits for a two-server study's helper to "
        "hold a closed round's n records (or to answer) before it leaves the round pending.")
    helper_retry_s: float = Field(
        60.0, gt=0, description="How soon a pending two-server round is read again.")
    signing_key: str | None = Field(
        None, description="PREFIX.key the trainer signs every model message with.")
