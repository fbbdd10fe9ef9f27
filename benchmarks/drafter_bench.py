"""How many tokens per verify step do history + sibling drafts give, versus n-gram lookup?

Replays multi-epoch rollout traces through the drafters as the engine would drive them:
every epoch (a step), all samples of all prompts advance together, one verify step at a
time, so a sibling only sees tokens its siblings already committed. A draft token is
accepted when it equals the token the trace actually produced next (the lossless
verifier reproduces the policy's tokens, so the trace is the ground truth); each step
commits the accepted tokens plus one bonus/recovered token.

Compared side by side: (a) vLLM-style n-gram prompt lookup, (b) history only,
(c) siblings only, (d) history + siblings + prompt (also with reward weighting), each at
fixed draft lengths and adaptive (per-token gains, cap 16, trimmed by the 0.5B H100
cost curve).
Also: drafting time per sequence per step (p50/p99), index memory per prompt, and the
step time the cost curve predicts relative to no speculation.

    python -m benchmarks.drafter_bench [--traces PATH] [--out benchmarks/results]
    python -m benchmarks.drafter_bench --traces benchmarks/data/tiny_grpo_service.npz  # committed

Without --traces (or when PATH does not exist) a synthetic trace set is generated: a
drifting template process (see `synthetic_traces`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.provenance import cpu_name, git_commit
from benchmarks.report import markdown_table
from services.rollout.drafter import (
    QWEN2_5_0_5B_H100,
    HistoDrafter,
    NgramContext,
    propose_ngram,
)

MAX_TOKENS = 2048
HISTORY_EPOCHS = 3  # epochs of history loaded per prompt (ages 0..2)
NGRAM_MIN, NGRAM_MAX = 2, 4  # vLLM's prompt_lookup_min / prompt_lookup_max
EOS = 2


@dataclass
class Trace:
    """One sampled response (the fields of benchmarks.traces.TraceRecord we use)."""

    prompt_id: str
    epoch: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    reward: float


# -- synthetic traces -------------------------------------------------------------------


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


def load_traces(path: str) -> list[Trace]:
    from benchmarks.traces import read_traces

    return [Trace(r.prompt_id, int(r.epoch), int(r.sample_index),
                  np.asarray(r.prompt_token_ids).tolist(), np.asarray(r.token_ids).tolist(),
                  float(r.reward)) for r in read_traces(path)]


# -- replay -----------------------------------------------------------------------------


@dataclass
class Config:
    name: str
    source: str  # ngram | history | siblings | all
    draft_len: int | None  # None = adaptive
    reward_weighting: bool = False

    def make_drafter(self) -> HistoDrafter:
        sources = {"history": (True, False, False), "siblings": (False, True, False),
                   "all": (True, True, True)}[self.source]
        use_history, use_siblings, use_prompt = sources
        common = {"use_history": use_history, "use_siblings": use_siblings,
                  "use_prompt": use_prompt, "reward_weighting": self.reward_weighting}
        if self.draft_len is None:
            return HistoDrafter(max_draft_len=16, cost_curve=QWEN2_5_0_5B_H100, **common)
        return HistoDrafter(max_draft_len=self.draft_len, min_prob=0.0, min_gain=0.0, **common)


class NgramEngine:
    """The n-gram baseline behind the same calls the replay makes on HistoDrafter."""

    def __init__(self, draft_len: int) -> None:
        self.draft_len = draft_len
        self.contexts: dict[str, NgramContext] = {}

    def start(self, request_id: str, prompt: list[int]) -> None:
        self.contexts[request_id] = NgramContext(prompt)

    def propose(self, request_ids, max_lens):
        return [propose_ngram(self.contexts[r], min(self.draft_len, m), NGRAM_MIN, NGRAM_MAX)
                for r, m in zip(request_ids, max_lens)]

    def add(self, request_id: str, tokens: list[int]) -> None:
        self.contexts[request_id].extend(tokens)


def _plain_ms(lengths: list[int]) -> float:
    """Verify-free decode time of one epoch: one token per sequence per step."""
    counts = np.bincount(np.asarray(lengths, dtype=np.int64))  # [max_len + 1]
    alive = len(lengths) - np.cumsum(counts)[:-1]  # sequences still running at each step
    return float(QWEN2_5_0_5B_H100.many(alive[alive > 0]).sum())


def replay(traces: list[Trace], config: Config, stop_token: int | None) -> dict:
    """Replays every epoch in order (each a step: history loaded, all samples advanced
    together one verify step at a time) and returns the row of measurements."""
    by_epoch: dict[int, list[Trace]] = defaultdict(list)
    for t in traces:
        by_epoch[t.epoch].append(t)
    history: dict[str, list[tuple[int, list[int], float]]] = defaultdict(list)
    drafter = config.make_drafter() if config.source != "ngram" else None
    ngram = NgramEngine(config.draft_len or 0) if drafter is None else None
    stops = frozenset([stop_token]) if stop_token is not None else frozenset()
    num_steps = num_committed = num_drafted = num_accepted = 0
    propose_ns: list[float] = []
    add_ns: list[float] = []
    spec_ms = plain_ms = 0.0
    memory: list[int] = []
    memory_bytes: list[int] = []
    load_ns = load_tokens = 0
    calls: list[tuple[int, int, int]] = []  # (ns, sequences, draft tokens) per propose call
    for epoch in sorted(by_epoch):
        records = by_epoch[epoch]
        prompt_ids = sorted({t.prompt_id for t in records})
        if drafter is not None:
            for pid in prompt_ids:
                earlier = [h for h in history[pid] if epoch - h[0] <= HISTORY_EPOCHS]
                start = time.thread_time_ns()
                drafter.load_history(pid, [h[1] for h in earlier],
                                     epoch_ages=[epoch - h[0] - 1 for h in earlier],
                                     rewards=[h[2] for h in earlier])
                load_ns += time.thread_time_ns() - start
                load_tokens += drafter.memory_tokens(pid)
        truth, pos = {}, {}
        for t in records:
            rid = f"{t.prompt_id}/{t.epoch}/{t.sample_index}"
            truth[rid], pos[rid] = t.token_ids, 0
            if drafter is not None:
                drafter.start_request(rid, t.prompt_id, t.prompt_token_ids)
            else:
                ngram.start(rid, t.prompt_token_ids)
        active = [rid for rid in truth if truth[rid]]
        while active:
            max_lens = [MAX_TOKENS - pos[r] - 1 for r in active]
            start = time.thread_time_ns()
            if drafter is not None:
                drafts = drafter.propose(active, max_lens, [stops] * len(active))
            else:
                drafts = ngram.propose(active, max_lens)
            elapsed = time.thread_time_ns() - start
            propose_ns.append(elapsed / len(active))
            num_draft_tokens = sum(map(len, drafts))
            calls.append((elapsed, len(active), num_draft_tokens))
            spec_ms += QWEN2_5_0_5B_H100(len(active) + num_draft_tokens)
            still, add_time = [], 0
            for rid, draft in zip(active, drafts):
                seq, p = truth[rid], pos[rid]
                accepted = 0
                while accepted < len(draft) and p + accepted < len(seq) and draft[accepted] == seq[p + accepted]:
                    accepted += 1
                committed = seq[p:p + accepted + 1]
                start = time.thread_time_ns()
                if drafter is not None:
                    drafter.add_tokens(rid, committed)
                    drafter.record_acceptance(rid, len(draft), accepted)
                else:
                    ngram.add(rid, committed)
                add_time += time.thread_time_ns() - start
                num_steps += 1
                num_committed += len(committed)
                num_drafted += len(draft)
                num_accepted += accepted
                pos[rid] = p + len(committed)
                if pos[rid] < len(seq):
                    still.append(rid)
                elif drafter is not None:
                    drafter.stop_request(rid)
            add_ns.append(add_time / len(active))
            active = still
        plain_ms += _plain_ms([len(s) for s in truth.values()])
        if drafter is not None:
            memory += [drafter.memory_tokens(pid) for pid in prompt_ids]
            memory_bytes += [drafter.memory_bytes(pid) for pid in prompt_ids]
            for pid in prompt_ids:
                drafter.release_prompt(pid)
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
        "config": config.name,
        "propose_us_per_seq_fit": per_seq_ns / 1e3,
        "propose_us_per_draft_token_fit": per_token_ns / 1e3,
        "num_tokens": num_committed,
        "num_verify_steps": num_steps,
        "mean_accepted_per_step": num_committed / max(1, num_steps),
        # the same without the bonus/recovered token: accepted draft tokens per verify step
        "mean_accepted_drafts_per_step": num_accepted / max(1, num_steps),
        "acceptance_rate": num_accepted / max(1, num_drafted),
        "draft_tokens_per_step": num_drafted / max(1, num_steps),
        "propose_us_p50": float(np.percentile(propose_ns, 50)) / 1e3,
        "propose_us_p90": float(np.percentile(propose_ns, 90)) / 1e3,
        "propose_us_p99": float(np.percentile(propose_ns, 99)) / 1e3,
        "load_history_us_per_token": load_ns / 1e3 / load_tokens if load_tokens else 0.0,
        "add_us_p50": float(np.percentile(add_ns, 50)) / 1e3,
        "add_us_p99": float(np.percentile(add_ns, 99)) / 1e3,
        "memory_tokens_mean": float(np.mean(memory)) if memory else 0.0,
        "memory_tokens_max": int(max(memory)) if memory else 0,
        "memory_bytes_per_token": float(sum(memory_bytes) / sum(memory)) if memory and sum(memory) else 0.0,
        "cost_model_speedup": plain_ms / spec_ms if spec_ms else 0.0,
    }


def configs() -> list[Config]:
    out = []
    for source in ("ngram", "history", "siblings", "all"):
        for k in (4, 8, 16, None):
            if source == "ngram" and k is None:
                continue
            out.append(Config(f"{source}/{'adaptive' if k is None else k}", source, k))
    out.append(Config("all+reward/16", "all", 16, reward_weighting=True))
    out.append(Config("all+reward/adaptive", "all", None, reward_weighting=True))
    return out


def _stop_token(traces: list[Trace]) -> int | None:
    finals = Counter(t.token_ids[-1] for t in traces if t.token_ids)
    token, count = finals.most_common(1)[0] if finals else (None, 0)
    return token if count >= len(traces) // 2 else None


COLUMNS = [  # (header, result key, format)
    ("config", "config", "{}"),
    ("acc/step", "mean_accepted_per_step", "{:.2f}"),
    ("acc drafts/step", "mean_accepted_drafts_per_step", "{:.2f}"),
    ("acc rate", "acceptance_rate", "{:.2f}"),
    ("draft/step", "draft_tokens_per_step", "{:.1f}"),
    ("propose p50 µs", "propose_us_p50", "{:.1f}"),
    ("propose p99 µs", "propose_us_p99", "{:.1f}"),
    ("fit µs/seq", "propose_us_per_seq_fit", "{:.1f}"),
    ("fit µs/draft tok", "propose_us_per_draft_token_fit", "{:.2f}"),
    ("add p50 µs", "add_us_p50", "{:.1f}"),
    ("add p99 µs", "add_us_p99", "{:.1f}"),
    ("load µs/tok", "load_history_us_per_token", "{:.1f}"),
    ("mem tok/prompt", "memory_tokens_mean", "{:.0f}"),
    ("B/tok", "memory_bytes_per_token", "{:.0f}"),
    ("cost-model speedup", "cost_model_speedup", "{:.2f}"),
]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", help="trace file (benchmarks.traces format); default: synthetic")
    parser.add_argument("--out", default="benchmarks/results", help="where drafter.md/.json go")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=None,
                        help="prompts to replay (synthetic: generated, default 8; traces: the first N)")
    parser.add_argument("--samples", type=int, default=8, help="synthetic samples per prompt")
    parser.add_argument("--epochs", type=int, default=4, help="synthetic epochs")
    args = parser.parse_args(argv)
    if args.traces and Path(args.traces).exists():
        traces, source = load_traces(args.traces), args.traces
        if args.prompts is not None:
            keep = set(sorted({t.prompt_id for t in traces})[:args.prompts])
            traces = [t for t in traces if t.prompt_id in keep]
    else:
        if args.traces:
            print(f"{args.traces} does not exist: replaying synthetic traces", file=sys.stderr)
        num_prompts = args.prompts or 8
        traces = synthetic_traces(num_prompts, args.epochs, args.samples, seed=args.seed)
        source = f"synthetic(prompts={num_prompts}, samples={args.samples}, epochs={args.epochs}, seed={args.seed})"
    stop_token = _stop_token(traces)
    started, load_before = time.time(), os.getloadavg()[0]
    rows = []
    for config in configs():
        rows.append(replay(traces, config, stop_token))
        print(f"  {config.name}: {rows[-1]['mean_accepted_per_step']:.2f} tokens/step", file=sys.stderr)
    by_name = {r["config"]: r for r in rows}
    best_ngram = max(by_name[f"ngram/{k}"]["mean_accepted_per_step"] for k in (4, 8, 16))
    ratio_16 = by_name["all/16"]["mean_accepted_per_step"] / best_ngram
    findings = {
        "history_siblings_vs_best_ngram": ratio_16,
        "adaptive_vs_fixed16_cost_model": by_name["all/adaptive"]["cost_model_speedup"]
        / by_name["all/16"]["cost_model_speedup"],
        "reward_weighting_delta_acc_per_step_16": by_name["all+reward/16"]["mean_accepted_per_step"]
        - by_name["all/16"]["mean_accepted_per_step"],
        "reward_weighting_delta_acc_per_step_adaptive": by_name["all+reward/adaptive"]["mean_accepted_per_step"]
        - by_name["all/adaptive"]["mean_accepted_per_step"],
    }
    # The headline figures (accepted draft tokens per verify step, bonus token
    # excluded), each source at its best setting; "rhymerl" = history + siblings + prompt.
    def best(source: str, settings) -> dict:
        return max((by_name[f"{source}/{k}"] for k in settings),
                   key=lambda r: r["mean_accepted_drafts_per_step"])

    best_ngram_row = best("ngram", (4, 8, 16))
    best_rhymerl_row = best("all", (4, 8, 16, "adaptive"))
    headline = {
        "ngram_mean_accepted": best_ngram_row["mean_accepted_drafts_per_step"],
        "ngram_best_config": best_ngram_row["config"],
        "rhymerl_mean_accepted": best_rhymerl_row["mean_accepted_drafts_per_step"],
        "rhymerl_best_config": best_rhymerl_row["config"],
        "rhymerl_mean_accepted_fixed": {str(k): by_name[f"all/{k}"]["mean_accepted_drafts_per_step"]
                                        for k in (4, 8, 16)},
        "rhymerl_mean_accepted_adaptive": by_name["all/adaptive"]["mean_accepted_drafts_per_step"],
        "rhymerl_vs_ngram_mean_accepted": best_rhymerl_row["mean_accepted_drafts_per_step"]
        / max(1e-12, best_ngram_row["mean_accepted_drafts_per_step"]),
        # drafting time per sequence per step (one propose call over the batch / its
        # size), at rhymerl's best setting; the worst p99 over its settings alongside
        "drafting_us_p50": best_rhymerl_row["propose_us_p50"],
        "drafting_us_p99": best_rhymerl_row["propose_us_p99"],
        "drafting_config": best_rhymerl_row["config"],
        "drafting_us_p99_worst_rhymerl_setting": max(by_name[f"all/{k}"]["propose_us_p99"]
                                                     for k in (4, 8, 16, "adaptive")),
        # index updates (add_tokens + record_acceptance) per sequence per step, same row
        "index_update_us_p50": best_rhymerl_row["add_us_p50"],
        "index_update_us_p99": best_rhymerl_row["add_us_p99"],
    }
    summary = {
        **headline,
        "traces": source,
        "num_traces": len(traces),
        "num_prompts": len({t.prompt_id for t in traces}),
        "num_epochs": len({t.epoch for t in traces}),
        "mean_response_tokens": float(np.mean([len(t.token_ids) for t in traces])),
        "findings": findings,
        "cpu": cpu_name(),
        "device": "CPU, one core (drafting is host-side)",
        "python": platform.python_version(),
        "git_commit": git_commit("services/rollout/drafter", "benchmarks/drafter_bench.py"),
        "command": "python -m benchmarks.drafter_bench" + (f" --traces {args.traces}" if args.traces else ""),
        "wall_s": time.time() - started,
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "timing_clock": "time.thread_time_ns (CPU time of the replay thread)",
        "rows": rows,
    }
    text = markdown_table(rows, COLUMNS)
    print(text)
    print(f"history+siblings+prompt (16) vs best n-gram: {ratio_16:.2f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "drafter.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "drafter.md").write_text(_markdown(summary, text))
    return summary


def _markdown(summary: dict, text: str) -> str:
    f = summary["findings"]
    return f"""# Drafter benchmark

