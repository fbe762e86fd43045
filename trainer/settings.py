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
    signing_key: str | None = Field(
        None, description="PREFIX.key the trainer signs every model message with.")
