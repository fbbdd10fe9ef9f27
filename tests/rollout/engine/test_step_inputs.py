"""prepare_step's packed layout against a token-by-token reference layout, on a ragged
batch: decodes, a prefill chunk that does not sample, a last prefill chunk that does,
verify steps with drafts, sequences spanning several (non-contiguous) blocks.

If this fails, the forward reads or writes the wrong KV slots, or samples the wrong rows.
"""

from __future__ import annotations

import torch

from services.rollout.engine.request import EngineRequest
from services.rollout.engine.sequence import Sequence
from services.rollout.engine.step_inputs import prepare_step

BLOCK = 4


def make_seq(i: int, num_tokens: int, computed: int, scheduled: int, draft: list[int], table: list[int]) -> Sequence:
    req = EngineRequest(request_id=f"r{i}", prompt_id=f"p{i}", step_id="s", sample_index=0,
                        prompt_token_ids=[(7 * i + 3 * j) % 50 + 1 for j in range(num_tokens)],
                        generated_token_ids=[], temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=i,
                        max_tokens=64, max_new_tokens=64, stop_token_ids=frozenset(), min_tokens=0,
                        ignore_eos=True, logprobs=True)
    seq = Sequence(req, (0,), 256)
    seq.num_computed_tokens, seq.num_scheduled_tokens, seq.draft_token_ids = computed, scheduled, draft
    seq.block_table = table
    return seq


