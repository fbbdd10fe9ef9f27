"""The worker's engine, chosen by RHYMERL_WORKER_ENGINE: rhymerl's own or vLLM's.

Apart from the server so a benchmark builds the same engine a worker would, and so
neither engine's imports (vLLM's take seconds) load unless chosen.
"""

from __future__ import annotations

from services.rollout.settings import WorkerSettings


def check_drafter(settings: WorkerSettings) -> None:
    """Refuses a worker whose drafter cannot load (DrafterLibraryError names `make install`)."""
    if settings.speculative and settings.drafter == "compiled":
        from services.rollout.drafter.compiled import load_library

        load_library()


def build_engine(settings: WorkerSettings, worker_id: str):
    check_drafter(settings)
    if settings.engine == "vllm":
        from services.rollout.vllm_engine.builder import build_vllm_engine

        return build_vllm_engine(settings, worker_id=worker_id)
    import dataclasses

    from services.rollout.drafter import DrafterConfig
    from services.rollout.drafter.compiled import make_drafter
    from services.rollout.engine import LLMEngine

    drafter = make_drafter(settings.drafter, DrafterConfig(max_draft_len=settings.max_draft_len,
                                                           tree=settings.tree_drafts))
    engine = LLMEngine.from_path(
        settings.model_path, device=settings.device, dtype=None if settings.dtype == "auto" else settings.dtype, max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens, num_kv_blocks=settings.num_kv_blocks or None,
        block_size=settings.block_size, drafter=drafter, speculative=settings.speculative,
        max_draft_len=settings.max_draft_len, worker_id=worker_id, batch_invariant=settings.batch_invariant,
        measure_cost=settings.measure_cost, overlap=settings.overlap,
        deferred_cost_per_step=settings.feed_tokens_per_step)
    # The drafter prices draft tokens on the engine's own cost model (its measured curve),
    # which exists only once the engine has sized it for the loaded model.
    drafter.config = dataclasses.replace(drafter.config, cost_model=engine.cost_model)
    return engine
