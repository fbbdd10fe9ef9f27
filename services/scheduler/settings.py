"""Scheduler settings (environment variables prefixed RHYMERL_SCHEDULER_)."""

from typing import Literal

from pydantic_settings import SettingsConfigDict

from services.common.security import TLSSettings


class SchedulerSettings(TLSSettings):
    model_config = SettingsConfigDict(env_prefix="RHYMERL_SCHEDULER_")

    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int = 9091
    # HistoryService address; empty disables history (no length prediction, no drafts from history).
    history_address: str = "localhost:50052"
    # Static workers, comma-separated host:port (workers may also register themselves).
    workers: str = ""
    # Placement policy: static | seer | histopipe | rhymerl.
    policy: str = "static"
    # Divided rollout (seer, rhymerl): a request runs at most this many tokens per chunk;
    # 0 = the policy default. static and histopipe run whole requests.
    chunk_tokens: int = 0
    # A worker that fails health checks this long is dropped and its work re-queued.
    worker_timeout_s: float = 30.0
    # Finished steps kept in memory for idempotent re-submission: at most this many, and
    # at most this many bytes of samples (the oldest go first; the step log still has them).
    max_steps_retained: int = 64
    max_retained_bytes: int = 512 * 1024 * 1024
    # Most samples admitted and unfinished over all steps (RESOURCE_EXHAUSTED beyond): what
    # bounds the scheduler's memory (about 1 KiB per sample plus its tokens).
    max_samples_in_flight: int = 262_144
    # Redis for the step log: every finished sample is kept there, so a step re-submitted
    # after a scheduler restart replays them and generates only the missing ones. Empty: no
    # step log (a restart regenerates every sample of an unfinished step).
    redis_url: str = ""
    # How long a step's log outlives its last sample.
    step_log_ttl_s: float = 86_400.0
    # When a weight push applies: after_steps (synchronous RL: it waits for the running
    # steps, whose chunks keep dispatching) or between_chunks (bounded staleness: it waits
    # only for the chunks in flight; samples spanning it report per-token versions).
    weight_updates: Literal["after_steps", "between_chunks"] = "after_steps"
    # Bounded staleness 1 (rhymerl policy): when a trainer submits step N+1 before step N
    # has finished, alternate each step's order (short-first, then long-first) so one
    # step's tail overlaps the next one's head. Off: every step long-first.
    cross_step: bool = False
    # Bearer tokens trainers must send to RolloutService (comma-separated; in Kubernetes
    # from a Secret). Empty: no auth (a trusted network only).
    auth_tokens: str = ""
    # A sample whose Run call fails this many times (worker crash, engine error) is
    # given up: it finishes as ABORT with the last error, instead of looping forever.
    max_attempts: int = 3
    # Epochs of history used for length prediction.
    history_epochs: int = 4
    # A JSON-lines file every policy call and decision is appended to, for offline replay
    # (python -m services.scheduler.simulator.replay FILE); empty = not recorded.
    record_events: str = ""

    def static_workers(self) -> list[str]:
        return [w.strip() for w in self.workers.split(",") if w.strip()]
