"""The engine's persistent per-slot state and the array paths built on it.

  - ``BlockTables``: each running sequence's block table as a row of one numpy array,
    written by the block manager; a row given back and taken again must hold nothing of
    its last sequence (a stale block id there makes the forward read another sequence's
    KV);
  - the decode layout (``step_inputs._decode_step``: numpy over the batch, rows gathered
    from ``BlockTables``) against the per-sequence layout, on batches whose rows were
    reused;
  - ``accepted_lengths`` (every sequence's draft accepted by array operations) against
    the one-sequence walk;
  - engines on the array paths (``VECTOR_MIN_SEQS`` = 1, so even small batches take
    them): output equal to the reference and to plain decoding, with sampling slots and
    table rows reused after finishes, aborts and preemptions;
  - the steady batch (``step_inputs.SteadyBatch``: a decode step's positions and last
    tokens kept by batch position and advanced by the commit, the next step laid out
    from them, in place where its shape is the last one's) against the per-sequence
    layout through random lifecycles, and engines on it against the reference;
  - a steady batch's decode pass on its arrays (``BatchScheduler._schedule_steady``)
    against the per-sequence pass, step by step through random lifecycles, and what it
    refuses;
  - a step's linear drafts checked at once (``LLMEngine._take_linear_drafts``) against
    the per-sequence checks, with junk drafts, a tight budget and a small cache;
  - metric exports deferred behind the next forward, flushed when the engine goes idle.

If these fail, a reused slot leaks its last request's state into a new one, or the fast
paths stopped computing what the per-sequence ones do.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import services.rollout.engine.batch_scheduler as batch_scheduler
import services.rollout.engine.engine as engine_module
import services.rollout.engine.step_inputs as step_inputs
from services.common import metrics as m
from services.rollout.engine.block_manager import BlockManager
from services.rollout.engine.input_batch import BlockTables, HostReader, Staging, VerifyStats
from services.rollout.engine.step_inputs import new_staging, prepare_step
from services.rollout.engine.verifier import LinearVerdicts, accepted_lengths, num_accepted
from tests.rollout.engine.test_block_manager import seq_of
from tests.rollout.engine.test_engine import (OracleDrafter, _engine_with, assert_same, make_request,
                                              mixed_requests, model, prompt_of, reference_generate, run_to_end)

__all__ = ["model"]  # the module-scoped fixture, from test_engine

CPU = torch.device("cpu")


@pytest.fixture
def array_paths(monkeypatch):
    """Every decode step of any batch size takes the numpy layout and the array verify."""
    monkeypatch.setattr(step_inputs, "VECTOR_MIN_SEQS", 1)
    monkeypatch.setattr(step_inputs, "LINEAR_MIN_SEQS", 1)
    calls = {"verify_linear": 0}
    real = engine_module.verify_linear

    def counted(*args, **kw):
        calls["verify_linear"] += 1
        return real(*args, **kw)

    monkeypatch.setattr(engine_module, "verify_linear", counted)
    return calls


# ---------------------------------------------------------------------- BlockTables


def assert_rows_mirror(bm: BlockManager, running: list) -> None:
    bm.tables.sync()
    rows = [s.row for s in running]
    assert len(set(rows)) == len(rows) and min(rows, default=0) >= 0
    array, lengths = bm.tables.array, bm.tables.lengths
    for seq in running:
        n = len(seq.block_table)
        assert lengths[seq.row] == n
        assert array[seq.row, :n].tolist() == seq.block_table
        assert not array[seq.row, n:].any(), "a row holds blocks past its table"
    free = [r for r in range(array.shape[0]) if r not in set(rows)]
    assert not array[free].any() and not lengths[free].any(), "a free row kept its last table"


@pytest.mark.parametrize("max_held, scalar_max", [(1 << 16, BlockTables.SCALAR_SYNC_MAX), (5, 8), (1 << 16, 0),
                                                  (1 << 16, 1 << 16)])
def test_block_table_rows_follow_every_change_and_come_back_clean(monkeypatch, max_held, scalar_max):
    """Random admissions (cached prefixes included), growth, truncation, frees: after each
    operation the running sequences' rows equal their tables padded with zeros, and free
    rows are all zeros. A row that kept a freed sequence's blocks fails here. With a small
    ``MAX_HELD`` the changes are also written in between, as a long run without gathers
    writes them. ``scalar_max``: the held changes a sync writes one by one (0: every
    sync by numpy; past any count: every sync one by one)."""
    monkeypatch.setattr(BlockTables, "MAX_HELD", max_held)
    monkeypatch.setattr(BlockTables, "SCALAR_SYNC_MAX", scalar_max)
    rng = random.Random(7)
    bm = BlockManager(num_blocks=96, block_size=4)
    running, next_id = [], 0
    for _ in range(400):
        op = rng.random()
        if op < 0.3 or not running:
            prompt = [rng.randrange(1, 5) for _ in range(rng.randrange(1, 30))]
            seq = seq_of(prompt, f"r{next_id}")
            next_id += 1
            cached = bm.cached_prefix(seq)
            if bm.num_new_blocks_to_admit(seq, cached) <= bm.num_free_blocks:
                bm.admit(seq, cached)
                running.append(seq)
        elif op < 0.55:
            seq = rng.choice(running)
            seq.token_ids.extend(rng.randrange(1, 5) for _ in range(rng.randrange(1, 9)))
            bm.ensure_slots(seq, seq.num_tokens)
        elif op < 0.7:
            seq = rng.choice(running)
            bm.truncate(seq, rng.randrange(1, seq.num_tokens + 1))
            del seq.token_ids[len(seq.block_table) * bm.block_size:]
        elif op < 0.8:
            seq = rng.choice(running)
            seq.num_computed_tokens = len(seq.token_ids)
            bm.commit(seq)
        else:
            seq = running.pop(rng.randrange(len(running)))
            bm.free(seq)
            assert seq.row == -1
        assert len(bm.tables._entries) <= max_held  # what is held stays bounded
        if rng.random() < 0.5:  # changes also pile up between syncs (several steps' worth)
            assert_rows_mirror(bm, running)
    assert_rows_mirror(bm, running)
    assert next_id > 100 and bm.tables.array.shape[0] >= 8  # rows were taken back and given out again


@pytest.mark.parametrize("scalar_max", [0, BlockTables.SCALAR_SYNC_MAX])
def test_a_sync_widens_the_tables_for_a_longer_table(monkeypatch, scalar_max):
    """A table longer than the array is wide: the sync widens it (one by one or by numpy),
    the other rows kept."""
    monkeypatch.setattr(BlockTables, "SCALAR_SYNC_MAX", scalar_max)
    tables = BlockTables(rows=4, cols=2)
    a, b = tables.assign(), tables.assign()
    tables.extend(a, 0, [7, 8])
    tables.sync()
    tables.extend(b, 0, [1])
    tables.extend(b, 1, [2, 3, 4, 5])
    tables.sync()
    assert tables.array.shape[1] >= 5 and tables.lengths[[a, b]].tolist() == [2, 5]
    assert tables.array[a].tolist()[:3] == [7, 8, 0] and tables.array[b].tolist()[:5] == [1, 2, 3, 4, 5]


# ---------------------------------------------------------------------- the decode layout


def decode_batch(rng: random.Random, bm: BlockManager, seqs: list, slot_of: dict) -> list:
    """Each of ``seqs`` made a decode at its last token with a random linear draft (KV for it
    ensured), as the engine leaves them before the forward."""
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.num_scheduled_tokens = 1
        seq.draft_token_ids = [rng.randrange(1, 50) for _ in range(rng.choice([0, 0, 1, 3, 6]))]
        assert bm.ensure_slots(seq, seq.num_tokens + len(seq.draft_token_ids))
        seq.slot = slot_of[seq.request_id]
    return seqs


def assert_same_layout(fast, general) -> None:
    for name in ("input_ids", "positions", "sample_rows"):
        assert getattr(fast, name).tolist() == getattr(general, name).tolist(), name
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        assert getattr(fast.metadata, name).tolist() == getattr(general.metadata, name).tolist(), name
        assert getattr(fast.metadata, name).dtype == getattr(general.metadata, name).dtype, name
    assert fast.metadata.max_query_len == general.metadata.max_query_len
    assert fast.metadata.tree_mask is None and general.metadata.tree_mask is None
    assert (fast.num_seqs, fast.num_tokens, fast.is_prefill) == (general.num_seqs, general.num_tokens, False)
    for name in ("row_slots", "positions"):
        assert getattr(fast.sampling, name).tolist() == getattr(general.sampling, name).tolist(), name
    assert fast.sampling.row_slots_host.tolist() == general.sampling.row_slots_host.tolist()
    assert fast.sampling.masked is None and general.sampling.masked is None
    # what verify_linear reads: the token fed at each row, each sequence's first row
    assert fast.sampling.fed_host.tolist() == general.sampling.fed_host.tolist() == general.input_ids.tolist()
    assert (fast.sampling.query_start_host.tolist() == general.sampling.query_start_host.tolist()
            == general.metadata.query_start_loc.tolist())
    for t in (fast.input_ids, fast.positions, fast.metadata.slot_mapping, fast.sample_rows,
              fast.metadata.block_tables, fast.metadata.seq_lens, fast.metadata.query_start_loc):
        assert t.is_contiguous() and t.data_ptr() % 16 == 0


def test_decode_layout_equals_the_per_sequence_layout_on_reused_rows(monkeypatch):
    """Rounds of decode batches with linear drafts, sequences of very different lengths
    finishing and new ones taking their rows (and their request slots): the numpy layout
    equals the per-sequence one in every tensor, its block tables padded with zeros where
    a row's last sequence had blocks."""
    rng = random.Random(3)
    bm = BlockManager(num_blocks=512, block_size=4)
    monkeypatch.setattr(step_inputs, "VECTOR_MIN_SEQS", 1)
    monkeypatch.setattr(step_inputs, "LINEAR_MIN_SEQS", 1)  # the per-sequence path marks its linear steps too
    staging, general_staging = new_staging(CPU), new_staging(CPU)
    running, slot_of, free_slots, next_id = [], {}, list(range(40)), 0
    for round_ in range(30):
        while len(running) < 12:  # a mix of long and short sequences
            length = rng.choice([2, 3, 5, 60, 90]) if round_ % 2 else rng.choice([1, 2, 4])
            seq = seq_of([rng.randrange(1, 50) for _ in range(length)], f"r{next_id}")
            next_id += 1
            bm.admit(seq, bm.cached_prefix(seq))
            slot_of[seq.request_id] = free_slots.pop()
            running.append(seq)
        batch = decode_batch(rng, bm, rng.sample(running, rng.randrange(1, len(running) + 1)), slot_of)
        fast = step_inputs._decode_step(batch, bm.block_size, staging, bm.tables)
        assert fast is not None
        assert_same_layout(fast, prepare_step(batch, bm.block_size, CPU, 50, general_staging))
        for seq in batch:  # commit one token and drop the drafts' blocks, as the engine does
            seq.token_ids.append(rng.randrange(1, 50))
            seq.draft_token_ids = []
            bm.truncate(seq, seq.num_tokens)
        for seq in rng.sample(running, rng.randrange(0, 5)):  # finish / abort / preempt: row and slot back
            running.remove(seq)
            bm.free(seq)
            free_slots.append(slot_of.pop(seq.request_id))
    assert next_id > 40


