"""A WorkItem off the wire -> a checked EngineRequest (the checks: services/common/validation.py)."""

from __future__ import annotations

from rhymerl.v1 import common_pb2, worker_pb2

from services.common.errors import InvalidArgument
from services.common.validation import check_length, check_sampling, check_token_ids
from services.rollout.engine.request import EngineRequest


def to_engine_request(item: worker_pb2.WorkItem, field: str, vocab_size: int, max_model_len: int) -> EngineRequest:
    """Raises InvalidArgument naming the field (``field`` is the item's own, e.g. items[3])."""
    if not item.request_id:
        raise InvalidArgument("must be non-empty", f"{field}.request_id")
    check_token_ids(item.prompt_token_ids, f"{field}.prompt_token_ids", vocab_size)
    check_token_ids(item.generated_token_ids, f"{field}.generated_token_ids", vocab_size, allow_empty=True)
    p = item.sampling
    check_sampling(p, f"{field}.sampling", vocab_size)
    remaining = p.max_tokens - len(item.generated_token_ids)
    if not 1 <= item.max_new_tokens <= remaining:
        raise InvalidArgument(f"must be in [1, {remaining}] (max_tokens minus generated tokens)",
                              f"{field}.max_new_tokens")
    check_length(len(item.prompt_token_ids), p.max_tokens, max_model_len, f"{field}.prompt_token_ids",
                 f"{field}.sampling.max_tokens")
    return EngineRequest(
        request_id=item.request_id, prompt_id=item.prompt_id, step_id=item.step_id,
        sample_index=item.sample_index, prompt_token_ids=list(item.prompt_token_ids),
        generated_token_ids=list(item.generated_token_ids), temperature=p.temperature,
        top_p=p.top_p or 1.0, top_k=p.top_k, min_p=p.min_p, seed=p.seed, max_tokens=p.max_tokens,
        max_new_tokens=item.max_new_tokens, stop_token_ids=frozenset(p.stop_token_ids),
        min_tokens=p.min_tokens, ignore_eos=p.ignore_eos, logprobs=p.logprobs,
        logprobs_mode="processed" if p.logprobs_mode == common_pb2.LOGPROBS_MODE_PROCESSED else "raw")
