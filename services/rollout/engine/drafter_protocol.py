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

Draft trees (engine/tree.py) are optional: a drafter that has ``propose_trees`` and
``record_tree_acceptance`` and whose ``tree_drafts`` is true is asked for trees instead
of linear drafts (``TreeDrafter``); the engine then reports a tree's verdict with
``record_tree_acceptance`` and a linear one (parents None) with ``record_acceptance``.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable


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

    def stop_request(self, request_id) -> None:
        pass