def test_the_decode_layout_refuses_what_it_does_not_lay_out(monkeypatch):
    """Prefill chunks, draft trees, rows masking stop tokens, and sequences without a row
    go the per-sequence way; a step with any of the first three is not a decode layout
    (``fed_host`` None: the engine verifies it sequence by sequence), one whose sequences
    merely lack rows still is."""
    monkeypatch.setattr(step_inputs, "VECTOR_MIN_SEQS", 1)
    monkeypatch.setattr(step_inputs, "LINEAR_MIN_SEQS", 1)
    bm = BlockManager(num_blocks=64, block_size=4)
    seqs = [seq_of(prompt_of(6, i), f"r{i}") for i in range(8)]
    for i, seq in enumerate(seqs):
        bm.admit(seq, [])
        seq.slot = i
    rng = random.Random(0)
    decode_batch(rng, bm, seqs, {s.request_id: s.slot for s in seqs})
    seqs[0].draft_token_ids = seqs[0].draft_token_ids or [5]
    assert step_inputs._decode_step(seqs, 4, new_staging(CPU), bm.tables) is not None
    assert step_inputs._decode_step(seqs, 4, new_staging(CPU), None) is None
    cases = [("num_computed_tokens", 2, False), ("draft_parents", [-1] * len(seqs[0].draft_token_ids), False),
             ("mask_stops_below", 1 << 20, False), ("row", -1, True)]
    for name, value, linear in cases:
        saved = getattr(seqs[0], name)
        setattr(seqs[0], name, value)
        if name == "num_computed_tokens":
            seqs[0].num_scheduled_tokens = seqs[0].num_tokens - 2
        assert step_inputs._decode_step(seqs, 4, new_staging(CPU), bm.tables) is None, name
        general = prepare_step(seqs, 4, CPU, 50, new_staging(CPU), bm.tables)
        assert (general.sampling.fed_host is not None) == linear, name
        setattr(seqs[0], name, saved)
        seqs[0].num_scheduled_tokens = 1


