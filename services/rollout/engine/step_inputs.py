"""The flat layout of one step's tokens, built on the host once per step.

Each sequence feeds its ``num_scheduled_tokens`` tokens from ``num_computed_tokens`` on,
then, if that reaches its end (it samples), its draft. The step concatenates them:
  input_ids, positions, slot_mapping  one entry per fed token (slot = the KV cache row:
                                      block_table[p // block_size] * block_size + p % block_size);
  sample_rows                         the rows whose logits are needed: the last fed token
                                      of each sampling sequence, then one per draft token;
  block_tables, seq_lens, query_start_loc  one row / entry per sequence;
and the sampler's rows (``StepSampling``): each logits row's request slot
(input_batch.SlotParams) and absolute position, and the stop tokens masked out of the
rows before min_tokens (as flat indices row * vocab + token).
A draft tree (``seq.draft_parents``, engine/tree.py) is fed the same way, its nodes in
order after the last token, one KV slot each; but a node's position (RoPE and sampling)
is its depth past the last token's, and the step carries ``metadata.tree_mask``: per fed
token the rows of its sequence's query it may see (its ancestors; -1 for every token of
a sequence without a tree). A step with no tree has no mask (plain causal attention).

This runs on the host before every forward, so it is written for the common decode
step of a large batch: per sequence a few list operations (slot mappings are ranges per
block, not one computation per token), and every integer goes to the device in two
non-blocking copies (one int64 buffer, one int32 buffer, input_batch.Staging) whose
slices are the tensors. Slices start at multiples of 4 entries, so every tensor is 16-byte
aligned like a fresh allocation (Triton specialises kernels on pointer alignment).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from services.rollout.engine.attention import AttentionMetadata
from services.rollout.engine.input_batch import BlockTables, SlotParams, Staging, StepSampling
from services.rollout.engine.sequence import Sequence
from services.rollout.engine.tree import CAUSAL, depths, row_masks


# Below this many sequences the per-sequence path lays a decode step out faster: a numpy
# call costs a few microseconds on the step's cold caches (after the forward), a short
# sequence's Python less than one (benchmarks/engine_host.py: the numpy layout paid at
# 256 sequences, cost more at 16 and 64). Sequences with long block tables tip it sooner.
VECTOR_MIN_SEQS = 128
# From this many sequences a decode-layout step (every sequence its last token, perhaps a
# linear draft, no masked row) carries ``fed_host`` / ``query_start_host`` whichever path
# laid it out, so the verifier accepts its drafts by array operations (verify_linear).
LINEAR_MIN_SEQS = 8
# Up to this many sequences a steady step rewrites its staged entries one by one
# (``_restage_scalars``), past it by numpy over the batch (``_restage_arrays``).
SCALAR_RESTAGE_MAX = 8


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sample_rows] int64, rows of the flat batch whose logits are needed
    num_seqs: int
    num_tokens: int
    is_prefill: bool  # any sequence fed more than its last token
    sampling: StepSampling | None  # the sampler's rows; None when no sequence samples
    # A decode layout's per-sequence state by batch position (None: not a decode layout)
    steady: SteadyBatch | None = None


@dataclass(slots=True)
class SteadyBatch:
    """One decode-layout step's sequences and the per-sequence state its layout read, as
    arrays by batch position (vLLM's persistent ``InputBatch``, for what a decode feeds):
    each sequence's block-table row, request slot and first fed position (its
    ``num_computed_tokens``). The engine's commit advances it (``advance``: each
    sequence's next position and last token, from the step's sampled arrays, when no
    sequence's chunk ended). The next step, when its sequences are the same objects in
    the same order (all decoding again) and no table row was taken or given back since
    (``BlockTables.epoch``: no admission, finish, abort or preemption), is laid out from
    these arrays and the drafts alone (``_steady_step``), without reading its sequences'
    tokens and counts. A sequence's row and slot do not change while it holds its
    blocks, and its position only grows, so a sequence that masked no stop token at this
    step masks none at the next."""

    seqs: list[Sequence]
    rows: np.ndarray  # [num_seqs] int64: each sequence's BlockTables row
    slots: np.ndarray  # [num_seqs] int64: each sequence's SlotParams slot
    # [num_seqs] int64: the position of the token each sequence fed first (None where
    # starts_list holds them: ``starts_array``)
    starts: np.ndarray | None
    epoch: int  # BlockTables.epoch when laid out
    next_starts: np.ndarray | None = None  # set by advance: the next step's starts (or next_starts_list)
    # starts + 1 where the layout has no drafts, made while the step was laid out: what
    # advance(1, ...) sets next_starts to, without a numpy call after the forward (the
    # first one there costs several microseconds on a CPU, its code evicted by the
    # forward's and the sampler's)
    plus_one: np.ndarray | None = None
    # A batch of a few sequences (``_restage_scalars``, ``advance_lists``) keeps the same
    # as lists instead, where a list is cheaper than any numpy call; an array is made
    # from one only where asked for (``starts_array``, ``next_starts_array``).
    starts_list: list[int] | None = None
    next_starts_list: list[int] | None = None
    plus_one_list: list[int] | None = None
    next_last: np.ndarray | list[int] | None = None  # set by advance: each sequence's last token
    # What a next step of the same shape (the same query lengths; the block tables, staged
    # last, may change width) rewrites in place (``_restage_decode``), set where the step
    # was staged:
    inputs: StepInputs | None = None
    draft_lens: list[int] | None = None  # each sequence's draft length (None: no drafts)
    query_lens: np.ndarray | None = None  # [num_seqs] with drafts: 1 + draft length (made when first needed)
    seq_of_token: np.ndarray | None = None  # [num_tokens] with drafts (made when first needed)
    offsets: np.ndarray | None = None  # [num_tokens] with drafts: each token's position past its start
    first_rows: np.ndarray | None = None  # [num_seqs] with drafts: each sequence's first row (made when first needed)
    draft_rows: np.ndarray | None = None  # [num_tokens] with drafts: whether a row is a draft's (likewise)
    width: int = 0  # the block tables' staged width
    tables_version: int = -1  # BlockTables.version when the tables were gathered
    generations: tuple[int, int] = (-1, -1)  # the staging buffers' generations after this step's stage
    # (each sequence's request id, stop tokens and Sequence.end_len: ``requests``)
    _requests: tuple[list[str], list[frozenset[int]], np.ndarray] | None = None
    _placeholders: np.ndarray | None = None  # (``placeholders``)
    _few: FewWrites | None = None  # (``_restage_scalars``)

    def requests(self) -> tuple[list[str], list[frozenset[int]], np.ndarray]:
        """Each sequence's request id, stop tokens and chunk end (``Sequence.end_len``, an
        array), made once: none of them changes while a sequence runs. Read-only."""
        if self._requests is None:
            seqs = self.seqs
            self._requests = ([s.request_id for s in seqs], [s.stop_token_ids for s in seqs],
                              np.array([s.end_len for s in seqs], dtype=np.int64))
        return self._requests

    def placeholders(self) -> np.ndarray:
        """The last tokens of a step whose tokens are not read yet (``LLMEngine._leave``):
        zeros, the placeholder, one per sequence (made once); a layout from them is fed the
        device's tokens instead (``ModelRunner.run``'s ``fed``)."""
        if self._placeholders is None:
            self._placeholders = np.zeros(len(self.seqs), dtype=np.int64)
        return self._placeholders

    def advance(self, num_committed, last_tokens: np.ndarray) -> None:
        """Every sequence committed ``num_committed`` tokens (an array, or one count for
        all), the last of them ``last_tokens``; none ended its chunk."""
        if (type(num_committed) is int and num_committed == 1
                and (self.plus_one is not None or self.plus_one_list is not None)):  # a decode step
            self.next_starts, self.next_starts_list = self.plus_one, self.plus_one_list
        else:
            self.next_starts, self.next_starts_list = self.starts_array() + num_committed, None
        self.next_last = last_tokens

    def advance_lists(self, num_committed: list[int], last_tokens: list[int]) -> None:
        """``advance`` from lists: for a few sequences (those ``_restage_scalars`` lays
        out) kept as lists, no numpy call; for more, as arrays."""
        if len(num_committed) > SCALAR_RESTAGE_MAX:
            self.advance(np.array(num_committed, dtype=np.int64), np.array(last_tokens, dtype=np.int64))
            return
        starts = self.starts_list if self.starts_list is not None else self.starts.tolist()
        self.next_starts, self.next_starts_list = None, [s + n for s, n in zip(starts, num_committed)]
        self.next_last = last_tokens

    def advanced(self) -> bool:
        """Whether ``advance`` has set the next step's starts."""
        return self.next_starts is not None or self.next_starts_list is not None

    def starts_array(self) -> np.ndarray:
        if self.starts is None:
            self.starts = np.array(self.starts_list, dtype=np.int64)
        return self.starts

    def next_starts_array(self) -> np.ndarray:
        if self.next_starts is None and self.next_starts_list is not None:
            self.next_starts = np.array(self.next_starts_list, dtype=np.int64)
        return self.next_starts


