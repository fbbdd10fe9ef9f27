"""The reasoning task's tokenizer: a closed word-level vocabulary built in code.

Text is cut into single digits, lowercase words, single spaces/newlines and single
symbols; each piece is one token, and decoding concatenates them, so
decode(encode(text)) == text for any text of the task. A fixed vocabulary (no training,
no download) keeps the same ids on every machine. Saved as tokenizer.json plus the
config files Hugging Face `AutoTokenizer` needs.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)

WORDS = (
    "add", "mul", "gcd", "collatz", "sort", "answer", "digit", "carry", "row", "shift",
    "sum", "even", "odd", "steps", "pass", "swap",
)  # fmt: skip
SYMBOLS = tuple("+-*/%=<>:,()[]") + (" ", "\n")
DIGITS = tuple("0123456789")
# One piece per token: a digit, a run of lowercase letters, or any other single character.
_PIECE = r"[0-9]|[a-z]+|[^0-9a-z]"


def vocabulary() -> dict[str, int]:
    """Token -> id; special tokens first, so their ids are fixed (see PAD_ID ... UNK_ID)."""
    tokens = SPECIAL_TOKENS + DIGITS + SYMBOLS + WORDS
    return {token: i for i, token in enumerate(tokens)}


def build_tokenizer() -> Tokenizer:
    """The task tokenizer; encoding a single text prepends <bos>."""
    tokenizer = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(_PIECE), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def save_tokenizer(directory: str | Path) -> None:
    """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": True,
        "padding_side": "left",  # generation pads on the left
        **special,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
