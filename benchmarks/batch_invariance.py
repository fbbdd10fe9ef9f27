"""The batch-invariance probe of engine_bench and batch_invariant_bench: does a sequence's
logits row change with the batch around it?"""

from __future__ import annotations

import torch

from services.rollout.models.transformer import CausalLM


@torch.inference_mode()
def batch_invariance(model: CausalLM, label: str, block_size: int = 16, batch_invariant: bool = False) -> dict:
    """Does a sequence's logits row change when other sequences join the batch, or when
    more tokens are verified behind it? The probe sequence's next-token logits are
    computed (a) alone as a decode, (b) in a batch of decodes, (c) as the first row of an
    8-token verify, (d) that verify in a batch of ragged verifies; compared bit for bit.
    Runs the engine's own path (model + paged attention backend, eager)."""
    from services.rollout.engine.attention import (
        AttentionMetadata,
        KVCache,
        PagedAttention,
    )

    cfg = model.config
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(3)
    lens = [37, 70, 5, 120]  # probe first, then the others
    prompts = [torch.randint(1, cfg.vocab_size, (n,), generator=gen).tolist() for n in lens]
    draft = torch.randint(1, cfg.vocab_size, (16,), generator=gen).tolist()
    width = -(-(max(lens) + len(draft)) // block_size)
    cache = KVCache(cfg.num_hidden_layers, len(lens) * width, block_size, cfg.num_key_value_heads, cfg.head_dim,
                    dtype, device)
    attn = PagedAttention(cache, cfg.head_dim ** -0.5, batch_invariant=batch_invariant)
    tables = [list(range(s * width, (s + 1) * width)) for s in range(len(lens))]

    def forward(items: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
        """items: (sequence, tokens fed, position of the first) -> each item's logits rows."""
        ids, pos, slots, seq_lens, cu = [], [], [], [], [0]
        for s, tokens, start in items:
            ids += tokens
            pos += range(start, start + len(tokens))
            slots += [tables[s][p // block_size] * block_size + p % block_size for p in range(start, start + len(tokens))]
            seq_lens.append(start + len(tokens))
            cu.append(cu[-1] + len(tokens))
        t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)
        attn.metadata = AttentionMetadata(t(slots, torch.int64), t([tables[s] for s, _, _ in items], torch.int32),
                                          t(seq_lens, torch.int32), t(cu, torch.int32),
                                          max(b - a for a, b in zip(cu, cu[1:])))
        hidden = model.forward(t(ids, torch.int64), t(pos, torch.int64), attn)
        logits = model.compute_logits(hidden, batch_invariant).float()
        return [logits[a:b] for a, b in zip(cu, cu[1:])]

    for s, p in enumerate(prompts):
        forward([(s, p[:-1], 0)])  # prefill all but the last prompt token
    last = [(s, [p[-1]], len(p) - 1) for s, p in enumerate(prompts)]
    alone = forward([last[0]])[0][0]
    cases = {
        "decode in a batch of 4": forward([last[1], last[0], last[2], last[3]])[1][0],
        "verify 8 drafts, alone": forward([(0, [prompts[0][-1]] + draft[:8], lens[0] - 1)])[0][0],
        "verify 16 drafts in a ragged batch": forward([
            (1, [prompts[1][-1]] + draft[:3], lens[1] - 1), (0, [prompts[0][-1]] + draft, lens[0] - 1),
            last[2], (3, [prompts[3][-1]] + draft[:5], lens[3] - 1)])[1][0],
    }
    diffs = {name: float((row - alone).abs().max()) for name, row in cases.items()}
    return dict(model=label, invariant=all(torch.equal(row, alone) for row in cases.values()), max_abs_diff=diffs)