@dataclass(slots=True)
class FewWrites:
    """What ``_restage_scalars`` reads of a steady batch of a few sequences that stays the
    same from step to step, made at its first restage: the sequences' rows as a list and
    where the parts it writes lie in the staged buffers (their layout is the batch's own
    while it restages)."""

    rows: list[int]
    index: dict[int, int]  # a row's sequence's place in the batch
    at64: tuple[int, int, int, int]  # the int64 buffer's token ids, positions, KV slots, row positions
    lens_at: int  # the int32 buffer's sequence lengths

    @classmethod
    def of(cls, steady: SteadyBatch, staging: tuple[Staging, Staging]) -> FewWrites:
        int64, int32 = staging
        rows = steady.rows.tolist()
        return cls(rows, {row: i for i, row in enumerate(rows)}, tuple(int64.bounds(i)[0] for i in (0, 1, 2, 5)),
                   int32.bounds(0)[0])


def new_staging(device: torch.device) -> tuple[Staging, Staging]:
    """The (int64, int32) staging buffers ``prepare_step`` fills."""
    return Staging(torch.int64, device), Staging(torch.int32, device)


def prepare_step(seqs: list[Sequence], block_size: int, device: torch.device, vocab_size: int = 0,
                 staging: tuple[Staging, Staging] | None = None, tables: BlockTables | None = None,
                 steady: SteadyBatch | None = None) -> StepInputs:
    """The step's inputs, through ``staging`` (a fresh pair when None); ``vocab_size``
    places the masked stop tokens (any value when no row masks one); ``tables``: the block
    manager's rows of the sequences' block tables (decode and verify steps gather from
    them; None: every step is laid out sequence by sequence); ``steady``: the last step's
    state, advanced by its commit (``SteadyBatch``; never a step with draft trees)."""
    staging = staging or new_staging(device)
    if steady is not None and tables is not None:
        inputs = _steady_step(seqs, block_size, staging, tables, steady)
        if inputs is not None:
            return inputs
    decode = _decode_step(seqs, block_size, staging, tables)
    if decode is not None:
        return decode
    rows_table = tables
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    row_slots: list[int] = []  # per logits row: its request's slot, the position it samples
    row_positions: list[int] = []
    masked: list[int] = []  # row * vocab + token
    seq_lens: list[int] = []
    cu_q = [0]
    width = max(len(s.block_table) for s in seqs)
    zeros = [0] * width
    tables: list[int] = []
    num_tokens, max_query_len = 0, 1  # every scheduled sequence feeds a token at least
    is_prefill = False
    decode_only = rows_table is not None  # every sequence a decode with a row, no masked row: a SteadyBatch
    rows_of: list[int] = []
    starts_of: list[int] = []
    draft_lens: list[int] = []
    linear = len(seqs) >= LINEAR_MIN_SEQS  # still a decode layout (LINEAR_MIN_SEQS)
    trees: list[tuple[int, list[int]]] = []  # (first token's index, row masks) of each tree sequence
    for seq in seqs:
        start, n, table, token_ids = seq.num_computed_tokens, seq.num_scheduled_tokens, seq.block_table, seq.token_ids
        length = len(token_ids)
        if n == 1 and start + 1 == length and not seq.draft_token_ids:  # a plain decode
            input_ids.append(token_ids[start])
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
            sample_rows.append(num_tokens)
            row_slots.append(seq.slot)
            row_positions.append(length)
            num_tokens += 1
            num_rows = 1
            end = start + 1
            row_depths = None
            if decode_only:
                rows_of.append(seq.row)
                starts_of.append(start)
                draft_lens.append(0)
        else:
            decoding = n == 1 and start + 1 == length and seq.draft_parents is None
            linear = linear and decoding
            if decode_only:
                decode_only = decoding
                rows_of.append(seq.row)
                starts_of.append(start)
                draft_lens.append(len(seq.draft_token_ids))
            end = start + n
            input_ids.extend(token_ids[start:end])
            num_rows = 0
            row_depths = None
            if end == length:  # samples: its draft follows; rows: its last fed token's, the draft's
                draft = seq.draft_token_ids
                input_ids.extend(draft)
                end += len(draft)
                sample_rows.extend(range(num_tokens + n - 1, num_tokens + end - start))
                num_rows = 1 + len(draft)
                row_slots.extend([seq.slot] * num_rows)
                if seq.draft_parents is None:
                    row_positions.extend(range(length, length + num_rows))
                else:  # a tree: positions by depth, rows masked to their ancestors
                    row_depths = [0] + depths(seq.draft_parents)
                    row_positions.extend([length + d for d in row_depths])
                    trees.append((num_tokens, row_masks(seq.draft_parents, n)))
            for b in range(start // bs, (end - 1) // bs + 1):  # the block's run of positions
                first = b * bs
                base = table[b] * bs - first
                slots.extend(range(base + max(start, first), base + min(end, first + bs)))
            if row_depths is None:
                positions.extend(range(start, end))
            else:
                positions.extend(range(start, length))
                positions.extend([length - 1 + d for d in row_depths[1:]])
            num_tokens += end - start
            max_query_len = max(max_query_len, end - start)
            is_prefill |= n > 1
        if num_rows and length < seq.mask_stops_below:
            linear = decode_only = False
            _mask_stop_tokens(seq, len(row_slots) - num_rows, num_rows, vocab_size, masked, row_depths)
        cu_q.append(num_tokens)
        seq_lens.append(end)
        tables.extend(table)
        tables.extend(zeros[len(table):])
    int64, int32 = staging
    tree_mask: list[int] = []
    if trees:
        tree_mask = [CAUSAL] * num_tokens
        for first, row_mask in trees:
            tree_mask[first:first + len(row_mask)] = row_mask
    ids_t, pos_t, slots_t, rows_t, row_slots_t, row_pos_t, masked_t, tree_mask_t = int64.stage(
        [input_ids, positions, slots, sample_rows, row_slots, row_positions, masked, tree_mask])
    lens_t, cu_t, tables_t = int32.stage([seq_lens, cu_q, tables])  # (the tables last: _restage_decode)
    md = AttentionMetadata(slot_mapping=slots_t, block_tables=tables_t.view(len(seqs), width), seq_lens=lens_t,
                           query_start_loc=cu_t, max_query_len=max_query_len,
                           tree_mask=tree_mask_t if trees else None)
    sampling = None
    if row_slots:
        sampling = StepSampling(row_slots=row_slots_t, positions=row_pos_t, masked=masked_t if masked else None,
                                row_slots_host=int64.host_part(4))
        if linear:
            sampling.fed_host = np.array(input_ids, dtype=np.int64)
            sampling.query_start_host = np.array(cu_q, dtype=np.int64)
    inputs = StepInputs(input_ids=ids_t, positions=pos_t, metadata=md, sample_rows=rows_t, num_seqs=len(seqs),
                        num_tokens=num_tokens, is_prefill=is_prefill, sampling=sampling)
    if decode_only and min(rows_of) >= 0:  # its parts lie as _stage_decode's do: restageable
        inputs.steady = SteadyBatch(seqs, np.array(rows_of, dtype=np.int64),
                                    np.array([s.slot for s in seqs], dtype=np.int64),
                                    np.array(starts_of, dtype=np.int64), rows_table.epoch, inputs=inputs,
                                    draft_lens=draft_lens if num_tokens > len(seqs) else None, width=width,
                                    tables_version=rows_table.version,
                                    generations=(int64.generation, int32.generation))
    return inputs


def _decode_step(seqs: list[Sequence], bs: int, staging: tuple[Staging, Staging],
                 tables: BlockTables | None) -> StepInputs | None:
    """``prepare_step`` for the common step where every sequence decodes: it feeds its last
    token, then perhaps a linear draft, and masks no stop token. One pass over the
    sequences gathers what changes every step (last token, draft, position, rows); the
    rest is numpy over those arrays (``_stage_decode``). None when a sequence is anything
    else, or when no ``tables`` (the per-sequence path then lays the step out)."""
    if tables is None or len(seqs) < VECTOR_MIN_SEQS:
        return None
    ids: list[int] = []
    starts: list[int] = []
    rows: list[int] = []
    slots: list[int] = []
    num_drafts: list[int] = []
    for seq in seqs:
        token_ids, start = seq.token_ids, seq.num_computed_tokens
        draft = seq.draft_token_ids
        if (seq.num_scheduled_tokens != 1 or start + 1 != len(token_ids) or seq.draft_parents is not None
                or start + 1 < seq.mask_stops_below or seq.row < 0):
            return None
        ids.append(token_ids[start])
        if draft:
            ids.extend(draft)
        starts.append(start)
        rows.append(seq.row)
        slots.append(seq.slot)
        num_drafts.append(len(draft))
    return _stage_decode(seqs, bs, staging, tables, np.array(rows, dtype=np.int64),
                         np.array(starts, dtype=np.int64), np.array(slots, dtype=np.int64),
                         np.array(ids, dtype=np.int64), None if len(ids) == len(seqs) else num_drafts)


def _steady_step(seqs: list[Sequence], bs: int, staging: tuple[Staging, Staging], tables: BlockTables,
                 steady: SteadyBatch) -> StepInputs | None:
    """``prepare_step`` for a steady batch (``SteadyBatch``): the last step's sequences
    again, advanced by its commit, no row taken or given back since. Their positions and
    last tokens are the advanced arrays; only the drafts are read from the sequences. A
    step of the last one's shape is written into its staged buffers in place
    (``_restage_decode``), another staged afresh (``_stage_decode``; below
    ``VECTOR_MIN_SEQS`` sequences the per-sequence path does that faster). None when the
    batch is not steady, or a small one changed shape."""
    if not steady.advanced() or steady.epoch != tables.epoch or seqs != steady.seqs:
        return None
    last = steady.next_last
    drafts = [seq.draft_token_ids for seq in seqs]
    n = len(seqs)
    if not any(drafts):
        fed, draft_lens = last, None
    elif n < VECTOR_MIN_SEQS:  # a few sequences: the interleaving in Python
        draft_lens = list(map(len, drafts))
        ids: list[int] = []
        for token, draft in zip(last if type(last) is list else last.tolist(), drafts):
            ids.append(token)
            ids.extend(draft)
        fed = ids if n <= SCALAR_RESTAGE_MAX else np.array(ids, dtype=np.int64)  # (the list: _restage_scalars)
    else:
        draft_lens = list(map(len, drafts))
        if draft_lens == steady.draft_lens and steady.draft_rows is not None:  # the last step's shape
            first, is_draft = steady.first_rows, steady.draft_rows
        else:
            query_lens = np.array(draft_lens, dtype=np.int64) + 1
            first = np.zeros(n, dtype=np.int64)
            np.cumsum(query_lens[:-1], out=first[1:])
            is_draft = np.ones(int(first[-1] + query_lens[-1]), dtype=np.bool_)
            is_draft[first] = False
            if draft_lens == steady.draft_lens:
                steady.first_rows, steady.draft_rows = first, is_draft
        fed = np.empty(len(is_draft), dtype=np.int64)
        fed[first] = last
        fed[is_draft] = np.fromiter(chain.from_iterable(drafts), dtype=np.int64, count=len(is_draft) - n)
    inputs = _restage_decode(steady, bs, staging, tables, fed, draft_lens)
    if inputs is not None or n < VECTOR_MIN_SEQS:
        return inputs
    if type(fed) is list:  # (a few sequences' last tokens: SteadyBatch.advance_lists)
        fed = np.array(fed, dtype=np.int64)
    return _stage_decode(seqs, bs, staging, tables, steady.rows, steady.next_starts_array(), steady.slots, fed,
                         draft_lens)


def _restage_decode(steady: SteadyBatch, bs: int, staging: tuple[Staging, Staging], tables: BlockTables,
                    fed: np.ndarray | list[int], draft_lens: list[int] | None) -> StepInputs | None:
    """The steady step written into the last step's staged buffers in place: what a decode
    step changes (tokens, positions, KV slots, the rows' positions, lengths, and the
    block tables where one changed: staged last, they may take another width,
    ``Staging.reshape_last``) over the parts that stay (sample rows, the rows' slots,
    query starts), the last step's tensors and objects reused (but a resized block
    tables' view). None when the query lengths changed, the buffers were staged since,
    or wider tables do not fit them."""
    int64, int32 = staging
    last = steady.inputs
    if (last is None or (int64.generation, int32.generation) != steady.generations
            or draft_lens != steady.draft_lens):
        return None
    tables.sync()
    rows = steady.rows
    few = len(rows) <= SCALAR_RESTAGE_MAX
    if few and steady._few is None:
        steady._few = FewWrites.of(steady, staging)
    retable = tables.version != steady.tables_version
    widened = False
    if retable:
        if few:
            lengths = tables.lengths_view
            width = max(lengths[row] for row in steady._few.rows)
        else:
            width = int(tables.lengths[rows].max())
        if width != steady.width:  # the block tables (staged last) take another size
            views = int32.reshape_last((len(rows), width))
            if views is None:
                return None
            last.metadata.block_tables, steady.width = views[2], width
            widened = True
    if few:
        _restage_scalars(steady, bs, staging, tables, fed, draft_lens, retable, widened)
    else:
        _restage_arrays(steady, bs, staging, tables, fed, draft_lens, retable)
    if last.sampling.fed_host is not None:
        last.sampling.fed_host = np.array(fed, dtype=np.int64) if type(fed) is list else fed
    steady.starts, steady.starts_list = steady.next_starts, steady.next_starts_list
    steady.next_starts = steady.next_starts_list = steady.next_last = None
    steady.tables_version = tables.version
    steady.generations = int64.generation, int32.generation
    return last


def _restage_arrays(steady: SteadyBatch, bs: int, staging: tuple[Staging, Staging], tables: BlockTables,
                    fed: np.ndarray, draft_lens: list[int] | None, retable: bool) -> None:
    """``_restage_decode``'s writes, by numpy over the batch."""
    int64, int32 = staging
    rows, starts = steady.rows, steady.next_starts_array()
    if draft_lens is None:
        positions, row_of_token = starts, rows
    else:
        if steady.seq_of_token is None:  # (a step the per-sequence path laid out)
            steady.query_lens = query_lens = np.array(draft_lens, dtype=np.int64) + 1
            steady.seq_of_token = np.repeat(np.arange(len(rows)), query_lens)
            steady.offsets = np.arange(len(fed)) - (np.cumsum(query_lens) - query_lens)[steady.seq_of_token]
        positions, row_of_token = starts[steady.seq_of_token] + steady.offsets, rows[steady.seq_of_token]
    host = int64.begin_rewrite()
    a, b = int64.bounds(0)
    host[a:b] = fed
    a, b = int64.bounds(1)
    host[a:b] = positions
    a, b = int64.bounds(2)
    host[a:b] = tables.array[row_of_token, positions // bs]
    host[a:b] *= bs
    host[a:b] += positions % bs
    a, b = int64.bounds(5)
    np.add(positions, 1, out=host[a:b])
    int64.end_rewrite()
    host = int32.begin_rewrite()
    if retable:
        a, b = int32.bounds(2)
        host[a:b] = tables.array[rows, :steady.width].reshape(-1)
    a, b = int32.bounds(0)
    if draft_lens is None:
        host[a:b] = steady.plus_one = starts + 1
    else:
        np.add(starts, steady.query_lens, out=host[a:b])
        steady.plus_one = None
    steady.plus_one_list = None
    int32.end_rewrite()


def _restage_scalars(steady: SteadyBatch, bs: int, staging: tuple[Staging, Staging], tables: BlockTables,
                     fed: np.ndarray | list[int], draft_lens: list[int] | None, retable: bool,
                     widened: bool) -> None:
    """``_restage_decode``'s writes for a few sequences, entry by entry, as Python ints
    through memoryviews of the buffers and the tables, from lists (the batch's starts and
    ``plus_one`` kept as lists: ``SteadyBatch.starts_list``): right after a forward the
    host's caches are cold, and each numpy call then costs several microseconds where a
    memoryview's write costs a fraction (``FewWrites``). ``fed``: the tokens fed, a list
    where the caller made one. A table that changed is written entry by entry too, from
    the changes synced since the last gather (``BlockTables.changes_since``), unless the
    tables took another width (``widened``) or the changes are no longer all kept."""
    int64, int32 = staging
    few = steady._few
    table = tables.view
    int64.begin_rewrite()
    host = int64.host_view
    ids_at, pos_at, kv_at, row_pos_at = few.at64
    if type(fed) is not list:
        fed = [0] * len(few.rows) if fed is steady._placeholders else fed.tolist()
    starts = steady.next_starts_list
    if starts is None:
        starts = steady.next_starts_list = steady.next_starts.tolist()
    t = 0
    ends = []
    for start, row, k in zip(starts, few.rows, draft_lens or [0] * len(few.rows)):
        for p in range(start, start + k + 1):
            host[ids_at + t] = fed[t]
            host[pos_at + t] = p
            host[kv_at + t] = table[row, p // bs] * bs + p % bs
            host[row_pos_at + t] = p + 1
            t += 1
        ends.append(start + k + 1)
    int64.end_rewrite()
    int32.begin_rewrite()
    host = int32.host_view
    if retable:
        a, b = int32.bounds(2)
        changes = None if widened else tables.changes_since(steady.tables_version)
        if changes is None:
            int32.host_np[a:b] = tables.array[steady.rows, :steady.width].reshape(-1)
        else:
            width = steady.width
            for entries in changes:
                for (row, col), block in entries.items():
                    i = few.index.get(row)
                    if i is not None and col < width:
                        host[a + i * width + col] = block
    lens_at = few.lens_at
    for i, end in enumerate(ends):
        host[lens_at + i] = end
    int32.end_rewrite()
    steady.plus_one, steady.plus_one_list = None, ends if draft_lens is None else None  # (a decode: the next starts)


def _stage_decode(seqs: list[Sequence], bs: int, staging: tuple[Staging, Staging], tables: BlockTables,
                  row_of_seq: np.ndarray, start_of_seq: np.ndarray, slot_of_seq: np.ndarray, fed: np.ndarray,
                  draft_lens: list[int] | None) -> StepInputs:
    """A decode layout from arrays by batch position: each sequence's table row, first fed
    position and request slot, the tokens fed (each sequence's last token, then its
    draft) and, with drafts, each sequence's draft length (None: no drafts).
    Positions, KV slots (gathered from the table rows), sampler rows and lengths are
    numpy over them; the step carries its ``SteadyBatch``."""
    tables.sync()
    n, num_tokens = len(seqs), len(fed)
    seq_of_token = offsets = None
    if draft_lens is None:  # no drafts: one token per sequence
        positions, row_of_token, slot_of_row = start_of_seq, row_of_seq, slot_of_seq
        cu, seq_lens, max_query_len = np.arange(n + 1), start_of_seq + 1, 1
    else:
        query_lens = np.array(draft_lens, dtype=np.int64) + 1
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu[1:])
        seq_of_token = np.repeat(np.arange(n), query_lens)
        offsets = np.arange(num_tokens) - cu[seq_of_token]
        positions = start_of_seq[seq_of_token] + offsets
        row_of_token, slot_of_row = row_of_seq[seq_of_token], slot_of_seq[seq_of_token]
        seq_lens, max_query_len = start_of_seq + query_lens, int(query_lens.max())
    table = tables.array
    kv_slots = table[row_of_token, positions // bs].astype(np.int64) * bs + positions % bs
    width = int(tables.lengths[row_of_seq].max())
    int64, int32 = staging
    ids_t, pos_t, slots_t, rows_t, row_slots_t, row_pos_t = int64.stage_arrays(
        [fed, positions, kv_slots, np.arange(num_tokens), slot_of_row, positions + 1])
    lens_t, cu_t, tables_t = int32.stage_arrays([seq_lens, cu, table[row_of_seq, :width]])
    md = AttentionMetadata(slot_mapping=slots_t, block_tables=tables_t, seq_lens=lens_t,
                           query_start_loc=cu_t, max_query_len=max_query_len)
    sampling = StepSampling(row_slots=row_slots_t, positions=row_pos_t, masked=None,
                            row_slots_host=int64.host_part(4))
    if n >= LINEAR_MIN_SEQS:
        sampling.fed_host, sampling.query_start_host = fed, cu
        if draft_lens is None or draft_lens.count(draft_lens[0]) == n:  # every sequence its rows alike
            sampling.rows_per_seq = max_query_len
    steady = SteadyBatch(seqs, row_of_seq, slot_of_seq, start_of_seq, tables.epoch, draft_lens=draft_lens,
                         query_lens=None if draft_lens is None else query_lens, seq_of_token=seq_of_token,
                         offsets=offsets, width=width, tables_version=tables.version,
                         generations=(int64.generation, int32.generation),
                         plus_one=seq_lens if draft_lens is None else None)
    inputs = steady.inputs = StepInputs(input_ids=ids_t, positions=pos_t, metadata=md, sample_rows=rows_t,
                                        num_seqs=n, num_tokens=num_tokens, is_prefill=False, sampling=sampling,
                                        steady=steady)
    return inputs


def _mask_stop_tokens(seq: Sequence, first_row: int, num_rows: int, vocab_size: int, masked: list[int],
                      row_depths: list[int] | None = None) -> None:
    """Stop tokens out of seq's rows before min_tokens (Sequence.masked_token_ids): row j
    samples the token at generated index (num_tokens - num_prompt_tokens) + j (a tree's
    row: + its depth, ``row_depths[j]``)."""
    num_masked = seq.req.min_tokens - (len(seq.token_ids) - seq.num_prompt_tokens)
    if num_masked > 0 and seq.stop_token_ids:
        ids = [t for t in sorted(seq.stop_token_ids) if t < vocab_size]
        rows = (range(min(num_rows, num_masked)) if row_depths is None
                else [j for j, d in enumerate(row_depths) if d < num_masked])
        masked.extend((first_row + j) * vocab_size + t for j in rows for t in ids)


def sampling_of(seqs: list[Sequence], params: SlotParams, device: torch.device) -> StepSampling:
    """The sampler's rows for ``seqs`` (each sampling its last token and draft), their
    requests given slots in ``params``: what ``prepare_step`` makes for a step, for
    callers that sample without a forward (the verifier's tests)."""
    row_slots: list[int] = []
    row_positions: list[int] = []
    masked: list[int] = []
    for seq in seqs:
        slot, num_rows, length = params.assign(seq.req), 1 + len(seq.draft_token_ids), len(seq.token_ids)
        row_slots.extend([slot] * num_rows)
        row_depths = None if seq.draft_parents is None else [0] + depths(seq.draft_parents)
        row_positions.extend(range(length, length + num_rows) if row_depths is None
                             else [length + d for d in row_depths])
        _mask_stop_tokens(seq, len(row_slots) - num_rows, num_rows, params.vocab_size, masked, row_depths)
    int64 = Staging(torch.int64, device)
    row_slots_t, row_pos_t, masked_t = int64.stage([row_slots, row_positions, masked])
    return StepSampling(row_slots=row_slots_t, positions=row_pos_t, masked=masked_t if masked else None,
                        row_slots_host=int64.host_part(0))
