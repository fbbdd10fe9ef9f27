"""The lockstep replay of recorded rollouts that every drafter in the benchmark goes through.

Every epoch (an RL step) in order: each prompt's earlier epochs are handed to the drafter
(`load_history`, for drafters that take it), every sample of the epoch starts, and all
of them advance together one verify step at a time, so a sibling only sees tokens its
siblings already committed. A draft token is accepted when it equals the token the trace
produced next (the lossless verifier reproduces the policy's tokens, so the trace is the
ground truth); each step commits the accepted tokens plus one bonus/recovered token.

One function, `replay`, drives every drafter (rhymerl's, vLLM's n-gram, vLLM's suffix
method) through the engine-facing calls (start_request, propose, the step's commits,
stop_request), so they are compared on exactly the same steps. The commits go as the
engines send them after a verify: every request's record_acceptance and add_tokens in
one `commit_step` call where the drafter has one (drafter_protocol.commit_step; else the
same calls one by one, in the same order), then the finished requests' stop_request. A
drafter with draft trees on (`tree_drafts`, services/rollout/engine/tree.py) is asked
`propose_trees`; a tree's accepted tokens are the path the engine's verifier would follow
(the trace's token at each depth), and every node counts as a verified draft token. The
tail columns count only the steps with at most `TAIL_BATCH` sequences left.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from services.rollout.drafter import DrafterConfig, NgramContext, propose_ngram
from services.rollout.engine.cost_model import CostModel
from services.rollout.engine.drafter_protocol import commit_step
from services.rollout.engine.tree import accept_path, depths, shape

MAX_TOKENS = 2048
HISTORY_EPOCHS = 3  # epochs of history loaded per prompt (ages 0..2)
NGRAM_MIN, NGRAM_MAX = 2, 4  # vLLM's prompt_lookup_min / prompt_lookup_max
EOS = 2
COST = CostModel()  # the engine's H100 curve for the 0.5B model (services/rollout/engine/cost_model.py)
TAIL_BATCH = 16  # the epoch's tail: steps with at most this many sequences left
MAX_TREE_NODES = 16  # a draft tree's nodes per sequence and step (the engine's max_draft_len)


class CollectorPauses:
    """The garbage collector's pauses so far (thread CPU time, read in a `gc.callbacks`
    callback), so that a timed span can be measured net of them. A collection scans the
    young objects of the whole process, and it starts inside whichever call allocates the
    object that crosses its threshold: in these replays, mostly inside `propose` (its
    result lists are the step's largest burst of allocations), whoever kept the objects
    that filled the young generation. Measured inside the spans, 50-60 µs gen-0 collections
    set the one-sequence step's p99 (they fall in about 1% of those steps), so the spans
    are reported net of them and the figures with them beside (`step_summary`)."""

    def __init__(self) -> None:
        self.ns = 0  # total pause so far
        self.count = 0  # collections so far
        self._start = 0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.thread_time_ns()
        else:
            self.ns += time.thread_time_ns() - self._start
            self.count += 1

    def mark(self) -> tuple[int, int]:
        """The pauses so far, read before a span (outside its clock reads) for ``since``."""
        return self.ns, self.count

    def since(self, mark: tuple[int, int]) -> tuple[int, int]:
        """(pause ns, collections) since ``mark``: what a span's clock reads included."""
        return self.ns - mark[0], self.count - mark[1]

    @classmethod
    def installed(cls) -> "CollectorPauses":
        pauses = cls()
        gc.callbacks.append(pauses._callback)
        return pauses


PAUSES = CollectorPauses.installed()  # (only collections run it: nothing on the timed path)
STEP_COLLECTOR = None  # the worker's collector, run where a step's forward runs (worker_gc)


def worker_gc() -> None:
    """Runs this process's garbage collector as a worker's runs (services.rollout.server's
    worker_collector at the worker's settings): start-up objects frozen, automatic
    collections deferred, and the replays run the due collections where the engine does,
    while the step's forward runs: after `propose`, before the step's commits (outside
    the timed spans). A benchmark's command line calls it; tests leave it off."""
    global STEP_COLLECTOR
    from services.rollout.server import worker_collector
    from services.rollout.settings import WorkerSettings

    STEP_COLLECTOR = worker_collector(WorkerSettings())  # (None: the setting empty, CPython's, as that worker)


def gc_policy() -> dict:
    """How this process's garbage collector ran (for the results)."""
    if STEP_COLLECTOR is None:
        return {"policy": "CPython's defaults: collections wherever Python allocates"}
    c = STEP_COLLECTOR
    return {"policy": "the worker's: start-up objects frozen, collections where the step's forward runs "
                      "(between propose and the commits), automatic ones deferred",
            "thresholds": [c.young, c.middle, c.old], "collections_behind_forward": list(c.collections)}


@dataclass
class Trace:
    """One sampled response (the fields of services.common.traces.TraceRecord we use)."""

    prompt_id: str
    epoch: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    reward: float


def synthetic_traces(num_prompts: int = 8, num_epochs: int = 4, num_samples: int = 8,
                     seed: int = 0) -> list[Trace]:
    """Structured step-by-step answers drifting over epochs.

    Per prompt: a plan of steps (a heavy-tailed count), each with 3 alternative
    phrasings (6-30 tokens, some quoting spans of the prompt) and a "good" one that earns
    reward. A sample picks a phrasing per step (copying a random earlier-epoch parent's
    choice 60% of the time, else from the policy's probabilities), sometimes repeats a
    step (self-verification: heavier tail), then suffers sampling noise: 6% of tokens
    substituted, occasional inserted spans. Between epochs the policy moves toward the
    good phrasings (GRPO-like) and phrasings mutate slightly (policy drift).
    """
    rng = np.random.default_rng(seed)
    vocab, marker, answer = 6000, 3, 4
    traces = []
    for p in range(num_prompts):
        topic = rng.choice(np.arange(16, vocab), size=400, replace=False)
        prompt = rng.choice(topic, size=int(rng.integers(40, 160))).tolist()
        num_steps = int(min(48, 3 + rng.pareto(1.2) * 4))
        phrasings, probs, good = [], [], []
        for s in range(num_steps):
            options = []
            for _ in range(3):
                body = rng.choice(topic, size=int(rng.integers(6, 30))).tolist()
                if rng.random() < 0.5:
                    at = int(rng.integers(0, len(prompt) - 4))
                    cut = int(rng.integers(0, len(body)))
                    body[cut:cut] = prompt[at:at + 4]
                options.append([marker, 5 + s % 11] + body)
            phrasings.append(options)
            probs.append(rng.dirichlet([1.0, 1.0, 1.0]))
            good.append(int(rng.integers(0, 3)))
        final = [answer] + prompt[-5:] + [EOS]
        parents: list[list[int]] = []
        for epoch in range(num_epochs):
            chosen_this_epoch = []
            for n in range(num_samples):
                parent = parents[int(rng.integers(len(parents)))] if parents else None
                choices = [parent[s] if parent is not None and rng.random() < 0.6
                           else int(rng.choice(3, p=probs[s])) for s in range(num_steps)]
                chosen_this_epoch.append(choices)
                tokens: list[int] = []
                for s, c in enumerate(choices):
                    segment = list(phrasings[s][c])
                    if rng.random() < 0.05:
                        at = int(rng.integers(0, len(segment)))
                        segment[at:at] = rng.choice(topic, size=int(rng.integers(1, 7))).tolist()
                    repeats = 1 + (int(rng.geometric(0.4)) if rng.random() < 0.08 else 0)
                    tokens += segment * repeats
                arr = np.array(tokens, dtype=np.int64)
                noise = rng.random(len(arr)) < 0.06
                arr[noise] = rng.choice(topic, size=int(noise.sum()))
                tokens = (arr.tolist() + final)[:MAX_TOKENS]
                score = np.mean([c == g for c, g in zip(choices, good)])
                reward = float(score > 0.5) + 0.1 * float(rng.normal())
                traces.append(Trace(f"p{p}", epoch, n, prompt, tokens, reward))
            for s in range(num_steps):  # policy update toward the good phrasing
                probs[s] = probs[s] * np.exp(0.5 * (np.arange(3) == good[s]))
                probs[s] /= probs[s].sum()
                if rng.random() < 0.1:
                    option = phrasings[s][int(rng.integers(0, 3))]
                    option[int(rng.integers(2, len(option)))] = int(rng.choice(topic))
            parents = chosen_this_epoch
    return traces


def check_trace_files(parser: argparse.ArgumentParser, paths: list[str] | None) -> None:
    """A trace file that is not there is a usage error naming it, before anything runs (not
    a FileNotFoundError traceback once the replays before it were done)."""
    missing = [path for path in paths or [] if not Path(path).is_file()]
    if missing:
        parser.error(f"--traces: no such file: {', '.join(missing)}")


def load_traces(path: str) -> list[Trace]:
    from services.common.traces import read_traces

    return [Trace(r.prompt_id, int(r.epoch), int(r.sample_index),
                  np.asarray(r.prompt_token_ids).tolist(), np.asarray(r.token_ids).tolist(),
                  float(r.reward)) for r in read_traces(path)]


def stop_token(traces: list[Trace]) -> int | None:
    """The token most responses end with (their EOS), if at least half do."""
    finals = Counter(t.token_ids[-1] for t in traces if t.token_ids)
    token, count = finals.most_common(1)[0] if finals else (None, 0)
    return token if count >= len(traces) // 2 else None


class NgramDrafter:
    """vLLM's n-gram prompt lookup behind the engine-facing drafter calls."""

    def __init__(self, draft_len: int) -> None:
        self.draft_len = draft_len
        self.contexts: dict[str, NgramContext] = {}

    def start_request(self, request_id: str, prompt_id: str, prompt: list[int], generated=()) -> None:
        self.contexts[request_id] = NgramContext(prompt)

    def propose(self, request_ids, max_lens, stop_token_ids=None, budget=None):
        return [propose_ngram(self.contexts[r], min(self.draft_len, m), NGRAM_MIN, NGRAM_MAX)
                for r, m in zip(request_ids, max_lens)]

    def add_tokens(self, request_id: str, tokens: list[int]) -> None:
        self.contexts[request_id].extend(tokens)

    def record_acceptance(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        pass

    def stop_request(self, request_id: str) -> None:
        del self.contexts[request_id]


class CrossingFloor:
    """The floor under a drafter's timed calls in this replay: each `propose` and
    `commit_step` crosses into the compiled core's library once through ctypes, as
    CompiledDrafter's do (a call bound to the drafter's handle), and does nothing else: no
    drafts, nothing committed. Its step times are what the clock reads, the Python calls
    and one empty crossing each cost on this machine, below any drafter's (the lifecycle
    calls go to a real CompiledDrafter, untimed)."""

    def __init__(self) -> None:
        from services.rollout.drafter.compiled import CompiledDrafter

        self._real = real = CompiledDrafter(DrafterConfig())
        self._cross = partial(real._lib.rhd_global_tokens, real._handle)  # (adds up two counters)
        for name in ("start_request", "stop_request", "load_history", "memory_tokens", "memory_bytes",
                     "release_prompt", "add_global_responses"):
            setattr(self, name, getattr(real, name))

    def propose(self, request_ids, max_lens, stop_token_ids=None, budget=None, num_seqs=None) -> list[list[int]]:
        self._cross()
        return [[] for _ in request_ids]

    def commit_step(self, request_ids, num_draft, num_accepted, token_ids, num_tokens) -> None:
        self._cross()


def plain_ms(lengths: list[int]) -> float:
    """Verify-free decode time of one epoch: one token per sequence per step."""
    counts = np.bincount(np.asarray(lengths, dtype=np.int64))  # [max_len + 1]
    alive = len(lengths) - np.cumsum(counts)[:-1]  # sequences still running at each step
    return float(sum(COST.step_ms(int(n)) for n in alive[alive > 0]))


def modeled_speedup(batch_size: int, draft_per_verify: float, accepted_per_verify: float) -> float:
    """Rollout speedup at a steady batch of `batch_size` decoding sequences, each carrying
    `draft_per_verify` draft tokens and gaining 1 + `accepted_per_verify` tokens per verify
    step, on the engine's cost curve: (time per token without drafts) / (with them)."""
    plain = COST.step_ms(batch_size) / batch_size
    spec = COST.step_ms(round(batch_size * (1 + draft_per_verify))) / (batch_size * (1 + accepted_per_verify))
    return plain / spec


def replay(traces: list[Trace], make_drafter: Callable[[], object], stop: int | None, name: str = "",
           num_seqs: int | None = None, drafts_log: list | None = None) -> dict:
    """Replays every epoch in order through a fresh drafter from `make_drafter` and
    returns the row of measurements (`name` labels it). With `num_seqs`, rhymerl's drafter
    prices its drafts as if every step's forward held that many sequences. `drafts_log`
    gets every propose's drafts (to compare two drafters draft for draft)."""
    by_epoch: dict[int, list[Trace]] = defaultdict(list)
    for t in traces:
        by_epoch[t.epoch].append(t)
    history: dict[str, list[tuple[int, list[int], float]]] = defaultdict(list)
    drafter = make_drafter()
    at_batch = {"num_seqs": num_seqs} if num_seqs else {}
    load_history = getattr(drafter, "load_history", None)
    # As the worker does: each response that finishes feeds the drafter's global index.
    add_global = getattr(drafter, "add_global_responses", None)
    # The compiled drafter stages commits and applies them in one call (flush): timed as commits.
    flush = getattr(drafter, "flush", None)
    stops = frozenset([stop]) if stop is not None else frozenset()
    trees_on = bool(getattr(drafter, "tree_drafts", False)) and callable(getattr(drafter, "propose_trees", None))
    num_steps = num_committed = num_drafted = num_accepted = 0
    tail_steps = tail_drafted = tail_accepted = 0
    tree_shapes: list[tuple[int, int]] = []  # (width, depth) of each tree draft
    propose_ns: list[float] = []
    add_ns: list[float] = []
    spec_ms = no_spec_ms = 0.0
    memory: list[int] = []
    memory_bytes: list[int] = []
    global_tokens = 0
    load_ns = load_tokens = 0
    calls: list[tuple[int, int, int]] = []  # (ns, sequences, draft tokens) per propose call
    steps: list[tuple[int, int, int]] = []  # (sequences, propose ns, commit ns) per step, net of collections
    gross: list[tuple[int, int, int]] = []  # the same with the collector's pauses inside the spans
    gc_count = gc_ns = 0  # collections inside the timed spans, their pause
    for epoch in sorted(by_epoch):
        records = by_epoch[epoch]
        prompt_ids = sorted({t.prompt_id for t in records})
        if load_history is not None:
            for pid in prompt_ids:
                earlier = [h for h in history[pid] if epoch - h[0] <= HISTORY_EPOCHS]
                start = time.thread_time_ns()
                load_history(pid, [h[1] for h in earlier], epoch_ages=[epoch - h[0] - 1 for h in earlier],
                             rewards=[h[2] for h in earlier])
                load_ns += time.thread_time_ns() - start
                load_tokens += drafter.memory_tokens(pid)
        truth, pos = {}, {}
        for t in records:
            rid = f"{t.prompt_id}/{t.epoch}/{t.sample_index}"
            truth[rid], pos[rid] = t.token_ids, 0
            drafter.start_request(rid, t.prompt_id, t.prompt_token_ids)
        active = [rid for rid in truth if truth[rid]]
        while active:
            max_lens = [MAX_TOKENS - pos[r] - 1 for r in active]
            mark = PAUSES.mark()
            start = time.thread_time_ns()
            if trees_on:
                trees = drafter.propose_trees(active, max_lens, [stops] * len(active), max_nodes=MAX_TREE_NODES,
                                              **at_batch)
                drafts = [tokens for tokens, _ in trees]
            else:
                drafts = drafter.propose(active, max_lens, [stops] * len(active), **at_batch)
                trees = None
            gross_propose = time.thread_time_ns() - start
            pause, collections = PAUSES.since(mark)
            elapsed = gross_propose - pause
            gc_count, gc_ns = gc_count + collections, gc_ns + pause
            if STEP_COLLECTOR is not None:  # the worker's collections, while the step's forward runs
                STEP_COLLECTOR()
            if drafts_log is not None:
                drafts_log.append(drafts)
            propose_ns.append(elapsed / len(active))
            num_draft_tokens = sum(map(len, drafts))
            calls.append((elapsed, len(active), num_draft_tokens))
            spec_ms += COST.step_ms(len(active) + num_draft_tokens)
            still, finished = [], []
            commit_ids, commit_draft, commit_accepted, commit_tokens, commit_counts = [], [], [], [], []
            tree_commits = []
            tail = len(active) <= TAIL_BATCH
            for i, (rid, draft) in enumerate(zip(active, drafts)):
                seq, p = truth[rid], pos[rid]
                parents = trees[i][1] if trees is not None and draft else None
                if parents is None:
                    accepted = 0
                    while accepted < len(draft) and p + accepted < len(seq) and draft[accepted] == seq[p + accepted]:
                        accepted += 1
                else:  # the verifier's walk: the trace's token at each depth is the sampled one
                    sampled = [seq[p + d] if p + d < len(seq) else -1 for d in [0] + depths(parents)]
                    path = accept_path(draft, parents, sampled)
                    accepted = len(path)
                    tree_shapes.append(shape(parents))
                committed = seq[p:p + accepted + 1]
                commit_ids.append(rid)
                if parents is None:
                    commit_draft.append(len(draft))
                    commit_accepted.append(accepted)
                else:
                    commit_draft.append(0)
                    commit_accepted.append(0)
                    tree_commits.append((rid, parents, path))
                commit_tokens += committed
                commit_counts.append(len(committed))
                if tail:
                    tail_steps += 1
                    tail_drafted += len(draft)
                    tail_accepted += accepted
                num_steps += 1
                num_committed += len(committed)
                num_drafted += len(draft)
                num_accepted += accepted
                pos[rid] = p + len(committed)
                if pos[rid] < len(seq):
                    still.append(rid)
                else:
                    finished.append((rid, seq))
            mark = PAUSES.mark()
            start = time.thread_time_ns()
            for rid, parents, path in tree_commits:  # (a tree's acceptance and the request's tokens commute)
                drafter.record_tree_acceptance(rid, parents, path)
            commit_step(drafter, commit_ids, commit_draft, commit_accepted, commit_tokens, commit_counts)
            if flush is not None:
                flush()
            gross_commit = time.thread_time_ns() - start
            pause, collections = PAUSES.since(mark)
            add_time = gross_commit - pause
            gc_count, gc_ns = gc_count + collections, gc_ns + pause
            for rid, seq in finished:
                drafter.stop_request(rid)
                if add_global is not None:
                    add_global([seq])
            add_ns.append(add_time / len(active))
            steps.append((len(active), elapsed, add_time))
            gross.append((len(active), gross_propose, gross_commit))
            active = still
        no_spec_ms += plain_ms([len(s) for s in truth.values()])
        if load_history is not None:
            memory += [drafter.memory_tokens(pid) for pid in prompt_ids]
            memory_bytes += [drafter.memory_bytes(pid) for pid in prompt_ids]
            for pid in prompt_ids:
                drafter.release_prompt(pid)
        if hasattr(drafter, "global_tokens"):
            global_tokens = max(global_tokens, drafter.global_tokens())
        for t in records:
            history[t.prompt_id].append((t.epoch, t.token_ids, t.reward))
    # propose time ~ a * sequences + b * draft tokens (least squares over the calls)
    per_seq_ns = per_token_ns = 0.0
    if calls:
        ns, num_seqs, num_tokens = np.array(calls, dtype=np.float64).T  # [num_calls] each
        (per_seq_ns, per_token_ns), *_ = np.linalg.lstsq(np.c_[num_seqs, num_tokens], ns, rcond=None)
    propose_ns = propose_ns or [0.0]
    add_ns = add_ns or [0.0]
    return {
        "config": name,
        "propose_us_per_seq_fit": per_seq_ns / 1e3,
        "propose_us_per_draft_token_fit": per_token_ns / 1e3,
        "num_tokens": num_committed,
        "num_verify_steps": num_steps,
        "mean_accepted_per_step": num_committed / max(1, num_steps),
        # the same without the bonus/recovered token: accepted draft tokens per verify step
        "mean_accepted_drafts_per_step": num_accepted / max(1, num_steps),
        "acceptance_rate": num_accepted / max(1, num_drafted),
        "draft_tokens_per_step": num_drafted / max(1, num_steps),
        # the epoch's tail (steps with <= TAIL_BATCH sequences): accepted and verified draft
        # tokens per sequence and verify step
        "tail_num_verify_steps": tail_steps,
        "tail_mean_accepted_drafts_per_step": tail_accepted / max(1, tail_steps),
        "tail_draft_tokens_per_step": tail_drafted / max(1, tail_steps),
        "num_tree_drafts": len(tree_shapes),
        "tree_width_mean": float(np.mean([w for w, _ in tree_shapes])) if tree_shapes else None,
        "tree_depth_mean": float(np.mean([d for _, d in tree_shapes])) if tree_shapes else None,
        "propose_us_p50": float(np.percentile(propose_ns, 50)) / 1e3,
        "propose_us_p90": float(np.percentile(propose_ns, 90)) / 1e3,
        "propose_us_p99": float(np.percentile(propose_ns, 99)) / 1e3,
        "load_history_us_per_token": load_ns / 1e3 / load_tokens if load_tokens else 0.0,
        "add_us_p50": float(np.percentile(add_ns, 50)) / 1e3,
        "add_us_p99": float(np.percentile(add_ns, 99)) / 1e3,
        "memory_tokens_mean": float(np.mean(memory)) if memory else 0.0,
        "memory_tokens_max": int(max(memory)) if memory else 0,
        "memory_bytes_per_token": float(sum(memory_bytes) / sum(memory)) if memory and sum(memory) else 0.0,
        "global_tokens_max": global_tokens,
        "cost_model_speedup": no_spec_ms / spec_ms if spec_ms else 0.0,
        "drafter_step_us": step_summary(steps, gross, gc_count, gc_ns),
    }


def step_summary(steps: list[tuple[int, int, int]], gross: list[tuple[int, int, int]] | None = None,
                 gc_count: int = 0, gc_ns: int = 0) -> dict:
    """The drafter's host time per engine step (thread CPU time), as issue 24 states its
    targets: per sequence per step over the steps with >= 16 sequences (propose, and the
    commits after the verify: the step's commit_step, or its add_tokens and
    record_acceptance calls, and a flush, timed together), the drafter's whole time per
    step with >= 100 sequences, and a one-sequence step's; and propose per sequence over the
    tail's steps (<= TAIL_BATCH sequences: where draft trees are drafted).

    `steps` are timed net of the garbage collector's pauses inside them (CollectorPauses);
    `gross`, the same spans with those pauses, gives the same figures under "with_gc",
    beside the number of collections inside the spans and their total pause."""
    big = [(n, p, c) for n, p, c in steps if n >= 16]
    tail = [p / n / 1e3 for n, p, _ in steps if n <= TAIL_BATCH]
    huge = [(p + c) / 1e6 for n, p, c in steps if n >= 100]
    one = [(p + c) / 1e3 for n, p, c in steps if n == 1]

    def pct(values: list[float], q: float) -> float | None:
        return float(np.percentile(values, q)) if values else None

    out = {
        "num_steps_16plus": len(big),
        "propose_p50": pct([p / n / 1e3 for n, p, _ in big], 50),
        "propose_p99": pct([p / n / 1e3 for n, p, _ in big], 99),
        "commit_p50": pct([c / n / 1e3 for n, _, c in big], 50),
        "commit_p99": pct([c / n / 1e3 for n, _, c in big], 99),
        "num_steps_100plus": len(huge),
        "step_ms_100plus": float(np.mean(huge)) if huge else None,
        "num_one_seq_steps": len(one),
        "one_seq_p99": pct(one, 99),
        "num_tail_steps": len(tail),
        "tail_propose_p50": pct(tail, 50),
        "tail_propose_p99": pct(tail, 99),
    }
    if gross is not None:
        with_gc = step_summary(gross)
        out["with_gc"] = {k: with_gc[k] for k in ("propose_p50", "propose_p99", "commit_p50", "commit_p99",
                                                   "step_ms_100plus", "one_seq_p99")}
        out["gc_collections_in_spans"] = gc_count
        out["gc_ms_in_spans"] = gc_ns / 1e6
    return out
