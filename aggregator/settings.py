"""Settings of `ipdp aggregator run` (IPDP_AGGREGATOR_*)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from ipdp.settings import RecordWindowSettings


class AggregatorSettings(RecordWindowSettings):
    """The consume → validate → fold → commit loop (and the record window it shares with the
    gateway: replay_window_s, max_future_skew_s)."""

    model_config = SettingsConfigDict(env_prefix="IPDP_AGGREGATOR_", extra="ignore")

    group: str = "ipdp-aggregator"
    max_batch: int = Field(5000, ge=1, description="Most records folded in one atomic commit.")
    poll_timeout_ms: int = Field(500, ge=1)
    session_timeout_ms: int = Field(6000, ge=1000)
    max_message_bytes: int = Field(
        1 << 20, ge=64, description="Largest record or container folded; a longer one is "
        "dead-lettered as oversized.")
    unknown_study_ttl_s: float = Field(
        5.0, ge=0, description="A study hash no study has is remembered as unknown this long, "
        "so records with made-up hashes cost no Redis lookup each; a study created meanwhile is "
        "taken up at most this late.")
    columnar_fetch: bool = Field(
        True, description="Parse fetched Kafka record batches as arrays (aggregator/fetch.py); "
        "false uses kafka-python's per-record parser."
    )
    helper_timeout_s: float = Field(
        30.0, gt=0, description="A two-server study's helper: the longest wait for one answer.")
    helper_retry_s: float = Field(
        5.0, gt=0, description="A two-server study's helper: how long one call is sent again "
        "on a connection error or a 503 before the fold backs off and retries it (prepare) or "
        "leaves it to the journal (commit).")
    retry_initial_s: float = Field(0.2, gt=0)
    retry_max_s: float = Field(10.0, gt=0)
