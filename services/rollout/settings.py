"""Rollout worker settings (environment variables prefixed RHYMERL_WORKER_)."""

import socket

from pydantic_settings import SettingsConfigDict

from services.common.security import TLSSettings


class WorkerSettings(TLSSettings):
    model_config = SettingsConfigDict(env_prefix="RHYMERL_WORKER_", protected_namespaces=())

    host: str = "0.0.0.0"
    port: int = 50061
    metrics_port: int = 9161
    # Defaults to the host name; must be unique in the fleet.
    id: str = ""
    # Where the scheduler reaches this worker; defaults to <hostname>:<port>.
    advertise_address: str = ""
    # A Hugging Face-format checkpoint directory (config.json + *.safetensors).
    model_path: str = ""
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # KV-cache blocks; 0 sizes the cache from free memory.
    num_kv_blocks: int = 0
    block_size: int = 16
    speculative: bool = True
    max_draft_len: int = 16
    # Batch-invariant kernels: a sample's logits, tokens and logprobs are bitwise the same
    # whatever it is batched with, verified with, or where it resumes, and equal to
    # services/rollout/engine/logprobs.py's trainer reference. Off: identical in
    # distribution only. The default and its cost: docs/sampling.md.
    batch_invariant: bool = False

    # Registers with this scheduler on start and leaves on SIGTERM; empty = static config.
    scheduler_address: str = ""
    # Re-registers this often for as long as it runs (a restarted scheduler gets the
    # worker back within one interval); unanswered attempts back off up to it.
    heartbeat_s: float = 2.0
    # HistoryService for drafts from earlier epochs; empty = siblings and prompt only.
    history_address: str = ""
    history_epochs: int = 4
    # At each step start, this many of the history service's most recent responses to any
    # prompt (at most this many tokens) feed the drafter's global index; 0: own samples only.
    global_recent_responses: int = 512
    global_recent_tokens: int = 131072
    drain_timeout_s: float = 60.0
    # Policy version of the checkpoint at model_path.
    initial_version: int = 0

    def worker_id(self, port: int) -> str:
        return self.id or f"{socket.gethostname()}:{port}"

    def address(self, port: int) -> str:
        return self.advertise_address or f"{socket.gethostname()}:{port}"