# ---------------------------------------------------------------------- the steady batch


def counting_steady_paths(monkeypatch) -> dict:
    """Counts the steps ``_steady_step`` laid out, those of them rewritten in place, and
    those rewritten with block tables of another width (``Staging.reshape_last``), and the
    rewrites of a few sequences' tables from their changes alone (``changes_since``)."""
    calls = {"steady": 0, "in_place": 0, "reshaped": 0, "changes": 0}
    steady, restage, reshape = step_inputs._steady_step, step_inputs._restage_decode, Staging.reshape_last
    changes_since = BlockTables.changes_since

    def counted_changes(self, version):
        out = changes_since(self, version)
        calls["changes"] += out is not None
        return out

    monkeypatch.setattr(BlockTables, "changes_since", counted_changes)

    def counted_reshape(self, shape):
        out = reshape(self, shape)
        calls["reshaped"] += out is not None
        return out

    monkeypatch.setattr(Staging, "reshape_last", counted_reshape)

    def counted_steady(*args, **kw):
        out = steady(*args, **kw)
        calls["steady"] += out is not None
        return out

    def counted_restage(*args, **kw):
        out = restage(*args, **kw)
        calls["in_place"] += out is not None
        return out

    monkeypatch.setattr(step_inputs, "_steady_step", counted_steady)
    monkeypatch.setattr(step_inputs, "_restage_decode", counted_restage)
    return calls


@pytest.mark.parametrize("seed, vector_min, scalar_max", [(0, 1, 0), (1, 1, 8), (2, 128, 8), (3, 128, 0)])
def test_the_steady_layout_equals_the_per_sequence_layout_through_random_lifecycles(monkeypatch, seed,
                                                                                    vector_min, scalar_max):
    """The engine's loop on the layout's side, with random lifecycles: a batch of decodes
    with random linear drafts (often none, often every sequence the same length, so steps
    keep their shape) is laid out with the last step's ``SteadyBatch``, then each sequence
    commits a random number of its fed tokens (its accepted drafts and one more, as a
    verify does: its drafts' blocks dropped) and the state is advanced from those
    counts, unless a sequence's chunk "ended". Between steps, at random: admissions,
    finishes, aborts and preemptions (rows taken and given back), a batch of other
    sequences or in another order, a sequence left out, the staging buffers used by
    another layout. Every step's tensors equal the per-sequence layout's (no tables,
    no state) made from the sequences themselves; a steady layout reading a stale
    position, token, row or block table, or rewriting buffers that another step staged
    since, fails here. ``vector_min`` (VECTOR_MIN_SEQS) 1: a steady step of another shape
    is staged afresh by numpy; 128: by the per-sequence path, its record rewritten in place
    by the next step. ``scalar_max`` (SCALAR_RESTAGE_MAX) 0: every rewrite by numpy; 8:
    the small batches' entry by entry."""
    rng = random.Random(seed)
    monkeypatch.setattr(step_inputs, "LINEAR_MIN_SEQS", 1)  # both layouts carry fed_host at any size
    monkeypatch.setattr(step_inputs, "VECTOR_MIN_SEQS", vector_min)
    monkeypatch.setattr(step_inputs, "SCALAR_RESTAGE_MAX", scalar_max)
    calls = counting_steady_paths(monkeypatch)
    bs = 8
    bm = BlockManager(num_blocks=1024, block_size=bs)
    staging, general_staging = new_staging(CPU), new_staging(CPU)
    running, slot_of, free_slots, next_id = [], {}, list(range(64)), 0
    batch, steady, draft_len = [], None, 0

    def admit(n):
        nonlocal next_id
        for _ in range(n):
            seq = seq_of([rng.randrange(1, 50) for _ in range(rng.choice([1, 3, 4, 7, 30]))], f"r{next_id}")
            next_id += 1
            bm.admit(seq, bm.cached_prefix(seq))
            slot_of[seq.request_id] = free_slots.pop()
            seq.num_computed_tokens = seq.num_tokens - 1  # its prompt computed: it decodes
            running.append(seq)

    admit(rng.randrange(1, 10))
    for step in range(160):
        event = rng.random()
        if event < 0.08 and running:  # finished, aborted or preempted: its row back
            seq = rng.choice(running)
            running.remove(seq)
            bm.free(seq)
            free_slots.append(slot_of.pop(seq.request_id))
            if rng.random() < 0.5:  # preempted and taken back at once (a new row, recomputed)
                bm.admit(seq, [])
                slot_of[seq.request_id] = free_slots.pop()
                seq.num_computed_tokens = seq.num_tokens - 1
                running.append(seq)
        elif event < 0.14:
            admit(rng.randrange(1, 3))
        if not running:
            admit(1)
        if event > 0.9 or not batch or any(s not in running for s in batch):
            batch = rng.sample(running, rng.randrange(1, len(running) + 1))  # another batch
        elif event > 0.85 and len(batch) > 1:
            batch = batch[1:]  # one left out
        elif event > 0.8:
            prepare_step(batch, bs, CPU, 50, staging)  # another layout through the same buffers
        batch = list(batch)  # a new list every step, as the scheduler's
        same_len = rng.random() < 0.8
        if rng.random() < 0.2:
            draft_len = rng.choice([0, 0, 1, 3])
        for seq in batch:
            seq.num_scheduled_tokens = 1
            n = draft_len if same_len else rng.choice([0, 0, 1, 2, 5])
            seq.draft_token_ids = [rng.randrange(1, 50) for _ in range(n)]
            assert bm.ensure_slots(seq, seq.num_tokens + n)
            seq.slot = slot_of[seq.request_id]
        fast = prepare_step(batch, bs, CPU, 50, staging, bm.tables, steady)
        assert_same_layout(fast, prepare_step(batch, bs, CPU, 50, general_staging))
        steady = fast.steady
        assert steady is not None and steady.seqs == batch
        committed = []
        for seq in batch:  # a verify's commit: accepted drafts and one more token
            k = rng.randrange(0, len(seq.draft_token_ids) + 1) + 1
            seq.token_ids.extend(rng.randrange(1, 50) for _ in range(k))
            seq.num_computed_tokens += k
            seq.draft_token_ids = []
            bm.truncate(seq, seq.num_tokens)
            assert bm.ensure_slots(seq, seq.num_tokens)  # the scheduler's, for the last token's KV
            committed.append(k)
        last = [s.token_ids[-1] for s in batch]
        way = rng.random()
        if way < 0.1:  # a chunk "ended": the engine advances nothing
            pass
        elif way < 0.4 and committed == [1] * len(batch):  # a decode's commit, as the engine's _leave
            steady.advance(1, np.array(last))
        elif way < 0.7:  # a verify laid out per sequence, as the engine's (lists for a few, else arrays)
            steady.advance_lists(committed, last)
        else:
            steady.advance(np.array(committed), np.array(last))
    assert calls["steady"] > 20 and calls["in_place"] > 10 and calls["reshaped"] > 2, calls
    if scalar_max:  # tables rewritten from their changes alone, not gathered again
        assert calls["changes"] > 5, calls


