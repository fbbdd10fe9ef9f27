"""Which sequences run in the next forward, and how many of their tokens.

Every step mixes three kinds of work under one token budget
(``max_num_batched_tokens``):
  1. decoding sequences: 1 token each (their draft, if any, is added by the engine
     later from what budget is left);
  2. sequences part-way through a chunked prefill: their next chunk;
  3. waiting sequences admitted in arrival order while the budget, ``max_num_seqs`` and
     free KV blocks allow.
So a long prompt is prefilled a chunk at a time beside the running decodes instead of
stalling them. A waiting sample whose sibling (same prompt) is still prefilling waits
one more step, then takes the sibling's full prompt blocks by reference: a group of n
samples prefills its prompt once.

When a decoding sequence needs a new block and none is free, the most recently admitted
sequence is preempted: its blocks are freed and it goes back to the front of the queue
to be recomputed later (its tokens are kept; sampling is keyed on (seed, position), so
the recomputed run continues from the same distribution; bit for bit in batch-invariant
mode).

This module knows nothing about models, drafts or sampling.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from services.rollout.engine.block_manager import BlockManager
from services.rollout.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from services.rollout.engine.step_inputs import SteadyBatch

# From this many running sequences a steady batch's decode pass is numpy over its arrays
# (``BatchScheduler._schedule_steady``); below, the per-sequence pass costs less than the
# few numpy calls (benchmarks/engine_host.py).
STEADY_SCHEDULE_MIN = 32


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)  # decodes first, then prefill chunks
    num_decodes: int = 0
    num_tokens: int = 0  # scheduled tokens, drafts excluded
    num_preempted: int = 0
    # Where the decodes are the last step's decode layout, advanced (``_schedule_steady``):
    # its state, which the step's drafts read instead of the sequences
    steady: SteadyBatch | None = None

    @property
    def decode_seqs(self) -> list[Sequence]:
        return self.seqs[:self.num_decodes]

    def sampling_seqs(self) -> list[Sequence]:
        """The sequences that sample this step: decodes and prefills whose last chunk runs
        (read before ``postprocess``, which advances the other prefill chunks)."""
        if self.num_decodes == len(self.seqs):  # (most steps: decodes only)
            return self.seqs
        prefills = self.seqs[self.num_decodes:]
        return self.seqs[:self.num_decodes] + [
            s for s in prefills if s.num_computed_tokens + s.num_scheduled_tokens == len(s.token_ids)]

    def num_prompt_tokens(self) -> int:
        if self.num_decodes == len(self.seqs):
            return 0
        return sum(s.num_scheduled_tokens for s in self.seqs[self.num_decodes:])


class BatchScheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                return seq
        return None

    def remove(self, seq: Sequence) -> None:
        """Take seq out (finished or aborted) and free its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self, steady: SteadyBatch | None = None) -> ScheduledBatch:
        """The next step's batch. ``steady``: the last step's decode layout, advanced by
        its commit (the runner's ``SteadyBatch``), which lets a steady batch's decode pass
        run on its arrays (``_schedule_steady``); any other value, None included, only
        costs the per-sequence pass."""
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        # 1. decodes (their last token), each needing a slot for its last token's KV, in one
        # pass that sets the prefills (their next chunk) aside. A sequence preempted while
        # making room leaves ``running`` and is skipped when the pass reaches it.
        prefills = []
        block_size = self.block_manager.block_size
        running, scheduled = SequenceStatus.RUNNING, batch.seqs
        if steady is not None and self._schedule_steady(steady, batch):
            budget -= len(scheduled)
            decoding = []  # (all of them scheduled)
        else:
            decoding = list(self.running)
        for seq in decoding:
            left = len(seq.token_ids) - seq.num_computed_tokens
            if left != 1:
                if left > 1:
                    prefills.append(seq)
                continue
            if seq.status != running or budget == 0:
                continue  # preempted below while making room, or out of budget
            if len(seq.token_ids) > len(seq.block_table) * block_size:  # its last block is full
                while not self.block_manager.ensure_slots(seq, seq.num_tokens):
                    victim = self.running[-1]
                    self._preempt(victim)
                    batch.num_preempted += 1
                    if victim is seq:
                        break
            if seq.status == running:
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
                budget -= 1
        batch.num_decodes = len(batch.seqs)
        # 2. chunks of prefills already under way
        prefilling_keys = set()
        for seq in prefills:
            if seq.status == SequenceStatus.RUNNING:
                if self._computes_shareable_blocks(seq):
                    prefilling_keys.add(seq.prompt_key)
                if budget > 0:
                    budget -= self._schedule_chunk(seq, budget, batch)
        # 3. admissions
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.prompt_key in prefilling_keys:
                skipped.append(self.waiting.popleft())  # a sibling is computing the shared prompt
                continue
            cached = self.block_manager.cached_prefix(seq)
            if self.block_manager.num_new_blocks_to_admit(seq, cached) > self.block_manager.num_free_blocks:
                break
            self.waiting.popleft()
            self.block_manager.admit(seq, cached)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if self._computes_shareable_blocks(seq):
                prefilling_keys.add(seq.prompt_key)
            budget -= self._schedule_chunk(seq, budget, batch)
        self.waiting.extendleft(reversed(skipped))
        batch.num_tokens = self.max_num_batched_tokens - budget
        return batch

    def _schedule_steady(self, steady: SteadyBatch, batch: ScheduledBatch) -> bool:
        """The decode pass for a steady batch, on its arrays: where the running sequences
        are the last step's decode layout (``steady.seqs``, in order), advanced by its
        commit (so each one's next token is its last: it decodes) and no table row was
        taken or given back since (no admission, finish, abort or preemption), each decodes,
        and only those whose last token's KV slot is past their blocks (their table length,
        ``BlockTables.lengths``, against their next position) get a block, in order, as the
        per-sequence pass gives them. False, with nothing changed, where that does not
        hold or the free blocks would not do for all of them (the pass then preempts)."""
        seqs = steady.seqs
        if (not steady.advanced() or len(seqs) < STEADY_SCHEDULE_MIN or len(seqs) > self.max_num_batched_tokens
                or steady.epoch != self.block_manager.tables.epoch or seqs != self.running):
            return False
        starts = steady.next_starts_array()
        bm = self.block_manager
        tables = bm.tables
        tables.sync()
        # next_starts: each sequence's num_computed_tokens; its length one more
        short = np.flatnonzero(starts >= tables.lengths[steady.rows] * bm.block_size).tolist()
        if short:
            needy = [seqs[i] for i in short]
            if sum(bm.num_blocks_for(s.num_tokens) - len(s.block_table) for s in needy) > bm.num_free_blocks:
                return False
            for seq in needy:
                bm.ensure_slots(seq, seq.num_tokens)
        for seq in seqs:
            seq.num_scheduled_tokens = 1
        batch.seqs.extend(seqs)
        batch.steady = steady
        return True

    def postprocess(self, batch: ScheduledBatch, elapsed_s: float) -> None:
        """After the forward: every sequence in it is charged the step's time, and a
        prefill chunk that did not reach the end has its KV computed (its full blocks
        become shareable); sampling sequences are advanced by the engine's commit."""
        for seq in batch.seqs[:batch.num_decodes]:
            seq.busy_s += elapsed_s
        self.advance_prefills(batch, elapsed_s, charge_sampling=True)

    def advance_prefills(self, batch: ScheduledBatch, elapsed_s: float, charge_sampling: bool = False) -> None:
        """``postprocess`` for the prefill chunks (the engine's commit pass charges the
        sampling sequences itself: ``charge_sampling`` False leaves them alone)."""
        for seq in batch.seqs[batch.num_decodes:]:  # (a decode feeds its last token)
            if seq.num_computed_tokens + seq.num_scheduled_tokens < seq.num_tokens:
                seq.busy_s += elapsed_s
                seq.num_computed_tokens += seq.num_scheduled_tokens
                self.block_manager.commit(seq)
            elif charge_sampling:
                seq.busy_s += elapsed_s

    def budget_left(self, batch: ScheduledBatch) -> int:
        return self.max_num_batched_tokens - batch.num_tokens

    def _computes_shareable_blocks(self, seq: Sequence) -> bool:
        """Whether seq has full prompt blocks still to compute (that its siblings could share)."""
        return seq.num_computed_tokens + self.block_manager.block_size <= seq.num_prompt_tokens

    def _schedule_chunk(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int:
        seq.num_scheduled_tokens = min(seq.num_uncomputed, budget)
        batch.seqs.append(seq)
        return seq.num_scheduled_tokens

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        self.waiting.appendleft(seq)
