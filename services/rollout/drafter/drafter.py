"""HistoDrafter: model-free drafts for RL rollouts from three sources scored together.

Sources: the prompt's own index (its earlier epochs, recency- and optionally
reward-weighted; its live siblings; the prompt), and the worker's global index of recent
responses to all prompts. walk.py turns them into one draft per request; budget.py says
how long a draft may be at the step's batch size.

Lifecycle, as the worker and its engine drive it:
1. `load_history(prompt_id, responses, ...)` when a step starts, once per prompt, with
   that prompt's responses from earlier epochs (the history service's bulk answer);
   `add_global_responses(responses)` with recent responses to any prompt (the history
   service's stream at step start, and each sample finished here: indexed as it ran).
2. `start_request(request_id, prompt_id, prompt)` when a sample is scheduled (or resumes
   on this worker after migration, with the tokens generated elsewhere).
3. Every engine step: `propose(request_ids, max_lens, stop_token_ids, budget)` before
   the verify forward; after it, `add_tokens(request_id, committed)` (accepted + the
   recovered/bonus token) and `record_acceptance(request_id, num_draft, num_accepted)`.
   With `DrafterConfig.tree` the engine asks `propose_trees` instead (draft trees at
   batches up to `tree_max_batch`, tree_walk.py; linear drafts above) and reports a
   tree's verdict with `record_tree_acceptance(request_id, parents, path)`.
4. `stop_request(request_id)` when the sample's chunk ends or it leaves the worker;
   `release_prompt(prompt_id)` when the prompt's group is done for the step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from services.rollout.drafter.budget import draft_within_budget, gain_threshold
from services.rollout.drafter.config import DrafterConfig
from services.rollout.drafter.global_index import GlobalIndex
from services.rollout.drafter.prompt_index import START, HistoryResponse, LiveSequence, PromptIndex, reward_factors
from services.rollout.drafter.request_state import DrafterStats, RequestState
from services.rollout.drafter.tree_walk import tree_steps
from services.rollout.drafter.walk import initial_gain, steps
from services.rollout.engine.drafter_protocol import commit_calls

_NO_STOPS: frozenset[int] = frozenset()
_EMA = 0.2  # per propose call, of the drafts' running averages (for the cost threshold)


class UnknownRequestError(KeyError):
    """A request id that was never started, or was already stopped."""


class HistoDrafter:
    """Drafts from earlier epochs, live siblings, the prompt and recent responses to
    other prompts. Not thread-safe: one engine loop drives it."""

    def __init__(self, config: DrafterConfig | None = None) -> None:
        self.config = config = config or DrafterConfig()
        self._prompts: dict[str, PromptIndex] = {}
        self._requests: dict[str, RequestState] = {}
        self._global = GlobalIndex(config.global_max_tokens, START) if config.use_global else None
        self._draft_per_seq, self._gain_per_seq = 2.0, 1.0  # running averages (budget.py)
        self._num_asked = self._num_empty = self._num_draft_tokens = self._num_accepted = 0

    # -- sources ---------------------------------------------------------------------

    def load_history(self, prompt_id: str, responses: Sequence[np.ndarray | list[int]],
                     epoch_ages: Sequence[int] | None = None,
                     rewards: Sequence[float] | None = None) -> None:
        """Bulk-loads one prompt's responses from earlier epochs (replacing earlier
        history), before the prompt's requests of the step start.

        Args:
            responses: token ids of each response (without the prompt).
            epoch_ages: per response, how many epochs ago it was sampled (0 = the most
                recent earlier epoch); None: all 0.
            rewards: per response, its reward (used with `reward_weighting`).

        Raises:
            ValueError: if `epoch_ages` or `rewards` do not match `responses` in length.
        """
        cfg = self.config
        ages = list(epoch_ages) if epoch_ages is not None else [0] * len(responses)
        if len(ages) != len(responses) or (rewards is not None and len(rewards) != len(responses)):
            raise ValueError("epoch_ages and rewards must have one entry per response")
        entry = self._prompt(prompt_id)
        if not cfg.use_history:
            return
        factors = (reward_factors(rewards, cfg.reward_temperature) if cfg.reward_weighting and rewards is not None
                   else [1.0] * len(responses))
        history = [HistoryResponse([START] + np.asarray(tokens, dtype=np.int64).tolist(), age,
                                   cfg.history_weight * cfg.recency_decay ** age * factor)
                   for tokens, age, factor in zip(responses, ages, factors)]
        entry.set_history(history, int(cfg.max_tokens_per_prompt * cfg.history_fraction))

    def add_global_responses(self, responses: Iterable[np.ndarray | Sequence[int]]) -> None:
        """Adds whole responses (to any prompt) to the global index: the history stream's
        at step start, and each sample finished here (indexed as it ran: skipped once).
        The oldest are forgotten past `global_max_tokens`."""
        if self._global is None:
            return
        for tokens in responses:
            self._global.add(np.asarray(tokens, dtype=np.int64).tolist())

    def has_prompt(self, prompt_id: str) -> bool:
        """Whether this drafter holds an index for the prompt (history loaded, or a
        request of it running). The worker asks before deciding to fetch history."""
        return prompt_id in self._prompts

    # -- requests --------------------------------------------------------------------

    def start_request(self, request_id: str, prompt_id: str, prompt_token_ids: Sequence[int],
                      generated_token_ids: Sequence[int] = ()) -> None:
        """A sample is scheduled, or resumes after migration with `generated_token_ids`
        produced elsewhere (they are indexed like new ones).

        Raises:
            ValueError: if the request id is already running.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already started")
        cfg = self.config
        entry = self._prompt(prompt_id)
        if cfg.use_prompt:
            entry.set_prompt([int(t) for t in prompt_token_ids])
        seq = LiveSequence(tokens=[START] + [int(t) for t in generated_token_ids], shared=cfg.use_siblings)
        entry.add_live(request_id, seq)
        glob = self._global.start_match(seq.tokens) if self._global is not None else None
        self._requests[request_id] = RequestState(prompt_id, seq, glob)

    def add_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """The tokens committed to the sequence after a verify step (accepted drafts +
        the recovered or bonus token); siblings see them in their next proposals.
        O(1) amortised per token.

        Raises:
            UnknownRequestError: if the request was not started or was stopped.
        """
        request = self._get(request_id)
        request.decay()
        tokens = [int(t) for t in token_ids]
        self._prompts[request.prompt_id].append(request.seq, tokens)
        if request.glob is not None:
            self._global.follow(request.glob, request.seq.tokens, len(tokens))

    def record_acceptance(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        """`num_accepted` of the first `num_draft` tokens of the request's last draft were
        accepted: calibrates the request's gains."""
        request = self._get(request_id)
        gains = request.last_gains[:num_draft]
        if not gains:
            return
        # Each verified position i (the accepted ones and the first rejected one) was
        # accepted with the modelled probability gains[i] / gains[i-1]; comparing the
        # accepted count with the sum of those, uncalibrated, estimates the calibration.
        previous, expected = 1.0, 0.0
        for gain in gains[:num_accepted + 1]:
            expected += gain / previous
            previous = gain
        request.obs += num_accepted
        request.pred += expected / request.calibration_used
        self._num_accepted += num_accepted
        request.last_gains = []

    def commit_step(self, request_ids: Sequence[str], num_draft: Sequence[int], num_accepted: Sequence[int],
                    token_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        """A step's commits for all its requests, in order (``drafter_protocol.commit_calls``:
        record_acceptance where num_draft[i] > 0, then add_tokens of the request's
        num_tokens[i] tokens, back to back in `token_ids`, where num_tokens[i] >= 0). All
        or nothing: everything is checked before anything is applied.

        Raises:
            UnknownRequestError: a request was not started or was stopped.
            ValueError: lengths or counts that disagree, a negative count.
        """
        for request_id in request_ids:
            self._get(request_id)
        n = len(request_ids)
        if len(num_draft) != n or len(num_accepted) != n or len(num_tokens) != n:
            raise ValueError("num_draft, num_accepted and num_tokens must have one entry per request")
        if n and (min(num_draft) < 0 or min(num_accepted) < 0 or min(num_tokens) < -1):
            raise ValueError("num_draft and num_accepted must be >= 0, num_tokens >= -1")
        tokens = [int(t) for t in token_ids]
        if sum(c for c in num_tokens if c > 0) != len(tokens):
            raise ValueError(f"num_tokens add up to {sum(c for c in num_tokens if c > 0)}, not the {len(tokens)} "
                             "token_ids given")
        for name, request_id, args in commit_calls(request_ids, num_draft, num_accepted, tokens, num_tokens):
            getattr(self, name)(request_id, *args)

    @property
    def tree_drafts(self) -> bool:
        """Whether the engine should ask ``propose_trees`` (DrafterConfig.tree)."""
        return self.config.tree

    def record_tree_acceptance(self, request_id: str, parents: list[int], path: list[int]) -> None:
        """The accepted nodes (root to leaf) of the request's last tree: counted as accepted
        tokens. A tree does not move the request's calibration (the linear drafts' evidence,
        decaying every step): fed from trees (at each verified node, the sum of its
        children's conditional gains against the one token accepted there), it shrank the
        tail's trees and accepted fewer tokens for as many verified (docs/drafter.md,
        "Draft trees": 1.152 vs 1.175 accepted for 4.83 vs 4.68 verified on set 1).
        Raises UnknownRequestError as ``record_acceptance`` does."""
        self._get(request_id).last_gains = []
        self._num_accepted += len(path)

    def stop_request(self, request_id: str) -> None:
        """The sample's chunk ended, it was aborted or left the worker. Its tokens stay
        in the prompt's index for the siblings still running.

        Raises:
            UnknownRequestError: if the request was not started or was already stopped.
        """
        request = self._requests.pop(request_id, None)
        if request is None:
            raise UnknownRequestError(request_id)
        entry = self._prompts[request.prompt_id]
        entry.finish(request_id)
        if request.glob is not None:
            self._global.finish(request.glob, request.seq.tokens)
        if entry.released and not entry.live:
            del self._prompts[request.prompt_id]

    def release_prompt(self, prompt_id: str) -> None:
        """The prompt's group is done for the step: frees its index now, or when its last
        running request stops."""
        entry = self._prompts.get(prompt_id)
        if entry is None:
            return
        if entry.live:
            entry.released = True
        else:
            del self._prompts[prompt_id]

    # -- drafting ----------------------------------------------------------------------

    def propose(self, request_ids: Sequence[str], max_lens: Sequence[int],
                stop_token_ids: Sequence[frozenset[int]] | None = None,
                budget: int | None = None, num_seqs: int | None = None) -> list[list[int]]:
        """Called by the engine before each verify step for the requests it may draft for.

        Args:
            request_ids: the requests, in batch order.
            max_lens: per request, the most draft tokens it may take.
            stop_token_ids: per request, tokens that end it; a draft may end with one
                but never goes past it.
            budget: the most draft tokens over the whole batch (None: no limit).
            num_seqs: sequences in the step's forward, the batch size a draft token is
                priced at (None: these requests; a model of another batch passes its own).

        Returns:
            One linear draft (possibly empty) per request.

        Raises:
            UnknownRequestError: if a request was not started or was stopped.
            ValueError: if max_lens or stop_token_ids differ from request_ids in length.
        """
        cfg = self.config
        if stop_token_ids is None:
            stop_token_ids = [_NO_STOPS] * len(request_ids)
        min_gain = cfg.min_gain
        if cfg.cost_model is not None:
            min_gain = max(min_gain, gain_threshold(cfg.cost_model, num_seqs or len(request_ids),
                                                    self._draft_per_seq, self._gain_per_seq))
        requests = [self._get(request_id) for request_id in request_ids]
        # Best first within the budget (only the drafts' tokens that can make its cut are
        # computed), unless a request's global matches must catch up with a flip first:
        # that indexes its text, which the drafts before it in the batch must not see.
        flips = self._global.flips if self._global is not None else 0
        lazy = all(r.glob is None or r.glob.flips == flips for r in requests)
        walks, bounds = [], []
        for request, max_len, stops in zip(requests, max_lens, stop_token_ids, strict=True):
            walk, bound = self._walk(request, min(max_len, cfg.max_draft_len), stops, min_gain)
            walks.append(walk if lazy or walk is None else iter(list(walk)))
            bounds.append(bound)
        drafts, all_gains = draft_within_budget(walks, bounds, None if budget is None else max(0, budget))
        self._account(requests, drafts, all_gains)
        return drafts

    def propose_trees(self, request_ids: Sequence[str], max_lens: Sequence[int],
                      stop_token_ids: Sequence[frozenset[int]] | None = None, budget: int | None = None,
                      max_nodes: int = 16, num_seqs: int | None = None) -> list[tuple[list[int], list[int] | None]]:
        """``propose`` for an engine that verifies draft trees (engine/tree.py): at batches
        of at most ``tree_max_batch`` sequences (``num_seqs``, else these requests; and with
        ``tree`` on), each request's draft
        tree, grown best first (tree_walk.py) to at most ``max_nodes`` nodes and
        ``max_lens[i]`` deep, the batch cut to ``budget`` nodes by gain as linear drafts
        are; otherwise ``propose``'s linear drafts.

        Returns:
            Per request (tokens, parents): the tree flattened in topological order
            (parents[i] < i, -1: the root), or (draft, None) for a linear draft.
        """
        cfg = self.config
        n = len(request_ids)
        if not cfg.tree or (num_seqs or n) > cfg.tree_max_batch:
            return [(d, None) for d in self.propose(request_ids, max_lens, stop_token_ids, budget, num_seqs)]
        if stop_token_ids is None:
            stop_token_ids = [_NO_STOPS] * n
        min_gain = cfg.min_gain if cfg.tree_min_gain is None else cfg.tree_min_gain
        if cfg.cost_model is not None:
            min_gain = max(min_gain, gain_threshold(cfg.cost_model, num_seqs or n, self._draft_per_seq,
                                                    self._gain_per_seq))
        requests = [self._get(request_id) for request_id in request_ids]
        walks, bounds, all_parents = [], [], []
        cap = min(max_nodes, cfg.max_draft_len * cfg.tree_width)
        for request, max_len, stops in zip(requests, max_lens, stop_token_ids, strict=True):
            parents: list[int] = []
            all_parents.append(parents)
            depth = min(max_len, cfg.max_draft_len)
            sources = (request.sources(self._prompts[request.prompt_id].index, self._global, cfg)
                       if depth > 0 else [])
            request.calibration_used = calibration = request.calibration
            if not sources:
                walks.append(None)
                bounds.append(0.0)
                continue
            gain = initial_gain(sources)
            # drafted whole, in order: a request's global matches may catch up inside
            # `sources`, which the trees before it in the batch must not see half done
            walks.append(iter(list(tree_steps(sources, gain, cap, depth, stops, cfg.tree_width, cfg.smoothing,
                                              cfg.backoff_weight, cfg.min_match_len, min_gain, calibration,
                                              parents))))
            bounds.append(gain * 0.99)
        drafts, all_gains = draft_within_budget(walks, bounds, None if budget is None else max(0, budget))
        self._account(requests, drafts, all_gains)
        return [(draft, parents[:len(draft)]) for draft, parents in zip(drafts, all_parents)]

    def _account(self, requests: list[RequestState], drafts: list[list[int]], all_gains: list[list[float]]) -> None:
        """A proposal's statistics: each request's gains, the empties, the running means."""
        for request, gains in zip(requests, all_gains):
            request.last_gains = gains
        num_tokens = sum(map(len, drafts))
        self._num_empty += drafts.count([])
        if n := len(requests):
            self._draft_per_seq += _EMA * (num_tokens / n - self._draft_per_seq)
            self._gain_per_seq += _EMA * (sum(map(sum, all_gains)) / n - self._gain_per_seq)
        self._num_asked += n
        self._num_draft_tokens += num_tokens

    def _walk(self, request: RequestState, cap: int, stops: frozenset[int],
              min_gain: float) -> tuple[Iterator[tuple[int, float]] | None, float]:
        """The request's draft as it is computed (None: none), and a bound on its gains."""
        cfg = self.config
        if cap <= 0:
            return None, 0.0
        sources = request.sources(self._prompts[request.prompt_id].index, self._global, self.config)
        request.calibration_used = calibration = request.calibration
        if not sources:
            return None, 0.0
        gain = initial_gain(sources)  # each token multiplies it by at most 0.99: the bound
        return steps(sources, gain, cap, stops, cfg.smoothing, cfg.backoff_weight, cfg.min_match_len, min_gain,
                     calibration), gain * 0.99

    # -- accounting --------------------------------------------------------------------

    def memory_tokens(self, prompt_id: str) -> int:
        """Tokens indexed for the prompt (the quantity bounded by max_tokens_per_prompt)."""
        entry = self._prompts.get(prompt_id)
        return entry.num_tokens if entry is not None else 0

    def memory_bytes(self, prompt_id: str) -> int:
        """Approximate Python heap of the prompt's index (O(states): for reports)."""
        entry = self._prompts.get(prompt_id)
        return entry.index.approx_bytes() if entry is not None else 0

    def global_tokens(self) -> int:
        """Tokens in the global index (bounded by global_max_tokens)."""
        return self._global.num_tokens if self._global is not None else 0

    def stats(self) -> DrafterStats:
        """A snapshot of the counters; the engine exports them as metrics."""
        return DrafterStats(self._num_asked, self._num_empty, self._num_draft_tokens, self._num_accepted,
                            len(self._prompts), sum(e.num_tokens for e in self._prompts.values()),
                            self.global_tokens())

    def _prompt(self, prompt_id: str) -> PromptIndex:
        entry = self._prompts.get(prompt_id)
        if entry is None:
            cfg = self.config
            entry = self._prompts[prompt_id] = PromptIndex(cfg.max_tokens_per_prompt, cfg.sibling_weight,
                                                           cfg.prompt_weight)
        entry.released = False
        return entry

    def _get(self, request_id: str) -> RequestState:
        request = self._requests.get(request_id)
        if request is None:
            raise UnknownRequestError(request_id)
        return request