def test_a_staged_last_part_takes_another_size_in_place():
    """``Staging.reshape_last``: the last part resized, the parts before it where they
    were, with their values (the last stage's tensors of them stay valid), the extent a
    GPU copy sends (``end_rewrite``) the new one; None, with nothing changed, where the
    buffer is too small."""
    staging = Staging(torch.int32, CPU, capacity=32)
    lens, _ = staging.stage_arrays([np.array([5, 6, 7]), np.arange(6).reshape(3, 2)])
    views = staging.reshape_last((3, 3))
    assert views[0].data_ptr() == lens.data_ptr() and views[0].tolist() == [5, 6, 7] and views[1].shape == (3, 3)
    assert staging.bounds(1) == (4, 13) and staging._end == 13
    assert staging.reshape_last((3, 10)) is None and staging.bounds(1) == (4, 13) and staging._end == 13
    assert staging.reshape_last((3, 1))[1].shape == (3, 1) and staging._end == 7


def test_a_steady_step_refuses_a_batch_that_changed(monkeypatch):
    """What ``_steady_step`` checks before it reads no sequence: the state advanced by the
    commit, the same sequences in the same order, no table row taken or given back; and
    a small batch whose shape changed goes the per-sequence way."""
    bm = BlockManager(num_blocks=64, block_size=4)
    seqs = [seq_of(prompt_of(6, i), f"r{i}") for i in range(3)]
    for i, seq in enumerate(seqs):
        bm.admit(seq, [])
        seq.slot = i
    decode_batch(random.Random(0), bm, seqs, {s.request_id: i for i, s in enumerate(seqs)})
    staging = new_staging(CPU)
    steady = prepare_step(seqs, 4, CPU, 50, staging, bm.tables).steady
    assert step_inputs._steady_step(list(seqs), 4, staging, bm.tables, steady) is None  # not advanced
    steady.advance(1, np.array([1, 2, 3]))
    assert step_inputs._steady_step(seqs[::-1], 4, staging, bm.tables, steady) is None
    assert step_inputs._steady_step(seqs[:2], 4, staging, bm.tables, steady) is None
    other = seq_of(prompt_of(3, 9), "r9")
    bm.admit(other, [])
    assert step_inputs._steady_step(list(seqs), 4, staging, bm.tables, steady) is None  # a row taken
    steady.epoch = bm.tables.epoch
    for seq in seqs:
        seq.token_ids.append(seq.num_tokens)
        seq.num_computed_tokens += 1
        seq.draft_token_ids = []
    assert step_inputs._steady_step(list(seqs), 4, staging, bm.tables, steady) is None  # no drafts now
    monkeypatch.setattr(step_inputs, "VECTOR_MIN_SEQS", 1)  # a large batch's: staged afresh
    assert step_inputs._steady_step(list(seqs), 4, staging, bm.tables, steady) is not None


def test_engines_lay_out_steady_batches_and_match_the_reference(model, monkeypatch):
    """Engines at small batches (every sequence a decode most steps) take the steady
    layout, in place and afresh, through late joins, finishes, an abort and a KV cache
    small enough to preempt: with and without speculation, every output equals the
    reference's (or the plain run's)."""
    calls = counting_steady_paths(monkeypatch)
    reqs = mixed_requests()
    refs = {r.request_id: reference_generate(model, r) for r in reqs}
    engine = _engine_with(model, reqs[:3], max_num_batched_tokens=16, speculative=False, num_kv_blocks=24)
    assert_same(run_to_end(engine, late={3: reqs[3:5], 9: reqs[5:]}), refs)
    assert engine.metrics.counters.num_preemptions > 0
    assert calls["steady"] >= calls["in_place"] > 10, calls
    reqs = [make_request(i, prompt_of(5 + 3 * i, i), temperature=[0.0, 1.0][i % 2], max_tokens=40,
                         max_new_tokens=40) for i in range(5)]
    plain = run_to_end(_engine_with(model, reqs, speculative=False))
    calls.update(steady=0, in_place=0)
    drafter = OracleDrafter({rid: out.token_ids for rid, out in plain.items()}, wrong_every=3)
    engine = _engine_with(model, reqs, drafter=drafter, block_size=16)  # (tables widen less often)
    for _ in range(4):
        engine.step()
    assert engine.abort("r3")
    spec = run_to_end(engine)
    assert spec["r3"].finish_reason == "abort"
    assert calls["steady"] > 5 and calls["in_place"] > 0, calls
    for rid, out in plain.items():
        if rid != "r3":
            assert spec[rid].token_ids == out.token_ids and spec[rid].finish_reason == out.finish_reason, rid
            assert torch.allclose(torch.tensor(spec[rid].logprobs), torch.tensor(out.logprobs), atol=1e-5)
    assert spec["r3"].token_ids == plain["r3"].token_ids[:len(spec["r3"].token_ids)]


