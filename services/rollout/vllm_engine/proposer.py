"""rhymerl's history drafter as a vLLM speculative proposer.

vLLM constructs this class inside its model runner (speculative_config method
"custom_class", model "services.rollout.vllm_engine.proposer.HistoryProposer")
and calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)``
once per step with one row per running request, expecting a draft per row.

Everything reaches it through ``call`` run by ``LLMEngine.collective_rpc`` in the
process that holds the model runner: the worker runs vLLM in-process (its
settings refuse the engine-core process), so that is a plain call; history is
still passed as token lists, as vLLM's RPC would need. vLLM passes no request ids to ``propose``; ``attach`` hands the proposer
its model runner, whose input batch names each row's request (the same field
vLLM's own suffix proposer reads).

The drafter sees the engine-facing lifecycle only: start_request when a
registered request first shows up in a batch (prompt + tokens generated so far,
so a resumed chunk is indexed like a new one), each step's commits in one
commit_step call (per request: record_acceptance with how many of the last draft
vLLM kept, add_tokens with its new tokens), and stop_request when the request
leaves the batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from services.rollout.engine.drafter_protocol import Commits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Registration:
    prompt_id: str
    prompt_len: int  # the sample's prompt, without tokens of earlier chunks
    end_len: int  # context length at which this chunk ends (no draft past it)
    stop_token_ids: frozenset[int]


@dataclass
class _Live:
    reg: Registration
    seen: int  # context tokens already given to the drafter
    last_draft: int = 0
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    undrafted: bool = False  # the drafter failed on this request: it goes on without drafts


class HistoryProposer:
    def __init__(self, vllm_config, drafter=None):
        import os

        from services.rollout.drafter import DrafterConfig
        from services.rollout.drafter.compiled import make_drafter

        self.k = vllm_config.speculative_config.num_speculative_tokens
        # RHYMERL_WORKER_DRAFTER (the worker's setting, exported by builder.py): compiled by default
        self.drafter = drafter or make_drafter(os.environ.get("RHYMERL_WORKER_DRAFTER", "compiled"),
                                               DrafterConfig(max_draft_len=self.k))
        self.runner = None
        self._registered: dict[str, Registration] = {}
        self._live: dict[str, _Live] = {}
        self._finished: dict[str, tuple[int, int, int]] = {}
        self.num_drafter_errors = 0

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's CPU runner calls this on every drafter; there is no draft model."""

    # --- called through collective_rpc -------------------------------------------
    def register(self, req_id: str, reg: Registration) -> None:
        self._registered[req_id] = reg

    def counters(self, req_id: str) -> tuple[int, int, int]:
        """(verify steps, draft tokens, accepted tokens) of a finished request, once."""
        self._retire(req_id)
        self._registered.pop(req_id, None)
        return self._finished.pop(req_id, (0, 0, 0))

    # --- called by vLLM's model runner ---------------------------------------------
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, **_) -> list[list[int]]:
        req_ids = list(self.runner.input_batch.req_ids) if self.runner is not None else []
        for gone in set(self._live) - set(req_ids):
            self._retire(gone)
        rows, max_lens, stops = [], [], []
        commits = Commits()
        observed = []
        for i, req_id in enumerate(req_ids):
            observed.append(self._observe(req_id, sampled_token_ids[i] if i < len(sampled_token_ids) else [],
                                          int(num_tokens_no_spec[i]), token_ids_cpu[i], commits))
        self._commit(commits)
        for i, live in enumerate(observed):
            if live is not None and not live.undrafted:
                rows.append(i)
                max_lens.append(max(0, min(self.k, live.reg.end_len - int(num_tokens_no_spec[i]) - 1)))
                stops.append(live.reg.stop_token_ids)
        drafts: list[list[int]] = [[] for _ in req_ids]
        if rows and any(max_lens):
            try:
                proposed = self.drafter.propose([req_ids[i] for i in rows], max_lens, stop_token_ids=stops)
            except Exception:  # noqa: BLE001 - a drafter bug costs speed, never a sample
                log.exception("drafter.propose failed; this step goes undrafted")
                self.num_drafter_errors += 1
                proposed = [[] for _ in rows]
            for i, draft, cap in zip(rows, proposed, max_lens):
                drafts[i] = [int(t) for t in draft[:cap]]
        for i, req_id in enumerate(req_ids):
            if req_id in self._live:
                self._live[req_id].last_draft = len(drafts[i])
        return drafts

    def _observe(self, req_id: str, sampled, n: int, row, commits: Commits) -> _Live | None:
        """The request's verdict and new tokens into `commits` (a new request is started,
        after the commits gathered before it: the order of calls one by one)."""
        live = self._live.get(req_id)
        if live is None:
            reg = self._registered.get(req_id)
            if reg is None or n < reg.prompt_len:
                return None
            self._commit(commits)
            context = [int(t) for t in row[:n]]
            try:
                self.drafter.start_request(req_id, reg.prompt_id, context[:reg.prompt_len], context[reg.prompt_len:])
            except Exception:  # noqa: BLE001
                log.exception("drafter.start_request failed for %s", req_id)
                self.num_drafter_errors += 1
                return None
            live = self._live[req_id] = _Live(reg, n)
            return live
        draft = accepted = 0
        if live.last_draft and sampled:
            draft, accepted = live.last_draft, min(len(sampled) - 1, live.last_draft)
            live.verify_steps += 1
            live.draft_tokens += live.last_draft
            live.accepted_tokens += accepted
        new = None
        if n > live.seen:
            new = [int(t) for t in row[live.seen:n]]
            live.seen = n
        if (draft or new is not None) and not live.undrafted:
            commits.add(req_id, draft, accepted, new)
        return live

    def _commit(self, commits: Commits) -> None:
        """The gathered commits in one call; where it fails, request by request (only the
        request that fails goes on without drafts)."""
        commits.send(self.drafter, lambda method, req_id, *args: self._drafter_call(self._live[req_id], method,
                                                                                   req_id, *args),
                     self._commit_step_failed)

    def _commit_step_failed(self, exc: Exception) -> None:
        """The drafter's ``commit_step`` raised (it applied nothing; its commits go again
        request by request): a drafter error, logged and counted."""
        log.warning("drafter.commit_step failed (%s: %s); committing request by request", type(exc).__name__, exc)
        self.num_drafter_errors += 1

    def _drafter_call(self, live: _Live, method, req_id: str, *args) -> None:
        """Calls the drafter for one request; if it raises, that request goes on without
        drafts (logged and counted) instead of the exception reaching vLLM's step."""
        if live.undrafted:
            return
        try:
            method(req_id, *args)
        except Exception:  # noqa: BLE001 - a drafter bug costs speed, never a sample
            log.exception("drafter.%s failed for %s; it decodes without drafts", method.__name__, req_id)
            self.num_drafter_errors += 1
            live.undrafted = True
            try:
                self.drafter.stop_request(req_id)
            except Exception:  # noqa: BLE001 - it may be half-started
                pass

    def _retire(self, req_id: str) -> None:
        live = self._live.pop(req_id, None)
        if live is None:
            return
        self._finished[req_id] = (live.verify_steps, live.draft_tokens, live.accepted_tokens)
        try:
            self.drafter.stop_request(req_id)
        except Exception:  # noqa: BLE001 - already stopped
            pass


def call(worker, method: str, *args, **kwargs):
    """Runs in the process holding vLLM's model runner (see the module docstring)."""
    runner = worker.model_runner
    proposer = getattr(runner, "drafter", None)
    if not isinstance(proposer, HistoryProposer):
        return None
    if method == "attach":
        proposer.runner = runner
        return True
    if method in ("register", "counters"):
        return getattr(proposer, method)(*args, **kwargs)
    if method in ("load_history", "release_prompt"):
        return getattr(proposer.drafter, method)(*args, **kwargs)
    raise ValueError(f"unknown proposer call {method!r}")
