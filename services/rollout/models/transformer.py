"""CausalLM: the Llama / Qwen2 / Qwen3 decoder, with Hugging Face's parameter names.

The three families differ only in small switches that ModelConfig carries: q/k/v biases
(Qwen2), per-head q/k RMSNorm and an explicit head_dim (Qwen3), llama3 RoPE scaling, tied
embeddings. The model sees a flat batch of tokens and their positions; which keys a query
attends to is the AttentionBackend's business, so this module knows nothing about KV
caches, batching or sequences.

When the backend is batch-invariant (``attn.batch_invariant``), every op that reduces
runs through a kernel whose per-row result does not depend on the number of rows
(kernels/matmul.py, kernels/rms_norm.py) and SiLU is computed as separate elementwise
ops, so a token's hidden state depends only on its sequence's tokens up to it. Otherwise,
without autograd (serving), the residual add + post-attention RMSNorm and SiLU(gate) * up
each run as one fused kernel on CUDA (kernels/fused.py; their PyTorch references, the
same ops as the unfused code, on the CPU).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.fused import add_rms_norm, silu_mul
from kernels.matmul import linear as invariant_linear
from kernels.rms_norm import rms_norm as invariant_rms_norm
from services.rollout.models.base import AttentionBackend
from services.rollout.models.config import ModelConfig


def project(layer: nn.Linear, x: Tensor, invariant: bool) -> Tensor:
    """``layer(x)``, through the batch-invariant matmul when asked."""
    return invariant_linear(x, layer.weight, layer.bias) if invariant else layer(x)


def silu(x: Tensor, invariant: bool) -> Tensor:
    # The CPU's fused SiLU takes a vector path or a scalar one depending on where an
    # element falls in the tensor, and the two differ in the last bit.
    if not invariant:
        return F.silu(x)
    xf = x.float()
    return (xf / (1.0 + torch.exp(-xf))).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, invariant: bool = False) -> Tensor:
        if invariant:
            return invariant_rms_norm(x, self.weight, self.eps)
        # Normalise in float32 and scale in the input dtype, as the reference implementation does.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """[head_dim // 2] float32 rotation frequencies, with the config's RoPE scaling applied."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_context_len / low_freq_factor, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= old_context_len / high_freq_factor) & (wavelen <= old_context_len / low_freq_factor)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Maps positions to the (cos, sin) that every layer's q and k rotate by."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        # Frequencies must stay float32 whatever dtype the model is cast to: in bf16 they
        # would be off by whole radians at long positions. `_apply` (behind .to(), .half(),
        # .to_empty()) restores them from this CPU copy, which no device context touches.
        self._inv_freq_fp32 = rope_inv_freq(config)
        self.register_buffer("inv_freq", self._inv_freq_fp32.to(torch.get_default_device()), persistent=False)

    def _apply(self, fn, recurse=True):
        kept = self.inv_freq
        super()._apply(fn, recurse)
        if kept.device == self.inv_freq.device and kept.dtype == torch.float32:
            # Still on its device: keep the very tensor. An engine's CUDA graphs read it by
            # address, and every LLMEngine calls model.to(device): a new tensor here would
            # leave an earlier engine on the same model reading freed memory for its RoPE.
            self.inv_freq = kept
        else:
            self.inv_freq = self._inv_freq_fp32.to(self.inv_freq.device)
        return self

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [num_tokens] -> cos, sin [num_tokens, 1, head_dim // 2] in `dtype`."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [num_tokens, head_dim // 2]
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotates pairs (i, i + head_dim/2) of x [num_tokens, heads, head_dim] (the HF layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend) -> Tensor:
        num_tokens = x.shape[0]
        inv = attn.batch_invariant
        q = project(self.q_proj, x, inv).view(num_tokens, self.num_heads, self.head_dim)
        k = project(self.k_proj, x, inv).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = project(self.v_proj, x, inv).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q, inv), self.k_norm(k, inv)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attn(self.layer_idx, q, k, v)  # [num_tokens, num_heads, head_dim]
        return project(self.o_proj, out.reshape(num_tokens, self.num_heads * self.head_dim), inv)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor, invariant: bool = False) -> Tensor:
        gate, up = project(self.gate_proj, x, invariant), project(self.up_proj, x, invariant)
        if invariant or torch.is_grad_enabled():
            return project(self.down_proj, silu(gate, invariant) * up, invariant)
        return project(self.down_proj, silu_mul(gate, up), invariant)  # fused on CUDA


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend) -> Tensor:
        inv = attn.batch_invariant
        h = self.self_attn(self.input_layernorm(x, inv), cos, sin, attn)
        if inv or torch.is_grad_enabled():
            x = x + h
            normed = self.post_attention_layernorm(x, inv)
        else:  # fused on CUDA: the same add and norm
            norm = self.post_attention_layernorm
            normed, x = add_rms_norm(h, x, norm.weight, norm.eps)
        return x + self.mlp(normed, inv)


class DecoderModel(nn.Module):
    """The `model.` prefix of HF names: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend) -> Tensor:
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        cos, sin = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x, attn.batch_invariant)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._tie_weights()

    def _tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _apply(self, fn, recurse=True):
        # Moving off the meta device (to_empty) gives each module a new Parameter, which
        # would untie lm_head from the embedding; tie them again.
        super()._apply(fn, recurse)
        self._tie_weights()
        return self

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend) -> Tensor:
        """
        Args:
            input_ids: [num_tokens] int64, all sequences of the batch concatenated.
            positions: [num_tokens] int64, each token's position in its own sequence.
            attn: decides which keys each query sees (and keeps the KV cache, if any).

        Returns:
            [num_tokens, hidden_size] final hidden states (after the last norm).
        """
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: Tensor, batch_invariant: bool = False) -> Tensor:
        """[num_tokens, hidden_size] -> [num_tokens, vocab_size] float32."""
        return project(self.lm_head, hidden, batch_invariant).float()

    def expected_weights(self) -> dict[str, Tensor]:
        """The tensors a checkpoint must provide, by HF name (a tied lm_head is not one)."""
        return dict(self.named_parameters())

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, Tensor]) -> None:
        """Copies HF-named tensors into the existing parameters, in place.

        Everything is checked before anything is copied, so a rejected checkpoint leaves
        the model untouched; copying in place keeps the parameter storage that a running
        engine (e.g. its CUDA graphs) holds pointers to.

        Raises:
            ValueError: naming the tensor that is missing, mis-shaped, or unknown.
        """
        expected = self.expected_weights()
        for name, param in expected.items():
            if name not in state_dict:
                raise ValueError(f"{name}: missing from the checkpoint")
            if tuple(state_dict[name].shape) != tuple(param.shape):
                raise ValueError(f"{name}: shape {tuple(state_dict[name].shape)}, expected {tuple(param.shape)}")
        for name in state_dict:
            if name not in expected and not self._is_ignorable(name):
                raise ValueError(f"{name}: unexpected tensor for a {self.config.architecture} model of this shape")
        for name, param in expected.items():
            param.copy_(state_dict[name])

    def _is_ignorable(self, name: str) -> bool:
        # Old Llama checkpoints store RoPE frequencies; tied checkpoints sometimes store lm_head.
        return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.config.tie_word_embeddings)
