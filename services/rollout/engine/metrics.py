"""The engine's Prometheus series (defined in services/common/metrics.py), bound to one
worker label, plus plain counters that tests and benchmarks read without Prometheus."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.common import metrics as m


@dataclass
class EngineCounters:
    num_steps: int = 0
    num_prompt_tokens: int = 0  # tokens fed by prefill chunks (re-prefills included)
    num_generation_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_preemptions: int = 0
    num_draft_misses: int = 0
    num_drafter_errors: int = 0
    num_eager_forwards: int = 0  # forwards that replayed no CUDA graph (every forward on the CPU)
    num_tree_drafts: int = 0  # drafts that were trees (a branch somewhere): engine/tree.py
    num_tree_nodes: int = 0
    num_tree_accepted: int = 0
    tree_width_sum: int = 0  # over the tree drafts: most nodes at one depth
    tree_depth_sum: int = 0  # over the tree drafts: the deepest node's depth


TREE_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the batch-size label of the tree series


def batch_bucket(num_seqs: int) -> str:
    """The tree series' batch label: the smallest bucket holding ``num_seqs`` (or 'more')."""
    for b in TREE_BATCH_BUCKETS:
        if num_seqs <= b:
            return str(b)
    return "more"


class EngineMetrics:
    """The plain counters change at once. The Prometheus series too, unless ``deferred``:
    then their updates are held (``_export``) until ``flush``, which the engine calls
    after it has launched the next step's forward (the exports run while the device
    computes, not between the sampled tokens' read and the next launch) and when it
    goes idle, so a scrape sees a busy engine's series at most one step late."""

    def __init__(self, worker_id: str, deferred: bool = False):
        w = worker_id
        self.counters = EngineCounters()
        self.deferred = deferred
        self._pending: list[tuple] = []  # held exports: (function, args)
        self._pending_misses = 0
        self._drafts = m.spec_num_drafts.labels(w)
        self._draft_tokens = m.spec_num_draft_tokens.labels(w)
        self._accepted = m.spec_num_accepted_tokens.labels(w)
        self._per_pos = m.spec_num_accepted_tokens_per_pos
        self._worker = w
        self._generation = m.generation_tokens.labels(w)
        self._prompt = m.prompt_tokens.labels(w)
        self._running = m.num_requests_running.labels(w)
        self._waiting = m.num_requests_waiting.labels(w)
        self._kv = m.kv_cache_usage.labels(w)
        self._step = {kind: m.engine_step_seconds.labels(w, kind) for kind in ("prefill", "decode", "verify")}
        self._forwards = {mode: m.engine_forwards.labels(w, mode) for mode in ("graph", "eager")}
        self._busy = m.worker_busy_seconds.labels(w)
        self._misses = m.drafter_misses.labels(w)
        self._drafter_errors = m.drafter_errors.labels(w)
        self._tree_width = m.tree_width.labels(w)
        self._tree_depth = m.tree_depth.labels(w)
        # Every batch bucket's tree series exported from the start, at 0 while no tree was
        # verified (as the histograms above): a dashboard reads them whether or not trees
        # are on, rather than finding no series at all.
        for bucket in [*map(str, TREE_BATCH_BUCKETS), "more"]:
            for counter in (m.tree_drafts, m.tree_nodes, m.tree_accepted):
                counter.labels(w, bucket)

    def _export(self, fn, *args) -> None:
        if self.deferred:
            self._pending.append((fn, args))
        else:
            fn(*args)

    def flush(self) -> None:
        """Runs the held exports, in order (nothing when not ``deferred``)."""
        if self._pending_misses:
            self._misses.inc(self._pending_misses)
            self._pending_misses = 0
        pending, self._pending = self._pending, []
        for fn, args in pending:
            fn(*args)

    def on_draft_miss(self) -> None:
        """A decoding sequence got no draft this step (no match, or cut by the budget)."""
        self.counters.num_draft_misses += 1
        if self.deferred:
            self._pending_misses += 1  # one export for the step's misses
        else:
            self._misses.inc()

    def on_tree(self, width: int, depth: int) -> None:
        """A draft tree went into the step's forward (its shape)."""
        c = self.counters
        c.num_tree_drafts += 1
        c.tree_width_sum += width
        c.tree_depth_sum += depth
        self._export(self._tree_width.observe, width)
        self._export(self._tree_depth.observe, depth)

    def on_tree_verdicts(self, verdicts, num_seqs: int) -> None:
        """A step's tree verdicts (``path`` set), by the step's batch-size bucket: nodes
        verified and tokens accepted, where trees pay and where they do not."""
        trees = [v for v in verdicts if v.path is not None]
        if not trees:
            return
        nodes, accepted = sum(v.num_draft for v in trees), sum(v.num_accepted for v in trees)
        self.counters.num_tree_nodes += nodes
        self.counters.num_tree_accepted += accepted
        self._export(self._export_trees, len(trees), nodes, accepted, batch_bucket(num_seqs))

    def _export_trees(self, num_trees: int, nodes: int, accepted: int, bucket: str) -> None:
        m.tree_drafts.labels(self._worker, bucket).inc(num_trees)
        m.tree_nodes.labels(self._worker, bucket).inc(nodes)
        if accepted:
            m.tree_accepted.labels(self._worker, bucket).inc(accepted)

    def on_drafter_error(self) -> None:
        self.counters.num_drafter_errors += 1
        self._drafter_errors.inc()

    def on_verdicts(self, verdicts) -> None:
        """A step's verdicts (each with ``num_draft`` and ``num_accepted``): the drafts among
        them counted at once, the same totals as one update per draft for fewer calls."""
        drafted = [v for v in verdicts if v.num_draft]
        if drafted:
            self.on_accepted(len(drafted), sum(v.num_draft for v in drafted), sum(v.num_accepted for v in drafted),
                             [v.num_accepted for v in drafted])

    def on_accepted(self, num_drafts: int, num_draft_tokens: int, num_accepted: int,
                    accepted: np.ndarray | list[int]) -> None:
        """A step's drafts: how many, their tokens, the tokens accepted, and per sequence the
        tokens it accepted (a sequence without a draft: 0; an array or a list); the
        per-position series are made from ``accepted`` when exported (behind the next
        forward: no numpy call here)."""
        if num_drafts == 0:
            return
        self._count_verifies(num_drafts, num_draft_tokens, num_accepted)
        self._export(self._export_accepted, num_drafts, num_draft_tokens, num_accepted, accepted)

    def _export_accepted(self, num_drafts: int, num_draft_tokens: int, num_accepted: int,
                         accepted: np.ndarray | list[int]) -> None:
        at_least = np.bincount(accepted)[::-1].cumsum()[::-1]  # [k]: drafts that accepted >= k tokens
        self._export_verifies(num_drafts, num_draft_tokens, num_accepted, at_least[1:].tolist())

    def on_verifies(self, num_drafts: int, num_draft_tokens: int, num_accepted: int,
                    accepted_per_pos: list[int]) -> None:
        """Several verified drafts at once: vLLM reports a step's totals, not each draft."""
        if num_drafts == 0:
            return
        self._count_verifies(num_drafts, num_draft_tokens, num_accepted)
        self._export(self._export_verifies, num_drafts, num_draft_tokens, num_accepted, accepted_per_pos)

    def _count_verifies(self, num_drafts: int, num_draft_tokens: int, num_accepted: int) -> None:
        c = self.counters
        c.num_drafts += num_drafts
        c.num_draft_tokens += num_draft_tokens
        c.num_accepted_tokens += num_accepted

    def _export_verifies(self, num_drafts: int, num_draft_tokens: int, num_accepted: int,
                         accepted_per_pos: list[int]) -> None:
        self._drafts.inc(num_drafts)
        self._draft_tokens.inc(num_draft_tokens)
        if num_accepted:
            self._accepted.inc(num_accepted)
        for pos, n in enumerate(accepted_per_pos):
            if n:
                self._per_pos.labels(self._worker, str(pos)).inc(n)

    def on_step(self, kind: str, seconds: float, num_prompt_tokens: int, num_generation_tokens: int,
                num_running: int, num_waiting: int, kv_usage: float, graphed: bool | None = None) -> None:
        """graphed: whether the step's forward replayed a CUDA graph; None: not known (vLLM's
        engine keeps that to itself), not counted."""
        c = self.counters
        c.num_steps += 1
        if graphed is not None:
            c.num_eager_forwards += not graphed
        c.num_prompt_tokens += num_prompt_tokens
        c.num_generation_tokens += num_generation_tokens
        self._export(self._export_step, kind, seconds, num_prompt_tokens, num_generation_tokens, num_running,
                     num_waiting, kv_usage, graphed)

    def _export_step(self, kind: str, seconds: float, num_prompt_tokens: int, num_generation_tokens: int,
                     num_running: int, num_waiting: int, kv_usage: float, graphed: bool | None) -> None:
        if graphed is not None:
            self._forwards["graph" if graphed else "eager"].inc()
        if num_prompt_tokens:
            self._prompt.inc(num_prompt_tokens)
        if num_generation_tokens:
            self._generation.inc(num_generation_tokens)
        self._step[kind].observe(seconds)
        self._busy.inc(seconds)
        self._running.set(num_running)
        self._waiting.set(num_waiting)
        self._kv.set(kv_usage)
