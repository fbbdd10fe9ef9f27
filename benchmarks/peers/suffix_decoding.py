"""vLLM's "suffix" speculative method behind the calls the drafter replay makes.

vLLM's SuffixDecodingProposer drives ArcticInference's `SuffixDecodingCache` so: a
request's prompt starts it (`start_request`), every step's sampled tokens are appended
(`add_active_response`, into its own prompt tree and into the global tree of responses
that every request drafts from), and the draft is `speculate` on the last
`max_tree_depth` tokens of prompt + response, with `max_spec_tokens` = min(the draft
cap, what the request has left); a finished request's response stays in the global tree
until `max_cached_requests` newer ones push it out (FIFO). `PeerSuffixDrafter` does the
same, either with one cache for all prompts (vLLM's global tree) or one per prompt (that
prompt's history + live siblings + its prompt, like rhymerl's per-prompt index).

The peer is built by `benchmarks.peers.build_suffix_decoding` (make bench); `load_peer`
raises `PeerUnavailable` with the reason when it is not there.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

from benchmarks.peers.build_suffix_decoding import ARCTIC_VERSION, package_dir

# vLLM's SpeculativeConfig defaults for method="suffix".
MAX_TREE_DEPTH = 24
MAX_CACHED_REQUESTS = 10_000
MAX_SPEC_FACTOR = 1.0
MIN_TOKEN_PROB = 0.1


class PeerUnavailable(RuntimeError):
    """The peer is not built here (run `python -m benchmarks.peers.build_suffix_decoding`)."""


def load_peer() -> type:
    """The peer's `SuffixDecodingCache` class, imported from the cache folder.

    Raises:
        PeerUnavailable: it was not built, or does not import (the reason says which).
    """
    folder = package_dir()
    if not (folder / "arctic_inference" / "suffix_decoding" / "cache.py").exists():
        raise PeerUnavailable(f"arctic-inference {ARCTIC_VERSION} suffix decoding is not built in {folder}; "
                              "run `python -m benchmarks.peers.build_suffix_decoding` (make bench does)")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    try:
        return importlib.import_module("arctic_inference.suffix_decoding").SuffixDecodingCache
    except ImportError as exc:
        raise PeerUnavailable(f"the built peer in {folder} does not import: {exc}") from exc


class PeerSuffixDrafter:
    """The replay's drafter calls, answered by SuffixDecodingCache as vLLM drives it.

    Args:
        make_cache: builds one SuffixDecodingCache (`load_peer()(max_tree_depth, ...)`).
        per_prompt: one cache per prompt id instead of one for all prompts.
        max_draft_len: vLLM's num_speculative_tokens.
    """

    def __init__(self, make_cache: Callable[[], object], per_prompt: bool = False, max_draft_len: int = 16,
                 max_tree_depth: int = MAX_TREE_DEPTH, max_spec_factor: float = MAX_SPEC_FACTOR,
                 min_token_prob: float = MIN_TOKEN_PROB) -> None:
        self.make_cache = make_cache
        self.per_prompt = per_prompt
        self.max_draft_len = max_draft_len
        self.max_tree_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._caches: dict[str, object] = {}
        self._requests: dict[str, tuple[object, list[int]]] = {}  # id -> (cache, prompt + response)

    def _cache(self, prompt_id: str):
        key = prompt_id if self.per_prompt else ""
        cache = self._caches.get(key)
        if cache is None:
            cache = self._caches[key] = self.make_cache()
        return cache

    def start_request(self, request_id: str, prompt_id: str, prompt_token_ids: Sequence[int],
                      generated_token_ids: Sequence[int] = ()) -> None:
        cache = self._cache(prompt_id)
        cache.start_request(request_id, [int(t) for t in prompt_token_ids])
        tokens = [int(t) for t in prompt_token_ids]
        self._requests[request_id] = (cache, tokens)
        if generated_token_ids:
            self.add_tokens(request_id, generated_token_ids)

    def propose(self, request_ids: Sequence[str], max_lens: Sequence[int], stop_token_ids=None,
                budget: int | None = None) -> list[list[int]]:
        drafts = []
        for request_id, max_len in zip(request_ids, max_lens, strict=True):
            cache, tokens = self._requests[request_id]
            draft = cache.speculate(request_id, tokens[-self.max_tree_depth:],
                                    max_spec_tokens=min(self.max_draft_len, max_len),
                                    max_spec_factor=self.max_spec_factor, min_token_prob=self.min_token_prob)
            drafts.append(list(draft.token_ids))
        return drafts

    def add_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        cache, tokens = self._requests[request_id]
        new = [int(t) for t in token_ids]
        cache.add_active_response(request_id, new)
        tokens += new

    def record_acceptance(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        """vLLM's suffix method does not adapt to acceptance."""

    def stop_request(self, request_id: str) -> None:
        cache, _ = self._requests.pop(request_id)
        cache.stop_request(request_id)
