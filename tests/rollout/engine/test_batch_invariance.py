"""Batch-invariant mode: a probe sequence's logits are bitwise the same whatever else
happens in the engine.

One probe sample is generated alone (the baseline), then in batches of 1..64 sequences
of mixed lengths joining at different steps (chunked prefill beside decodes), verified
with drafts of 0..16 tokens (accepted and rejected), resumed after a chunk on another
engine (a re-prefill of prompt + generated tokens), and after being preempted (its KV
recomputed). Every logits row the engine computes for the probe's true context must be
``torch.equal`` to the baseline's, so its tokens and logprobs are too.

If these fail, "the same tokens with and without speculation, after migration or
preemption" no longer holds bit for bit, and a trainer recomputing logprobs with our
model code (services/rollout/engine/logprobs.py) no longer gets the rollout's numbers.
"""

from __future__ import annotations

import pytest
import torch

from services.rollout.engine import CostModel, EngineRequest, LLMEngine
from services.rollout.loader import init_random_model
from services.rollout.models.config import ModelConfig

VOCAB = 101
CONFIG = ModelConfig(
    architecture="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=False, attention_bias=True,
    qk_norm=False, eos_token_ids=(0,), bos_token_id=None, dtype="float32")
PROBE_PROMPT = [1 + (11 * j) % (VOCAB - 1) for j in range(23)]
PROBE_TOKENS = 24


@pytest.fixture(scope="module")
def model():
    return init_random_model(CONFIG, seed=1)


def probe(**kw) -> EngineRequest:
    return request("probe", PROBE_PROMPT, seed=4242, max_tokens=PROBE_TOKENS, **kw)


def request(rid: str, prompt: list[int], seed: int, max_tokens: int, **kw) -> EngineRequest:
    fields = dict(request_id=rid, prompt_id=rid, step_id="s", sample_index=0, prompt_token_ids=list(prompt),
                  generated_token_ids=[], temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=seed,
                  max_tokens=max_tokens, max_new_tokens=max_tokens, stop_token_ids=frozenset(), min_tokens=0,
                  ignore_eos=True, logprobs=True)
    fields.update(kw)
    return EngineRequest(**fields)


def others(n: int, salt: int = 0) -> list[EngineRequest]:
    """n batch mates with prompts of 1..90 tokens and 3..40 tokens to generate."""
    return [request(f"o{i}", [1 + (5 * j + 17 * i + salt) % (VOCAB - 1) for j in range(1 + (37 * i + salt) % 90)],
                    seed=i + 100 * salt, max_tokens=3 + (11 * i) % 38) for i in range(n)]


class Recorder:
    """Wraps the engine's model runner: keeps every logits row computed for the probe,
    keyed by the context it predicts from (draft rows included), and counts the probe's
    prefills (more than one = its KV was recomputed)."""

    def __init__(self, engine: LLMEngine):
        # (the probe, its length, its draft, the row's logits): keyed by context once the
        # run is over (``rows``), since a step without drafts reads its last token after
        # the next forward (the engine's overlap: until then the token is a placeholder)
        self._seen: list[tuple[object, int, list[int], torch.Tensor]] = []
        self.draft_rows = 0
        self.prefills = 0
        self._run = engine.runner.run
        engine.runner.run = self.run

    def run(self, seqs, fed=None):
        logits = self._run(seqs, fed)
        row = 0
        for seq in seqs:
            if seq.request_id == "probe" and seq.num_computed_tokens == 0:
                self.prefills += 1
            if seq.num_computed_tokens + seq.num_scheduled_tokens != seq.num_tokens:
                continue  # a prefill chunk: no row samples
            for j in range(1 + len(seq.draft_token_ids)):
                if seq.request_id == "probe":
                    self._seen.append((seq, seq.num_tokens, seq.draft_token_ids[:j], logits[row].clone()))
                    self.draft_rows += j > 0
                row += 1
        return logits

    @property
    def rows(self) -> dict[tuple[int, ...], list[torch.Tensor]]:
        """Every logits row computed for the probe, by the context it predicts from."""
        rows: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for seq, length, draft, logits in self._seen:
            rows.setdefault(tuple(seq.token_ids[:length] + draft), []).append(logits)
        return rows


