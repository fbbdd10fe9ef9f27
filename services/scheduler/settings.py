"""Scheduler settings (environment variables prefixed RHYMERL_SCHEDULER_)."""

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from services.common.gc_tuning import parse_thresholds
from services.common.errors import InvalidArgument
from services.common.security import TLSSettings
from services.common.validation import check_host_port
from services.history.keys import DEFAULT_PREFIX, KeyPrefix
from services.scheduler.policies import POLICIES


class SchedulerSettings(TLSSettings):
    model_config = SettingsConfigDict(env_prefix="RHYMERL_SCHEDULER_")

    host: str = Field("0.0.0.0", description="Interface the gRPC server binds.")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port of RolloutService (trainers) and RegistryService (workers).")
    metrics_port: int = Field(9091, ge=0, le=65535, description="Prometheus /metrics port; 0 turns the endpoint off.")
    history_address: str = Field(
        "localhost:50052",
        description="HistoryService address; empty disables history (no length prediction, no drafts from history).")
    workers: str = Field("", description="Static workers, comma-separated host:port (workers may also register "
                                         "themselves).")
    policy: Literal[tuple(POLICIES)] = Field("static", description="Placement policy.")
    chunk_tokens: int = Field(
        0, ge=0, description="Divided rollout (seer, rhymerl): a request runs at most this many tokens per chunk; 0: the "
                       "policy default. static and histopipe run whole requests.")
    worker_timeout_s: float = Field(
        30.0, gt=0, description="A worker silent this long (no heartbeat; a static worker: no answered poll) is dropped "
                          "from the fleet (its work was re-queued when it missed its third beat).")
    abandoned_step_timeout_s: float = Field(
        300.0, ge=0, le=7 * 24 * 3600,
        description="A step that no trainer follows this long (no SubmitStep stream open on it: the trainer was "
                    "interrupted, crashed or hit its deadline) is cancelled as CancelStep does, so it stops holding "
                    "the fleet. A trainer back within it rejoins the running step; after it, resubmitting the step "
                    "id replays its finished samples and generates the cancelled ones. 0: never.")
    heartbeat_s: float = Field(
        5.0, gt=0, description="The workers' heartbeat interval: every registered worker re-registers this often (the "
                               "scheduler tells it in each RegisterResponse), and one that misses three beats is "
                               "marked lost (its chunks run elsewhere); static workers are polled this often instead. "
                               "Each beat costs the scheduler O(1).")
    health_port: int = Field(
        50053, ge=0, le=65535, description="Plaintext port of the scheduler's health process: grpc.health.v1 (liveness \"\" and "
                                 "readiness, as on the gRPC port) answered by a process of its own, never waiting for "
                                 "the scheduler's busy event loop; what the kubelet's probes should ask, with or "
                                 "without TLS. 0: none (health on the gRPC port only).")
    liveness_stall_s: float = Field(
        60.0, ge=0, description="The health process reports every service NOT_SERVING (liveness included) once the "
                                "scheduler's event loop has not turned for this long: a hung scheduler is restarted "
                                "by its liveness probe; lag shorter than this is not a failure. 0: never.")
    max_steps_retained: int = Field(
        64, ge=0, description="Finished steps kept in memory for idempotent re-submission (the oldest go first; the step "
                        "log still has them).")
    max_retained_bytes: int = Field(
        512 * 1024 * 1024, ge=0, description="At most this many bytes of memory for those steps (their samples, kept "
                                       "serialized and counted with their object overhead: what they really cost).")
    max_samples_in_flight: int = Field(
        262_144, ge=1, description="Most samples admitted and unfinished over all steps (RESOURCE_EXHAUSTED beyond): what "
                             "bounds the scheduler's memory (about 1 KiB per sample plus its tokens).")
    redis_url: str = Field(
        "", description="Redis for the step log: every finished sample is kept there, so a step re-submitted after a "
                        "scheduler restart replays them and generates only the missing ones. Empty: no step log (a "
                        "restart regenerates every sample of an unfinished step).")
    weights_dir: str = Field(
        "", description="Where the pushed bytes of the serving version are kept (one model's size on disk), so a "
                        "worker that restarts after a push is brought to that version by the scheduler; a volume "
                        "that outlives the container keeps that working across scheduler restarts. Empty: a private "
                        "temporary directory, removed at exit.")
    step_log_ttl_s: float = Field(86_400.0, gt=0, description="How long a step's log outlives its last sample.")
    step_log_hold_s: float = Field(
        30.0, ge=0, description="While the step log's Redis does not answer, finished samples wait for it this long "
                          "(retried) before they go to the trainer unlogged: a sample the trainer saw unlogged is "
                          "generated again by a restarted scheduler, at another version after a push. 0: samples "
                          "never wait (Redis down: no log, as if none were configured).")
    weight_updates: Literal["after_steps", "between_chunks"] = Field(
        "after_steps", description="When a weight push applies: after_steps (synchronous RL: it waits for the running "
                                   "steps, whose chunks keep dispatching) or between_chunks (bounded staleness: it "
                                   "waits only for the chunks in flight; samples spanning it report per-token "
                                   "versions).")
    weight_push_stall_s: float = Field(
        300.0, gt=0, description="A weight push (or load) ends when it stops making progress this long: a trainer that "
                           "sends no chunk fails it (DEADLINE_EXCEEDED); a worker that takes no chunk, or does not "
                           "answer this long after the last one (checking and loading the weights), is left out of "
                           "it (it gets no work until brought to the version), and a push no worker took fails "
                           "UNAVAILABLE naming each worker and what happened to it. The previous version keeps "
                           "serving whenever a push fails.")
    cross_step: bool = Field(
        False, description="Bounded staleness 1 (rhymerl policy): when step N+1 arrives before step N has finished, "
                           "alternate each step's order (short-first, then long-first) so one step's tail overlaps "
                           "the next one's head. Off: every step long-first.")
    auth_tokens: str = Field(
        "", description="Bearer tokens trainers must send to RolloutService (comma-separated; in Kubernetes from a "
                        "Secret). Empty: no auth (a trusted network only).")
    worker_tokens: str = Field(
        "", description="Bearer tokens workers must send to RegistryService (Register, Heartbeat, Deregister; "
                        "comma-separated; each worker's RHYMERL_WORKER_SCHEDULER_TOKEN is one of them). Empty: the "
                        "auth_tokens are asked instead, and with both empty workers register without a token (a "
                        "trusted network only).")
    max_attempts: int = Field(
        3, ge=1, description="A sample whose chunk fails this many times (an engine error on it, a malformed result) "
                       "finishes as ABORT with the last error, instead of looping forever.")
    fair_share: Literal["matched", "equal", "work_conserving"] = Field(
        "matched", description="Sharing the worker slots between running steps (fair_share.py). matched: an equal "
                               "split, and no step runs more chunks than the largest other running step has samples "
                               "(a small step beside a huge one runs in small batches; the huge step slows down "
                               "meanwhile). equal: an equal split only. work_conserving: a step may take every slot "
                               "the others do not need (full batches, the most throughput).")
    history_epochs: int = Field(4, ge=0, description="Epochs of history used for length prediction.")
    history_timeout_s: float = Field(
        2.0, ge=0.05, le=30.0, description="A step waits at most this long for history: its prompts' earlier lengths "
                                           "(at submission) and the write of its rollouts (before its summary; a "
                                           "slower write goes on behind it). A lookup past it, and the ones after it "
                                           "while history stays hung (skipped for 5 s, then twice as long each time "
                                           "it still hangs, up to 60 s), predict without history; one WARNING per "
                                           "outage (docs/architecture.md).")
    record_events: str = Field(
        "", description="A JSON-lines file every policy call and decision is appended to, for offline replay "
                        "(python -m services.scheduler.simulator.replay FILE); empty: not recorded.")
    gc_thresholds: str = Field(
        "10000,50,100", description="The scheduler process's garbage collector: once started, every object is "
                                    "frozen (gc.freeze: imports, servers, settings are never scanned again) and "
                                    "collections run at these thresholds (gen0,gen1,gen2 as gc.set_threshold; "
                                    "CPython's are 700,10,10). Empty: CPython's defaults, nothing frozen. "
                                    "docs/architecture.md has the measurement behind the default.")

    shard_registry_url: str = Field(
        "", description="Run as one shard behind a step router (rhymerl router): announce this scheduler (address, "
                        "capacity, version) in this Redis, which the router reads. Empty: not a shard (trainers talk "
                        "to this scheduler directly).")
    shard_address: str = Field(
        "", description="The address the router dials (in Kubernetes the pod's IP and port); empty: host:port, or "
                        "this machine's address when host is 0.0.0.0.")
    shard_id: str = Field("", description="The shard's name in the registry (unique per shard); empty: its address.")
    key_prefix: KeyPrefix = Field(
        DEFAULT_PREFIX, description="Prefix of every Redis key this service writes (the step log, the serving "
                                    "version's record, a shard's registry key); the same in every service of a "
                                    "release, as history's RHYMERL_HISTORY_KEY_PREFIX. Releases that share one "
                                    "Redis need different ones (their step ids, shard names and serving records "
                                    "would mix). Non-empty, no braces.")
    shard_ttl_s: float = Field(
        10.0, gt=0, description="A shard's registry key outlives its last refresh (every min(shard_ttl_s / 3, 1 s)) "
                                "this long: a hung or partitioned shard leaves the router's shards, and its groups run "
                                "elsewhere, within this time.")

    @field_validator("gc_thresholds")
    @classmethod
    def _three_thresholds(cls, value: str) -> str:
        parse_thresholds(value, "gc_thresholds")
        return value

    @field_validator("workers")
    @classmethod
    def _host_ports(cls, value: str) -> str:
        for entry in (w.strip() for w in value.split(",")):
            if entry:
                try:
                    check_host_port(entry, "workers")  # (the check a registering worker's address gets)
                except InvalidArgument:
                    raise ValueError(f"{entry!r} is not host:port (a port in [1, 65535]; an IPv6 host in "
                                     "brackets)") from None
        return value

    def gc_threshold_values(self) -> tuple[int, int, int] | None:
        return parse_thresholds(self.gc_thresholds, "gc_thresholds")

    def static_workers(self) -> list[str]:
        return [w.strip() for w in self.workers.split(",") if w.strip()]
