"""The trainer's reference (services/rollout/engine/logprobs.py) returns the rollout's
logprobs bit for bit: for seeded samples generated in batch-invariant mode with
speculation on and off, alone and in batches, chunked and resumed on another engine,
raw and processed, with stop tokens masked before min_tokens; from a model in memory
and from a checkpoint on disk.

If these fail, a trainer that recomputes logprobs with rhymerl's model code no longer
gets what the rollout returned: the importance ratio of its update is off by the
difference, which is exactly what the trainer-matched contract promises away.
"""

from __future__ import annotations

import pytest
import torch
from rhymerl import SamplingParams

from services.rollout.engine import CostModel, EngineRequest, LLMEngine, run_to_completion
from services.rollout.engine.logprobs import reference_logprobs
from services.rollout.loader import init_random_model, save_model
from services.rollout.models.config import ModelConfig

VOCAB = 80
EOS = 2
CONFIG = ModelConfig(
    architecture="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=False, attention_bias=True,
    qk_norm=False, eos_token_ids=(EOS,), bos_token_id=None, dtype="float32")
SAMPLINGS = {
    "raw": SamplingParams(temperature=0.9, top_k=30, top_p=0.9, max_tokens=20, min_tokens=4, stop_token_ids=(7,)),
    "processed": SamplingParams(temperature=1.1, top_k=12, min_p=0.02, max_tokens=20, min_tokens=2,
                                logprobs_mode="processed"),
    "greedy": SamplingParams(temperature=0.0, max_tokens=20, logprobs_mode="processed"),
}


@pytest.fixture(scope="module")
def model():
    return init_random_model(CONFIG, seed=5)


def prompts(n: int) -> list[list[int]]:
    return [[3 + (13 * i + 5 * j) % (VOCAB - 3) for j in range(4 + (9 * i) % 30)] for i in range(n)]


def request(i: int, prompt: list[int], sampling: SamplingParams, **kw) -> EngineRequest:
    fields = dict(request_id=f"r{i}", prompt_id=f"p{i % 3}", step_id="s", sample_index=i, prompt_token_ids=prompt,
                  generated_token_ids=[], temperature=sampling.temperature, top_p=sampling.top_p,
                  top_k=sampling.top_k, min_p=sampling.min_p, seed=7000 + i, max_tokens=sampling.max_tokens,
                  max_new_tokens=sampling.max_tokens, stop_token_ids=frozenset(sampling.stop_token_ids),
                  min_tokens=sampling.min_tokens, ignore_eos=sampling.ignore_eos, logprobs=True,
                  logprobs_mode=sampling.logprobs_mode)
    fields.update(kw)
    return EngineRequest(**fields)


class SiblingDrafter:
    """Drafts from earlier samples: even requests their own (accepted), odd ones another
    sample's (mostly rejected), so verify rows of every kind occur."""

    def __init__(self, corpus: list[list[int]]):
        self.corpus = corpus
        self.tokens: dict[str, list[int]] = {}

    def start_request(self, request_id, prompt_id, prompt_token_ids, generated_token_ids=()):
        self.tokens[request_id] = list(generated_token_ids)

    def add_tokens(self, request_id, token_ids):
        self.tokens[request_id].extend(token_ids)

    def record_acceptance(self, request_id, num_draft, num_accepted):
        pass

    def stop_request(self, request_id):
        self.tokens.pop(request_id, None)

    def propose(self, request_ids, max_lens, stop_token_ids=None, budget=None):
        out = []
        for rid, max_len in zip(request_ids, max_lens):
            done = len(self.tokens[rid])
            i = int(rid[1:])
            source = self.corpus[(i + i % 2) % len(self.corpus)]  # odd ids: another sample's tokens
            out.append(list(source[done:done + min(max_len, 6)]))
        return out


def rollout(model, reqs, drafter=None, device="cpu", batch_invariant=True, **kw) -> dict:
    engine = LLMEngine(model, device=device, num_kv_blocks=256, block_size=8, max_num_seqs=64,
                       max_num_batched_tokens=96, batch_invariant=batch_invariant, drafter=drafter,
                       speculative=drafter is not None, cost_model=CostModel(((1, 1.0), (512, 1.0))), **kw)
    return run_to_completion(engine, reqs)


@pytest.mark.parametrize("mode", SAMPLINGS)
def test_reference_equals_rollout_logprobs_with_and_without_speculation(model, mode):
    """Seeded samples, alone, in a batch of 9 without drafts, in a batch of 9 with drafts:
    the same tokens, and the reference's logprobs equal every rollout's bit for bit."""
    sampling = SAMPLINGS[mode]
    ps = prompts(9)
    reqs = lambda: [request(i, p, sampling) for i, p in enumerate(ps)]  # noqa: E731
    alone = {rid: rollout(model, [r])[rid] for r in reqs() for rid in [r.request_id]}
    plain = rollout(model, reqs())
    corpus = [o.token_ids for o in alone.values()]
    drafted = rollout(model, reqs(), drafter=SiblingDrafter(corpus))
    assert sum(o.num_accepted_tokens for o in drafted.values()) > 0
    assert sum(o.num_draft_tokens - o.num_accepted_tokens for o in drafted.values()) > 0
    expected = reference_logprobs(model, [(p, alone[f"r{i}"].token_ids) for i, p in enumerate(ps)], sampling)
    for outputs in (alone, plain, drafted):
        for i in range(len(ps)):
            out = outputs[f"r{i}"]
            assert out.token_ids == alone[f"r{i}"].token_ids
            assert out.logprobs == expected[i], (mode, i)
    if mode == "raw":  # stop tokens were masked before min_tokens: the reference masks them too
        assert any(len(o.token_ids) < sampling.max_tokens for o in alone.values())


