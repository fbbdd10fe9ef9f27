"""The engine on the GPU as a worker runs it: Triton kernels, CUDA graphs, bf16 and float32.

If these fail, a GPU worker returns samples that are not the policy's (speculation is
no longer lossless, a CUDA-graph bucket or the paged KV cache corrupts a sequence, the
model code disagrees with transformers), which the CPU suite cannot see.
"""

from __future__ import annotations

import copy
import dataclasses
import tempfile

import pytest
import torch

from benchmarks.engine_gpu_steps import cuda_synchronisations
from services.rollout.drafter import HistoDrafter
from services.rollout.drafter.compiled import CompiledDrafter
from services.rollout.engine import LLMEngine
from services.rollout.engine.attention import AttentionMetadata, KVCache, PagedAttention
from services.rollout.loader import init_random_model, save_model
from tests.gpu.agreement import assert_agree, outputs
from tests.rollout.engine.host_reads import counting_host_reads
from tests.rollout.engine.test_persistent_batch import assert_reads_hold_their_values
from tests.rollout.engine.test_engine import CONFIG, OracleDrafter, make_request, prompt_of, reference_generate, run_to_end

pytestmark = pytest.mark.gpu

# head_dim 64 and a GQA group of 2: the shapes the Triton kernels are tuned for
GPU_CONFIG = dataclasses.replace(CONFIG, vocab_size=512, hidden_size=256, intermediate_size=512,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=64)
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def models(dtype: torch.dtype):
    """The model in `dtype`, and its float32 copy (the same rounded weights) for the CPU reference."""
    model = init_random_model(dataclasses.replace(GPU_CONFIG, dtype="float32"), seed=3).to(dtype)
    return model, copy.deepcopy(model).float()


def requests(truncation: bool) -> list:
    """Greedy and sampled rows, prompts shorter and longer than a block (16), joined later
    by a second wave; with `truncation`, top-k / top-p / min-p rows too."""
    rows = [(3, 0.0, 0, 1.0, 0.0), (17, 1.0, 0, 1.0, 0.0), (40, 0.7, 0, 1.0, 0.0), (1, 1.3, 0, 1.0, 0.0),
            (16, 0.0, 0, 1.0, 0.0), (33, 1.0, 0, 1.0, 0.0)]
    if truncation:
        rows += [(9, 0.8, 10, 1.0, 0.0), (25, 1.0, 0, 0.9, 0.0), (5, 1.0, 0, 1.0, 0.05)]
    return [make_request(i, prompt_of(n, i), temperature=t, top_k=k, top_p=p, min_p=m, max_tokens=24,
                         max_new_tokens=24) for i, (n, t, k, p, m) in enumerate(rows)]


def engine(model, device: str, reqs, **kw) -> LLMEngine:
    args = dict(device=device, num_kv_blocks=256, block_size=16, max_num_batched_tokens=128, max_draft_len=6,
                max_num_seqs=16)
    e = LLMEngine(model, **{**args, **kw})
    for r in reqs:
        e.add_request(r)
    return e


def graph_replays(e: LLMEngine, device: str) -> None:
    if device == "cuda":  # the dry run on the CPU has no graphs
        assert e.runner.graphs is not None and e.runner.graphs.num_replays > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_speculation_equals_plain_decoding(device, dtype):
    """Drafts verified in one forward (an oracle corrupted every 3rd token, and the real
    history drafter, Python and compiled, on last epoch's responses) give the samples plain
    decoding gives."""
    model, cpu_model = models(dtype)
    reqs = requests(truncation=dtype == torch.float32)
    plain = run_to_end(engine(model, device, reqs, speculative=False))
    oracle = OracleDrafter({rid: o.token_ids for rid, o in plain.items()}, wrong_every=3)
    history, compiled = HistoDrafter(), CompiledDrafter()
    for r in reqs:  # each prompt's "last epoch": its own plain sample
        history.load_history(r.prompt_id, [plain[r.request_id].token_ids])
        compiled.load_history(r.prompt_id, [plain[r.request_id].token_ids])
    for drafter in (oracle, history, compiled):
        e = engine(model, device, reqs, drafter=drafter)
        spec = run_to_end(e)
        assert_agree(outputs(spec), outputs(plain), reqs, cpu_model, dtype)
        assert e.metrics.counters.num_accepted_tokens > 0
        graph_replays(e, device)


@pytest.mark.parametrize("dtype", DTYPES)
def test_output_matches_the_cpu_reference(device, dtype):
    """With CUDA graphs, Triton attention and sampling, with and without drafts: each
    sample is the float32 CPU reference's (one token per full recompute, dense attention)."""
    model, cpu_model = models(dtype)
    reqs = requests(truncation=False)
    want = {r.request_id: reference_generate(cpu_model, r)[:2] for r in reqs}
    plain = run_to_end(engine(model, device, reqs, speculative=False))
    assert_agree(outputs(plain), want, reqs, cpu_model, dtype)
    e = engine(model, device, reqs, drafter=OracleDrafter({k: v[0] for k, v in want.items()}, wrong_every=4))
    assert_agree(outputs(run_to_end(e)), want, reqs, cpu_model, dtype)
    graph_replays(e, device)


