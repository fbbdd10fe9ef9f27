"""The worker's engine, chosen by RHYMERL_WORKER_ENGINE: rhymerl's own or vLLM's.

Apart from the server so a benchmark builds the same engine a worker would, and so
neither engine's imports (vLLM's take seconds) load unless chosen.
"""

from __future__ import annotations

from services.common.errors import SettingError
from services.rollout.settings import WorkerSettings


def check_drafter(settings: WorkerSettings) -> None:
    """Refuses a worker whose drafter cannot load (DrafterLibraryError names `make install`)."""
    if settings.speculative and settings.drafter == "compiled":
        from services.rollout.drafter.compiled import load_library

        load_library()


def load_policy(settings: WorkerSettings, device):
    """The checkpoint at model_path, on ``device`` (``loader.worker_device``: a device this
    machine lacks is a SettingError there) in the worker's dtype. A checkpoint that does not
    load (no config.json, invalid JSON, an unsupported architecture, missing, truncated or
    mis-shaped weights) is a SettingError naming the setting: one line at start
    (services/cli.py), not a bare exception."""
    from safetensors import SafetensorError

    from services.rollout.loader import load_model, worker_dtype

    dtype = None if settings.dtype == "auto" else settings.dtype
    try:
        return load_model(settings.model_path, device, dtype or worker_dtype(device))
    except (OSError, ValueError, SafetensorError) as exc:
        raise SettingError("model_path", f"the checkpoint {settings.model_path!r} does not load: {exc}") from exc


def build_engine(settings: WorkerSettings, worker_id: str):
    check_drafter(settings)
    if settings.engine == "vllm":
        from services.rollout.vllm_engine.builder import build_vllm_engine

        return build_vllm_engine(settings, worker_id=worker_id)
    import dataclasses

    from services.rollout.drafter import DrafterConfig
    from services.rollout.drafter.compiled import make_drafter
    from services.rollout.engine import LLMEngine
    from services.rollout.loader import worker_device

    # No drafter without speculation: the engine would never call it, and the compiled one
    # needs its library, which a worker without drafts does not (check_drafter lets it start).
    drafter = make_drafter(settings.drafter, DrafterConfig(max_draft_len=settings.max_draft_len,
                                                           tree=settings.tree_drafts)) if settings.speculative else None
    device = worker_device(settings.device)
    engine = LLMEngine(
        load_policy(settings, device), device=device, max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens, num_kv_blocks=settings.num_kv_blocks or None,
        block_size=settings.block_size, drafter=drafter, speculative=settings.speculative,
        max_draft_len=settings.max_draft_len, worker_id=worker_id, batch_invariant=settings.batch_invariant,
        measure_cost=settings.measure_cost, overlap=settings.overlap,
        deferred_cost_per_step=settings.feed_tokens_per_step)
    # The drafter prices draft tokens on the engine's own cost model (its measured curve),
    # which exists only once the engine has sized it for the loaded model.
    if drafter is not None:
        drafter.config = dataclasses.replace(drafter.config, cost_model=engine.cost_model)
    return engine
