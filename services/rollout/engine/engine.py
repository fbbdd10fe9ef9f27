"""LLMEngine: continuous batching with a paged KV cache and batched lossless speculation.

The worker server calls ``add_request``/``abort`` and runs ``step()`` in a loop, in one
thread. One step:
  1. schedule: decodes, prefill chunks and admissions under the token budget;
  2. draft: the drafter proposes a draft for each decoding sequence, within the budget
     the cost model allows at this batch size;
  3. forward: one pass over every scheduled token and draft token (paged attention);
  4. verify: sample the policy's token at every sampling row, accept the longest
     matching draft prefix, plus the recovered/bonus token;
  5. commit: append tokens (stop tokens, max_tokens and the chunk budget applied one
     token at a time), roll back rejected drafts' KV, share newly full blocks;
     a draft tree's accepted path has its KV moved into place first (engine/tree.py).
  6. finish: return a RequestOutput for each request whose chunk ended.
The engine knows nothing about gRPC, history storage or other workers.

Overlap (``overlap``, on by default; SGLang's overlap scheduler, vLLM's async
scheduling). Without drafts, a step's tokens are not needed on the host to lay out the
next step: its positions, KV slots and sampler rows follow from the lengths alone. So a
step samples, queues the copy of its tokens to the host, and commits placeholders
(``_leave``: each sequence one token longer, its blocks and counts advanced); the next
step, when it is the same sequences decoding again (``_chains``), is scheduled and
launched with its tokens fed from the device (``ModelRunner.run``'s ``fed``), and only
then are the last step's tokens read and written in, its stop conditions applied and its
chunks finished (``_resolve``) -- on a GPU while the device runs the forward. A sequence
whose pending token ends it ran one row more in that forward, discarded. A step that
cannot chain (an admission, a finish, a preemption to come, a chunk ending by length)
reads the last step's tokens before its schedule, as without overlap. Drafting engines
do not overlap: the next draft depends on the tokens. ``abort``, ``load_weights`` and
``sync`` read a pending step's tokens first.

Deferred calls (``defer``): work handed to the engine thread whose result no step needs
(the worker's drafter feed: responses into the global draft index) runs with the step's
deferred work behind the next forward's launch, paced by its cost (engine/deferred.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from services.rollout.engine.batch_scheduler import BatchScheduler, ScheduledBatch
from services.rollout.engine.step_inputs import SteadyBatch
from services.rollout.engine.block_manager import BlockManager
from services.rollout.engine.cost_model import CostModel
from services.rollout.engine.deferred import DEFERRED_COST_PER_STEP, DeferredCalls
from services.rollout.engine.drafter_protocol import Commits, Drafter, NullDrafter, commit_step
from services.common.validation import check_sampling_values, check_stops_leave_a_token
from services.rollout.engine.logprobs import LOGPROBS_MODES
from services.rollout.engine.metrics import EngineMetrics
from services.rollout.engine.model_runner import ModelRunner, default_num_kv_blocks
from services.rollout.engine.request import EngineRequest, RequestOutput
from services.rollout.engine.sequence import Sequence, SequenceStatus
from services.rollout.engine.tree import MAX_TREE_ROWS, check_tree, is_chain, kv_moves, prune, shape
from services.rollout.engine.input_batch import PendingRead, VerifyStats
from services.rollout.engine.verifier import LinearVerdicts, Verdict, sample_later, verify, verify_linear

log = logging.getLogger(__name__)

# From this many drafting sequences a step's linear drafts are checked as one array
# (``LLMEngine._take_linear_drafts``), and their longest drafts read from the steady
# batch's arrays; below, the per-sequence Python costs less than the few numpy calls
# (benchmarks/engine_host.py at batch 1).
ARRAY_DRAFT_CHECKS_MIN = 8


FINISHED = SequenceStatus.FINISHED
# The token a sequence holds in place of one sampled but not read yet (a valid id: a layout
# made before the read feeds it, and the forward takes the device's token instead)
PLACEHOLDER = 0


@dataclass(slots=True)
class PendingStep:
    """A step without drafts whose sampled tokens are not read yet (``LLMEngine._leave``)."""

    batch: ScheduledBatch
    seqs: list[Sequence]  # its sampling sequences, in row order, each holding a placeholder
    tokens: torch.Tensor  # [rows] int64 on the device: what the next step feeds
    read: PendingRead  # the tokens and logprobs, on their way to the host
    start: float  # perf_counter and cost clock when the step began
    cost_start: float
    ended: tuple[float, float, bool]  # when it ended (both clocks), whether its forward replayed a CUDA graph
    num_prompt_tokens: int
    new_blocks: int  # KV blocks its sequences need for their next step
    ends: bool  # some sequence's chunk ends with its pending token, whatever it is
    skip_finished: bool  # some of seqs had finished already (the last step's resolve): no placeholder
    steady: SteadyBatch | None  # its decode layout, advanced (its last tokens placeholders)


class LLMEngine:
    def __init__(self, model, *, device="auto", max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 num_kv_blocks: int | None = None, block_size: int = 16, kv_cache_memory_fraction: float = 0.8,
                 drafter: Drafter | None = None, speculative: bool = True, max_draft_len: int = 16,
                 cost_model: CostModel | None = None, use_cuda_graphs: bool = True, worker_id: str = "local",
                 max_model_len: int | None = None, batch_invariant: bool = False, measure_cost: bool = True,
                 overlap: bool = True, deferred_cost_per_step: int = DEFERRED_COST_PER_STEP):
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or max_draft_len < 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1, max_draft_len >= 0")
        if deferred_cost_per_step < 1:
            raise ValueError(f"deferred_cost_per_step: {deferred_cost_per_step} < 1")
        self.device = _resolve_device(device, model)
        self.model = model.to(self.device).eval()
        cfg = model.config
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        drafting = speculative and drafter is not None
        self.max_draft_len = max_draft_len if drafting else 0
        self.speculative = drafting
        self._drafter: Drafter = drafter if drafting else NullDrafter()
        # Draft trees (engine/tree.py) when the drafter offers them (``propose_trees``, with
        # ``tree_drafts`` on: HistoDrafter's DrafterConfig.tree). Not in batch-invariant mode
        # on a GPU: the Triton kernel masks a tree's rows correctly, but a node's keys sit in
        # other lanes than in a plain decode's, so its bits could differ (the CPU reference
        # reads them in a plain decode's order: trees stay bitwise there).
        device_kind = _resolve_device(device, model).type
        self.tree_drafts = (drafting and callable(getattr(drafter, "propose_trees", None))
                            and callable(getattr(drafter, "record_tree_acceptance", None))
                            and bool(getattr(drafter, "tree_drafts", False))
                            and not (batch_invariant and device_kind == "cuda"))
        if self.tree_drafts and max_draft_len + 1 > MAX_TREE_ROWS:
            raise ValueError(f"max_draft_len: draft trees hold at most {MAX_TREE_ROWS - 1} nodes, got {max_draft_len}")
        # Requests the drafter failed on: they decode without drafts (still lossless).
        # A drafter bug costs speed, never a sample.
        self._undrafted: set[str] = set()
        # The H100 curve of the nearest model size (docs/cost-model.md) is the prior; with
        # measure_cost the engine's own step times replace it as they come in (on a CPU,
        # drafts rarely pay). Without, draft lengths do not depend on the machine's speed.
        self.cost_model = cost_model or CostModel.for_num_params(sum(p.numel() for p in model.parameters()),
                                                                 measure=measure_cost)
        self._cost_clock = cost_clock(self.device)  # what a step's cost is measured with
        if num_kv_blocks is None:
            num_kv_blocks = default_num_kv_blocks(self.model, self.device, block_size, max_num_batched_tokens,
                                                  kv_cache_memory_fraction, batch_invariant=batch_invariant)
        self.block_manager = BlockManager(num_kv_blocks, block_size)
        self.scheduler = BatchScheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.device, num_kv_blocks=num_kv_blocks, block_size=block_size,
                                  max_model_len=self.max_model_len, max_num_seqs=max_num_seqs,
                                  max_draft_len=self.max_draft_len, use_cuda_graphs=use_cuda_graphs,
                                  batch_invariant=batch_invariant, tree_drafts=self.tree_drafts)
        self.runner.tables = self.block_manager.tables
        self.batch_invariant = batch_invariant
        # The series' exports wait for the next forward's launch (EngineMetrics.flush in step())
        self.metrics = EngineMetrics(worker_id, deferred=True)
        # The garbage collector, run behind each step's forward (services/common/gc_tuning.py
        # StepCollector; the worker installs one); None: CPython collects where it allocates.
        self.collector = None
        self.seqs: dict[str, Sequence] = {}
        # what the next step() returns first: aborted chunks, and chunks that a pending step's
        # tokens ended when read outside a step (abort, load_weights, sync)
        self._aborted: list[RequestOutput] = []
        self._verify_stats = VerifyStats(max_num_seqs, max(self.max_draft_len, 1))  # linear steps' counts by slot
        # Without drafts, a step's tokens are read during the next step, behind its forward
        # (the module docstring); the step whose tokens wait, None when none does.
        self.overlap = overlap
        self._pending: PendingStep | None = None
        # Calls handed over with ``defer`` (the drafter's global-index inserts), run with the
        # deferred work behind each forward's launch, at most this much cost a step.
        self._calls = DeferredCalls()
        self.deferred_cost_per_step = deferred_cost_per_step

    @property
    def drafter(self) -> Drafter | None:
        """The drafter, None when drafting is off (the server loads history into it)."""
        return self._drafter if self.speculative else None

    # ------------------------------------------------------------------ requests
    def add_request(self, req: EngineRequest) -> None:
        """Queue one sample's chunk. Raises ValueError naming the offending field."""
        self._validate(req)
        seq = Sequence(req, self.model.config.eos_token_ids, self.max_model_len)
        seq.slot = self.runner.params.assign(req)  # its sampling parameters, on the device
        self._drafter_call(self._drafter.start_request, req.request_id, req.prompt_id,
                           req.prompt_token_ids, req.generated_token_ids)
        self.seqs[req.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its partial chunk comes back from the next step() as 'abort'."""
        self._resolve_pending(self._aborted)  # (its placeholder token is no output; it may have finished)
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        self._verify_stats.drain(seq)
        self._aborted.append(seq.to_output("abort"))
        self._remove(seq)
        return True

    def reset(self) -> list[str]:
        """Drops every request (after a failed step), freeing their KV blocks; no outputs
        come back for them. Returns their ids."""
        dropped = list(self.seqs)
        self._pending = None
        for seq in list(self.seqs.values()):
            self._remove(seq)
        self._aborted = []
        self.metrics.flush()
        self._calls.run()  # (no step runs them until new requests come)
        return dropped

    def sync(self) -> None:
        """Reads the tokens of the step that left them on the device now (``overlap``), so
        that every sequence's tokens and counts are whole between steps; the chunks this
        ends come back from the next ``step()``. Steps never need it (for inspection)."""
        self._resolve_pending(self._aborted)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._aborted)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def kv_cache_usage(self) -> float:
        return self.block_manager.usage()

    def load_weights(self, state_dict) -> None:
        """In-place weight update between steps, while idle; cached prefixes become stale."""
        self._resolve_pending(self._aborted)  # (sampled by the old weights)
        self.model.load_weights(state_dict)
        self.block_manager.reset_prefix_cache()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """One scheduling + forward + verify iteration; returns the chunks that ended."""
        outputs = self._step()
        if not self.scheduler.has_work():
            self._deferred_work(drain=True)  # idle: no next forward to do it behind
            self.runner.steady = None  # (its finished sequences need not be kept)
        return outputs

    def _step(self) -> list[RequestOutput]:
        start, cost_start = time.perf_counter(), self._cost_clock()
        outputs, self._aborted = self._aborted, []
        previous, self._pending = self._pending, None  # the last step, its tokens not read yet
        if previous is not None and not self._chains(previous):
            self._resolve(previous, outputs)
            previous = None
        batch = self.scheduler.schedule(self.runner.steady)                    # 1. schedule
        if not batch.seqs:
            return outputs
        if previous is not None and batch.seqs != previous.seqs:  # (_chains promised they are)
            raise RuntimeError("an overlapped step's batch is not the last step's sequences")
        if self.max_draft_len:
            self._propose_drafts(batch)                                        # 2. draft
        logits = self.runner.run(batch.seqs, None if previous is None else previous.tokens)  # 3. forward
        # The last step's deferred work while the device computes this step's forward (on a
        # GPU, nothing above has waited for it; the sampler's read below does), and the
        # garbage collector's due collection.
        self._deferred_work()
        if self.collector is not None:
            self.collector()
        sampling = batch.sampling_seqs()
        if not self.speculative:
            return self._plain_step(batch, sampling, logits, outputs, start, cost_start, previous)  # 4-6 no drafts
        if self.runner.sampling is not None and self.runner.sampling.fed_host is not None:
            return self._linear_step(batch, logits, outputs, start, cost_start)  # 4-6 decodes, linear drafts
        verdicts = verify(logits, sampling, self.runner.sampling, self.runner.params,
                          self.runner.reader)                                  # 4. verify
        if self.tree_drafts:
            self._move_tree_kv(sampling, verdicts)
        self.scheduler.postprocess(batch, time.perf_counter() - start)
        num_draft_tokens = sum(len(s.draft_token_ids) for s in sampling)
        num_prompt_tokens, num_generated = batch.num_prompt_tokens(), 0
        commits = Commits()  # the drafter's, sent in one call (before a request stops)
        num_outputs = len(outputs)
        for seq, verdict in zip(sampling, verdicts):
            num_generated += self._commit(seq, verdict, commits)               # 5. commit
            if seq.chunk_done:
                self._send(commits)
                outputs.append(self._finish(seq))                              # 6. finish
        self._send(commits)
        steady = self.runner.steady  # a decode layout (every sequence sampled): its next step's state
        if steady is not None and len(outputs) == num_outputs:
            steady.advance_lists([len(v.token_ids) for v in verdicts], [v.token_ids[-1] for v in verdicts])
        self.metrics.on_verdicts(verdicts)  # the step's drafts, counted at once
        if self.tree_drafts:
            self.metrics.on_tree_verdicts(verdicts, len(batch.seqs))
        self._record_step(batch, start, cost_start, num_prompt_tokens, num_draft_tokens, num_generated)
        return outputs

    def _deferred_work(self, drain: bool = False) -> None:
        """What the last step left for after the next forward's launch: its metric exports,
        the hashing of the blocks it filled, its verify counts by slot; and the calls
        handed over with ``defer``, as many as ``deferred_cost_per_step`` allows (all of
        them with ``drain``: the engine is idle)."""
        self.metrics.flush()
        self.block_manager.hash_filled()
        self._verify_stats.apply()
        if self._calls:
            self._calls.run(None if drain else self.deferred_cost_per_step)

    def defer(self, fn: Callable[[], object], cost: int = 0, urgent: bool = False) -> None:
        """Runs ``fn`` on this thread where it delays no step: right after a forward's
        launch, while the device computes, in the order given, at most
        ``deferred_cost_per_step`` of ``cost`` a step (a costlier call runs alone), all
        that are left once the engine has no work (engine/deferred.py): work whose result
        no step waits for, a worker's drafter feed. ``urgent``: behind the very next
        launch, before the paced calls, whatever its cost (work a request waits for: a
        new prompt's history loaded into the drafter). ``fn`` must not call the engine;
        its raising is logged, not raised."""
        self._calls.add(fn, cost, urgent)

    def num_deferred(self) -> int:
        """Calls handed to ``defer`` that have not run yet."""
        return len(self._calls)

    def _plain_step(self, batch: ScheduledBatch, sampling: list[Sequence], logits, outputs: list[RequestOutput],
                    start: float, cost_start: float, previous: PendingStep | None) -> list[RequestOutput]:
        """Sample, commit and finish when nothing drafts. The sampler's tokens stay on the
        device: each sampling sequence takes a placeholder token at once (``_leave``), and
        the tokens are read into them later (``_resolve``): with ``overlap``, during the
        next step, once its forward is launched on them (the module docstring), else now.
        ``previous``: the last step, whose tokens this step's forward fed, resolved here
        while that forward runs."""
        if not sampling:  # prefill chunks alone: nothing sampled
            self.scheduler.advance_prefills(batch, time.perf_counter() - start)
            self._record_step(batch, start, cost_start, batch.num_prompt_tokens(), 0, 0)
            return outputs
        runner = self.runner
        tokens, read = sample_later(logits, runner.sampling, runner.params, runner.reader)
        finished = previous is not None and self._resolve(previous, outputs)
        pending = self._leave(batch, sampling, tokens, read, start, cost_start, finished)
        if self.overlap:
            self._pending = pending
        else:
            self._resolve(pending, outputs)
        return outputs

    def _leave(self, batch: ScheduledBatch, sampling: list[Sequence], tokens: torch.Tensor, read: PendingRead,
               start: float, cost_start: float, finished: bool) -> PendingStep:
        """The step's commit before its tokens are known: each sampling sequence (but those
        the last step's resolve finished, where ``finished``) appends a placeholder token
        and logprob and advances as ``Sequence.append_token`` would, its filled blocks
        queued for hashing (they hold fed tokens only); ``_resolve`` writes the tokens in
        and applies the stop conditions. Returns the step, pending."""
        elapsed = time.perf_counter() - start
        num_prompt_tokens = 0
        if batch.num_decodes < len(batch.seqs):  # prefill chunks (a steady batch has none)
            self.scheduler.advance_prefills(batch, elapsed)  # (postprocess; the loop charges the others)
            num_prompt_tokens = batch.num_prompt_tokens()  # (before the loop clears the counts)
        bm = self.block_manager
        bs = bm.block_size
        new_blocks = 0
        ends = False
        for seq in sampling:
            if finished and seq.status is FINISHED:
                continue
            seq.busy_s += elapsed
            computed = seq.num_computed_tokens
            seq.num_computed_tokens = now = computed + seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            own = seq.token_ids
            own.append(PLACEHOLDER)
            seq.out_logprobs.append(0.0)
            ends |= len(own) >= seq.end_len  # its chunk ends with this token, whatever it is
            if now // bs != computed // bs:  # a block filled up: hash it later (_commit_filled_block)
                bm.commit_later(seq)
                new_blocks += len(own) > len(seq.block_table) * bs  # the next step feeds into a new block
        steady = self.runner.steady  # a decode layout (every sequence sampled): its next step's state
        if steady is not None and not finished:
            steady.advance(1, steady.placeholders())
        ended = time.perf_counter(), self._cost_clock(), self.runner.last_graphed
        return PendingStep(batch, sampling, tokens, read, start, cost_start, ended, num_prompt_tokens, new_blocks,
                           ends, finished, steady)

    def _resolve(self, p: PendingStep, outputs: list[RequestOutput]) -> bool:
        """Reads a pending step's tokens (the step's one wait for the device) into its
        sequences' placeholders, finishing those whose chunk ends with theirs, and records
        the step. Returns whether any finished."""
        token_array, logprob_array = p.read.result()
        num_outputs = len(outputs)
        num_generated = 0
        skip = p.skip_finished
        for seq, token, logprob in zip(p.seqs, token_array.tolist(), logprob_array.tolist()):
            if skip and seq.status is FINISHED:
                continue
            num_generated += 1
            own = seq.token_ids
            own[-1] = token
            seq.out_logprobs[-1] = logprob
            if (len(own) >= seq.end_len or token in seq.stop_token_ids) and seq.ends_with(token):
                outputs.append(self._finish(seq))  # (Sequence.append_token, inline)
        steady = p.steady
        if steady is not None and steady.next_last is steady.placeholders():
            steady.next_last = token_array  # (not consumed by an overlapped step: a next layout reads them)
        self._record_step(p.batch, p.start, p.cost_start, p.num_prompt_tokens, 0, num_generated, p.ended)
        return len(outputs) > num_outputs

    def _chains(self, p: PendingStep) -> bool:
        """Whether the next step can be launched on ``p``'s tokens before they are read:
        it is ``p``'s sequences again, every one decoding its pending token, as the
        scheduler will make it -- the running sequences are exactly ``p``'s, in order
        (none finished or was admitted since, no prefill in flight), none ends its chunk
        with its pending token, nothing waits that could be admitted, the token budget
        holds them all, and the free blocks do for those that need a new one (no
        preemption)."""
        s = self.scheduler
        return (not p.ends and s.running == p.seqs and len(p.seqs) <= s.max_num_batched_tokens
                and (not s.waiting or len(s.running) >= s.max_num_seqs)
                and p.new_blocks <= self.block_manager.num_free_blocks)

    def _resolve_pending(self, outputs: list[RequestOutput]) -> None:
        """The pending step resolved now (before an abort, a weight load, a step that
        cannot be overlapped)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._resolve(pending, outputs)

    def _linear_step(self, batch: ScheduledBatch, logits, outputs: list[RequestOutput], start: float,
                     cost_start: float) -> list[RequestOutput]:
        """Verify, commit and finish a step of the decode layout (every sequence samples:
        its last token, then perhaps a linear draft; step_inputs._decode_step): the drafts
        accepted for the whole batch by array operations (``verify_linear``), their counts
        per request summed by arrays too (``VerifyStats``), then one pass over the
        sequences appending what each committed, in order (the scheduler's ``postprocess``
        has nothing to do for such a step but charge its time). The drafter gets the
        step's verdicts and tokens in one ``commit_step`` call, made from the arrays after
        the pass (or, where a request's chunk ends, the commits before it first, then its
        stop_request: the same order as calls one by one)."""
        runner = self.runner
        v = verify_linear(logits, runner.sampling, runner.params, runner.reader)
        elapsed = time.perf_counter() - start
        seqs = batch.seqs
        steady = runner.steady  # this step's layout by sequence, when it keeps one
        if steady is not None:
            slots, request_ids = steady.slots, steady.requests()[0]
        else:
            slots, request_ids = runner.sampling.row_slots_host[v.query_start[:-1]], [s.request_id for s in seqs]
        self._verify_stats.record_later(slots, v.num_draft, v.num_accepted)  # (summed behind the next forward)
        tokens, logprobs = v.token_ids, v.logprobs
        bm = self.block_manager
        bs = bm.block_size
        num_generated = sent = 0  # sent: the sequences whose commits the drafter has
        num_outputs = len(outputs)
        for i, (seq, lo, num_draft, a) in enumerate(zip(seqs, v.query_start.tolist(), v.num_draft.tolist(),
                                                        v.num_accepted.tolist())):
            seq.busy_s += elapsed
            if num_draft:
                seq.draft_token_ids = []
            computed = seq.num_computed_tokens
            seq.num_computed_tokens = computed + 1 + a  # the fed token and the accepted drafts
            seq.num_scheduled_tokens = 0
            hi = lo + a + 1
            token_ids = tokens[lo:hi]
            own = seq.token_ids
            if len(own) + a + 1 < seq.end_len and seq.stop_token_ids.isdisjoint(token_ids):
                own += token_ids  # none can end the chunk (Sequence.append_tokens' common case)
                seq.out_logprobs += logprobs[lo:hi]
                num_generated += a + 1
            else:
                num_emitted, ended = seq.append_tokens(token_ids, logprobs[lo:hi])
                num_generated += num_emitted
                if ended:  # the commits so far and its verdict (no tokens), before the request stops
                    self._send_linear(v, request_ids, sent, i, ended=True)
                    sent = i + 1
                    outputs.append(self._finish(seq))
                    continue
            if num_draft and len(seq.block_table) * bs >= len(own) + bs:
                bm.truncate(seq, len(own))  # drop the rejected drafts' blocks
            if seq.num_computed_tokens // bs != computed // bs:
                bm.commit_later(seq)
        self._send_linear(v, request_ids, sent, len(seqs))
        if steady is not None and len(outputs) == num_outputs:  # the next step's state: each one's last token
            committed = v.num_accepted + 1
            steady.advance(committed, v.tokens[v.query_start[:-1] + v.num_accepted])
        num_draft_tokens = len(tokens) - len(seqs)
        self.metrics.on_accepted(int(np.count_nonzero(v.num_draft)), num_draft_tokens, int(v.num_accepted.sum()),
                                 v.num_accepted)
        self._record_step(batch, start, cost_start, batch.num_prompt_tokens(), num_draft_tokens, num_generated)
        return outputs

    def _send_linear(self, v: LinearVerdicts, request_ids: list[str], first: int, end: int,
                     ended: bool = False) -> None:
        """The drafter's commits of sequences ``first..end - 1`` of a linear step, from its
        arrays: each one's verdict and committed tokens; with ``ended``, sequence ``end``'s
        chunk ended: its verdict too (where it drafted), without tokens. ``request_ids``:
        the step's, by sequence. Requests the drafter failed on are left out."""
        ids = request_ids[first:end]
        drafts, accepted = v.num_draft[first:end].tolist(), v.num_accepted[first:end].tolist()
        counts = [a + 1 for a in accepted]
        tokens = v.committed(first, end).tolist()
        if ended and v.num_draft[end]:
            ids.append(request_ids[end])
            drafts.append(int(v.num_draft[end]))
            accepted.append(int(v.num_accepted[end]))
            counts.append(-1)
        if self._undrafted and any(r in self._undrafted for r in ids):
            kept = Commits()
            at = 0
            for request_id, d, a, n in zip(ids, drafts, accepted, counts):
                if request_id not in self._undrafted:
                    kept.add(request_id, d, a, None if n < 0 else tokens[at:at + n])
                at += max(n, 0)
            self._send(kept)
        elif ids:
            commit_step(self._drafter, ids, drafts, accepted, tokens, counts, self._drafter_call,
                        self._commit_step_failed)

    def _finish(self, seq: Sequence) -> RequestOutput:
        self._verify_stats.drain(seq)
        output = seq.to_output(seq.finish_reason)
        self._remove(seq)
        return output

    def _record_step(self, batch: ScheduledBatch, start: float, cost_start: float, num_prompt_tokens: int,
                     num_draft_tokens: int, num_generated: int, ended: tuple[float, float, bool] | None = None
                     ) -> None:
        """The step's metrics and its cost; ``ended``: (time, cost clock, whether graphed)
        where the step was done before now (a pending step, recorded when resolved)."""
        kind = "prefill" if num_prompt_tokens else ("verify" if num_draft_tokens else "decode")
        end, cost_end, graphed = ended or (time.perf_counter(), self._cost_clock(), self.runner.last_graphed)
        self.cost_model.observe(batch.num_tokens + num_draft_tokens, (cost_end - cost_start) * 1e3)
        self.metrics.counters.num_preemptions += batch.num_preempted
        self.metrics.on_step(kind, end - start, num_prompt_tokens, num_generated, self.num_running(),
                             self.num_waiting(), self.kv_cache_usage(), graphed)

    # ------------------------------------------------------------------ step parts
    def _held_to_flat_part(self) -> bool:
        """Whether a step's drafts must fit the cost curve's flat part (the H100 model:
        a memory-bound forward takes extra tokens for free up to a point). Not on a CPU
        whose drafter prices each draft token on this engine's curve (the history
        drafter's gain rule, services/rollout/drafter/budget.py: a token is kept only if
        its chance of acceptance pays for one more token in the forward): a CPU's forward
        is compute-bound from the first tokens, its curve has no flat part to speak of,
        and the cap, blind to how sure a draft is, cut every draft beside a batch of 16,
        drafts that verify 8 tokens in one step included (issue 29)."""
        config = getattr(self._drafter, "config", None)
        return self.device.type != "cpu" or getattr(config, "cost_model", None) is not self.cost_model

    def _propose_drafts(self, batch: ScheduledBatch) -> None:
        """Give each decoding sequence a draft within the cost model's budget (the token
        budget alone where ``_held_to_flat_part`` says no) and free KV (drafting engines)."""
        decodes = batch.decode_seqs
        if self._undrafted:
            decodes = [s for s in decodes if s.request_id not in self._undrafted]
        if not decodes:
            return
        budget = self.scheduler.budget_left(batch)
        if self._held_to_flat_part():
            budget = min(budget, self.cost_model.draft_budget(batch.num_tokens))
        room = self.runner.graph_token_room(batch.num_tokens)
        if room is not None:
            budget = min(budget, room)
        most = self.max_draft_len + 1
        steady = None if self._undrafted else batch.steady  # the decodes: the last step's layout, advanced
        if steady is not None and len(decodes) >= ARRAY_DRAFT_CHECKS_MIN:  # its arrays (a length: next position + 1)
            request_ids, stops, end_lens = steady.requests()
            request_ids, stops = list(request_ids), list(stops)
            max_lens = (np.minimum(end_lens - steady.next_starts_array() - 1, most) - 1).tolist()
        else:
            max_lens = [min(most, s.end_len - len(s.token_ids)) - 1 for s in decodes]  # (max_new_tokens_left() - 1)
            request_ids, stops = [s.request_id for s in decodes], [s.stop_token_ids for s in decodes]
        if budget <= 0 or not any(max_lens):
            return
        try:
            if self.tree_drafts:
                trees = self._drafter.propose_trees(request_ids, max_lens, stop_token_ids=stops, budget=budget,
                                                    max_nodes=self.max_draft_len)
            else:
                drafts = self._drafter.propose(request_ids, max_lens, stop_token_ids=stops, budget=budget)
        except Exception:  # noqa: BLE001 - not one request's fault: this step goes undrafted
            log.exception("drafter.propose failed; decoding this step without drafts")
            self.metrics.on_drafter_error()
            return
        vocab = self.model.config.vocab_size
        if not self.tree_drafts:
            if len(decodes) >= ARRAY_DRAFT_CHECKS_MIN and self._take_linear_drafts(decodes, drafts, max_lens,
                                                                                   budget, vocab):
                return
            trees = [(d, None) for d in drafts]
        bm = self.block_manager
        bs = bm.block_size
        for seq, (draft, parents), max_len in zip(decodes, trees, max_lens):
            if parents is None:
                draft = [int(t) for t in draft[:min(max_len, budget)]]
            else:
                draft, parents = self._checked_tree(draft, parents, max_len, budget)
            if draft:
                if min(draft) < 0 or max(draft) >= vocab:
                    draft, parents = [], None  # a drafter bug must not crash the step
                elif (len(seq.token_ids) + len(draft) > len(seq.block_table) * bs
                      and not bm.ensure_slots(seq, seq.num_tokens + len(draft))):
                    draft, parents = [], None  # no free KV for the draft: decode plainly this step
            seq.draft_token_ids = draft
            seq.draft_parents = parents
            budget -= len(draft)
            if not draft:
                self.metrics.on_draft_miss()
            elif parents is not None:
                self.metrics.on_tree(*shape(parents))

    def _take_linear_drafts(self, decodes: list[Sequence], drafts, max_lens: list[int], budget: int,
                            vocab: int) -> bool:
        """``_propose_drafts``' checks for the common step, over the whole step at once:
        linear drafts that, each cut to its ``max_lens``, fit the budget together (so no
        draft is cut by the budget), every token an integer in the vocabulary (checked as
        one array); each sequence then checks only its KV room, as the per-sequence loop
        does. False, with nothing set, where that does not hold: the per-sequence checks
        then decide (a bad draft dropped alone, the budget cut in order)."""
        cut = [draft[:n] for draft, n in zip(drafts, max_lens)]
        lens = list(map(len, cut))
        total = sum(lens)
        if total > budget:
            return False
        ints: list[int] = []
        if total:
            try:
                flat = np.array(list(chain.from_iterable(cut)), dtype=np.int64)
            except (TypeError, ValueError, OverflowError):
                return False
            if flat.shape != (total,) or flat.min() < 0 or flat.max() >= vocab:
                return False
            ints = flat.tolist()
        bm = self.block_manager
        bs = bm.block_size
        at = misses = 0
        for seq, k in zip(decodes, lens):
            draft = ints[at:at + k]
            at += k
            if (k and len(seq.token_ids) + k > len(seq.block_table) * bs
                    and not bm.ensure_slots(seq, seq.num_tokens + k)):
                draft = []  # no free KV for the draft: decode plainly this step
            seq.draft_token_ids = draft
            seq.draft_parents = None
            misses += not draft
        for _ in range(misses):
            self.metrics.on_draft_miss()
        return True

    def _checked_tree(self, tokens, parents, max_depth: int, budget: int) -> tuple[list[int], list[int] | None]:
        """A drafter's tree, checked (a bad one is no draft: a drafter bug must not crash
        the step), cut to ``max_depth`` and to the step's node budget; a chain is returned as
        a linear draft (parents None)."""
        try:
            tokens, parents = [int(t) for t in tokens], [int(p) for p in parents]
            check_tree(tokens, parents)
        except (TypeError, ValueError):
            log.warning("drafter proposed a malformed tree; decoding without it", exc_info=True)
            return [], None
        tokens, parents = prune(tokens, parents, max_depth, min(budget, self.max_draft_len))
        return tokens, None if is_chain(parents) else parents

    def _move_tree_kv(self, sampling: list[Sequence], verdicts: list[Verdict]) -> None:
        """The accepted paths' KV into place (node rows -> consecutive positions), in one copy
        for the step; the other nodes' slots are past the committed tokens, dropped by
        ``_commit``'s truncate."""
        src: list[int] = []
        dst: list[int] = []
        bs = self.block_manager.block_size
        for seq, verdict in zip(sampling, verdicts):
            if verdict.path:
                table = seq.block_table
                for a, b in kv_moves(verdict.path, seq.num_tokens - 1):
                    src.append(table[a // bs] * bs + a % bs)
                    dst.append(table[b // bs] * bs + b % bs)
        if src:
            self.runner.move_kv(src, dst)

    def _commit(self, seq: Sequence, verdict: Verdict, commits: Commits) -> int:
        """Append the verdict's tokens up to the first that ends the chunk; returns how many.
        The drafter's verdict and tokens go to `commits` (a tree's verdict straight to the
        drafter: it commutes with the others). Runs only when drafting (a draftless engine
        commits in ``_plain_step``)."""
        num_draft = 0
        if verdict.num_draft:
            seq.record_verify(verdict.num_draft, verdict.num_accepted)
            if verdict.path is not None:
                self._drafter_call(self._drafter.record_tree_acceptance, seq.request_id, seq.draft_parents,
                                   verdict.path)
                seq.draft_parents = None
            else:
                num_draft = verdict.num_draft
            seq.draft_token_ids = []
        # KV is now valid for the fed tokens and the accepted drafts
        computed = seq.num_computed_tokens
        seq.num_computed_tokens = computed + seq.num_scheduled_tokens + verdict.num_accepted
        seq.num_scheduled_tokens = 0
        num_emitted, ended = seq.append_tokens(verdict.token_ids, verdict.logprobs)
        if not ended:
            if verdict.num_draft:  # (only a draft's KV slots can run past the tokens)
                self.block_manager.truncate(seq, seq.num_tokens)  # drop the rejected drafts' blocks
            self._commit_filled_block(seq, computed)
        if seq.request_id not in self._undrafted and (num_draft or not ended):
            commits.add(seq.request_id, num_draft, verdict.num_accepted, None if ended else verdict.token_ids)
        return num_emitted

    def _commit_filled_block(self, seq: Sequence, computed_before: int) -> None:
        """Hash the sequence's blocks when this step's tokens filled one (else nothing to
        hash): after the next step's forward is launched (``BlockManager.hash_filled``)."""
        bs = self.block_manager.block_size
        if seq.num_computed_tokens // bs != computed_before // bs:
            self.block_manager.commit_later(seq)

    def _remove(self, seq: Sequence) -> None:
        self._verify_stats.drain(seq)  # (clears its slot's counts for the slot's next request)
        self.scheduler.remove(seq)
        self.runner.params.release(seq.slot)
        del self.seqs[seq.request_id]
        self._drafter_call(self._drafter.stop_request, seq.request_id)
        self._undrafted.discard(seq.request_id)

    def _send(self, commits: Commits) -> None:
        """A step's verdicts and tokens to the drafter in one call (``commit_step``); where
        it fails, request by request, and only the request that fails goes on without drafts."""
        commits.send(self._drafter, self._drafter_call, self._commit_step_failed)

    def _commit_step_failed(self, exc: Exception) -> None:
        """The drafter's ``commit_step`` raised (it applied nothing; its commits go again
        request by request): a drafter error, logged and counted."""
        log.warning("drafter.commit_step failed (%s: %s); committing request by request", type(exc).__name__, exc)
        self.metrics.on_drafter_error()

    def _drafter_call(self, method, request_id: str, *args) -> None:
        """Calls the drafter for one request; if it fails, that request goes on without
        drafts (logged and counted) instead of failing the step and the batch."""
        if request_id in self._undrafted:
            return
        try:
            method(request_id, *args)
        except Exception:  # noqa: BLE001 - see _undrafted
            self._drafter_failed(method, request_id)

    def _drafter_failed(self, method, request_id: str) -> None:
        """``method`` of the drafter raised for ``request_id`` (called from an except
        block): logged and counted, and the request goes on without drafts."""
        log.exception("drafter.%s failed for %s; it decodes without drafts", method.__name__, request_id)
        self.metrics.on_drafter_error()
        self._undrafted.add(request_id)
        if method != self._drafter.stop_request:
            try:
                self._drafter.stop_request(request_id)
            except Exception:  # noqa: BLE001 - it may not have started
                pass

    def _validate(self, req: EngineRequest) -> None:
        vocab = self.model.config.vocab_size
        num_tokens = len(req.prompt_token_ids) + len(req.generated_token_ids)
        if req.request_id in self.seqs:
            raise ValueError(f"request_id: {req.request_id!r} is already in the engine")
        if not req.prompt_token_ids:
            raise ValueError("prompt_token_ids: empty prompt")
        if any(not 0 <= t < vocab for t in [*req.prompt_token_ids, *req.generated_token_ids]):
            raise ValueError(f"prompt_token_ids: token ids must be in [0, {vocab})")
        if num_tokens >= self.max_model_len:
            raise ValueError(f"prompt_token_ids: {num_tokens} prompt + generated tokens leave no room below "
                             f"max_position_embeddings={self.max_model_len}")
        if req.max_tokens <= len(req.generated_token_ids):
            raise ValueError(f"max_tokens: {req.max_tokens} <= {len(req.generated_token_ids)} tokens already generated")
        if req.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: {req.max_new_tokens} < 1")
        if not -2**63 <= req.seed < 2**63:
            raise ValueError(f"seed: {req.seed} does not fit in int64")
        check_sampling_values(req.temperature, req.top_p, req.top_k, req.min_p, req.max_tokens, req.min_tokens, "")
        if req.min_tokens > 0:  # the stop tokens masked until then, EOS among them unless ignore_eos (Sequence's set)
            masked = {t for t in req.stop_token_ids if 0 <= t < vocab} | (
                set() if req.ignore_eos else {t for t in self.model.config.eos_token_ids if 0 <= t < vocab})
            check_stops_leave_a_token(masked, req.min_tokens, vocab, "stop_token_ids")
        if req.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode: {req.logprobs_mode!r} is not one of {LOGPROBS_MODES}")
        bm = self.block_manager
        if bm.num_blocks_for(num_tokens + 1) > bm.num_blocks:
            raise ValueError(f"prompt_token_ids: needs {bm.num_blocks_for(num_tokens + 1)} KV blocks, "
                             f"the cache has {bm.num_blocks}")
        chunk_tokens = min(num_tokens + req.max_new_tokens, len(req.prompt_token_ids) + req.max_tokens,
                           self.max_model_len)
        if bm.num_blocks_for(chunk_tokens) > bm.num_blocks:
            raise ValueError(f"max_new_tokens: the chunk needs up to {bm.num_blocks_for(chunk_tokens)} KV blocks, "
                             f"the cache has {bm.num_blocks}")


def run_to_completion(engine, requests) -> dict[str, RequestOutput]:
    """Adds ``requests`` and steps ``engine`` (ours or the vLLM one: the same four calls)
    until nothing is left; the last output of each request by id."""
    for r in requests:
        engine.add_request(r)
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] = o
    return out


def cost_clock(device: torch.device) -> Callable[[], float]:
    """The clock a step's cost is read on, for the cost model's curve (only its shape
    matters: the draft budget compares costs). A GPU: wall time (the forward runs on the
    device; the step waits for its results). A CPU: the CPU time the step took, not wall
    time: the cores are shared (the other workers, the services, any other process), and
    wall time would write the machine's load into the curve's shape -- a 1-token step
    timed in a quiet moment beside 32-token steps timed while the fleet was busy makes
    every batch look past the flat part, and the draft budget flipped between none and
    hundreds of tokens from one run to the next (issue 29: a small step beside a huge
    one decoded a token per step in some runs, drafted 8 in others). The engine thread's
    time when torch computes in it alone, else the process's (its intra-op threads)."""
    if device.type != "cpu":
        return time.perf_counter
    return time.thread_time if torch.get_num_threads() == 1 else time.process_time


def _resolve_device(device, model) -> torch.device:
    """'auto': CUDA when there is one, else CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