def test_cuda_graph_buckets_match_eager(device):
    """Batches that grow and shrink (requests joining late, finishing early) replay decode
    and verify graphs of several bucket sizes, padded; the samples equal the eager run's."""
    model, cpu_model = models(torch.float32)
    reqs = requests(truncation=True)
    late = {0: reqs[:1], 3: reqs[1:3], 9: reqs[3:]}  # 1, then 3, then 9 sequences at once
    eager = run_to_end(engine(model, device, [], use_cuda_graphs=False, speculative=False), late=dict(late))
    oracle = OracleDrafter({rid: o.token_ids for rid, o in eager.items()}, wrong_every=3)
    for drafter in (None, oracle):
        e = engine(model, device, [], drafter=drafter, speculative=drafter is not None)
        assert_agree(outputs(run_to_end(e, late=dict(late))), outputs(eager), reqs, cpu_model, torch.float32)
        if device == "cuda":
            graphs = e.runner.graphs
            assert graphs.num_replays > 0 and not graphs.failed
            assert len({seqs for seqs, _, _ in graphs.graphs}) >= 3  # several sequence buckets captured
            if drafter is not None:
                assert any(q > 1 for _, _, q in graphs.graphs)  # a verify bucket


def test_engines_made_one_after_another_capture_every_graph(device):
    """A process that makes engine after engine (benchmarks, tests, a worker reloading):
    an earlier engine's graphs, freed while a later one captures, must not break its
    captures (on an H100 a capture failed and the engine served without graphs)."""
    if device != "cuda":
        pytest.skip("CUDA graphs exist only on the GPU")
    model, _ = models(torch.bfloat16)
    for _ in range(3):
        e = engine(model, device, [], drafter=HistoDrafter(), speculative=True)
        graphs = e.runner.graphs
        assert graphs is not None and not graphs.failed
        assert any(q > 1 for _, _, q in graphs.graphs) and any(q == 1 for _, _, q in graphs.graphs)
        del e, graphs  # left to the cycle collector, as a benchmark's engines are


def test_a_second_engine_over_the_same_model_leaves_the_first_ones_graphs_right(device):
    """Each engine moves the model it is given to its device; the first engine's graphs read
    the model's tensors by address. In the H200 window of 2026-11-26 the sweep's plain engine,
    built first of three over one model, stopped ending its samples: the second engine's
    move had replaced the RoPE frequencies, and the first's graphs read their freed memory
    once it was reused (here: filled with NaN by many small allocations)."""
    model, cpu_model = models(torch.float32)
    reqs = requests(truncation=False)
    want = outputs(run_to_end(engine(model, device, reqs, use_cuda_graphs=False, speculative=False)))
    first = engine(model, device, [], speculative=False)
    second = engine(model, device, [], speculative=False)
    churn = [torch.full((64,), float("nan"), device=device) for _ in range(20000)]
    for r in reqs:
        first.add_request(r)
    assert_agree(outputs(run_to_end(first)), want, reqs, cpu_model, torch.float32)
    del churn, second


def synchronisations(e: LLMEngine, device: str) -> int:
    """How many times one ``e.step()`` makes the host wait for the GPU, as
    ``torch.cuda.set_sync_debug_mode`` reports them (on the CPU dry run: the host reads
    that tests/rollout/engine/host_reads.py counts)."""
    if device != "cuda":
        with counting_host_reads(e) as reads:
            e.step()
        return len(reads.calls)
    return cuda_synchronisations(e.step)


def test_decode_and_verify_steps_synchronise_once(device):
    """A decode or verify step (CUDA graph replay, the Triton sampler, top-k / top-p /
    min-p rows, stop tokens masked before min_tokens) waits for the GPU once: to read
    the sampled tokens. A second wait (a pageable copy, an ``.item()``, a host decision
    read from the device) fails it."""
    model, _ = models(torch.float32)
    reqs = requests(truncation=True) + [make_request(9, prompt_of(7, 9), temperature=1.0, min_tokens=8,
                                                     stop_token_ids=frozenset({3, 4}), ignore_eos=False,
                                                     max_tokens=24, max_new_tokens=24)]
    plain = run_to_end(engine(model, device, reqs, speculative=False))
    oracle = OracleDrafter({rid: o.token_ids for rid, o in plain.items()}, wrong_every=3)
    for drafter in (None, oracle):
        e = engine(model, device, reqs, drafter=drafter, speculative=drafter is not None)
        counts = []
        while e.has_unfinished():
            prompt_tokens = e.metrics.counters.num_prompt_tokens
            n = synchronisations(e, device)
            if e.metrics.counters.num_prompt_tokens == prompt_tokens:  # no prefill chunk ran
                counts.append(n)
        assert len(counts) >= 5 and max(counts) <= 1, counts
        graph_replays(e, device)
        if drafter is not None:
            assert e.metrics.counters.num_drafts > 0