def reference_layout(seqs: list[Sequence], bs: int) -> dict:
    """One token at a time, the layout model_runner.py documents."""
    out = dict(input_ids=[], positions=[], slots=[], sample_rows=[], seq_lens=[], cu_q=[0], tables=[])
    width = max(len(s.block_table) for s in seqs)
    for seq in seqs:
        start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
        tokens = seq.token_ids[start:start + n]
        if start + n == seq.num_tokens:
            tokens = tokens + seq.draft_token_ids
            out["sample_rows"] += list(range(out["cu_q"][-1] + n - 1, out["cu_q"][-1] + len(tokens)))
        for p in range(start, start + len(tokens)):
            out["slots"].append(seq.block_table[p // bs] * bs + p % bs)
            out["positions"].append(p)
        out["input_ids"] += tokens
        out["cu_q"].append(out["cu_q"][-1] + len(tokens))
        out["seq_lens"].append(start + len(tokens))
        out["tables"].append(seq.block_table + [0] * (width - len(seq.block_table)))
    return out


def test_prepare_matches_reference_layout():
    seqs = [
        make_seq(0, 9, 8, 1, [], [5, 2, 11]),  # decode at the first slot of its third block
        make_seq(1, 4, 3, 1, [], [7]),  # decode at a block's last slot
        make_seq(2, 6, 5, 1, [30, 31, 32, 33, 34], [3, 9, 14]),  # verify: the draft crosses two blocks
        make_seq(3, 8, 7, 1, [40], [1, 4, 19]),  # verify: the draft starts a new block
        make_seq(4, 13, 2, 6, [], [6, 8, 10, 12]),  # a prefill chunk that does not sample (drafts ignored)
        make_seq(5, 13, 5, 8, [], [13, 15, 16, 17]),  # the last prefill chunk: samples its last token
        make_seq(6, 3, 0, 3, [], [20]),  # a whole short prompt in one chunk
        make_seq(7, 10, 4, 1, [], [21, 22, 23]),  # a one-token prefill chunk: feeds one token, samples none
    ]
    seqs[4].draft_token_ids = [9, 9]  # a non-sampling sequence never feeds its draft
    inputs = prepare_step(seqs, BLOCK, torch.device("cpu"))
    ref = reference_layout(seqs, BLOCK)
    md = inputs.metadata
    assert inputs.input_ids.tolist() == ref["input_ids"]
    assert inputs.positions.tolist() == ref["positions"]
    assert md.slot_mapping.tolist() == ref["slots"]
    assert inputs.sample_rows.tolist() == ref["sample_rows"]
    assert md.seq_lens.tolist() == ref["seq_lens"]
    assert md.query_start_loc.tolist() == ref["cu_q"]
    assert md.block_tables.tolist() == ref["tables"]
    assert md.max_query_len == max(b - a for a, b in zip(ref["cu_q"], ref["cu_q"][1:]))
    assert (inputs.num_seqs, inputs.num_tokens, inputs.is_prefill) == (len(seqs), len(ref["input_ids"]), True)
    dtypes = (inputs.input_ids.dtype, inputs.positions.dtype, md.slot_mapping.dtype, inputs.sample_rows.dtype,
              md.block_tables.dtype, md.seq_lens.dtype, md.query_start_loc.dtype)
    assert dtypes == (torch.int64,) * 4 + (torch.int32,) * 3
    for t in (inputs.input_ids, inputs.positions, md.slot_mapping, inputs.sample_rows, md.block_tables,
              md.seq_lens, md.query_start_loc):
        assert t.is_contiguous() and t.data_ptr() % 16 == 0


def test_decode_only_step_is_not_prefill():
    seqs = [make_seq(i, 5 + i, 4 + i, 1, [], [i, 10 + i]) for i in range(3)]
    inputs = prepare_step(seqs, BLOCK, torch.device("cpu"))
    ref = reference_layout(seqs, BLOCK)
    assert md_lists(inputs) == (ref["slots"], ref["sample_rows"], ref["cu_q"])
    assert not inputs.is_prefill and inputs.metadata.max_query_len == 1


def md_lists(inputs):
    return (inputs.metadata.slot_mapping.tolist(), inputs.sample_rows.tolist(),
            inputs.metadata.query_start_loc.tolist())


def test_sampler_rows_follow_the_logits_rows():
    """Each logits row's request slot and sampled position (the last token's length, then
    one more per draft token), and the stop tokens masked before min_tokens as flat
    indices row * vocab + token; the plain-decode path and the general one agree."""
    seqs = [make_seq(0, 9, 8, 1, [], [5, 2, 11]), make_seq(2, 6, 5, 1, [30, 31], [3, 9]),
            make_seq(4, 13, 2, 6, [], [6, 8, 10, 12]), make_seq(5, 13, 5, 8, [], [13, 15, 16, 17])]
    for slot, seq in zip((7, 3, 9, 1), seqs):
        seq.slot = slot
    seqs[1].req.min_tokens, seqs[1].mask_stops_below = 2, seqs[1].num_prompt_tokens + 2  # as Sequence sets it
    seqs[1].stop_token_ids = frozenset({4, 1, 99})  # 99 is past the vocabulary: not masked
    vocab = 50
    sampling = prepare_step(seqs, BLOCK, torch.device("cpu"), vocab).sampling
    assert sampling.row_slots.tolist() == sampling.row_slots_host.tolist() == [7, 3, 3, 3, 1]
    assert sampling.positions.tolist() == [9, 6, 7, 8, 13]
    # seqs[1] has generated 0 tokens: its rows 1 and 2 (generated index 0, 1) mask 1 and 4
    assert sampling.masked.tolist() == [1 * vocab + 1, 1 * vocab + 4, 2 * vocab + 1, 2 * vocab + 4]
    decodes = [make_seq(i, 5 + i, 4 + i, 1, [], [i, 10 + i]) for i in range(3)]
    for i, seq in enumerate(decodes):
        seq.slot = 5 - i
    fast = prepare_step(decodes, BLOCK, torch.device("cpu"), vocab)
    decodes[0].mask_stops_below = 1 << 30  # not a plain decode any more (it would mask): the general path
    general = prepare_step(decodes, BLOCK, torch.device("cpu"), vocab)
    for a, b in ((fast, general), (fast.sampling, general.sampling)):
        for name in ("input_ids", "positions", "sample_rows", "row_slots"):
            if hasattr(a, name):
                assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    assert fast.sampling.positions.tolist() == general.sampling.positions.tolist() == [5, 6, 7]
    assert md_lists(fast) == md_lists(general)
    assert fast.metadata.block_tables.tolist() == general.metadata.block_tables.tolist()
    assert fast.metadata.seq_lens.tolist() == general.metadata.seq_lens.tolist()
    assert fast.sampling.masked is None and general.sampling.masked is None  # no stop tokens to mask
