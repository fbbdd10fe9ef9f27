"""Builds VllmEngine from the worker's settings: vLLM's V1 engine in this process.

In-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni" executor): it starts in
seconds instead of tens, and the proposer is a shared object reached by plain
calls. vLLM's engine-core process is refused by the settings (vllm_multiprocessing).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PROPOSER = "services.rollout.vllm_engine.proposer.HistoryProposer"


def engine_args(settings, proposer: str | None) -> dict:
    """LLMEngine arguments; ``proposer`` is "rhymerl", "ngram", "suffix" or None."""
    # float32 on the CPU as the native engine uses (bf16 matmuls are slow there)
    dtype = "float32" if settings.dtype == "auto" and settings.device in ("auto", "cpu") else settings.dtype
    args = dict(model=settings.model_path, skip_tokenizer_init=True, dtype=dtype,
                max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_num_batched_tokens,
                gpu_memory_utilization=settings.vllm_gpu_memory_utilization,
                distributed_executor_backend="uni", enable_prefix_caching=True, seed=0,
                enforce_eager=settings.vllm_enforce_eager,
                # temperature-scaled: rhymerl's logprobs (engine.check_logprobs_mode), vLLM's raw are not
                logprobs_mode="processed_logprobs")
    k = settings.max_draft_len
    if proposer == "rhymerl":
        args["speculative_config"] = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": k}
    elif proposer == "ngram":
        args["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k,
                                      "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    elif proposer == "suffix":
        args["speculative_config"] = {"method": "suffix", "num_speculative_tokens": k}
    return args


def intel_openmp_env(env: dict) -> dict:
    """``env`` with Intel OpenMP (the intel-openmp wheel vLLM installs) in LD_PRELOAD.

    vLLM's CPU kernels use Intel OpenMP, torch GNU OpenMP; with both in one process every
    op of a speculative step waited milliseconds on the other's threads (the tiny policy's
    n-gram rollout: 23.9 s against 1.7 s preloaded, docs/vllm.md). vLLM warns about it but
    cannot fix it: the preload must be in place before the process starts, so whoever
    starts a vLLM worker (LocalCluster, the bench, the image) passes it.
    """
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    preload = env.get("LD_PRELOAD", "")
    if not lib.exists() or "libiomp5" in preload:
        return dict(env)
    return {**env, "LD_PRELOAD": f"{lib}:{preload}" if preload else str(lib)}


def eos_token_ids(model_path: str) -> frozenset[int]:
    """EOS ids from the checkpoint (vLLM has none without a tokenizer)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        f = Path(model_path) / name
        if f.exists():
            eos = json.loads(f.read_text()).get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)


def checkpoint_specs(model_path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor's shape and safetensors dtype ("BF16", "F32", "I64", ...) in the
    checkpoint vLLM started from: what a weight push must match."""
    from safetensors import safe_open

    from services.rollout.weight_receiver import safetensors_files

    specs = {}
    for f in safetensors_files(model_path):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                part = st.get_slice(name)
                specs[name] = (tuple(part.get_shape()), part.get_dtype())
    return specs


def build_vllm_engine(settings, proposer: str | None = None, worker_id: str = "vllm"):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process only (settings.py)
    os.environ["RHYMERL_WORKER_DRAFTER"] = settings.drafter  # what HistoryProposer builds, inside vLLM
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.vllm_kv_cache_gib))
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from services.rollout.vllm_engine.cpu_expand import repair
    from services.rollout.vllm_engine.engine import VllmEngine
    from services.rollout.vllm_engine.stats import EngineStats

    if proposer is None and settings.speculative:
        proposer = "rhymerl"
    stats = EngineStats()
    llm = LLMEngine.from_engine_args(EngineArgs(**engine_args(settings, proposer), disable_log_stats=False),
                                     stat_loggers=[stats.logger_factory()])
    if settings.device in ("auto", "cpu"):
        llm.collective_rpc(repair)  # vLLM's CPU sampler at T > 0 with drafts (cpu_expand.py)
    return VllmEngine(llm, speculative=proposer == "rhymerl", eos_token_ids=eos_token_ids(settings.model_path),
                      max_model_len=llm.model_config.max_model_len, stats=stats,
                      weight_specs=checkpoint_specs(settings.model_path), worker_id=worker_id)
