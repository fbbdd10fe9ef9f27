"""Runs one forward over a step's flat batch of tokens and returns the logits to sample.

Given the scheduled sequences (each with ``num_scheduled_tokens`` of its tokens to feed
and, when it samples, a draft to verify), the runner
  1. lays their tokens out flat, one sequence after another, with positions, KV slots,
     block tables, context and query lengths (``prepare``, step_inputs.py);
  2. runs the model with the paged attention backend (on CUDA, a step replays a CUDA
     graph captured for its size bucket when no sequence feeds more tokens than a verify
     does: decode and verify steps, and short prefills such as a divided rollout's chunk
     resuming on its cached prefix; longer prefills and the CPU run eagerly);
  3. returns the logits of the rows that sample: the last fed token of each sequence
     that has fed all its tokens, plus one row per draft token (a draft tree's nodes
     included: their rows are masked to their ancestors, step_inputs.py);
and, after a tree verify, copies the accepted paths' KV into place (``move_kv``).
It knows nothing about scheduling, stop conditions or acceptance.
"""

from __future__ import annotations

import bisect
import gc
import logging
from collections.abc import Callable

import torch

from services.rollout.engine.attention import AttentionMetadata, KVCache, PagedAttention
from services.rollout.engine.input_batch import BlockTables, HostReader, SlotParams, StepSampling
from services.rollout.engine.sequence import Sequence
from services.rollout.engine.step_inputs import StepInputs, SteadyBatch, new_staging, prepare_step

log = logging.getLogger(__name__)

# CUDA graph buckets: padded sequence counts and padded token counts of a decode/verify step.
GRAPH_SEQ_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
GRAPH_TOKEN_BUCKETS = GRAPH_SEQ_BUCKETS + (288, 320, 384, 448, 512)