@pytest.mark.parametrize("speculative, seed", [(False, 0), (True, 1), (True, 2)])
def test_the_steady_schedule_equals_the_per_sequence_pass_through_random_lifecycles(model, monkeypatch,
                                                                                     speculative, seed):
    """``BatchScheduler._schedule_steady`` (a steady batch's decode pass on its arrays, and
    then the drafts' lengths from them, ``SteadyBatch.requests``) against the per-sequence
    pass it stands for: two engines stepped in lockstep, one taking it at every batch size
    (``STEADY_SCHEDULE_MIN`` 1), one never, through random late joins and aborts and a KV
    cache small enough to preempt (so some steady passes find too few free blocks and
    leave it to the pass). Every step schedules the same sequences with the same block
    tables and preemptions, and the outputs and per-request draft counts are the same."""
    rng = random.Random(seed)
    reqs = [make_request(i, prompt_of(rng.randrange(1, 12), i), temperature=[0.0, 1.0][i % 2],
                         max_tokens=rng.randrange(12, 30), max_new_tokens=30) for i in range(10)]
    plain = run_to_end(_engine_with(model, reqs, speculative=False))
    taken = {True: 0, False: 0}
    real = batch_scheduler.BatchScheduler._schedule_steady

    def counted(self, steady, batch):
        took = real(self, steady, batch)
        taken[took] += 1
        return took

    monkeypatch.setattr(batch_scheduler.BatchScheduler, "_schedule_steady", counted)
    monkeypatch.setattr(engine_module, "ARRAY_DRAFT_CHECKS_MIN", 1)  # drafts checked at once, their lengths
    read = step_inputs.SteadyBatch.requests                           # from the steady batch's arrays
    drafts_from_arrays = [0]

    def counted_requests(self):
        drafts_from_arrays[0] += 1
        return read(self)

    monkeypatch.setattr(step_inputs.SteadyBatch, "requests", counted_requests)

    def engine():
        drafter = OracleDrafter({rid: out.token_ids for rid, out in plain.items()}, wrong_every=3)
        return _engine_with(model, reqs[:4], speculative=speculative, drafter=drafter if speculative else None,
                            num_kv_blocks=11, max_num_batched_tokens=32)

    engines = {1: engine(), 10**9: engine()}  # STEADY_SCHEDULE_MIN: the steady pass at any size, never
    outputs = {k: {} for k in engines}
    pending, step = reqs[4:], 0
    while any(e.has_unfinished() for e in engines.values()) or pending:
        event = rng.random()
        joining = [pending.pop(0)] if pending and event < 0.15 else []
        running = engines[1].scheduler.running
        aborted = rng.choice(running).request_id if running and 0.15 <= event < 0.2 else None
        steps = {}
        found = set()  # (an abort may find the request finished by its pending token: alike in both)
        for threshold, e in engines.items():
            monkeypatch.setattr(batch_scheduler, "STEADY_SCHEDULE_MIN", threshold)
            for req in joining:
                e.add_request(req)
            if aborted is not None:
                found.add(e.abort(aborted))
            schedule = e.scheduler.schedule
            e.scheduler.schedule = lambda *args, _s=schedule, _k=threshold, _steps=steps: _steps.setdefault(
                _k, _s(*args))
            for out in e.step():
                outputs[threshold][out.request_id] = out
            del e.scheduler.schedule
        assert len(found) <= 1
        fast, walk = steps.get(1), steps.get(10**9)
        assert (fast is None) == (walk is None)
        if fast is not None:
            assert [(s.request_id, s.num_scheduled_tokens, list(s.block_table)) for s in fast.seqs] == \
                [(s.request_id, s.num_scheduled_tokens, list(s.block_table)) for s in walk.seqs], step
            assert (fast.num_decodes, fast.num_tokens, fast.num_preempted) == \
                (walk.num_decodes, walk.num_tokens, walk.num_preempted), step
        step += 1
        assert step < 2000
    fields = ("token_ids", "logprobs", "finish_reason", "num_verify_steps", "num_draft_tokens",
              "num_accepted_tokens", "accepted_per_pos")
    assert outputs[1].keys() == outputs[10**9].keys() == {r.request_id for r in reqs}
    for rid, out in outputs[10**9].items():
        assert [getattr(outputs[1][rid], f) for f in fields] == [getattr(out, f) for f in fields], rid
    counters = [e.metrics.counters for e in engines.values()]
    assert counters[0].num_preemptions == counters[1].num_preemptions > 0
    assert taken[True] > 10 and taken[False] > 0, taken
    assert (drafts_from_arrays[0] > 5) == speculative, drafts_from_arrays


def test_the_steady_schedule_refuses_what_it_does_not_stand_for(monkeypatch):
    """What ``_schedule_steady`` checks before it reads no sequence, each alone: the state
    advanced by the commit, the running sequences exactly the layout's (one more running,
    the same rows), no row taken or given back, enough sequences, enough free blocks for
    every block it would take (else it takes none and the per-sequence pass preempts)."""
    monkeypatch.setattr(batch_scheduler, "STEADY_SCHEDULE_MIN", 1)

    def decoding(num_blocks: int):  # three sequences at a block's end, their next token committed
        bm = BlockManager(num_blocks=num_blocks, block_size=4)
        sched = batch_scheduler.BatchScheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
        seqs = [seq_of(prompt_of(4, i), f"r{i}") for i in range(3)]
        for seq in seqs:
            sched.add(seq)
        assert len(sched.schedule().seqs) == 3  # admitted, prefilled below
        for seq in seqs:
            seq.num_computed_tokens = 3
        steady = step_inputs.SteadyBatch(list(seqs), np.array([s.row for s in seqs]), np.arange(3),
                                         np.full(3, 3), bm.tables.epoch)
        for seq in seqs:
            seq.token_ids.append(7)
            seq.num_computed_tokens = 4
        return bm, sched, seqs, steady

    def refused(sched, steady) -> bool:
        batch = batch_scheduler.ScheduledBatch()
        free = sched.block_manager.num_free_blocks
        took = sched._schedule_steady(steady, batch)
        assert took or (not batch.seqs and sched.block_manager.num_free_blocks == free)
        return not took

    bm, sched, seqs, steady = decoding(8)
    assert refused(sched, steady)  # not advanced
    steady.advance(1, np.full(3, 7))
    monkeypatch.setattr(batch_scheduler, "STEADY_SCHEDULE_MIN", 4)
    assert refused(sched, steady)
    monkeypatch.setattr(batch_scheduler, "STEADY_SCHEDULE_MIN", 1)
    fewer = step_inputs.SteadyBatch(seqs[:2], steady.rows[:2], steady.slots[:2], steady.starts[:2], steady.epoch)
    fewer.advance(1, np.full(2, 7))
    assert refused(sched, fewer)  # a third sequence runs
    sched.running.reverse()
    assert refused(sched, steady)  # another order
    sched.running.reverse()
    other = seq_of(prompt_of(3, 9), "r9")
    bm.admit(other, [])  # a row taken (by a sequence not running here)
    assert refused(sched, steady)
    bm.free(other)
    steady.epoch = bm.tables.epoch
    assert not refused(sched, steady)
    assert [len(s.block_table) for s in seqs] == [2, 2, 2] and all(s.num_scheduled_tokens == 1 for s in seqs)
    bm, sched, seqs, steady = decoding(5)  # two blocks free, three needed
    steady.advance(1, np.full(3, 7))
    assert refused(sched, steady)
    batch = sched.schedule(steady)  # the per-sequence pass: two get a block, the last is preempted
    assert [s.request_id for s in batch.seqs] == ["r0", "r1"] and batch.num_preempted == 1


