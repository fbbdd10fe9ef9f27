"""Settings of the history service, read from ``RHYMERL_HISTORY_*`` variables."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.security import TLSSettings
from services.history.keys import DEFAULT_PREFIX, DEFAULT_TTL_SECONDS, HistoryKeys, KeyPrefix


class HistorySettings(TLSSettings):
    model_config = SettingsConfigDict(env_prefix="RHYMERL_HISTORY_", frozen=True)

    host: str = Field("0.0.0.0", description="Interface the gRPC server binds.")
    port: int = Field(50052, ge=0, le=65535, description="gRPC port of HistoryService; 0 picks a free one.")
    metrics_port: int = Field(9092, ge=0, le=65535, description="Prometheus /metrics port; 0 turns the endpoint off.")
    redis_url: str = Field("", description="redis://[user:password@]host:port/db; empty starts a private redis-server on a Unix socket.")
    num_epochs: int = Field(4, ge=1, description="Epochs (K) kept per prompt; older ones are deleted on write.")
    ttl_seconds: int = Field(DEFAULT_TTL_SECONDS, ge=1, description="A prompt's keys expire this long after its last write.")
    key_prefix: KeyPrefix = Field(DEFAULT_PREFIX, description="Prefix of every Redis key (no braces: the hash tag is the prompt).")
    redis_start_wait_s: float = Field(
        60.0, ge=0, le=3600,
        description="At start, how long to wait for a configured Redis that does not answer yet (a bundled Redis "
                    "starting beside this pod, a node restart): retried every second, then the service exits with "
                    "one line naming redis_url. 0: exit at once. (Once serving, an outage makes it NOT_SERVING, "
                    "never exit.)")
    redis_timeout_s: float = Field(
        5.0, gt=0, description="Socket connect/read timeout towards Redis: a dead Redis fails a call, never hangs it.")

    def keys(self) -> HistoryKeys:
        return HistoryKeys(prefix=self.key_prefix, ttl_seconds=self.ttl_seconds)
