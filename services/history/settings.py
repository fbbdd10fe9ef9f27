"""Settings of the history service, read from ``RHYMERL_HISTORY_*`` variables."""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from services.common.security import TLSSettings
from services.history.keys import DEFAULT_PREFIX, DEFAULT_TTL_SECONDS, HistoryKeys


class HistorySettings(TLSSettings):
    model_config = SettingsConfigDict(env_prefix="RHYMERL_HISTORY_", frozen=True)

    host: str = "0.0.0.0"
    # gRPC port; 0 picks a free one.
    port: int = Field(50052, ge=0, le=65535)
    # Prometheus /metrics port; 0 turns the endpoint off.
    metrics_port: int = Field(9092, ge=0, le=65535)
    # redis://[user:password@]host:port/db; empty starts a private redis-server.
    redis_url: str = ""
    # Epochs (K) kept per prompt; older ones are deleted on write.
    num_epochs: int = Field(4, ge=1)
    # A prompt's keys expire this long after its last write.
    ttl_seconds: int = Field(DEFAULT_TTL_SECONDS, ge=1)
    key_prefix: str = DEFAULT_PREFIX
    # Socket connect/read timeout towards Redis: a dead Redis fails a call, never hangs it.
    redis_timeout_s: float = Field(5.0, gt=0)

    @field_validator("key_prefix")
    @classmethod
    def _brace_free(cls, prefix: str) -> str:
        HistoryKeys(prefix)  # raises on an empty prefix or one with braces
        return prefix

    def keys(self) -> HistoryKeys:
        return HistoryKeys(prefix=self.key_prefix, ttl_seconds=self.ttl_seconds)
