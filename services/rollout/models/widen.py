"""Widen a trained checkpoint to a larger shape that computes exactly the same function.

    python -m services.rollout.models.widen models/tiny models/wide-1.5B --shape Qwen2.5-1.5B \
        [--layers 8] [--dtype bfloat16] [--device cuda]

A real model's forward cost is its shape's (matrix sizes, layers, vocabulary), so a small
trained policy widened to, e.g., the Qwen2.5-1.5B shape costs what a 1.5B model costs per
step while sampling exactly what the small policy samples (and so rhyming across epochs
as it does). Nothing large travels: the widening runs where the model is used.

How each part keeps the function (source shape D hidden, d head_dim, V vocabulary; target
D' > D, d' = r * d, V' >= V):

- Hidden channels 0..D-1 carry the source's residual stream; channel D is a constant
  channel C = sqrt(eps * D) set by every token's embedding; channels D+1.. stay zero (every
  matrix writing into the residual has zero rows there). Every RMSNorm then sees
  sum(x^2) + C^2 over D' channels, i.e. (D / D') * (mean_D(x^2) + eps): with the target's
  eps = 0 and its weights scaled by sqrt(D / D') its output is the source's exactly. The
  norms' weight on the constant channel is 0, except the final norm's, which passes it on.
- Vocabulary: tokens V.. get the logit -BIG * (a positive value from the constant channel),
  below -1e4 (their probability is exactly 0 in float32, so every other token's logprob is
  unchanged). With tied embeddings the real tokens' logits all gain the same small shift
  (the constant channel times itself), which no softmax, temperature, top-k/p or min-p sees.
- Heads: source query head h (GQA group g = h // G) becomes target head g * G' + h % G in the
  target group g, whose KV head is the source's KV head g (G' = heads / KV heads >= G). The
  unused heads' o_proj columns are 0.
- head_dim: the HF RoPE layout rotates pairs (i, i + d/2) by theta^(-2i/d); source dim i of
  the first half goes to r * i (second half: r * i + d'/2), whose frequency theta^(-2ri/d')
  is the same float, and q is scaled by sqrt(d'/d) for the new 1/sqrt(head_dim). The
  padded dims of k and v are 0.
- Intermediate channels I..: down_proj's columns there are 0.
- Extra layers (identity): o_proj and down_proj all 0, so they add nothing to the residual.

Every entry whose value cannot reach the output (inputs that are always zero, heads and
layers whose outputs are multiplied by zero) holds seeded random values rather than zeros,
so the widened model is as dense as a real one wherever that is free; the remaining exact
zeros (mostly the identity layers' o_proj/down_proj) are why its forward time is checked
against a random-weight model of the same shape (benchmarks/spec_sweep.py).

The target's architecture is Qwen2 (a Llama source's q/k/v get zero biases). Refused, with
the field named: Qwen3 sources (per-head q/k norms), an o_proj bias, eps = 0, and target
shapes that cannot hold the source (a smaller dimension, head_dim not a multiple, GQA
groups that do not fit).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from services.rollout.models.config import ModelConfig
from services.rollout.models.transformer import CausalLM


@dataclasses.dataclass(frozen=True)
class Shape:
    """A decoder's dimensions (what its forward costs)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int


# The published Qwen2.5 configs (tied embeddings, vocabulary 151,936).
SHAPES = {
    "Qwen2.5-0.5B": Shape(896, 4864, 24, 14, 2, 64, 151936),
    "Qwen2.5-1.5B": Shape(1536, 8960, 28, 12, 2, 128, 151936),
}

# Padded tokens' logit is -_BIG_LOGIT / rms of the final norm's input (scaled): far below
# any real logit for any plausible activation size, and far from float32/bfloat16 overflow.
_BIG_LOGIT = 1e9


def shape_of(config: ModelConfig) -> Shape:
    return Shape(**{f.name: getattr(config, f.name) for f in dataclasses.fields(Shape)})


def named_shape(name: str, num_layers: int | None = None) -> Shape:
    """SHAPES[name], with `num_layers` layers instead of its own when given."""
    if name not in SHAPES:
        raise ValueError(f"shape: unknown {name!r}, expected one of {sorted(SHAPES)}")
    shape = SHAPES[name]
    return dataclasses.replace(shape, num_hidden_layers=num_layers) if num_layers else shape


def widened_config(source: ModelConfig, shape: Shape, dtype: str | None = None) -> ModelConfig:
    """The target's config. Raises ValueError naming the field that cannot be widened."""
    _check(source, shape)
    return dataclasses.replace(source, architecture="qwen2", attention_bias=True, qk_norm=False, rms_norm_eps=0.0,
                               dtype=dtype or source.dtype, **dataclasses.asdict(shape))


