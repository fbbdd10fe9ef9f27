"""Step router settings (environment variables prefixed RHYMERL_ROUTER_)."""

from pydantic import Field

from pydantic_settings import SettingsConfigDict

from services.common.security import TLSSettings
from services.history.keys import DEFAULT_PREFIX, KeyPrefix


class RouterSettings(TLSSettings):
    model_config = SettingsConfigDict(env_prefix="RHYMERL_ROUTER_")

    host: str = Field("0.0.0.0", description="Interface the gRPC server binds.")
    port: int = Field(50050, ge=0, le=65535, description="gRPC port of RolloutService (trainers submit steps here).")
    # not 9090 (Prometheus's own port), nor another service's default (tests/deploy/test_observability.py)
    metrics_port: int = Field(9089, ge=0, le=65535, description="Prometheus /metrics port; 0 turns the endpoint off.")
    registry_url: str = Field(
        "", description="Redis the scheduler shards announce themselves in (their RHYMERL_SCHEDULER_SHARD_REGISTRY_URL): "
                        "the router serves with every shard whose key is alive. Required.")
    key_prefix: KeyPrefix = Field(
        DEFAULT_PREFIX, description="Prefix of every Redis key this service reads and writes (the shards' registry "
                                    "keys, its steps in flight: the shards' RHYMERL_SCHEDULER_KEY_PREFIX); the same "
                                    "in every service of a release, as history's RHYMERL_HISTORY_KEY_PREFIX. "
                                    "Releases that share one Redis need different ones (their step ids, shard "
                                    "names and serving records would mix). Non-empty, no braces.")
    refresh_s: float = Field(2.0, gt=0, description="How often the registry is read (shards joining, leaving, "
                                                    "their capacity and version).")
    window: float = Field(
        1.0, gt=0, description="Samples a shard is given at once, as a multiple of its capacity (the slots of its "
                               "workers); the step's other prompt groups wait in the router and go to whichever shard "
                               "finishes groups first (tail stealing). At least one group per shard.")
    no_shard_timeout_s: float = Field(
        120.0, gt=0, description="A step's groups that no shard could take for this long (none alive at the step's "
                                 "version) finish as ABORT with the reason.")
    abandoned_step_timeout_s: float = Field(
        300.0, ge=0, le=7 * 24 * 3600,
        description="A step that no trainer follows this long (no SubmitStep stream open on it) is cancelled, its "
                    "sub-steps on the shards with it (as CancelStep does); a trainer back within it rejoins the "
                    "running step. 0: never. (The shards' own setting does not apply to routed steps: the router "
                    "follows them.)")
    max_steps_retained: int = Field(
        64, ge=1, description="Finished steps kept for idempotent re-submission, rewards and logprobs reports (the "
                              "oldest go first).")
    max_samples_retained: int = Field(
        262_144, ge=1, description="And at most this many samples over the steps kept (the oldest finished steps go "
                                   "first): what bounds the router's memory (each sample kept with its tokens).")
    max_samples_in_flight: int = Field(
        4_194_304, ge=1, description="Most samples of the unfinished steps together (RESOURCE_EXHAUSTED beyond, as a "
                                     "scheduler's own limit): each is kept with its tokens as it passes, so this "
                                     "bounds the router's memory for the steps in flight (16 shards' default limits).")
    resubmit_wait_s: float = Field(
        60.0, ge=0, description="A router that starts with steps a previous router was running (recorded in the "
                                "registry's Redis) lets no weight update start until trainers re-submitted them, or "
                                "this long: so a step runs again at the version of the samples it already delivered.")
    weights_dir: str = Field(
        "", description="Where the bytes of the last weight push are kept, to catch up a shard that missed it (down, "
                        "or without a worker, during the push). Empty: a private temporary directory.")
    auth_tokens: str = Field(
        "", description="Bearer tokens trainers must send (comma-separated). Empty: no auth (a trusted network only).")
    shard_auth_token: str = Field(
        "", description="Bearer token the router sends to the shards (one of their RHYMERL_SCHEDULER_AUTH_TOKENS); "
                        "empty: none.")
