"""CausalLM: the Llama / Qwen2 / Qwen3 decoder, with Hugging Face's parameter names.

The three families differ only in small switches that ModelConfig carries: q/k/v biases
(Qwen2), per-head q/k RMSNorm and an explicit head_dim (Qwen3), llama3 RoPE scaling, tied
embeddings. The model sees a flat batch of tokens and their positions; which keys a query
attends to is the AttentionBackend's business, so this module knows nothing about KV
caches, batching or sequences.

q/k/v and gate/up each run as one matmul over one fused weight (FusedLinear); the
checkpoint's separate tensors are named windows onto its rows (``_Shard``), so loading,
pushes, ``expected_weights`` and the state_dict all speak Hugging Face's names while the
model holds one copy of the weights.

When the backend is batch-invariant (``attn.batch_invariant``), every op that reduces
runs through a kernel whose per-row result does not depend on the number of rows
(kernels/matmul.py, kernels/rms_norm.py) and SiLU is computed as separate elementwise
ops, so a token's hidden state depends only on its sequence's tokens up to it. Otherwise,
without autograd (serving), every residual add with the RMSNorm after it (a layer's
post-attention norm, the next layer's input norm, the final norm), SiLU(gate) * up, and
RoPE with the backend's KV write each run as one fused kernel on CUDA (kernels/fused.py,
kernels/rotary.py; their PyTorch references, the same ops as the unfused code, on the CPU).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.fused import add_rms_norm, silu_mul
from kernels.matmul import linear as invariant_linear
from kernels.rotary import apply_rope
from kernels.rms_norm import rms_norm as invariant_rms_norm
from services.rollout.models.base import AttentionBackend
from services.rollout.models.config import ModelConfig


def project(layer: nn.Linear | FusedLinear, x: Tensor, invariant: bool) -> Tensor:
    """``x @ layer.weight.T + layer.bias``, through the batch-invariant matmul when asked."""
    return invariant_linear(x, layer.weight, layer.bias) if invariant else F.linear(x, layer.weight, layer.bias)


class FusedLinear(nn.Module):
    """Several projections of one input as one matmul: q/k/v, gate/up.

    One ``weight`` [sum(sizes), in_features] (and one ``bias``) holds the projections'
    rows stacked in the order given; there is no other copy. Checkpoints name the parts
    (Hugging Face's ``q_proj.weight``, ...): each part is a ``_Shard`` child of the
    fused layer's parent under its HF name, a window onto its rows of the fused
    parameters, through which the state_dict and ``CausalLM.expected_weights`` read
    and ``load_weights`` writes (vLLM's QKVParallelLinear and MergedColumnParallelLinear
    do the same with a weight loader per shard).
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool):
        super().__init__()
        self.sizes = list(parts.values())
        self.weight = nn.Parameter(torch.empty(sum(self.sizes), in_features))
        self.bias = nn.Parameter(torch.empty(sum(self.sizes))) if bias else None
        starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.shards = {name: _Shard(self, start, size) for (name, size), start in zip(parts.items(), starts)}

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, parts={list(self.shards)}, sizes={self.sizes}, " \
               f"bias={self.bias is not None}"

    def forward(self, x: Tensor, invariant: bool = False) -> tuple[Tensor, ...]:
        """[..., in_features] -> one [..., size] view per part, in order (views of one output)."""
        return project(self, x, invariant).split(self.sizes, dim=-1)

    # Its state is its shards' (under their HF names): nothing of its own to save or load.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        pass

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        pass