def _check(src: ModelConfig, shape: Shape) -> None:
    if src.qk_norm:
        raise ValueError("architecture: a Qwen3 source (per-head q/k RMSNorm) cannot be widened")
    if src.o_proj_bias:
        raise ValueError("attention_bias: a source with an o_proj bias cannot be widened to Qwen2 (none there)")
    if src.rms_norm_eps <= 0:
        raise ValueError("rms_norm_eps: the source's must be > 0 (it becomes the constant channel)")
    for field in ("intermediate_size", "num_hidden_layers", "vocab_size", "num_key_value_heads"):
        if getattr(shape, field) < getattr(src, field):
            raise ValueError(f"{field}: target {getattr(shape, field)} is smaller than the source's {getattr(src, field)}")
    if shape.hidden_size <= src.hidden_size:
        raise ValueError(f"hidden_size: target {shape.hidden_size} must exceed the source's {src.hidden_size} "
                         f"(one channel carries the norms' eps)")
    if shape.head_dim % src.head_dim or shape.head_dim % 2:
        raise ValueError(f"head_dim: target {shape.head_dim} is not an even multiple of the source's {src.head_dim}")
    if shape.num_attention_heads % shape.num_key_value_heads:
        raise ValueError(f"num_key_value_heads: {shape.num_key_value_heads} does not divide "
                         f"num_attention_heads {shape.num_attention_heads}")
    group, target_group = src.num_attention_heads // src.num_key_value_heads, \
        shape.num_attention_heads // shape.num_key_value_heads
    if target_group < group:
        raise ValueError(f"num_attention_heads: target GQA groups of {target_group} heads cannot hold the source's "
                         f"groups of {group}")