# ---------------------------------------------------------------------- the step's drafts at once


class JunkDrafter(OracleDrafter):
    """The oracle's drafts, some (at random, seeded) with a token outside the vocabulary,
    as numpy integers, or as floats: a drafter's bugs, which the engine's checks drop."""

    def __init__(self, continuations, seed: int):
        super().__init__(continuations, wrong_every=4)
        self.rng = random.Random(seed)

    def propose(self, request_ids, max_lens, stop_token_ids=None, budget=None):
        drafts = super().propose(request_ids, max_lens, stop_token_ids, budget)
        for i, draft in enumerate(drafts):
            kind = self.rng.random()
            if draft and kind < 0.1:
                draft[self.rng.randrange(len(draft))] = 10**6  # outside the vocabulary
            elif kind < 0.2:
                drafts[i] = np.array(draft, dtype=np.int64)
            elif kind < 0.25:
                drafts[i] = [float(t) for t in draft]
        return drafts


@pytest.mark.parametrize("seed", [0, 1])
def test_the_steps_drafts_checked_at_once_decide_as_the_per_sequence_checks(model, monkeypatch, seed):
    """``LLMEngine._take_linear_drafts`` (the step's drafts checked as one array) against
    the per-sequence checks it stands for: with drafts that carry junk tokens, come as
    numpy arrays or floats, exceed the token budget together (a small batch budget) or
    find no free KV (a small cache), two engines, one with it and one without, give the
    same tokens, logprobs, per-request draft counts, draft misses and preemptions; where
    it takes a step, every draft it set is a list of Python ints."""
    reqs = [make_request(i, prompt_of(4 + 5 * i, i), temperature=[0.0, 1.0][i % 2], max_tokens=30,
                         max_new_tokens=30) for i in range(6)]
    plain = run_to_end(_engine_with(model, reqs, speculative=False))
    continuations = {rid: out.token_ids for rid, out in plain.items()}
    monkeypatch.setattr(engine_module, "ARRAY_DRAFT_CHECKS_MIN", 1)  # (6 requests)
    real = engine_module.LLMEngine._take_linear_drafts
    taken = {True: 0, False: 0}

    def counted(self, decodes, *args):
        took = real(self, decodes, *args)
        taken[took] += 1
        if took:
            assert all(type(t) is int for s in decodes for t in s.draft_token_ids)
        return took

    def run(fast: bool):
        monkeypatch.setattr(engine_module.LLMEngine, "_take_linear_drafts",
                            counted if fast else lambda self, *args: False)
        engine = _engine_with(model, reqs, drafter=JunkDrafter(continuations, seed), max_num_batched_tokens=24,
                              num_kv_blocks=30)
        return run_to_end(engine), engine.metrics.counters

    fast, fast_counters = run(True)
    walk, walk_counters = run(False)
    assert taken[True] > 5 and taken[False] > 0, taken
    fields = ("token_ids", "logprobs", "finish_reason", "num_verify_steps", "num_draft_tokens",
              "num_accepted_tokens", "accepted_per_pos")
    for rid, out in walk.items():
        assert [getattr(fast[rid], f) for f in fields] == [getattr(out, f) for f in fields], rid
        assert out.token_ids == plain[rid].token_ids
    for name in ("num_draft_misses", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_preemptions"):
        assert getattr(fast_counters, name) == getattr(walk_counters, name), name
    assert walk_counters.num_draft_misses > 0 and walk_counters.num_preemptions > 0


# ---------------------------------------------------------------------- acceptance by arrays


def test_accepted_lengths_equal_the_walk_per_sequence():
    """``accepted_lengths`` against ``num_accepted`` sequence by sequence; with drafts all
    of one length (half the cases) also by its grid route (``rows_per_seq``), and the
    committed tokens of a range of sequences (``LinearVerdicts.committed``) both ways."""
    rng = np.random.default_rng(5)
    for case in range(400):
        n = int(rng.integers(1, 20))
        same = int(rng.integers(0, 7)) if case % 2 else None
        drafts = [rng.integers(0, 3, size=int(rng.integers(0, 7)) if same is None else same).tolist()
                  for _ in range(n)]
        sampled = [rng.integers(0, 3, size=len(d) + 1).tolist() for d in drafts]
        # each sequence's last token, then its draft (a last token may equal the sample before it)
        fed = np.array([t for d in drafts for t in [int(rng.integers(0, 3))] + d])
        starts = np.concatenate(([0], np.cumsum([len(d) + 1 for d in drafts])))
        expected = [num_accepted(d, s) for d, s in zip(drafts, sampled)]
        flat = np.array([t for s in sampled for t in s])
        assert accepted_lengths(flat, fed, starts).tolist() == expected
        if same is not None:
            assert accepted_lengths(flat, fed, starts, same + 1).tolist() == expected
            # the committed tokens of a range of sequences, on the grid and by offsets
            accepted = np.array(expected)
            grid, walk = (LinearVerdicts(flat.tolist(), [], starts, np.diff(starts) - 1, accepted, flat, q)
                          for q in (same + 1, 0))
            first = int(rng.integers(0, n))
            end = int(rng.integers(first, n + 1))
            assert grid.committed(first, end).tolist() == walk.committed(first, end).tolist() == \
                [t for s, a in zip(sampled[first:end], expected[first:end]) for t in s[:a + 1]]


# ---------------------------------------------------------------------- engines on the array paths


def test_array_paths_match_the_reference_across_finishes_and_late_joins(model, array_paths):
    reqs = mixed_requests()
    refs = {r.request_id: reference_generate(model, r) for r in reqs}
    engine = _engine_with(model, reqs[:3], max_num_batched_tokens=16, speculative=False)
    assert_same(run_to_end(engine, late={3: reqs[3:5], 9: reqs[5:]}), refs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("wrong_every", [0, 3])
def test_array_verify_is_lossless(model, array_paths, wrong_every):
    """Speculation through verify_linear: the same tokens, logprobs and per-request counts as
    decoding without drafts."""
    reqs = mixed_requests()
    plain = run_to_end(_engine_with(model, reqs, speculative=False))
    drafter = OracleDrafter({rid: out.token_ids for rid, out in plain.items()}, wrong_every)
    engine = _engine_with(model, reqs, drafter=drafter)
    spec = run_to_end(engine)
    assert array_paths["verify_linear"] >= 3
    for rid, out in plain.items():
        assert spec[rid].token_ids == out.token_ids and spec[rid].finish_reason == out.finish_reason
        assert torch.allclose(torch.tensor(spec[rid].logprobs), torch.tensor(out.logprobs), atol=1e-5)
    c = engine.metrics.counters
    assert sum(o.num_draft_tokens for o in spec.values()) == c.num_draft_tokens > 0
    assert sum(o.num_accepted_tokens for o in spec.values()) == c.num_accepted_tokens
    assert (c.num_accepted_tokens == c.num_draft_tokens) == (wrong_every == 0)
    assert not drafter.generated


def assert_reads_hold_their_values(device: str) -> None:
    """``HostReader.read_pair_later``, as the verify step takes it at once and the
    overlapped decode a step later: each read's tokens (int64) and logprobs (float32) are
    the sampler's, exact, and a pending read still holds its own after the next read of
    the same length (the turns; on CUDA, pinned buffers), every length again and again.
    (tests/gpu runs it on the GPU.)"""
    reader, gen = HostReader(), torch.Generator().manual_seed(0)
    previous = None
    for n in [1, 5, 1, 256, 7, 5, 5, 1, 2, 3, 4, 5]:
        tokens = torch.randint(0, 2**40, (n,), generator=gen)
        logprobs = -torch.rand(n, generator=gen) * 30
        pending = reader.read_pair_later(tokens.to(device), logprobs.to(device))
        if previous is not None:
            host_tokens, host_logprobs = previous[0].result()
            assert host_tokens.tolist() == previous[1] and host_logprobs.tolist() == previous[2]
        host_tokens, host_logprobs = pending.result()
        assert host_tokens.dtype == np.int64 and host_logprobs.dtype == np.float32
        assert host_tokens.tolist() == tokens.tolist() and host_logprobs.tolist() == logprobs.tolist()
        previous = pending, tokens.tolist(), logprobs.tolist()


def test_a_read_holds_its_values_through_the_next_read():
    assert_reads_hold_their_values("cpu")


@pytest.mark.parametrize("later", [False, True])
def test_verify_stats_sum_as_record_verify_does(later):
    """``VerifyStats`` (a step's counts summed by slot in arrays, drained into the
    sequence) against ``Sequence.record_verify`` one verdict at a time: random steps of
    random sequences, some without a draft, slots past the table and drafts longer than
    its positions (it grows), sequences drained part-way and their slots reused. ``later``:
    the steps' counts held (``record_later``, as the engine does) and applied now and then
    (``apply``); a drain must apply them first."""
    rng = np.random.default_rng(3)
    stats = VerifyStats(slots=4, positions=2)
    seqs = {}  # slot -> (the sequence drained into, the one record_verify counts into)
    for step in range(300):
        slots = rng.permutation(12)[:rng.integers(1, 12)]
        num_draft = rng.integers(0, 6, len(slots)) * (rng.random(len(slots)) < 0.8)
        num_accepted = rng.integers(0, num_draft + 1)
        if later:
            stats.record_later(slots, num_draft, num_accepted)
            if rng.random() < 0.3:
                stats.apply()
        else:
            stats.record(slots, num_draft, num_accepted)
        for slot, d, a in zip(slots.tolist(), num_draft.tolist(), num_accepted.tolist()):
            pair = seqs.setdefault(slot, (seq_of([1], f"d{slot}"), seq_of([1], f"w{slot}")))
            pair[0].slot = slot
            pair[1].record_verify(d, a)
        if rng.random() < 0.2:  # a request ends: its slot drained, then taken by another
            slot = int(rng.choice(list(seqs)))
            drained, walked = seqs.pop(slot)
            stats.drain(drained)
            fields = ("num_verify_steps", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos")
            assert [getattr(drained, f) for f in fields] == [getattr(walked, f) for f in fields], step
            assert not stats.table[slot].any()
    assert stats.table.shape[0] >= 12 and stats.table.shape[1] >= VerifyStats.PER_POS + 5


@pytest.mark.parametrize("wrong_every", [0, 3])
def test_array_verify_counts_each_requests_drafts_as_the_walk_does(model, array_paths, monkeypatch, wrong_every):
    """Per request, the verify steps, draft and accepted tokens and accepted drafts per
    position that the linear path sums by arrays (``VerifyStats``) equal those of the
    per-sequence walk (``Sequence.record_verify``), and an aborted request's output
    carries its counts so far and leaves its slot's counts clear for the next request."""
    reqs = mixed_requests()
    plain = run_to_end(_engine_with(model, reqs, speculative=False))
    continuations = {rid: out.token_ids for rid, out in plain.items()}
    spec = run_to_end(_engine_with(model, reqs, drafter=OracleDrafter(continuations, wrong_every)))
    linear_steps = array_paths["verify_linear"]
    monkeypatch.setattr(step_inputs, "VECTOR_MIN_SEQS", 10**9)
    monkeypatch.setattr(step_inputs, "LINEAR_MIN_SEQS", 10**9)
    walk = run_to_end(_engine_with(model, reqs, drafter=OracleDrafter(continuations, wrong_every)))
    assert array_paths["verify_linear"] == linear_steps >= 3  # the walk took none
    stats = ("num_verify_steps", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos")
    for rid, out in walk.items():
        assert [getattr(spec[rid], k) for k in stats] == [getattr(out, k) for k in stats], rid
    assert sum(o.num_verify_steps for o in walk.values()) > 0 and any(len(o.accepted_per_pos) > 1
                                                                      for o in walk.values())
    monkeypatch.undo()
    monkeypatch.setattr(step_inputs, "VECTOR_MIN_SEQS", 1)
    monkeypatch.setattr(step_inputs, "LINEAR_MIN_SEQS", 1)
    engine = _engine_with(model, reqs, drafter=OracleDrafter(continuations, wrong_every))
    longest = max(reqs, key=lambda r: r.max_tokens).request_id
    while not engine._verify_stats.table[engine.seqs[longest].slot, 0]:  # until it has verified a draft
        engine.step()
    slot = engine.seqs[longest].slot
    assert engine.abort(longest)
    aborted = engine.step()[0]
    assert aborted.finish_reason == "abort" and aborted.num_verify_steps > 0
    assert not engine._verify_stats.table[slot].any()


def test_reused_slots_and_rows_carry_nothing_of_their_last_request(model, array_paths):
    """A first wave of requests runs (two aborted mid-way, the rest finish; a small KV cache
    preempts some), then a second wave with other seeds and sampling settings takes their
    sampling slots and table rows: each second-wave sample equals its reference, the one a
    fresh engine would draw. A slot keeping its last seed, temperature or top-k, or a row
    keeping a block id, changes these samples."""
    first = [make_request(i, prompt_of(5 + 7 * i, i), temperature=1.0, top_k=3, seed=i, max_tokens=14,
                          max_new_tokens=14) for i in range(6)]
    second = [make_request(10 + i, prompt_of(3 + 5 * i, 10 + i), temperature=[0.0, 0.7, 1.3][i % 3],
                           top_p=[1.0, 0.9, 1.0][i % 3], min_p=[0.0, 0.0, 0.05][i % 3], seed=500 + i,
                           max_tokens=16, max_new_tokens=16) for i in range(6)]
    engine = _engine_with(model, first, num_kv_blocks=26, speculative=False)
    for _ in range(6):
        engine.step()
    assert engine.abort("r1") and engine.abort("r4")
    run_to_end(engine)
    slots_before = set(engine.runner.params._free)
    refs = {r.request_id: reference_generate(model, r) for r in second}
    for r in second:
        engine.add_request(r)
    assert {s.slot for s in engine.seqs.values()} <= slots_before  # the first wave's slots, reused
    assert_same(run_to_end(engine), refs)
    assert engine.metrics.counters.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == 26


# ---------------------------------------------------------------------- deferred metric exports


def test_metric_exports_wait_for_the_next_forward_and_flush_when_idle(model):
    """A step's Prometheus exports run in the next step, after its forward is launched
    (before the sampler reads anything), and all of them once the engine is idle: the
    series then equal the counters."""
    engine = _engine_with(model, mixed_requests()[:3], speculative=False, worker_id="deferred-test")
    generated = m.generation_tokens.labels("deferred-test")
    order = []
    for obj, name in ((engine.runner, "run"), (engine.metrics, "flush"), (engine_module, "sample_later")):
        real = getattr(obj, name)

        def spy(*args, _real=real, _name=name, **kw):
            order.append(_name)
            return _real(*args, **kw)

        setattr(obj, name, spy)
    exported = []
    while engine.has_unfinished():
        engine.step()
        exported.append((generated._value.get(), engine.metrics.counters.num_generation_tokens))
    assert order[:3] == ["run", "flush", "sample_later"]
    # while busy, the series lag the counters by at most the last step (a step's counts are
    # taken when its tokens are read: behind the next forward, or before the next step's
    # schedule where that step cannot be overlapped, whose exports then include them)
    for (value, counted), (_, counted_before) in zip(exported[1:-1], exported[:-2]):
        assert value in (counted_before, counted)
    assert any(value < counted for value, counted in exported[:-1])
    assert exported[-1][0] == exported[-1][1] == engine.metrics.counters.num_generation_tokens > 0
    steps = sum(m.engine_step_seconds.labels("deferred-test", k)._sum.get() > 0 for k in ("prefill", "decode"))
    assert steps == 2


@pytest.mark.parametrize("kind", ["compiled", "python"])
def test_the_history_drafter_gets_each_steps_commits_in_one_call(model, array_paths, kind):
    """On the array path the engine sends a step's verdicts and tokens in one commit_step:
    the drafter sees every request's committed tokens in order (all of them but a finished
    request's last step, as the per-request calls gave it), its accepted drafts are the
    engine's count, and the output stays that of decoding without drafts."""
    from services.rollout.drafter import DrafterConfig
    from services.rollout.drafter.compiled import make_drafter

    reqs = mixed_requests()
    plain = run_to_end(_engine_with(model, reqs, speculative=False))
    inner = make_drafter(kind, DrafterConfig())
    for r in reqs:
        inner.load_history(r.prompt_id, [plain[r.request_id].token_ids] * 2)
    seen: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    calls = []

    class Recorded(type(inner)):
        def commit_step(self, request_ids, num_draft, num_accepted, token_ids, num_tokens):
            calls.append(len(request_ids))
            at = 0
            for rid, n in zip(request_ids, num_tokens):
                seen[rid] += token_ids[at:at + max(n, 0)]
                at += max(n, 0)
            super().commit_step(request_ids, num_draft, num_accepted, token_ids, num_tokens)
    inner.__class__ = Recorded
    engine = _engine_with(model, reqs, drafter=inner)
    spec = run_to_end(engine)
    assert array_paths["verify_linear"] >= 3 and max(calls) > 1  # several requests per call
    for rid, out in plain.items():
        assert spec[rid].token_ids == out.token_ids
        tokens = out.token_ids
        assert seen[rid] == tokens[:len(seen[rid])] and len(seen[rid]) >= len(tokens) - engine.max_draft_len - 1
    assert inner.stats().num_accepted_tokens == engine.metrics.counters.num_accepted_tokens > 0
