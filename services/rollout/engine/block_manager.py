"""Paged KV-cache blocks: allocation, ref-counted prefix sharing, rollback.

A block holds the KV of ``block_size`` consecutive tokens. Once a block is full of
committed tokens it is hashed by its whole prefix (chain hash), so a later sequence
with the same leading tokens (the n samples of one prompt, a resumed chunk, a
preempted sequence coming back) takes it by reference instead of recomputing it.
Shared blocks are always full and never written again; each sequence's partial last
block is its own fresh block, so no copy-on-write is ever needed.

Freed blocks that carry a hash stay findable until reused (prefix cache); the free pool
hands out unhashed blocks first, then the least recently freed hashed ones.

A decode or verify step's filled blocks are hashed later (``commit_later``, then
``hash_filled``): the engine hashes them after launching the next step's forward, while
the device computes, instead of on the step's path. Whatever reads or drops the hashes
first (an admission's ``cached_prefix``, ``free``, ``reset_prefix_cache``) hashes the
waiting blocks before it, in the order they filled, so it sees what hashing at once
would have shown it (or one more shared block: a free block of the same tokens taken
for another sequence meanwhile no longer hides the newly filled one).

Every change to a running sequence's table is also written to its row of ``tables``
(input_batch.BlockTables): a sequence takes a row when admitted and gives it back when
its blocks are freed, so the step's inputs gather block tables by row.

This module knows nothing about models or scheduling policy: it sees token ids and
block tables.
"""

from __future__ import annotations

from collections import OrderedDict

from services.rollout.engine.input_batch import BlockTables
from services.rollout.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.num_hashed_blocks: dict[int, int] = {}  # seq_id -> leading blocks of its table already hashed
        self._filled: dict[int, Sequence] = {}  # seq_id -> sequence whose filled blocks wait for hash_filled
        self.tables = BlockTables()  # the running sequences' tables, a row each (seq.row)

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _chain_hash(self, prev: int, tokens: tuple[int, ...]) -> int:
        return hash((prev, tokens))

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding seq's leading tokens' KV. At least one token is left to compute,
        because the last token's logits are needed to sample."""
        self.hash_filled()
        bs = self.block_size
        blocks: list[int] = []
        prev = 0
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            prev = self._chain_hash(prev, tokens)
            block = self.hash_to_block.get(prev)
            if block is None or self.block_tokens[block] != tokens:
                break
            blocks.append(block)
        return blocks

    def num_new_blocks_to_admit(self, seq: Sequence, cached: list[int]) -> int:
        """Free blocks that admitting seq (all its known tokens) would consume."""
        revived = sum(1 for b in cached if self.ref_counts[b] == 0)  # cached but in the free pool
        return self.num_blocks_for(seq.num_tokens) - len(cached) + revived

    # ------------------------------------------------------------------ changes
    def admit(self, seq: Sequence, cached: list[int]) -> None:
        """Give seq its cached prefix by reference plus fresh blocks for the rest of its tokens."""
        assert not seq.block_table
        for block in cached:
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
        seq.block_table = list(cached)
        seq.row = self.tables.assign()
        self.tables.extend(seq.row, 0, seq.block_table)
        seq.num_computed_tokens = len(cached) * self.block_size
        self.num_hashed_blocks[seq.seq_id] = len(cached)
        ok = self.ensure_slots(seq, seq.num_tokens)
        assert ok, "caller checked num_new_blocks_to_admit"

    def can_ensure_slots(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_blocks_for(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to hold num_tokens tokens; False (and no change) if short."""
        missing = self.num_blocks_for(num_tokens) - len(seq.block_table)
        if missing > self.num_free_blocks:
            return False
        if missing > 0:
            new = [self._take_free_block() for _ in range(missing)]
            if seq.row >= 0:
                self.tables.extend(seq.row, len(seq.block_table), new)
            seq.block_table.extend(new)
        return True

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Drop the blocks past the first num_tokens tokens (rejected draft tokens' KV)."""
        keep, table = -(-num_tokens // self.block_size), seq.block_table
        if len(table) <= keep:
            return
        if seq.row >= 0:
            self.tables.truncate(seq.row, keep, len(table))
        while len(table) > keep:
            self._release(table.pop())

    def commit(self, seq: Sequence) -> None:
        """Hash the blocks that just became full of committed KV, making them shareable."""
        bs = self.block_size
        start = self.num_hashed_blocks.get(seq.seq_id, 0)
        end = seq.num_computed_tokens // bs
        if end <= start:  # no block filled up (most steps): nothing to hash
            self.num_hashed_blocks[seq.seq_id] = start
            return
        prev = self.block_hashes[seq.block_table[start - 1]] if start > 0 else 0
        for i in range(start, end):
            block = seq.block_table[i]
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            prev = self._chain_hash(prev if prev is not None else 0, tokens)
            if self.block_hashes[block] is None:
                self.block_hashes[block] = prev
                self.block_tokens[block] = tokens
                self.hash_to_block.setdefault(prev, block)
        self.num_hashed_blocks[seq.seq_id] = max(start, end)

    def commit_later(self, seq: Sequence) -> None:
        """``commit`` of seq at the next ``hash_filled`` (or before whatever reads the
        hashes first), in the order of these calls."""
        self._filled.setdefault(seq.seq_id, seq)

    def hash_filled(self) -> None:
        """The ``commit``s that ``commit_later`` put off, in order."""
        if self._filled:
            filled, self._filled = self._filled, {}
            for seq in filled.values():
                self.commit(seq)

    def free(self, seq: Sequence) -> None:
        self.hash_filled()
        for block in reversed(seq.block_table):
            self._release(block)
        if seq.row >= 0:
            self.tables.release(seq.row, len(seq.block_table))
            seq.row = -1
        seq.block_table = []
        seq.num_computed_tokens = 0
        self.num_hashed_blocks.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget every hash: after a weight update the cached KV is stale."""
        self.hash_filled()  # (blocks filled before the update: hashed, then forgotten, as at once)
        self.hash_to_block.clear()
        self.block_hashes = [None] * self.num_blocks
        self.block_tokens = [None] * self.num_blocks

    # ------------------------------------------------------------------ internals
    def _take_free_block(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        h = self.block_hashes[block]
        if h is not None and self.hash_to_block.get(h) == block:
            del self.hash_to_block[h]
        self.block_hashes[block] = None
        self.block_tokens[block] = None
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, block
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None
            if self.block_hashes[block] is None:
                self.free_blocks.move_to_end(block, last=False)  # nothing cached: reuse first
