"""What the simulator rolls out: true response lengths per prompt, per epoch.

Two sources: a synthetic generator (heavy-tailed per-prompt length distributions whose
scale drifts slowly across epochs, with rare jumps, as RhymeRL observes), and recorded
traces (``benchmarks/data/*.npz`` through ``services.common.traces.read_traces``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common.traces import read_traces
from services.scheduler.length_model import History
from services.scheduler.policies.base import Request, RequestKey


@dataclass
class SimStep:
    step_id: str
    requests: list[Request]
    true_len: dict[RequestKey, int]  # request -> its response length
    history: History  # what the history service would return for these prompts


@dataclass(frozen=True)
class LengthLaw:
    """The distribution a synthetic workload drew its lengths from: per prompt and epoch
    lognormal(scale, ``sample_sigma``), and ``max_tokens`` with ``runaway_prob``."""

    scales: dict[str, list[float]]  # prompt_id -> per epoch (oldest first) the log-scale mu
    sample_sigma: float
    runaway_prob: float


@dataclass(frozen=True)
class Workload:
    lengths: dict[str, list[list[int]]]  # prompt_id -> per epoch (oldest first) its sample lengths
    prompt_lens: dict[str, int]
    max_tokens: int
    source: str
    law: LengthLaw | None = None  # synthetic workloads only

    def known_law_history(self, epoch: int, num_samples: int = 256, seed: int = 0) -> History:
        """Per prompt, ``num_samples`` fresh draws from the law its epoch-``epoch`` samples
        came from: the best history there can be (it knows each prompt's length
        distribution this epoch, not which of its samples will be long)."""
        if self.law is None:
            raise ValueError(f"{self.source}: only a synthetic workload knows its length law")
        rng = np.random.default_rng([seed, epoch, 1])  # not the stream the workload drew from
        history = {}
        for prompt_id, scales in self.law.scales.items():
            if epoch >= len(scales):
                continue
            lengths = np.exp(scales[epoch] + rng.normal(0.0, self.law.sample_sigma, num_samples))  # [num_samples]
            lengths[rng.random(num_samples) < self.law.runaway_prob] = self.max_tokens
            history[prompt_id] = [np.clip(lengths, 1, self.max_tokens).astype(np.int64).tolist()]
        return history

    @property
    def num_epochs(self) -> int:
        return max(len(epochs) for epochs in self.lengths.values())

    def history_before(self, epoch: int, depth: int = 4) -> History:
        """Per prompt, the lengths of up to ``depth`` epochs before ``epoch``, newest first."""
        return {p: [epochs[e] for e in range(min(epoch, len(epochs)) - 1, max(-1, epoch - 1 - depth), -1)]
                for p, epochs in self.lengths.items() if epoch > 0 and len(epochs) >= 1}

    def step(self, epoch: int, step_id: str | None = None, history_depth: int = 4,
             history_lag: int = 0) -> SimStep:
        """Fresh requests for every prompt that has this epoch; first epoch: no history.

        ``history_lag=1`` leaves out the previous epoch (still running when a cross-step
        scheduler starts this one, so not yet in the history store).
        """
        step_id = step_id or f"e{epoch}"
        requests, true_len = [], {}
        for prompt_id, epochs in self.lengths.items():
            if epoch >= len(epochs):
                continue
            for i, length in enumerate(epochs[epoch]):
                request = Request(step_id, prompt_id, i,
                                  self.prompt_lens[prompt_id], self.max_tokens)
                requests.append(request)
                true_len[request.key] = int(length)
        return SimStep(step_id, requests, true_len,
                       self.history_before(max(0, epoch - history_lag), history_depth))

    def take(self, num_prompts: int) -> Workload:
        """The first ``num_prompts`` prompts, tiled with renamed copies when there are fewer."""
        names = list(self.lengths)
        chosen = {}
        for i in range(num_prompts):
            name = names[i % len(names)]
            chosen[name if i < len(names) else f"{name}#{i // len(names)}"] = name
        law = None if self.law is None else LengthLaw(
            {new: self.law.scales[old] for new, old in chosen.items()}, self.law.sample_sigma, self.law.runaway_prob)
        return Workload({new: self.lengths[old] for new, old in chosen.items()},
                        {new: self.prompt_lens[old] for new, old in chosen.items()},
                        self.max_tokens, self.source if num_prompts <= len(names) else self.source + " (tiled)",
                        law)


def synthetic_workload(num_prompts: int, n: int = 16, num_epochs: int = 4, max_tokens: int = 16384,
                       seed: int = 0, median_len: float = 1200.0, prompt_sigma: float = 0.9,
                       sample_sigma: float = 0.5, runaway_prob: float = 0.01, drift_sigma: float = 0.1,
                       jump_prob: float = 0.03, jump_sigma: float = 0.8, growth: float = 0.03) -> Workload:
    """Heavy-tailed lengths correlated across epochs.

    A prompt's log-scale mu starts at N(log median_len, prompt_sigma) (hard prompts get
    long answers); each epoch it drifts by N(log(1 + growth), drift_sigma) (answers
    lengthen slowly during RL), and with probability ``jump_prob`` it jumps by
    N(0, jump_sigma) (the few prompts whose length rank changes). A sample's length is
    lognormal(mu, sample_sigma); with probability ``runaway_prob`` it runs to
    ``max_tokens`` (a repetition loop).
    """
    rng = np.random.default_rng(seed)
    mu = rng.normal(np.log(median_len), prompt_sigma, num_prompts)  # [num_prompts]
    prompt_lens = rng.integers(64, 1024, num_prompts)  # [num_prompts]
    per_epoch, scales = [], []
    for epoch in range(num_epochs):
        if epoch:
            mu = mu + rng.normal(np.log1p(growth), drift_sigma, num_prompts)
            jumps = rng.random(num_prompts) < jump_prob
            mu = mu + jumps * rng.normal(0.0, jump_sigma, num_prompts)
        scales.append(mu)
        lengths = np.exp(mu[:, None] + rng.normal(0.0, sample_sigma, (num_prompts, n)))  # [num_prompts, n]
        lengths[rng.random((num_prompts, n)) < runaway_prob] = max_tokens
        per_epoch.append(np.clip(lengths, 1, max_tokens).astype(np.int64))
    names = [f"p{i}" for i in range(num_prompts)]
    return Workload({name: [per_epoch[e][i].tolist() for e in range(num_epochs)] for i, name in enumerate(names)},
                    {name: int(prompt_lens[i]) for i, name in enumerate(names)}, max_tokens,
                    f"synthetic(seed={seed}, median={median_len:g}, prompt_sigma={prompt_sigma}, "
                    f"sample_sigma={sample_sigma}, runaway={runaway_prob})",
                    LengthLaw({name: [float(scales[e][i]) for e in range(num_epochs)] for i, name in enumerate(names)},
                              sample_sigma, runaway_prob))


def trace_workload(paths: Iterable[str | Path], max_tokens: int | None = None) -> Workload:
    """Lengths from recorded rollouts (``services.common.traces.read_traces``), by prompt and epoch."""
    by_prompt: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    prompt_lens: dict[str, int] = {}
    names = []
    for path in paths:
        names.append(Path(path).name)
        for record in read_traces(path):
            by_prompt[str(record.prompt_id)][int(record.epoch)].append(len(record.token_ids))
            prompt_lens[str(record.prompt_id)] = len(record.prompt_token_ids)
    if not by_prompt:
        raise ValueError(f"no trace records in {names}")
    lengths = {p: [epochs[e] for e in sorted(epochs)] for p, epochs in by_prompt.items()}
    longest = max(x for epochs in lengths.values() for lens in epochs for x in lens)
    return Workload(lengths, prompt_lens, max_tokens or longest, "traces " + ",".join(names))