class ModelRunner:
    def __init__(self, model, device: torch.device, *, num_kv_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_draft_len: int, use_cuda_graphs: bool, batch_invariant: bool = False,
                 tree_drafts: bool = False):
        cfg = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        dtype = next(model.parameters()).dtype
        self.kv_cache = KVCache(cfg.num_hidden_layers, num_kv_blocks, block_size, cfg.num_key_value_heads,
                                cfg.head_dim, dtype, device)
        self.attn = PagedAttention(self.kv_cache, scale=cfg.head_dim ** -0.5, batch_invariant=batch_invariant)
        # What persists between steps (input_batch.py): the staging buffers of the step's
        # integers, every request's sampling parameters by slot, the pinned read-back.
        self.staging = new_staging(device)
        self.params = SlotParams(cfg.vocab_size, device, capacity=max_num_seqs)
        self.reader = HostReader()
        self.tables: BlockTables | None = None  # the block manager's table rows (the engine sets them)
        self.sampling: StepSampling | None = None  # the last run's sampler rows
        # The last run's decode layout by batch position, which the engine's commit advances
        # so that a steady batch's next step is laid out from it (step_inputs.SteadyBatch).
        # Not with draft trees (a tree's rows are laid out sequence by sequence).
        self.steady: SteadyBatch | None = None
        self._keeps_steady = not tree_drafts
        self.last_graphed = False  # whether the last run replayed a CUDA graph (else eager)
        self.fed_device_tokens = False  # whether the last run fed the step before's tokens from the device
        self.graphs: CUDAGraphs | None = None
        if use_cuda_graphs and device.type == "cuda":
            self.graphs = CUDAGraphs(self, max_num_seqs, max_draft_len, tree_drafts)
            self.graphs.capture_all()  # (in inference mode)

    # ------------------------------------------------------------------ 1. layout
    def prepare(self, seqs: list[Sequence]) -> StepInputs:
        inputs = prepare_step(seqs, self.block_size, self.device, self.model.config.vocab_size, self.staging,
                              self.tables, self.steady)
        self.steady = inputs.steady if self._keeps_steady else None
        return inputs

    def graph_token_room(self, num_tokens: int) -> int | None:
        """Draft tokens a step of ``num_tokens`` can take and still replay a CUDA graph
        (a step past the largest captured bucket runs eagerly: at a real model's size that
        costs more than the drafts save). None: no limit (no graphs, or the step is eager
        whatever it drafts)."""
        if self.graphs is None or self.graphs.failed or self.graphs.max_verify_query_len == 1:
            return None
        largest = self.graphs.token_buckets[-1]
        return largest - num_tokens if num_tokens <= largest else None

    # ------------------------------------------------------------------ 2-3. forward + logits
    @torch.inference_mode()
    def run(self, seqs: list[Sequence], fed: torch.Tensor | None = None) -> torch.Tensor:  # [rows, vocab] float32
        """``fed``: the tokens the first ``len(fed)`` rows feed, on the device (the last
        step's samples, not read yet: the engine's overlapped decode, engine.py), in place
        of the values the layout took from the sequences (placeholders)."""
        inputs = self.prepare(seqs)
        self.fed_device_tokens = fed is not None
        if fed is not None:
            inputs.input_ids[:fed.shape[0]].copy_(fed)  # (queued after the layout's own copy)
        self.sampling = inputs.sampling
        logits = None
        if self.graphs is not None:  # the bucket refuses steps a graph cannot hold (long prefills)
            logits = self.graphs.replay(inputs)  # [num_tokens, vocab]: every row's, the LM head in the graph
        self.last_graphed = logits is not None
        num_rows = inputs.sample_rows.numel()
        if logits is not None:
            # every row samples (a decode layout: the rows in order) or the sampling rows of them
            return logits if num_rows == inputs.num_tokens else logits[inputs.sample_rows]
        self.attn.metadata = inputs.metadata
        hidden = self.model.forward(inputs.input_ids, inputs.positions, self.attn)  # [num_tokens, hidden]
        if num_rows == 0:
            return torch.empty(0, self.model.config.vocab_size, dtype=torch.float32, device=self.device)
        return self.model.compute_logits(hidden[inputs.sample_rows], self.attn.batch_invariant)

    @torch.inference_mode()
    def move_kv(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Copies the KV of cache rows ``src_slots`` to ``dst_slots`` in every layer, all
        sources read before any write (a draft tree's accepted path, engine/tree.py)."""
        cache = self.kv_cache
        src = torch.tensor(src_slots, dtype=torch.int64).to(self.device, non_blocking=True)
        dst = torch.tensor(dst_slots, dtype=torch.int64).to(self.device, non_blocking=True)
        for pool in (cache.k, cache.v):
            flat = pool.view(pool.shape[0], -1, *pool.shape[3:])  # [layers, slots, kvh, d]
            flat.index_copy_(1, dst, flat.index_select(1, src))


class CUDAGraphs:
    """Decode/verify forwards captured as CUDA graphs, one per (seq bucket, token bucket,
    query-length class): decode graphs by sequence count, verify graphs by token count
    (``bucket``), all captured when the runner starts (``capture_all``).

    A graph reads static buffers: the step's tokens are copied in packed at the front,
    the padding rows get slot -1 (no KV write) and belong to no sequence, and padding
    sequences get query length 0 (skipped by the kernel). Pure decode steps use a graph
    launched for query length 1; verify steps one launched for 1 + max_draft_len. With
    draft trees the verify graphs also read a static tree mask (-1, causal, for the rows
    of linear drafts and padding), so a tree step replays the graph of its token count
    like a linear one (a tree of n nodes feeds n + 1 tokens, as an n-token draft does).
    """

    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_draft_len: int, tree_drafts: bool = False):
        self.runner = runner
        self.seq_buckets = [b for b in GRAPH_SEQ_BUCKETS if b < max_num_seqs] + [min(max_num_seqs, 256)]
        # No step feeds more than every sequence's last token plus a full draft.
        buckets = sorted(set(GRAPH_TOKEN_BUCKETS) | set(self.seq_buckets))
        most = max_num_seqs * (1 + max_draft_len)
        self.token_buckets = [b for b in buckets if b < most] + [b for b in buckets if b >= most][:1]
        self.max_verify_query_len = max_draft_len + 1
        max_seqs, max_tokens, dev = self.seq_buckets[-1], self.token_buckets[-1], runner.device
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(max_seqs, runner.max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=torch.int32, device=dev)
        # the LM head runs inside the graph: its logits, every row's (float32)
        self.logits = torch.zeros(max_tokens, runner.model.config.vocab_size, dtype=torch.float32, device=dev)
        self.tree_mask = torch.full((max_tokens,), -1, dtype=torch.int64, device=dev) if tree_drafts else None
        self.graphs: dict[tuple[int, int, int], Callable[[], None]] = {}  # bucket -> replay
        self._keep_alive: list = []  # the captured torch.cuda.CUDAGraph objects
        self.pool = None
        self.failed = False
        self.num_replays = 0

    def bucket(self, num_seqs: int, num_tokens: int, max_query_len: int) -> tuple[int, int, int] | None:
        """A decode step's graph is chosen by its sequence count; a verify step's by its token
        count alone (room for as many sequences as tokens, up to the largest sequence
        bucket), so there is one verify graph per token bucket rather than one per (sequence,
        token) pair: ragged drafts would otherwise meet a new pair, and a capture, on most steps."""
        if num_seqs > self.seq_buckets[-1] or num_tokens > self.token_buckets[-1]:
            return None
        if max_query_len > self.max_verify_query_len:
            return None
        if max_query_len == 1:
            seqs = self.seq_buckets[bisect.bisect_left(self.seq_buckets, num_seqs)]
            return seqs, seqs, 1
        tokens = self.token_buckets[bisect.bisect_left(self.token_buckets, num_tokens)]
        seqs = self.seq_buckets[bisect.bisect_left(self.seq_buckets, min(tokens, self.seq_buckets[-1]))]
        return seqs, tokens, self.max_verify_query_len

    def replay(self, inputs: StepInputs) -> torch.Tensor | None:  # [num_tokens, vocab] or None: run eagerly
        md = inputs.metadata
        key = self.bucket(inputs.num_seqs, inputs.num_tokens, md.max_query_len)
        if key is None or self.failed or (md.tree_mask is not None and self.tree_mask is None):
            return None
        if key not in self.graphs and not self._capture(*key):
            return None
        num_seqs, num_tokens = inputs.num_seqs, inputs.num_tokens
        seq_bucket, token_bucket, _ = key
        self.input_ids[:num_tokens].copy_(inputs.input_ids)
        self.positions[:num_tokens].copy_(inputs.positions)
        self.slot_mapping[:token_bucket].fill_(-1)
        self.slot_mapping[:num_tokens].copy_(md.slot_mapping)
        width = md.block_tables.shape[1]
        self.block_tables[:num_seqs, :width].copy_(md.block_tables)
        self.seq_lens[:seq_bucket].zero_()
        self.seq_lens[:num_seqs].copy_(md.seq_lens)
        self.query_start_loc[num_seqs + 1:seq_bucket + 1].fill_(num_tokens)
        self.query_start_loc[:num_seqs + 1].copy_(md.query_start_loc)
        if self.tree_mask is not None and key[2] > 1:  # a verify graph reads the mask
            self.tree_mask[:token_bucket].fill_(-1)
            if md.tree_mask is not None:
                self.tree_mask[:num_tokens].copy_(md.tree_mask)
        self.graphs[key]()
        self.num_replays += 1
        return self.logits[:num_tokens]

    def _capture(self, seq_bucket: int, token_bucket: int, max_query_len: int) -> bool:
        runner = self.runner
        tree_mask = self.tree_mask[:token_bucket] if self.tree_mask is not None and max_query_len > 1 else None
        md = AttentionMetadata(self.slot_mapping[:token_bucket], self.block_tables[:seq_bucket],
                               self.seq_lens[:seq_bucket], self.query_start_loc[:seq_bucket + 1], max_query_len,
                               tree_mask)
        # Warm-up and capture over an empty batch: nothing is written to or read from the cache.
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        self.query_start_loc.zero_()
        ids, positions = self.input_ids[:token_bucket], self.positions[:token_bucket]

        def forward() -> None:
            runner.attn.metadata = md
            hidden = runner.model.forward(ids, positions, runner.attn)
            self.logits[:token_bucket] = runner.model.compute_logits(hidden, runner.attn.batch_invariant)

        try:
            replay = self._record(forward)
        except Exception:  # a model op that cannot be captured: keep serving, eagerly
            log.exception("CUDA graph capture failed for %s; running eagerly", (seq_bucket, token_bucket))
            self.failed = True
            return False
        self.graphs[(seq_bucket, token_bucket, max_query_len)] = replay
        return True

    def _record(self, forward: Callable[[], None]) -> Callable[[], None]:
        """Capture forward as a CUDA graph (after a warm-up run that compiles the Triton
        kernels outside the capture); returns its replay."""
        forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # No garbage collection while capturing: collecting an earlier engine's graphs
        # destroys them, which CUDA forbids during a capture and which invalidates it
        # (seen on an H100, with engines made one after another in one process).
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                forward()
        finally:
            if collecting:
                gc.enable()
        torch.cuda.synchronize()
        if self.pool is None:
            self.pool = graph.pool()
        self._keep_alive.append(graph)
        return graph.replay

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every decode bucket and, when drafts are verified, every verify bucket up
        front (largest first, so the pool is sized once): a capture costs a forward and more,
        so none is left for the first steps to pay."""
        gc.collect()  # an earlier engine's graphs are freed now, not during a capture
        keys = [(s, s, 1) for s in self.seq_buckets]
        if self.max_verify_query_len > 1:
            keys += [self.bucket(1, t, self.max_verify_query_len) for t in self.token_buckets if t > 1]
        for key in sorted(set(keys), key=lambda k: (k[1], k[0], k[2]), reverse=True):
            if not self.failed and key not in self.graphs:
                self._capture(*key)

def default_num_kv_blocks(model, device: torch.device, block_size: int, max_num_batched_tokens: int,
                          memory_fraction: float, cpu_bytes: int = 512 << 20, batch_invariant: bool = False) -> int:
    """KV blocks that fit: on CUDA, memory_fraction of the GPU minus the weights and the
    activations of the largest step (measured by running it); on CPU, cpu_bytes of cache."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    per_block = KVCache.bytes_per_block(cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, cfg.head_dim,
                                        dtype)
    if device.type != "cuda":
        return max(64, min(1 << 16, cpu_bytes // per_block))
    num_tokens = min(max_num_batched_tokens, cfg.max_position_embeddings)
    num_blocks = -(-num_tokens // block_size)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    scratch = KVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype,
                      device)
    attn = PagedAttention(scratch, cfg.head_dim ** -0.5, batch_invariant)
    attn.metadata = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :],
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        max_query_len=num_tokens)
    with torch.inference_mode():
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        hidden = model.forward(ids, torch.arange(num_tokens, device=device), attn)
        model.compute_logits(hidden, batch_invariant)  # every row may sample (verify steps)
    torch.cuda.synchronize(device)
    del scratch, attn, hidden
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    activations = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
    available = int(total * memory_fraction) - (total - free) - activations
    if available < per_block:
        raise RuntimeError(f"kv_cache_memory_fraction={memory_fraction}: no GPU memory left for the KV cache")
    return available // per_block