def test_host_reads_hold_their_values_through_the_next_read(device):
    """The verify step's read and the overlapped decode's (pinned buffers by length and
    turn, an event each) on the device: exact, and a pending read intact after the next."""
    assert_reads_hold_their_values(device)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_overlapped_decode_samples_what_reading_at_once_does(device, dtype):
    """Steps without drafts launched on the last step's tokens straight from the device
    (CUDA-graph replays fed by a device copy, the tokens read behind the next forward
    through pinned buffers used by turns, engine.py's overlap): bit for bit the samples of
    the engine that reads each step's tokens before the next (batch-invariant kernels),
    with stop tokens found one step late and a second wave joining mid-run."""
    model, _ = models(dtype)
    reqs = requests(truncation=True)
    reqs = [dataclasses.replace(r, stop_token_ids=frozenset({5, 11, 17}), ignore_eos=False) if i % 2 else r
            for i, r in enumerate(reqs)]
    late = {6: reqs[6:]}
    kw = dict(speculative=False, batch_invariant=True)
    plain = run_to_end(engine(model, device, reqs[:6], overlap=False, **kw), late=dict(late))
    want = outputs(plain)
    e = engine(model, device, reqs[:6], overlap=True, **kw)
    fed = []
    run = e.runner.run

    def spied(seqs, tokens=None):
        fed.append(tokens is not None)
        return run(seqs, tokens)

    e.runner.run = spied
    got = run_to_end(e, late=dict(late))
    assert outputs(got) == want
    assert [o.finish_reason for o in got.values()] == [plain[rid].finish_reason for rid in got]
    assert sum(fed) >= 10 and any(o.finish_reason == "stop" for o in plain.values())
    graph_replays(e, device)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_kv_cache_under_pressure(device, dtype):
    """Too few KV blocks for the batch: sequences are preempted and recomputed, with and
    without drafts, and every sample still equals the unconstrained run's; every block is
    free at the end."""
    model, cpu_model = models(dtype)
    reqs = requests(truncation=False)
    roomy = run_to_end(engine(model, device, reqs, speculative=False))
    oracle = OracleDrafter({rid: o.token_ids for rid, o in roomy.items()}, wrong_every=3)
    for drafter in (None, oracle):
        e = engine(model, device, reqs, num_kv_blocks=7, drafter=drafter, speculative=drafter is not None)
        assert_agree(outputs(run_to_end(e)), outputs(roomy), reqs, cpu_model, dtype)
        assert e.metrics.counters.num_preemptions > 0
        assert e.block_manager.num_free_blocks == 7


@torch.inference_mode()
def paged_logits(model, sequences: list[list[int]], device: str, block_size: int = 16) -> list[torch.Tensor]:
    """Every position's logits through the worker's path: the paged KV cache and attention
    backend, each sequence prefilled in two chunks (the second reads the first's KV)."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    width = max(-(-len(s) // block_size) for s in sequences)
    cache = KVCache(cfg.num_hidden_layers, len(sequences) * width, block_size, cfg.num_key_value_heads,
                    cfg.head_dim, dtype, torch.device(device))
    attn = PagedAttention(cache, cfg.head_dim ** -0.5)

    def t(values, dt) -> torch.Tensor:
        return torch.tensor(values, dtype=dt, device=device)

    out = []
    for s, tokens in enumerate(sequences):
        table = list(range(s * width, (s + 1) * width))
        rows = []
        for start, end in ((0, len(tokens) // 2), (len(tokens) // 2, len(tokens))):
            pos = list(range(start, end))
            attn.metadata = AttentionMetadata(
                t([table[p // block_size] * block_size + p % block_size for p in pos], torch.int64),
                t([table], torch.int32), t([end], torch.int32), t([0, end - start], torch.int32), end - start)
            rows.append(model.compute_logits(model.forward(t(tokens[start:end], torch.int64), t(pos, torch.int64),
                                                           attn)).float())
        out.append(torch.cat(rows))  # [len(tokens), vocab]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_match_transformers(device, dtype):
    """The model code through the paged path equals Hugging Face transformers' own model
    loaded from the same checkpoint, on the same device in the same dtype."""
    from transformers import AutoModelForCausalLM

    model, _ = models(dtype)
    with tempfile.TemporaryDirectory() as tmp:
        save_model(model, tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(device).eval()
    model = model.to(device)
    sequences = [prompt_of(n, n) for n in (5, 16, 47, 100)]
    ours = paged_logits(model, sequences, device)
    for tokens, mine in zip(sequences, ours):
        with torch.inference_mode():
            theirs = hf(torch.tensor([tokens], device=device)).logits[0].float()  # [len, vocab]
        error = float((mine - theirs).norm() / theirs.norm())
        assert error < {torch.float32: 1e-4, torch.bfloat16: 2e-2}[dtype], (len(tokens), error)
        same_argmax = (mine.argmax(-1) == theirs.argmax(-1)).float().mean().item()
        assert same_argmax > (0.999 if dtype == torch.float32 else 0.9), (len(tokens), same_argmax)