@torch.no_grad()
def widen_state(state: Mapping[str, Tensor], source: ModelConfig, shape: Shape, seed: int = 0,
                device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """The target's HF-named tensors (on `device`, in `dtype`) from the source's."""
    _check(source, shape)
    D, Dn, V, Vn = source.hidden_size, shape.hidden_size, source.vocab_size, shape.vocab_size
    I, d, dn = source.intermediate_size, source.head_dim, shape.head_dim
    H, K, Hn, Kn = source.num_attention_heads, source.num_key_value_heads, shape.num_attention_heads, \
        shape.num_key_value_heads
    G, Gn, r = H // K, Hn // Kn, dn // d
    device = torch.device(device)
    gen = torch.Generator(device).manual_seed(seed)

    def free(rows: int, cols: int | None = None) -> Tensor:
        """Seeded values for entries the output never sees: N(0, 1/fan_in) for a matrix,
        1 + N(0, 0.02^2) for a norm's weight, N(0, 0.02^2) for a bias (cols=0)."""
        if cols is None:
            return 1.0 + 0.02 * torch.randn(rows, generator=gen, device=device)
        if cols == 0:
            return 0.02 * torch.randn(rows, generator=gen, device=device)
        return torch.randn(rows, cols, generator=gen, device=device) / math.sqrt(cols)

    def src(name: str) -> Tensor:
        return state[name].to(device=device, dtype=torch.float32)

    def ar(n: int) -> Tensor:
        return torch.arange(n, device=device)

    dims = torch.cat([ar(d // 2) * r, ar(d // 2) * r + dn // 2])  # source dim -> target dim, within a head
    q_heads = [(h // G) * Gn + h % G for h in range(H)]
    q_rows = torch.cat([qh * dn + dims for qh in q_heads])  # [H * d]
    kv_rows = torch.cat([k * dn + dims for k in range(K)])  # [K * d]
    hid = ar(D)
    const = math.sqrt(source.rms_norm_eps * D)
    norm_scale = math.sqrt(D / Dn)
    q_scale = math.sqrt(r)
    out: dict[str, Tensor] = {}

    embed = torch.zeros(Vn, Dn, device=device)
    embed[:V, :D] = src("model.embed_tokens.weight")
    embed[:V, D] = const
    if source.tie_word_embeddings:
        embed[V:, D] = -_BIG_LOGIT / const
    else:
        embed[V:] = free(Vn - V, Dn)  # never an input (never sampled)
        head = free(Vn, Dn)
        head[:V, :D + 1] = 0
        head[:V, :D] = src("lm_head.weight")
        head[V:, :D + 1] = 0
        head[V:, D] = -_BIG_LOGIT / const
        out["lm_head.weight"] = head
    out["model.embed_tokens.weight"] = embed

    def norm(name: str, const_weight: float) -> Tensor:
        w = free(Dn)
        w[:D] = src(name) * norm_scale
        w[D] = const_weight
        return w

    out["model.norm.weight"] = norm("model.norm.weight", 1.0)
    for layer in range(shape.num_hidden_layers):
        p = f"model.layers.{layer}."
        if layer >= source.num_hidden_layers:  # identity: reads anything, writes nothing
            out.update(_free_layer(p, shape, free))
            out[p + "self_attn.o_proj.weight"] = torch.zeros(Dn, Hn * dn, device=device)
            out[p + "mlp.down_proj.weight"] = torch.zeros(Dn, shape.intermediate_size, device=device)
            continue
        out[p + "input_layernorm.weight"] = norm(p + "input_layernorm.weight", 0.0)
        out[p + "post_attention_layernorm.weight"] = norm(p + "post_attention_layernorm.weight", 0.0)
        a = p + "self_attn."
        q = free(Hn * dn, Dn)
        q[q_rows[:, None], hid[None, :]] = src(a + "q_proj.weight") * q_scale
        q_bias = free(Hn * dn, 0)
        q_bias[q_rows] = src(a + "q_proj.bias") * q_scale if source.attention_bias else 0.0
        out[a + "q_proj.weight"], out[a + "q_proj.bias"] = q, q_bias
        for name in ("k_proj", "v_proj"):
            w = free(Kn * dn, Dn)
            w[:K * dn] = 0  # the source KV heads' padded dims stay 0
            w[kv_rows[:, None], hid[None, :]] = src(a + name + ".weight")
            bias = free(Kn * dn, 0)
            bias[:K * dn] = 0
            if source.attention_bias:
                bias[kv_rows] = src(a + name + ".bias")
            out[a + name + ".weight"], out[a + name + ".bias"] = w, bias
        o = free(Dn, Hn * dn)
        o[D:] = 0
        for qh in set(range(Hn)) - set(q_heads):
            o[:, qh * dn:(qh + 1) * dn] = 0
        o[hid[:, None], q_rows[None, :]] = src(a + "o_proj.weight")
        out[a + "o_proj.weight"] = o
        m = p + "mlp."
        for name in ("gate_proj", "up_proj"):
            w = free(shape.intermediate_size, Dn)
            w[:I, :D] = src(m + name + ".weight")
            out[m + name + ".weight"] = w
        down = free(Dn, shape.intermediate_size)
        down[D:] = 0
        down[:, I:] = 0
        down[:D, :I] = src(m + "down_proj.weight")
        out[m + "down_proj.weight"] = down
    return {name: t.to(dtype) for name, t in out.items()}


def _free_layer(prefix: str, shape: Shape, free) -> dict[str, Tensor]:
    Dn, In, q, kv = shape.hidden_size, shape.intermediate_size, shape.num_attention_heads * shape.head_dim, \
        shape.num_key_value_heads * shape.head_dim
    a, m = prefix + "self_attn.", prefix + "mlp."
    return {prefix + "input_layernorm.weight": free(Dn), prefix + "post_attention_layernorm.weight": free(Dn),
            a + "q_proj.weight": free(q, Dn), a + "q_proj.bias": free(q, 0),
            a + "k_proj.weight": free(kv, Dn), a + "k_proj.bias": free(kv, 0),
            a + "v_proj.weight": free(kv, Dn), a + "v_proj.bias": free(kv, 0),
            m + "gate_proj.weight": free(In, Dn), m + "up_proj.weight": free(In, Dn)}


def widen_model(model: CausalLM, shape: Shape, seed: int = 0, device: str | torch.device | None = None,
                dtype: torch.dtype | None = None) -> CausalLM:
    """A new CausalLM of `shape` computing `model`'s function (on `device`, in `dtype`;
    default: the source's)."""
    from services.rollout.loader import _empty_model

    device = torch.device(device or model.lm_head.weight.device)
    dtype = dtype or model.lm_head.weight.dtype
    config = widened_config(model.config, shape, str(dtype).removeprefix("torch."))
    state = widen_state(model.expected_weights(), model.config, shape, seed, device, dtype)
    target = _empty_model(config, device)
    target.load_weights(state)
    return target


def widen_checkpoint(source_dir: str | Path, target_dir: str | Path, shape: Shape, seed: int = 0,
                     device: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> Path:
    """Writes the widened checkpoint of `source_dir` (config.json + model.safetensors) to
    `target_dir`, with the source's tokenizer files, and `widened_from` in config.json."""
    import shutil

    from services.rollout.loader import load_model, save_model

    source_dir, target_dir = Path(source_dir), Path(target_dir)
    model = widen_model(load_model(source_dir, "cpu", torch.float32), shape, seed, device, dtype)
    save_model(model, target_dir, extra_config={"widened_from": {"shape": dataclasses.asdict(shape), "seed": seed}})
    for extra in source_dir.iterdir():
        if extra.name.startswith(("tokenizer", "special_tokens", "vocab", "generation_config")):
            shutil.copy2(extra, target_dir / extra.name)
    return target_dir


def zero_share(model: CausalLM) -> float:
    """Share of the model's weights that are exactly zero."""
    params = list(model.expected_weights().values())
    return sum(int((p == 0).sum()) for p in params) / sum(p.numel() for p in params)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="checkpoint directory to widen")
    parser.add_argument("target", help="directory to write")
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, help="layers instead of the shape's own")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shape = named_shape(args.shape, args.layers)
    path = widen_checkpoint(args.source, args.target, shape, args.seed, args.device, getattr(torch, args.dtype))
    print(f"{args.source} widened to {args.shape} ({shape.num_hidden_layers} layers, {args.dtype}): {path}")


if __name__ == "__main__":
    main()