class TrueContinuationDrafter:
    """Drafts the probe's true continuation, k = 0..16 tokens per step (cycling), with
    every 5th draft token wrong, so verifies accept, reject, and mix lengths."""

    def __init__(self, continuation: list[int]):
        self.continuation = continuation
        self.generated: dict[str, int] = {}
        self.calls = 0

    def start_request(self, request_id, prompt_id, prompt_token_ids, generated_token_ids=()):
        self.generated[request_id] = len(generated_token_ids)

    def add_tokens(self, request_id, token_ids):
        self.generated[request_id] += len(token_ids)

    def record_acceptance(self, request_id, num_draft, num_accepted):
        pass

    def stop_request(self, request_id):
        self.generated.pop(request_id, None)

    def propose(self, request_ids, max_lens, stop_token_ids=None, budget=None):
        drafts = []
        for rid, max_len in zip(request_ids, max_lens):
            self.calls += 1
            done = self.generated[rid]
            k = min(max_len, self.calls % 17)
            draft = list(self.continuation[done:done + k]) if rid == "probe" else [1 + (done + j) % 50 for j in range(k)]
            drafts.append([(t + 1) % VOCAB if j % 5 == 4 else t for j, t in enumerate(draft)])
        return drafts


def run(model, reqs, late: dict[int, list[EngineRequest]] | None = None, drafter=None, **kw):
    """Runs the requests (``late[k]`` join before step k) in batch-invariant mode; returns
    (outputs by request id, the probe's Recorder, the engine)."""
    args = dict(device="cpu", num_kv_blocks=512, block_size=16, max_num_seqs=128, max_num_batched_tokens=256,
                batch_invariant=True, drafter=drafter, speculative=drafter is not None, max_draft_len=16,
                cost_model=CostModel(((1, 1.0), (512, 1.0))))  # a flat curve: drafts never cost
    args.update(kw)
    engine = LLMEngine(model, **args)
    recorder = Recorder(engine)
    for r in reqs:
        engine.add_request(r)
    late = dict(late or {})
    outputs, step = {}, 0
    while engine.has_unfinished() or late:
        for r in late.pop(step, []):
            engine.add_request(r)
        for out in engine.step():
            outputs[out.request_id] = out
        step += 1
        assert step < 5000
    return outputs, recorder, engine


@pytest.fixture(scope="module")
def baseline(model):
    """The probe decoded alone: its tokens, logprobs and one logits row per position."""
    outputs, rec, _ = run(model, [probe()])
    assert all(len(rows) == 1 for rows in rec.rows.values()) and len(rec.rows) == PROBE_TOKENS
    return outputs["probe"], {ctx: rows[0] for ctx, rows in rec.rows.items()}


def assert_same_as_baseline(baseline, out, rec, min_rows: int = PROBE_TOKENS) -> int:
    """Every recorded row on the probe's true path equals the baseline's; returns how many."""
    base_out, base_rows = baseline
    assert out.token_ids == base_out.token_ids and out.logprobs == base_out.logprobs
    compared = 0
    for ctx, rows in rec.rows.items():
        if ctx in base_rows:
            for row in rows:
                assert torch.equal(row, base_rows[ctx]), f"position {len(ctx)}: {(row - base_rows[ctx]).abs().max()}"
                compared += 1
    assert compared >= min_rows
    return compared