class _Shard(nn.Module):
    """One HF-named part of a FusedLinear (e.g. ``q_proj``): rows [start, start + size) of
    its weight and bias. Holds no parameter; its state_dict entries are copies of those
    rows, and loading one writes into them in place."""

    def __init__(self, fused: FusedLinear, start: int, size: int):
        super().__init__()
        object.__setattr__(self, "fused", fused)  # a reference, not a child: the parent owns the fused layer
        self.start, self.size = start, size

    @property
    def weight(self) -> Tensor:
        """[size, in_features], a view of the fused weight (autograd sees it)."""
        return self.fused.weight[self.start:self.start + self.size]

    @property
    def bias(self) -> Tensor | None:
        return None if self.fused.bias is None else self.fused.bias[self.start:self.start + self.size]

    def tensors(self) -> dict[str, Tensor]:
        """{"weight": view, "bias": view} (no bias entry without one)."""
        return {"weight": self.weight} | ({} if self.bias is None else {"bias": self.bias})

    def extra_repr(self) -> str:
        return f"rows {self.start}..{self.start + self.size - 1} of a fused weight"

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # Copies, so that each entry has its own storage (safetensors and torch.save would
        # otherwise write, or refuse, the whole fused tensor for each shard).
        for name, view in self.tensors().items():
            destination[prefix + name] = view if keep_vars else view.detach().clone()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        views = self.tensors()
        for name, view in views.items():
            key = prefix + name
            if key not in state_dict:
                missing_keys.append(key)
            elif state_dict[key].shape != view.shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{tuple(state_dict[key].shape)}, the shape in current model is {tuple(view.shape)}.")
            else:
                with torch.no_grad():
                    view.copy_(state_dict[key])
        if strict:
            unexpected_keys.extend(key for key in state_dict
                                   if key.startswith(prefix) and key[len(prefix):] not in views)


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
        before = self.inv_freq
        super()._apply(fn, recurse)
        device = self.inv_freq.device
        if before.device == device and before.dtype == torch.float32:
            # The same tensor, its values restored in place: CUDA graphs captured over it (an
            # engine's) read its address, and a replacement would leave them reading freed
            # memory. Every LLMEngine calls model.to(device) on the model it is given: a
            # second engine over one model (the benchmarks) silently broke the first's graphs
            # once the freed memory was reused (the sweep's plain runs in the H200 window).
            with torch.inference_mode(before.is_inference()):  # an inference tensor changes only in that mode
                before.copy_(self._inv_freq_fp32)
            self.inv_freq = before
        else:  # moved to another device: a new tensor there (graphs are per device)
            self.inv_freq = self._inv_freq_fp32.to(device)
        return self

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [num_tokens] -> cos, sin [num_tokens, 1, head_dim // 2] in `dtype`."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [num_tokens, head_dim // 2]
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(hidden, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size},
                                    bias=config.attention_bias)
        self.q_proj, self.k_proj, self.v_proj = self.qkv_proj.shards.values()
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend) -> Tensor:
        num_tokens = x.shape[0]
        inv = attn.batch_invariant
        q, k, v = self.qkv_proj(x, inv)  # views of one [num_tokens, (heads + 2 * kv_heads) * head_dim]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q, inv), self.k_norm(k, inv)
        rotary = None if inv or torch.is_grad_enabled() else getattr(attn, "rotary", None)
        if rotary is not None:  # a backend that rotates q and k itself (fused with its KV write on CUDA)
            out = rotary(self.layer_idx, q, k, v, cos, sin)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            out = attn(self.layer_idx, q, k, v)  # [num_tokens, num_heads, head_dim]
        return project(self.o_proj, out.reshape(num_tokens, self.num_heads * self.head_dim), inv)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = FusedLinear(config.hidden_size, {"gate_proj": size, "up_proj": size}, bias=False)
        self.gate_proj, self.up_proj = self.gate_up_proj.shards.values()
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor, invariant: bool = False) -> Tensor:
        gate, up = self.gate_up_proj(x, invariant)  # views of one [num_tokens, 2 * intermediate_size]
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
        x = x + self.self_attn(self.input_layernorm(x, inv), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x, inv), inv)

    def forward_fused(self, x: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor,
                      attn: AttentionBackend) -> tuple[Tensor, Tensor]:
        """``forward`` with each residual add and the norm after it as one kernel on CUDA
        (the same add and norm): x is the last layer's MLP output, residual the stream it
        adds to (None: x is the embeddings). Returns this layer's MLP output and the stream
        before it (the next layer's norm, or the final one, adds them)."""
        norm = self.input_layernorm
        if residual is None:
            residual, normed = x, norm(x)
        else:
            normed, residual = add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self.self_attn(normed, cos, sin, attn)
        norm = self.post_attention_layernorm
        normed, residual = add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(normed), residual


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
        if attn.batch_invariant or torch.is_grad_enabled():
            for layer in self.layers:
                x = layer(x, cos, sin, attn)
            return self.norm(x, attn.batch_invariant)
        # every residual add fused with the norm after it (kernels/fused.py on CUDA): the
        # stream is carried beside each layer's output, as vLLM's decoder layers do
        residual = None
        for layer in self.layers:
            x, residual = layer.forward_fused(x, residual, cos, sin, attn)
        return add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]


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
        """The tensors a checkpoint must provide, by HF name (a tied lm_head is not one), in
        the model's own order: parameters, and the HF-named shards of the fused ones as
        views into them (no copy; writing into one writes the model's weights)."""
        out: dict[str, Tensor] = {}
        seen: set[int] = set()
        for module_name, module in self.named_modules():
            prefix = module_name + "." if module_name else ""
            if isinstance(module, _Shard):
                out.update((prefix + name, view) for name, view in module.tensors().items())
            elif not isinstance(module, FusedLinear):
                for name, param in module.named_parameters(recurse=False):
                    if id(param) not in seen:  # a tied lm_head is the embedding
                        seen.add(id(param))
                        out[prefix + name] = param
        return out

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, Tensor]) -> None:
        """Copies HF-named tensors into the existing parameters, in place (a fused layer's
        parts, e.g. q_proj/k_proj/v_proj, into their rows of its one weight and bias).

        Everything is checked before anything is copied, so a rejected checkpoint leaves
        the model untouched; copying in place keeps the parameter storage that a running
        engine (e.g. its CUDA graphs) holds pointers to.

        A tensor's floating-point dtype may differ from its parameter's (a bfloat16 push
        into a float32 model is converted); a tensor that is not floating point (an
        integer, bool or complex one) for a floating-point parameter is refused: copying
        it would silently truncate the weights to integers (or drop imaginary parts).

        Raises:
            ValueError: naming the tensor that is missing, mis-shaped, of a wrong dtype, or unknown.
        """
        expected = self.expected_weights()
        for name, param in expected.items():
            if name not in state_dict:
                raise ValueError(f"{name}: missing from the checkpoint")
            tensor = state_dict[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            if not _dtype_fits(tensor, param):
                raise ValueError(f"{name}: dtype {_dtype_name(tensor)}, expected "
                                 + (f"a floating-point one (the model's is {_dtype_name(param)})"
                                    if param.is_floating_point() else _dtype_name(param)))
        for name in state_dict:
            if name not in expected and not self._is_ignorable(name):
                raise ValueError(f"{name}: unexpected tensor for a {self.config.architecture} model of this shape")
        for name, param in expected.items():
            param.copy_(state_dict[name])

    def _is_ignorable(self, name: str) -> bool:
        # Old Llama checkpoints store RoPE frequencies; tied checkpoints sometimes store lm_head.
        return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.config.tie_word_embeddings)


def _dtype_fits(tensor: Tensor, param: Tensor) -> bool:
    """A floating-point tensor for a floating-point parameter (converted on copy), else the same dtype."""
    if param.is_floating_point():
        return tensor.is_floating_point()
    return tensor.dtype == param.dtype


def _dtype_name(tensor: Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")
