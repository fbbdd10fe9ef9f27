"""What the engine needs from a drafter (services/rollout/drafter.HistoDrafter fits it),
and the NullDrafter it uses when drafting is off.

The engine calls, from its one thread:
  start_request   when a request is added (its prompt and any tokens of earlier chunks);
  propose         once per step for the decoding requests, with each one's maximum draft
                  length and the step's total draft-token budget from the cost model
                  (on a CPU, for a drafter pricing its tokens on the engine's cost model,
                  the step's token budget: LLMEngine._held_to_flat_part);
  add_tokens      after each step with the tokens a request committed;
  record_acceptance after each verify that carried a draft;
  stop_request    when the request's chunk ends or it is aborted.
The server, not the engine, calls load_history before adding a prompt's requests.

A drafter may also have ``commit_step`` (both rhymerl drafters do): a step's
record_acceptance and add_tokens calls for all its requests in one call, all or nothing
(``commit_calls`` lists the calls it stands for). The engines gather a step's commits in
``Commits`` and send them with ``commit_step`` below, which falls back to the per-request
calls for a drafter without it.

Draft trees (engine/tree.py) are optional: a drafter that has ``propose_trees`` and
``record_tree_acceptance`` and whose ``tree_drafts`` is true is asked for trees instead
of linear drafts (``TreeDrafter``); the engine then reports a tree's verdict with
``record_tree_acceptance`` and a linear one (parents None) with ``record_acceptance``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@runtime_checkable
class Drafter(Protocol):
    def start_request(self, request_id: str, prompt_id: str, prompt_token_ids: Sequence[int],
                      generated_token_ids: Sequence[int] = ()) -> None: ...

    def add_tokens(self, request_id: str, token_ids: Sequence[int]) -> None: ...

    def propose(self, request_ids: list[str], max_lens: list[int], stop_token_ids=None,
                budget: int | None = None) -> list[list[int]]: ...

    def record_acceptance(self, request_id: str, num_draft: int, num_accepted: int) -> None: ...

    def stop_request(self, request_id: str) -> None: ...


@runtime_checkable
class TreeDrafter(Drafter, Protocol):
    tree_drafts: bool  # whether to ask it for trees (a config switch: off, it drafts linearly)

    def propose_trees(self, request_ids: list[str], max_lens: list[int], stop_token_ids=None,
                      budget: int | None = None, max_nodes: int = 16) -> list[tuple[list[int], list[int] | None]]:
        """Per request (tokens, parents): a flattened tree in topological order (parents
        None: a linear draft), at most ``max_lens[i]`` deep and ``max_nodes`` nodes, at most
        ``budget`` nodes over the batch."""
        ...

    def record_tree_acceptance(self, request_id: str, parents: list[int], path: list[int]) -> None:
        """The nodes of the request's last tree (``parents``) that were accepted, root to leaf."""
        ...


class NullDrafter:
    """Drafting off: the engine runs the same calls, and every one does nothing (the
    engine then keeps its draft length at 0, so propose is never asked)."""

    def start_request(self, request_id, prompt_id, prompt_token_ids, generated_token_ids=()) -> None:
        pass

    def add_tokens(self, request_id, token_ids) -> None:
        pass

    def propose(self, request_ids, max_lens, stop_token_ids=None, budget=None) -> list[list[int]]:
        return [[] for _ in request_ids]

    def record_acceptance(self, request_id, num_draft, num_accepted) -> None:
        pass

    def commit_step(self, request_ids, num_draft, num_accepted, token_ids, num_tokens) -> None:
        pass

    def stop_request(self, request_id) -> None:
        pass


def commit_calls(request_ids: Sequence[str], num_draft: Sequence[int], num_accepted: Sequence[int],
                 token_ids: Sequence[int], num_tokens: Sequence[int]) -> Iterator[tuple[str, str, tuple]]:
    """The per-request calls a ``commit_step`` stands for, in order, as (method name,
    request id, arguments): for request i, ``record_acceptance(num_draft[i],
    num_accepted[i])`` where num_draft[i] > 0, then ``add_tokens`` of its num_tokens[i]
    tokens (the next ones of `token_ids`) where num_tokens[i] >= 0 (-1: no add_tokens)."""
    at = 0
    for request_id, draft, accepted, count in zip(request_ids, num_draft, num_accepted, num_tokens):
        if draft > 0:
            yield "record_acceptance", request_id, (draft, accepted)
        if count >= 0:
            yield "add_tokens", request_id, (token_ids[at:at + count],)
            at += count


def commit_step(drafter, request_ids: Sequence[str], num_draft: Sequence[int], num_accepted: Sequence[int],
                token_ids: Sequence[int], num_tokens: Sequence[int], call=None, failed=None) -> None:
    """A step's commits: ``drafter.commit_step`` where it has one, else its per-request
    calls (``commit_calls``). With `call` (``call(method, request_id, *args)``, an engine's
    guard that sets a failing request aside), a ``commit_step`` that raises, which applies
    nothing, is retried as the per-request calls through `call`, so one bad request costs
    only its own drafts (`failed`, if given, is told of the batch's exception first: a
    drafter error to count); without `call`, errors propagate."""
    batched = getattr(drafter, "commit_step", None)
    if batched is not None:
        try:
            batched(request_ids, num_draft, num_accepted, token_ids, num_tokens)
            return
        except Exception as exc:
            if call is None:
                raise
            if failed is not None:
                failed(exc)
    for name, request_id, args in commit_calls(request_ids, num_draft, num_accepted, token_ids, num_tokens):
        if call is None:
            getattr(drafter, name)(request_id, *args)
        else:
            call(getattr(drafter, name), request_id, *args)


@dataclass
class Commits:
    """A step's commits gathered for one ``commit_step`` (its arguments, request by request)."""

    ids: list[str] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def add(self, request_id: str, num_draft: int, num_accepted: int, token_ids: list[int] | None) -> None:
        """The request's verdict (num_draft 0: none) and committed tokens (None: none)."""
        self.ids.append(request_id)
        self.drafts.append(num_draft)
        self.accepted.append(num_accepted)
        self.counts.append(-1 if token_ids is None else len(token_ids))
        if token_ids:
            self.tokens += token_ids

    def send(self, drafter, call=None, failed=None) -> None:
        """``commit_step`` of what was gathered (if anything), then empty again."""
        if not self.ids:
            return
        try:
            commit_step(drafter, self.ids, self.drafts, self.accepted, self.tokens, self.counts, call, failed)
        finally:
            for values in (self.ids, self.drafts, self.accepted, self.tokens, self.counts):
                values.clear()