Command: `{summary['command']}` (OMP_NUM_THREADS=1), commit {summary['git_commit']},
CPU: {summary['cpu']}, Python {summary['python']}, wall {summary['wall_s']:.0f} s,
1-min load average {summary['load_average_1min'][0]:.1f} -> {summary['load_average_1min'][1]:.1f}
on {os.cpu_count()} cores (times are thread CPU time; a loaded machine still inflates them).
Traces: {summary['traces']}: {summary['num_prompts']} prompts x {summary['num_epochs']} epochs,
{summary['num_traces']} responses, mean {summary['mean_response_tokens']:.0f} tokens.

Replay: all samples of an epoch advance together one verify step at a time (siblings see
only committed tokens); a draft token is accepted when it equals the trace's next token;
`acc/step` = 1 + accepted (the bonus/recovered token) per verify step; `acc rate` =
accepted / drafted. n-gram: prompt_lookup_min={NGRAM_MIN}, prompt_lookup_max={NGRAM_MAX}
over the request's prompt + generated tokens. Draft lengths 4/8/16 are fixed caps (draft whenever a continuation
exists); `adaptive` = same cap of 16, the drafter's per-token gains (min_gain 0.1)
trimmed to the 0.5B H100 cost curve's optimum for the step's batch.
`propose`/`add` = host CPU time per sequence per step (one `propose` call over the
step's whole batch, divided by its size; `add` = add_tokens + record_acceptance);
`fit` = least-squares split of propose time into µs per sequence + µs per draft token
(steadier than p99 on a shared machine);
`load` = load_history CPU time per indexed token (the bulk build when a step starts);
`mem` = indexed tokens per prompt at the end of a step (history of the last
{HISTORY_EPOCHS} epochs + live siblings + prompt), `B/tok` = Python heap bytes per
indexed token; `cost-model speedup` = verify time without speculation / with it, from
the 0.5B H100 cost curve of docs/cost-model.md (all sequences of a step share a forward).

{text}

Headline (accepted draft tokens per verify step, bonus token excluded, each at its best
setting; rhymerl = history + siblings + prompt):
- n-gram ({summary['ngram_best_config']}): {summary['ngram_mean_accepted']:.3f};
  rhymerl ({summary['rhymerl_best_config']}): {summary['rhymerl_mean_accepted']:.3f}
  (**{summary['rhymerl_vs_ngram_mean_accepted']:.2f}x**); rhymerl at fixed draft lengths:
  {', '.join(f"{k}: {v:.3f}" for k, v in summary['rhymerl_mean_accepted_fixed'].items())}.
- drafting time per sequence per step ({summary['drafting_config']}): p50
  {summary['drafting_us_p50']:.1f} µs, p99 {summary['drafting_us_p99']:.1f} µs (worst p99
  over rhymerl's settings: {summary['drafting_us_p99_worst_rhymerl_setting']:.1f} µs); index
  updates p50 {summary['index_update_us_p50']:.1f} µs, p99 {summary['index_update_us_p99']:.1f} µs.

Findings (computed by this run):
- history + siblings + prompt (draft 16) vs the best n-gram setting:
  **{f['history_siblings_vs_best_ngram']:.2f}x** mean accepted tokens per verify step.
- adaptive vs fixed 16 (history + siblings + prompt), cost-model speedup ratio:
  {f['adaptive_vs_fixed16_cost_model']:.3f} (adaptive drafts fewer tokens at a higher
  acceptance rate; it pays when the batch is large enough to make drafts cost).
- reward weighting, change in mean accepted tokens per step: {f['reward_weighting_delta_acc_per_step_16']:+.3f}
  at draft 16, {f['reward_weighting_delta_acc_per_step_adaptive']:+.3f} adaptive (off by default).
"""


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
