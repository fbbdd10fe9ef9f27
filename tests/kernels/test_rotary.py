"""RoPE fused with the KV cache's write (kernels/rotary.py) against its reference
(``apply_rope`` on q and k, then ``write_kv``): float32 bit for bit, bfloat16 to its
rounding on the CPU interpreter (bit for bit on a GPU); q, k and v read by stride from one
fused q/k/v output, grouped KV heads, head counts and widths no power of two, padding slots.

If these fail, the model's GPU path (outside batch-invariant mode) attends with other
rotated queries, or caches other keys or values, than the reference model does."""

import pytest
import torch

from kernels import rotary
from kernels.paged_attention import write_kv_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton: GPU, else the interpreter
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def case(num_tokens, heads, kv_heads, head_dim, dtype, seed=0, num_blocks=6, block_size=4):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 3).to(dtype).to(DEVICE)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(num_tokens, n, head_dim) for t, n in ((q, heads), (k, kv_heads), (v, kv_heads)))  # strided views
    positions = torch.randint(0, 4000, (num_tokens,), generator=g).to(DEVICE)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)).to(DEVICE)
    freqs = positions[:, None].float() * inv_freq[None, :]
    cos, sin = freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(DEVICE)
    slots[::3] = -1  # padding tokens: nothing written
    cache = lambda: torch.full((num_blocks, block_size, kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE)  # noqa: E731
    return q, k, v, cos, sin, slots, cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2, 1, 8), (5, 14, 2, 64), (7, 12, 2, 128), (3, 6, 6, 24), (0, 4, 2, 16)])
def test_rope_store_matches_the_reference(dtype, shape):
    num_tokens, heads, kv_heads, head_dim = shape
    q, k, v, cos, sin, slots, cache = case(num_tokens, heads, kv_heads, head_dim, dtype)
    got_k, got_v, want_k, want_v = cache(), cache(), cache(), cache()
    got_q = rotary.rope_store_triton(q, k, v, cos, sin, got_k, got_v, slots)
    want_q = rotary.rope_store_reference(q, k, v, cos, sin, want_k, want_v, slots)
    assert got_q.shape == want_q.shape == q.shape and got_q.dtype == dtype and got_q.is_contiguous()
    assert torch.equal(got_v, want_v)  # values move as they are; padding slots keep the 7s
    if dtype == torch.float32 or DEVICE == "cuda":
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    else:  # (the CPU interpreter's float32 -> bf16 cast need not round to nearest like the GPU's:
        # a product rounded the other way moves a difference by one of its ulps, 1/16 below 16)
        torch.testing.assert_close(got_q.float(), want_q.float(), atol=1 / 16, rtol=2e-2)
        torch.testing.assert_close(got_k.float(), want_k.float(), atol=1 / 16, rtol=2e-2)


def test_the_reference_is_huggingface_rope_and_write_kv():
    """apply_rope is HF's rotate_half rotation; the reference stores exactly what write_kv does."""
    q, k, v, cos, sin, slots, cache = case(6, 4, 2, 16, torch.float32, seed=3)
    rotate_half = lambda x: torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)  # noqa: E731
    cos_full, sin_full = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    hf_q = q * cos_full + rotate_half(q) * sin_full
    hf_k = k * cos_full + rotate_half(k) * sin_full
    got_k, got_v, want_k, want_v = cache(), cache(), cache(), cache()
    q_rot = rotary.rope_store_reference(q, k, v, cos, sin, got_k, got_v, slots)
    write_kv_reference(hf_k, v, want_k, want_v, slots)
    torch.testing.assert_close(q_rot, hf_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(got_v, want_v)


def test_on_tensors_triton_does_not_run_the_reference_runs(monkeypatch):
    if DEVICE == "cuda":
        pytest.skip("on a GPU Triton runs")
    monkeypatch.delenv("RHYMERL_TRITON", raising=False)
    called = []
    monkeypatch.setattr(rotary, "rope_store_triton", lambda *a: called.append(1))
    q, k, v, cos, sin, slots, cache = case(3, 2, 1, 8, torch.float32)
    rotary.rope_store(q, k, v, cos, sin, cache(), cache(), slots)
    assert not called


def test_the_model_rotates_through_the_backend_exactly_as_through_its_own_rope(monkeypatch):
    """A decoder's forward over the paged backend with RoPE and the KV write in the Triton
    kernel (the interpreter on the CPU; paged attention and the rest their references)
    gives the same hidden states and the same cache, bit for bit in float32, as the model
    rotating q and k itself and the backend only writing and attending; batch-invariant
    mode keeps the model's own rotation."""
    from services.rollout.engine.attention import AttentionMetadata, KVCache, PagedAttention
    from services.rollout.loader import init_random_model
    from services.rollout.models.config import ModelConfig

    cfg = ModelConfig(
        architecture="qwen2", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=False, attention_bias=True,
        qk_norm=False, eos_token_ids=(0,), bos_token_id=None, dtype="float32")
    model = init_random_model(cfg, seed=2).to(DEVICE)

    class OwnRope:  # the backend's __call__ only: the model applies RoPE itself
        def __init__(self, paged):
            self.paged, self.batch_invariant = paged, paged.batch_invariant

        def __call__(self, *args):
            return self.paged(*args)

    tokens = torch.tensor([5, 17, 3, 88, 41, 9, 60], device=DEVICE)  # two sequences: 4 and 3 tokens
    positions = torch.tensor([0, 1, 2, 3, 10, 11, 12], device=DEVICE)  # the second resumes at 10

    def forward(wrap, batch_invariant=False):
        cache = KVCache(cfg.num_hidden_layers, 8, 4, cfg.num_key_value_heads, cfg.head_dim, torch.float32,
                        torch.device(DEVICE))
        paged = PagedAttention(cache, cfg.head_dim ** -0.5, batch_invariant)
        paged.metadata = AttentionMetadata(
            slot_mapping=torch.tensor([0, 1, 2, 3, 18, 19, 20], device=DEVICE),  # blocks 0 and 4
            block_tables=torch.tensor([[0, 1, 2, 3], [2, 3, 4, 5]], dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([4, 13], dtype=torch.int32, device=DEVICE),
            query_start_loc=torch.tensor([0, 4, 7], dtype=torch.int32, device=DEVICE), max_query_len=4)
        with torch.inference_mode():
            hidden = model.model(tokens, positions, wrap(paged))
        return hidden, cache.k.clone(), cache.v.clone()

    calls = []
    kernel = rotary.rope_store_triton
    monkeypatch.setattr(rotary, "use_triton", lambda t: True)
    monkeypatch.setattr(rotary, "rope_store_triton", lambda *a: calls.append(1) or kernel(*a))
    fused = forward(lambda paged: paged)
    assert len(calls) == cfg.num_hidden_layers  # one kernel a layer
    own = forward(OwnRope)
    for got, want in zip(fused, own):
        assert torch.equal(got, want)
    forward(lambda paged: paged, batch_invariant=True)
    assert len(calls) == cfg.num_hidden_layers  # (batch-invariant: the model's own rotation)
