"""What every part of engine_bench shares: a request, a run of the engine to completion,
the result row of a run (tokens, seconds, forward steps, drafts and accepted tokens), and
a drafter of known continuations for the benchmarks that time verify steps."""

from __future__ import annotations

import time

import torch

from services.rollout.engine import EngineRequest, LLMEngine, run_to_completion


def request(i: int, prompt: list[int], seed: int, temperature: float, max_tokens: int) -> EngineRequest:
    return EngineRequest(
        request_id=f"r{i}", prompt_id=f"p{i // 4}", step_id="bench", sample_index=i % 4, prompt_token_ids=prompt,
        generated_token_ids=[], temperature=temperature, top_p=1.0, top_k=0, min_p=0.0, seed=seed,
        max_tokens=max_tokens, max_new_tokens=max_tokens, stop_token_ids=frozenset(), min_tokens=0,
        ignore_eos=True, logprobs=True)


def run_engine(engine: LLMEngine, reqs: list[EngineRequest]) -> tuple[dict, float]:
    start = time.perf_counter()
    outputs = run_to_completion(engine, reqs)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return outputs, time.perf_counter() - start


def result_row(system: str, sampling: str, engine: LLMEngine, outputs: dict, seconds: float, part: str = "cpu",
         setting: str = "") -> dict:
    c = engine.metrics.counters
    tokens = sum(len(o.token_ids) for o in outputs.values())
    return dict(part=part, system=system, sampling=sampling, setting=setting, tokens=tokens, seconds=seconds,
                steps=c.num_steps, draft_tokens=c.num_draft_tokens, accepted_tokens=c.num_accepted_tokens,
                mean_accepted_per_verify=(c.num_accepted_tokens / c.num_drafts) if c.num_drafts else 0.0)


class ContinuationDrafter:
    """Drafts each request's known continuation (from an earlier run), ``max_lens`` tokens
    at a time: every step verifies full drafts, the verify-heavy end of speculation."""

    def __init__(self, continuations: dict[str, list[int]]):
        self.continuations, self.done = continuations, {}

    def start_request(self, request_id, prompt_id, prompt_token_ids, generated_token_ids=()):
        self.done[request_id] = len(generated_token_ids)

    def add_tokens(self, request_id, token_ids):
        self.done[request_id] += len(token_ids)

    def record_acceptance(self, *args):
        pass

    def stop_request(self, request_id):
        self.done.pop(request_id, None)

    def commit_step(self, request_ids, num_draft, num_accepted, token_ids, num_tokens):
        """A step's add_tokens in one call, as both rhymerl drafters take them (the engines
        send a step's commits so; drafter_protocol.commit_step)."""
        done = self.done
        for request_id, count in zip(request_ids, num_tokens):
            if count > 0:
                done[request_id] += count

    def propose(self, request_ids, max_lens, stop_token_ids=None, budget=None):
        return [self.continuations[r][self.done[r]:self.done[r] + n] for r, n in zip(request_ids, max_lens)]