@pytest.mark.parametrize("batch_size", [1, 2, 3, 7, 16, 33, 64])
def test_probe_logits_identical_in_batches_of_1_to_64(model, baseline, batch_size):
    """Batch mates of mixed prompt lengths arrive before, with and after the probe, so its
    rows share forwards with decodes and chunked prefills of every size."""
    mates = others(batch_size - 1, salt=batch_size)
    early, late = mates[: len(mates) // 2], mates[len(mates) // 2:]
    outputs, rec, _ = run(model, early + [probe()], late={3: late[: len(late) // 2], 9: late[len(late) // 2:]},
                          max_num_batched_tokens=64)
    assert len(outputs) == batch_size
    assert_same_as_baseline(baseline, outputs["probe"], rec)


def test_probe_logits_identical_with_0_to_16_drafts(model, baseline):
    """Verify rows (1 + k tokens, k = 0..16, accepted or rejected) equal decode rows."""
    base_out, _ = baseline
    drafter = TrueContinuationDrafter(base_out.token_ids)
    outputs, rec, _ = run(model, [probe()] + others(12, salt=5), drafter=drafter)
    assert outputs["probe"].num_accepted_tokens > 0 and outputs["probe"].num_draft_tokens > outputs[
        "probe"].num_accepted_tokens  # some drafts accepted, some rejected
    assert_same_as_baseline(baseline, outputs["probe"], rec)
    assert rec.draft_rows > 0


def test_probe_resumed_on_another_engine_after_a_chunk(model, baseline):
    """Chunk 1 (9 tokens) in one batch; chunk 2 re-prefilled on a fresh engine in another."""
    first, rec_a, _ = run(model, [probe(max_new_tokens=9)] + others(5, salt=1))
    head = first["probe"].token_ids
    assert len(head) == 9 and first["probe"].finish_reason is None
    second, rec_b, _ = run(model, others(20, salt=2) + [probe(generated_token_ids=head,
                                                                max_new_tokens=PROBE_TOKENS - 9)])
    base_out, base_rows = baseline
    rows = {**rec_a.rows, **rec_b.rows}
    assert head + second["probe"].token_ids == base_out.token_ids
    assert first["probe"].logprobs + second["probe"].logprobs == base_out.logprobs
    assert all(torch.equal(rows[ctx][0], row) for ctx, row in base_rows.items())


def test_probe_after_preemption(model, baseline):
    """A KV pool too small for the batch: the probe (admitted last) is preempted and its
    KV recomputed from its tokens; its logits do not change."""
    mates = [request(f"o{i}", [1 + (3 * j + i) % (VOCAB - 1) for j in range(8)], seed=i, max_tokens=30)
             for i in range(4)]
    outputs, rec, engine = run(model, mates + [probe()], num_kv_blocks=20, block_size=4)
    assert engine.metrics.counters.num_preemptions > 0 and rec.prefills >= 2, "the probe was never preempted"
    assert_same_as_baseline(baseline, outputs["probe"], rec)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("use_cuda_graphs", [False, True])
def test_gpu_bf16_probe_identical_in_batches_with_and_without_cuda_graphs(use_cuda_graphs):
    """bf16 on the GPU (Triton matmul, RMSNorm, fixed-split attention): the probe alone and
    eager equals the probe in batches and under drafts, with CUDA graphs or without."""
    gpu_model = init_random_model(CONFIG, seed=1).to("cuda", torch.bfloat16)
    kw = dict(device="cuda", num_kv_blocks=512, use_cuda_graphs=use_cuda_graphs)
    alone_out, alone_rec, _ = run(gpu_model, [probe()], device="cuda", num_kv_blocks=512, use_cuda_graphs=False)
    gpu_baseline = (alone_out["probe"], {ctx: rows[0] for ctx, rows in alone_rec.rows.items()})
    for batch_size in (2, 17, 64):
        outputs, rec, _ = run(gpu_model, others(batch_size - 1, salt=batch_size) + [probe()], **kw)
        assert_same_as_baseline(gpu_baseline, outputs["probe"], rec)
    drafter = TrueContinuationDrafter(alone_out["probe"].token_ids)
    outputs, rec, _ = run(gpu_model, [probe()] + others(12, salt=5), drafter=drafter, **kw)
    assert_same_as_baseline(gpu_baseline, outputs["probe"], rec)
