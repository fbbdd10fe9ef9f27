"""The n-gram prompt-lookup baseline, as vLLM's `ngram` speculative method behaves.

For one request, the context is its prompt followed by its generated tokens. The draft
is what followed the earliest earlier occurrence of the longest context suffix of
n tokens, prompt_lookup_min <= n <= prompt_lookup_max, cut at the end of the context.
It sees nothing of other requests or epochs; it is here to be measured against.
The search runs over the context's int32 bytes with `bytearray.find` (C speed).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

_WIDTH = 4  # bytes per int32 token


class NgramContext:
    """One request's prompt + generated tokens, kept as int32 bytes for searching."""

    __slots__ = ("buf", "num_tokens")

    def __init__(self, token_ids: Iterable[int]) -> None:
        self.buf = bytearray(np.asarray(list(token_ids), dtype="<i4").tobytes())
        self.num_tokens = len(self.buf) // _WIDTH

    def extend(self, token_ids: Iterable[int]) -> None:
        tokens = np.asarray(list(token_ids), dtype="<i4")
        self.buf += tokens.tobytes()
        self.num_tokens += len(tokens)


def propose_ngram(context: NgramContext, num_draft: int, prompt_lookup_min: int = 2,
                  prompt_lookup_max: int = 4) -> list[int]:
    """The n-gram lookup draft for one request.

    Args:
        context: the request's prompt + generated tokens.
        num_draft: the most draft tokens to return.
        prompt_lookup_min, prompt_lookup_max: the n-gram sizes tried, longest first.

    Returns:
        Up to `num_draft` tokens (empty when no n-gram of the allowed sizes recurs).
    """
    buf, total = context.buf, context.num_tokens
    if num_draft <= 0:
        return []
    for n in range(min(prompt_lookup_max, total - 1), prompt_lookup_min - 1, -1):
        pattern = bytes(buf[(total - n) * _WIDTH:])
        pos = buf.find(pattern)
        while pos != -1 and pos % _WIDTH:
            pos = buf.find(pattern, pos + 1)
        if pos == -1 or pos // _WIDTH >= total - n:
            continue  # only the suffix itself matches
        start = pos // _WIDTH + n
        end = min(total, start + num_draft)
        return np.frombuffer(buf, dtype="<i4", count=end - start, offset=start * _WIDTH).tolist()
    return []
