"""Rollout worker settings (environment variables prefixed RHYMERL_WORKER_)."""

import socket
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from services.common.gc_tuning import parse_thresholds
from services.common.security import TLSSettings


# Settings of rhymerl's own engine that vLLM's never reads (refused with engine=vllm).
VLLM_IGNORES = ("batch_invariant", "num_kv_blocks", "block_size", "measure_cost", "tree_drafts", "overlap")


class WorkerSettings(TLSSettings):
    model_config = SettingsConfigDict(env_prefix="RHYMERL_WORKER_", protected_namespaces=())

    host: str = Field("0.0.0.0", description="Interface the gRPC server binds.")
    port: int = Field(50061, ge=0, le=65535, description="gRPC port of WorkerService.")
    metrics_port: int = Field(9161, ge=0, le=65535, description="Prometheus /metrics port; 0 turns the endpoint off.")
    id: str = Field("", description="Worker id, unique in the fleet; empty: <hostname>:<port>.")
    advertise_address: str = Field("", description="Where the scheduler reaches this worker; empty: <hostname>:<port>.")
    model_path: str = Field("", description="A Hugging Face-format checkpoint directory (config.json + *.safetensors).")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
                        description="auto (cuda when there is a GPU), cpu, cuda or cuda:N.")
    engine: Literal["rhymerl", "vllm"] = Field(
        "rhymerl", description="rhymerl (its own engine) or vllm (vLLM's V1 engine, `make install-vllm`; "
                               "docs/vllm.md).")
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0, le=1, description="vLLM's gpu_memory_utilization.")
    vllm_kv_cache_gib: int = Field(2, ge=1, description="VLLM_CPU_KVCACHE_SPACE on vLLM's CPU build.")
    vllm_enforce_eager: bool = Field(
        False, description="vLLM's enforce_eager: no torch.compile and no CUDA graphs. Starts in seconds instead of "
                           "minutes (the compile warm-up), at a slower step on a GPU.")
    vllm_multiprocessing: bool = Field(
        False, description="Run vLLM's engine core in a process of its own (vLLM's default). Not supported: the "
                           "vLLM worker runs it in-process, and turning this on is an error at start.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and activations; auto: the checkpoint's (float32 on a CPU).")
    max_num_seqs: int = Field(256, ge=1, description="Most sequences decoding at once (the batch).")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Most tokens in one forward (prefill chunks + decode + drafts).")
    num_kv_blocks: int = Field(0, ge=0, description="KV-cache blocks; 0 sizes the cache from free memory. A cache of "
                                                  "fewer tokens (blocks x block_size) than the model's length caps the "
                                                  "sequences the worker registers for (prompt + max_tokens): longer "
                                                  "steps are refused at submit, naming the field.")
    block_size: int = Field(16, ge=1, description="Tokens per KV-cache block.")
    speculative: bool = Field(True, description="Draft from history and siblings, verified by the policy (lossless).")
    max_draft_len: int = Field(16, ge=0, description="Most draft tokens per sequence and verify step.")
    drafter: Literal["compiled", "python"] = Field(
        "compiled", description="compiled: the history drafter's C++ core (built by `make install`; a worker "
                                "without it refuses to start); python: the reference HistoDrafter, the same "
                                "drafts ~20x slower (docs/drafter.md).")
    tree_drafts: bool = Field(
        False, description="Draft trees at batches of at most 16 sequences (several continuations verified in one "
                           "forward, lossless; docs/drafter.md), from either drafter. Off until trees are shown "
                           "to pay; refused with --engine vllm.")
    batch_invariant: bool = Field(
        False, description="Batch-invariant kernels: a sample's logits, tokens and logprobs are bitwise the same "
                           "whatever it is batched with, verified with, or where it resumes, and equal to the "
                           "trainer reference (services/rollout/engine/logprobs.py). Off: identical in "
                           "distribution only. Its cost: docs/sampling.md.")
    overlap: bool = Field(
        True, description="Steps without drafts launch their forward on the last step's tokens before reading "
                          "them, and commit them while it runs (docs/architecture.md); off: each step reads its "
                          "tokens before the next is laid out. The same samples either way.")
    measure_cost: bool = Field(
        True, description="Re-measure the forward cost curve from this worker's own step times; off: keep the "
                          "H100 table of docs/cost-model.md, so draft lengths do not depend on the machine's speed.")
    scheduler_address: str = Field(
        "", description="Registers with this scheduler on start and leaves on SIGTERM; empty: static config.")
    scheduler_token: str = Field(
        "", description="Bearer token sent with the registration, the heartbeats and the deregistration (one of the "
                        "scheduler's RHYMERL_SCHEDULER_WORKER_TOKENS, or of its AUTH_TOKENS where it has no worker "
                        "tokens); empty: none (a scheduler with tokens refuses it UNAUTHENTICATED).")
    heartbeat_s: float = Field(
        5.0, gt=0, description="Re-registers (its heartbeat) this often until the scheduler answers: from then on at "
                               "the interval the scheduler names (RHYMERL_SCHEDULER_HEARTBEAT_S). Unanswered attempts "
                               "back off up to it.")
    history_address: str = Field(
        "", description="HistoryService for drafts from earlier epochs; empty: siblings and prompt only.")
    history_epochs: int = Field(4, ge=0, description="Earlier epochs of a prompt the drafter reads.")
    history_tokens: int = Field(
        32 * 1024 * 1024, ge=0, description="Tokens of earlier epochs the drafter keeps over all prompts (about 100 "
                                            "bytes each in its index; each prompt's counted up to its index's cap): "
                                            "past it, or past 10,000 prompts, the least recently used prompts are "
                                            "released. 0: the prompt count only.")
    history_timeout_s: float = Field(
        2.0, ge=0.05, le=30.0, description="A new prompt's earlier epochs and a new step's recent responses are read "
                                           "from history before the items run: each read waits at most this long. "
                                           "One past it, and the ones after it while history stays hung (skipped "
                                           "for 5 s, then twice as long each time it still hangs, up to 60 s), "
                                           "draft without history; one WARNING per outage. Raise it where many new "
                                           "prompts with long responses make a healthy read slower "
                                           "(docs/architecture.md).")
    global_recent_responses: int = Field(
        512, ge=0, description="At each step start, this many of the history service's most recent responses to any "
                         "prompt feed the drafter's global index; 0: own samples only.")
    global_recent_tokens: int = Field(131072, ge=0, description="At most this many tokens of those responses.")
    feed_tokens_per_step: int = Field(
        2048, ge=1, description="The drafter's global index takes at most this many tokens of finished and streamed "
                                "responses per engine step, inserted while the step's forward runs (a longer "
                                "response alone); with no request in flight, all at once (docs/architecture.md).")
    drain_timeout_s: float = Field(60.0, ge=0, description="On SIGTERM, seconds to finish running work before exiting.")
    initial_version: int = Field(0, ge=0, description="Policy version of the checkpoint at model_path.")
    gc_thresholds: str = Field(
        "700,10,100", description="The worker process's garbage collector: once started, every object is frozen "
                                  "(gc.freeze: the model, imports, servers are never scanned again); rhymerl's engine "
                                  "collects behind each step's forward once gen0 objects were allocated (gen1, gen2 "
                                  "as gc.set_threshold), automatic collections waiting for 50x gen0; with "
                                  "--engine vllm, collections run at these thresholds. Empty: CPython's defaults "
                                  "(700,10,10), nothing frozen, collections wherever Python allocates "
                                  "(docs/architecture.md).")

    @field_validator("gc_thresholds")
    @classmethod
    def _three_thresholds(cls, value: str) -> str:
        thresholds = parse_thresholds(value, "gc_thresholds")
        if thresholds is not None and min(thresholds) < 1:
            raise ValueError(f"gc_thresholds: each threshold must be at least 1, not {value!r}")
        return value

    def gc_threshold_values(self) -> tuple[int, int, int] | None:
        return parse_thresholds(self.gc_thresholds, "gc_thresholds")

    @field_validator("vllm_multiprocessing")
    @classmethod
    def _vllm_in_process(cls, value: bool) -> bool:
        # The vLLM worker is built and tested in-process only (the proposer, its history,
        # weight pushes and the CPU sampler repair all reach vLLM's model runner through
        # collective_rpc, never exercised across vLLM's engine-core process here).
        if value:
            raise ValueError("RHYMERL_WORKER_VLLM_MULTIPROCESSING=true is not supported: the vLLM worker runs "
                             "vLLM in-process only (docs/vllm.md)")
        return value

    @model_validator(mode="after")
    def _vllm_reads_no_engine_setting_of_ours(self) -> "WorkerSettings":
        # vLLM's engine never reads these: accepting them would promise what it does not do
        # (batch_invariant: bitwise results; vLLM sizes its own KV cache and blocks and
        # prices no drafts). Their defaults pass; anything else is refused by name.
        if self.engine != "vllm":
            return self
        for name in VLLM_IGNORES:
            if getattr(self, name) != type(self).model_fields[name].default:
                option = f"--{name.replace('_', '-')} (RHYMERL_WORKER_{name.upper()})"
                raise ValueError(f"{option} = {getattr(self, name)!r} has no effect with --engine vllm "
                                 f"(vLLM's engine never reads {name}): leave it at its default "
                                 f"{type(self).model_fields[name].default!r} or use --engine rhymerl (docs/vllm.md)")
        return self

    def worker_id(self, port: int) -> str:
        return self.id or f"{socket.gethostname()}:{port}"

    def address(self, port: int) -> str:
        return self.advertise_address or f"{socket.gethostname()}:{port}"