def test_reference_equals_a_chunked_rollout_resumed_elsewhere(model, tmp_path):
    """A sample generated in chunks of 6 on three engines (each chunk re-prefilled beside
    other work), then scored from the checkpoint on disk: the same logprobs."""
    sampling = SAMPLINGS["raw"]
    prompt = prompts(4)[3]
    tokens, logprobs = [], []
    for chunk, mates in enumerate((2, 5, 0, 3)):
        req = request(0, prompt, sampling, generated_token_ids=list(tokens), max_new_tokens=6)
        if len(tokens) >= sampling.max_tokens:
            break
        others = [request(10 + k, p, sampling) for k, p in enumerate(prompts(mates))]
        out = rollout(model, others + [req])["r0"]
        tokens += out.token_ids
        logprobs += out.logprobs
        if out.finish_reason is not None:
            break
    save_model(model, tmp_path / "ckpt")
    assert reference_logprobs(tmp_path / "ckpt", [(prompt, tokens)], sampling) == [logprobs]
    whole = rollout(model, [request(0, prompt, sampling)])["r0"]
    assert whole.token_ids == tokens and whole.logprobs == logprobs


def test_processed_logprobs_are_larger_than_raw(model):
    """Processed logprobs renormalise over the allowed tokens: >= raw, and > where top-k cut mass."""
    prompt, sampling = prompts(2)[1], SAMPLINGS["processed"]
    tokens = rollout(model, [request(0, prompt, sampling)])["r0"].token_ids
    processed = reference_logprobs(model, [(prompt, tokens)], sampling)[0]
    raw = reference_logprobs(model, [(prompt, tokens)], SamplingParams(**{**sampling.__dict__, "logprobs_mode": "raw"}))[0]
    assert all(p >= r for p, r in zip(processed, raw)) and any(p > r for p, r in zip(processed, raw))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_reference_equals_rollout_with_cuda_graphs_and_drafts(model):
    """bf16 on the GPU, CUDA graphs on, drafts verified: the reference (Triton kernels,
    one prefill) equals the rollout's logprobs bit for bit."""
    gpu_model = init_random_model(CONFIG, seed=5).to("cuda", torch.bfloat16)
    sampling = SAMPLINGS["raw"]
    ps = prompts(9)
    reqs = lambda: [request(i, p, sampling) for i, p in enumerate(ps)]  # noqa: E731
    plain = rollout(gpu_model, reqs(), device="cuda", use_cuda_graphs=True)
    drafted = rollout(gpu_model, reqs(), device="cuda", use_cuda_graphs=True,
                      drafter=SiblingDrafter([plain[f"r{i}"].token_ids for i in range(len(ps))]))
    expected = reference_logprobs(gpu_model, [(p, plain[f"r{i}"].token_ids) for i, p in enumerate(ps)], sampling,
                                  device="cuda")
    for outputs in (plain, drafted):
        assert [outputs[f"r{i}"].logprobs for i in range(len(ps))] == expected


# docs/sampling.md: in the default mode the reference equals the rollout "to rounding"
# (float32 on a CPU); this is the bound it states.
DEFAULT_MODE_TOLERANCE = 1e-5


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_default_mode_reference_is_within_the_documented_tolerance(model, mode):
    """Default mode (not batch-invariant): each sample alone, and a batch of 9 with drafts
    verified. The reference's logprobs of each returned sequence are within the tolerance
    docs/sampling.md states of the rollout's, token for token. (The tokens themselves are
    not compared: in this mode a last-bit difference may flip a near-tie.)"""
    sampling = SAMPLINGS[mode]
    ps = prompts(9)
    reqs = lambda: [request(i, p, sampling) for i, p in enumerate(ps)]  # noqa: E731
    alone = {r.request_id: rollout(model, [r], batch_invariant=False)[r.request_id] for r in reqs()}
    drafted = rollout(model, reqs(), drafter=SiblingDrafter([o.token_ids for o in alone.values()]),
                      batch_invariant=False)
    assert sum(o.num_accepted_tokens for o in drafted.values()) > 0
    worst = 0.0
    for outputs in (alone, drafted):
        got = [outputs[f"r{i}"] for i in range(len(ps))]
        expected = reference_logprobs(model, [(p, o.token_ids) for p, o in zip(ps, got)], sampling)
        for out, want in zip(got, expected):
            assert len(out.logprobs) == len(want) == len(out.token_ids) > 0
            worst = max([worst, *(abs(a - b) for a, b in zip(out.logprobs, want))])
    assert worst <= DEFAULT_MODE_TOLERANCE, worst
