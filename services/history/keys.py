"""Every Redis key and TTL of the history store, in one place.

Per prompt (hash tag ``{<id>}``, so a prompt's keys share one Redis Cluster slot
and one Lua script may touch all of them):

    <prefix>:{<id>}:epochs                sorted set: step_id scored by arrival
                                          (1, 2, 3, ...; newest = highest)
    <prefix>:{<id>}:epoch:<step>          hash, one per kept epoch:
        version       policy version of the step (decimal)
        lengths       packed little-endian int32 pairs (sample_index, length),
                      one pair appended per newly stored sample
        tok:<i>       sample i's token ids, packed little-endian int32
        rew:<i>       sample i's reward, packed little-endian float32

Global (one key, one slot; written beside the per-prompt scripts, never inside them):

    <prefix>:recent                       list, newest first, capped: the last stored
                                          responses to any prompt (recent.py packs them)

Every key of a prompt expires ``ttl_seconds`` after the prompt's last write; the recent
list ``ttl_seconds`` after the last write to it.
``<id>`` is the prompt id with ``%``, ``{`` and ``}`` percent-escaped (``%25``, ``%7B``,
``%7D``; ``escape_id``), every other character as it is: an id without those three
characters is its own ``<id>``. Redis Cluster hashes a key by the text between its first
``{`` and the first ``}`` after it, so a raw ``}`` in the id would end the tag early (the
prompt's keys could then land on different slots: CROSSSLOT for the scripts) and let one
prompt's key equal another's (prompt ``p}:epoch:s`` step ``1`` and prompt ``p`` step
``s}:epoch:1``). With the prefix brace-free and ``<id>`` brace-free, a key's tag is exactly
``<id>``, the escaping is reversible, and the text after the tag (``:epochs``, or
``:epoch:`` followed by the step) tells the two kinds apart: distinct (prompt, step)
pairs always have distinct keys. So the step id, which only ever follows the tag, is
used as it is, whatever it holds.

The hash fields are read and written only by the Lua scripts in store.py.
This module knows nothing about Redis connections or the wire format of RPCs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import AfterValidator

DEFAULT_PREFIX = "rhymerl"
DEFAULT_TTL_SECONDS = 7 * 24 * 3600
_ESCAPED = str.maketrans({"%": "%25", "{": "%7B", "}": "%7D"})


def check_prefix(prefix: str) -> str:
    """A key prefix every service of a release shares (history's keys, the scheduler's step
    log and serving record, the shard registry): non-empty and brace-free, so that a key's
    hash tag is the one its service puts in it. Releases sharing one Redis set different ones."""
    if not prefix or "{" in prefix or "}" in prefix:
        raise ValueError(f"key prefix must be non-empty and brace-free, got {prefix!r}")
    return prefix


# A settings field holding a key prefix (history's, the scheduler's, the router's), checked as above.
KeyPrefix = Annotated[str, AfterValidator(check_prefix)]


def escape_id(prompt_id: str) -> str:
    """``prompt_id`` as it appears inside its keys' hash tag: brace-free, one-to-one
    (``%``, ``{``, ``}`` become ``%25``, ``%7B``, ``%7D``; ``urllib.parse.unquote`` undoes it)."""
    return prompt_id.translate(_ESCAPED)


@dataclass(frozen=True)
class HistoryKeys:
    """Names the keys of one prompt; ``prefix`` must not contain braces."""

    prefix: str = DEFAULT_PREFIX
    ttl_seconds: int = DEFAULT_TTL_SECONDS

    def __post_init__(self):
        check_prefix(self.prefix)
        if self.ttl_seconds < 1:
            raise ValueError(f"ttl_seconds must be >= 1, got {self.ttl_seconds}")

    def prompt(self, prompt_id: str) -> str:
        """The hash-tagged stem every key of ``prompt_id`` starts with."""
        return f"{self.prefix}:{{{escape_id(prompt_id)}}}"

    def epochs(self, prompt_id: str) -> str:
        return f"{self.prompt(prompt_id)}:epochs"

    def epoch_stem(self, prompt_id: str) -> str:
        """The epoch key without its step id (the Lua scripts append the step id)."""
        return f"{self.prompt(prompt_id)}:epoch:"

    def recent(self) -> str:
        return f"{self.prefix}:recent"

    def epoch(self, prompt_id: str, step_id: str) -> str:
        """The step id is appended as it is (the module docstring says why that is safe)."""
        return self.epoch_stem(prompt_id) + step_id
