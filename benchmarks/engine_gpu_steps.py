"""engine_bench's GPU part: decode and verify step times with random bf16 weights for the
Qwen2.5-0.5B/1.5B shapes, the CUDA-graph forward alone and the whole engine step, beside
the floor measured in the same run (a CUDA-graphed chain of the same weight matrices)."""

from __future__ import annotations

import gc
import math
import time
import warnings
from collections.abc import Callable

import torch

from benchmarks.engine_run import request
from services.common.cost_curve import H100_CURVES
from services.rollout.engine import CostModel, LLMEngine
from services.rollout.loader import init_random_model
from services.rollout.models.config import ModelConfig
from services.rollout.models.transformer import CausalLM


def qwen_shape(name: str) -> ModelConfig:
    """Qwen2.5-0.5B / 1.5B shapes (random weights, bf16)."""
    hidden, inter, layers, heads, kv = {"0.5B": (896, 4864, 24, 14, 2), "1.5B": (1536, 8960, 28, 12, 2)}[name]
    return ModelConfig(
        architecture="qwen2", vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads, rms_norm_eps=1e-6,
        rope_theta=1e6, rope_scaling=None, max_position_embeddings=32768, tie_word_embeddings=True,
        attention_bias=True, qk_norm=False, eos_token_ids=(151643,), bos_token_id=None, dtype="bfloat16")


class FixedDrafter:
    """Proposes `draft_len` arbitrary tokens for every request (verify-cost measurement)."""

    def __init__(self, draft_len: int):
        self.draft_len = draft_len

    def start_request(self, *a, **k): ...
    def add_tokens(self, *a, **k): ...
    def record_acceptance(self, *a, **k): ...
    def stop_request(self, *a, **k): ...

    def propose(self, request_ids, max_lens, stop_token_ids=None, budget=None):
        return [[7] * min(self.draft_len, m) for m in max_lens]


def random_model_cuda(config: ModelConfig) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to(torch.bfloat16).to_empty(device="cuda")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.normal_(0, 0.02)
            else:
                p.normal_(0, 1 / math.sqrt(p.shape[-1]))
    return model


CASES = [(b, 0) for b in (1, 16, 64, 256)] + [(1, 16), (4, 16), (16, 8), (16, 15), (32, 7), (64, 3)]


def gpu_part(context_len: int, num_steps: int, shapes: dict[str, ModelConfig] | None = None,
             cases: list[tuple[int, int]] = CASES, device: str = "cuda", on_row=None) -> list[dict]:
    """Per shape (default: Qwen2.5-0.5B and 1.5B) and (batch, draft) case: the engine step,
    its CUDA-graph forward and the measured floor. `device="cpu"` (tiny shapes) only checks
    that it runs; `on_row` sees each row as it is measured."""
    rows = []
    shapes = shapes or {name: qwen_shape(name) for name in ("0.5B", "1.5B")}
    cuda = device == "cuda"
    for name, config in shapes.items():
        model = random_model_cuda(config) if cuda else init_random_model(config, seed=0)
        floor = dict(H100_CURVES.get(name, {1: None}))
        for batch, draft in cases:
            max_tokens = 10 * num_steps
            blocks_per_seq = -(-(context_len + max_tokens + draft + 1) // 16)
            engine = LLMEngine(model, device=device, max_num_seqs=batch, max_num_batched_tokens=8192,
                               num_kv_blocks=batch * blocks_per_seq + 1, block_size=16,
                               drafter=FixedDrafter(draft) if draft else None, speculative=bool(draft),
                               max_draft_len=max(draft, 1), cost_model=CostModel(tolerance=100.0))
            gen = torch.Generator().manual_seed(batch)
            for i in range(batch):
                prompt = torch.randint(1, config.vocab_size, (context_len,), generator=gen).tolist()
                engine.add_request(request(i, prompt, i, 1.0, max_tokens))
            while any(s.num_uncomputed > 1 for s in engine.seqs.values()) or engine.num_waiting():
                engine.step()  # prefill
            for _ in range(3):
                engine.step()  # capture graphs, warm up
            _sync(device)
            start = time.perf_counter()
            for _ in range(num_steps):
                engine.step()
            _sync(device)
            step_ms = (time.perf_counter() - start) / num_steps * 1e3
            forward_ms = _graph_forward_ms(engine, batch, batch * (1 + draft), draft) if cuda else None
            syncs = cuda_synchronisations(engine.step) if cuda else None
            tokens = batch * (1 + draft)
            floor_ms = _weight_chain_ms(config, batch, device) if draft == 0 else None
            rows.append(dict(part="gpu", model=name, batch=batch, draft=draft, tokens_per_forward=tokens,
                             forward_ms=forward_ms, step_ms=step_ms, measured_floor_ms=floor_ms, syncs=syncs,
                             design_ms=CostModel(H100_CURVES[name]).step_ms(tokens) if name in H100_CURVES else None,
                             floor_ms={"0.5B": 0.34, "1.5B": 1.06}.get(name), design_m1_ms=floor[1]))
            print(rows[-1], flush=True)
            if on_row is not None:
                on_row(rows[-1])
            del engine
            gc.collect()  # the engine's CUDA graphs hold references back to it
            if cuda:
                torch.cuda.empty_cache()
        del model
        gc.collect()
    return rows


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def cuda_synchronisations(step: Callable[[], object]) -> int:
    """How many times one call of ``step`` makes the host wait for the GPU, as
    ``torch.cuda.set_sync_debug_mode("warn")`` reports them (each blocking copy, ``.item()``,
    ``.tolist()``, explicit synchronize, ...), plus the waits for a queued read of a step's
    tokens (``PendingRead.result``: an event's synchronize, which the debug mode does not
    report)."""
    from services.rollout.engine.input_batch import PendingRead

    result, waits = PendingRead.result, []

    def counted(pending):
        waits.append(pending)
        return result(pending)

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        PendingRead.result = counted
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            PendingRead.result = result
    return sum("synchroniz" in str(w.message) for w in caught) + len(waits)


def floor_dims(config: ModelConfig) -> tuple[int, ...]:
    """The shape's dimensions as ``cost_probe.weight_matrices`` takes them."""
    return (config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.vocab_size)


def _weight_chain_ms(config: ModelConfig, batch: int, device: str, repeats: int = 20) -> float:
    """The measured floor of a decode step at this batch: every weight matrix of one forward
    of this shape (each layer's q, k, v, o, gate, up and down projections and the LM head:
    ``cost_probe.weight_matrices``) multiplied by a [batch, in_features] input, one after
    another, captured as one CUDA graph; ms. Taken from the shape, not from the model's
    ``nn.Linear`` modules: the fused q/k/v and gate/up projections are not ``nn.Linear``,
    and the LM head of tied embeddings reads the embedding table."""
    from benchmarks.cost_probe import chain_ms, weight_matrices

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return chain_ms(weight_matrices(floor_dims(config), device, dtype), batch, repeats)


def _graph_forward_ms(engine: LLMEngine, batch: int, tokens: int, draft: int) -> float | None:
    graphs = engine.runner.graphs
    if graphs is None:
        return None
    key = graphs.bucket(batch, tokens, 1 + draft)
    if key not in graphs.graphs:
        return None
    replay = graphs.graphs[key]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay()
    start.record()
    for _ in range(20):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20
