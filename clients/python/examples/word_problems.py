"""Arithmetic word problems in plain English with a verifiable reward, for RL of
pretrained chat models (e.g. SmolLM2-135M-Instruct, `make model-smollm2`).

Six kinds, each one or two arithmetic steps: adding, taking away, equal groups, sharing,
buying packs then eating some, and change from a purchase. Every problem is generated
with its integer answer, so the reward is exact. The prompt asks for the final answer on
a last line `Answer: <number>`; `final_answer` reads that line, or, when a reply has no
such line, the last number in it (small models often state the answer in a sentence).

The same interface as `reasoning_task` (Problem, make_prompts, sample_problems, reward),
so the example trainer runs either with `--task words` or `--task reasoning`. Unlike that
task's closed vocabulary, these prompts need a real tokenizer, and the trainer wraps
them in the tokenizer's chat template.

Pure Python: no torch, no numpy. Knows nothing about tokenizers, models or rhymerl.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

KINDS = ("add", "take", "groups", "share", "packs", "change")
NAMES = ("Tom", "Mia", "Sam", "Lena", "Omar", "Ava", "Ben", "Zoe")
ITEMS = ("apples", "marbles", "stickers", "cookies", "pencils", "stamps", "shells", "books")
INSTRUCTION = "Think step by step, then give the final answer on the last line as: Answer: <number>"
_ANSWER_LINE = re.compile(r"answer\s*(?:is)?\s*[:=]?\s*\$?\s*(-?\d[\d,]*)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*")


@dataclass(frozen=True)
class Problem:
    """One task instance. `prompt` is the user's message (the trainer adds the chat template)."""

    prompt_id: str  # derived from the content, so the same problem has the same id in any set
    kind: str
    operands: tuple[int, ...]  # the numbers, then the name's and the item's index
    prompt: str
    answer: str  # the integer, as text


def make_problem(kind: str, operands: tuple[int, ...]) -> Problem:
    """The problem of `kind` on `operands` = (numbers..., name index, item index)."""
    *numbers, name_index, item_index = operands
    name, item = NAMES[name_index % len(NAMES)], ITEMS[item_index % len(ITEMS)]
    friend = NAMES[(name_index + 1) % len(NAMES)]
    if kind == "add":
        a, b = numbers
        text, answer = (f"{name} has {a} {item}. {friend} gives {name} {b} more. "
                        f"How many {item} does {name} have now?", a + b)  # fmt: skip
    elif kind == "take":
        a, b = numbers
        text, answer = (f"{name} had {a} {item} and gave {b} of them to {friend}. "
                        f"How many {item} does {name} have left?", a - b)  # fmt: skip
    elif kind == "groups":
        a, b = numbers
        text, answer = f"A box holds {a} {item}. How many {item} are in {b} boxes?", a * b
    elif kind == "share":
        a, b = numbers
        text, answer = (f"{name} shares {a * b} {item} equally among {b} friends. "
                        f"How many {item} does each friend get?", a)  # fmt: skip
    elif kind == "packs":
        a, b, c = numbers
        text, answer = (f"{name} buys {a} packs of {item} with {b} {item} in each pack, then gives away {c}. "
                        f"How many {item} does {name} have?", a * b - c)  # fmt: skip
    elif kind == "change":
        a, b, c = numbers
        text, answer = (f"One notebook costs {a} dollars. {name} buys {b} notebooks and pays with {c} dollars. "
                        f"How many dollars of change does {name} get?", c - a * b)  # fmt: skip
    else:
        raise ValueError(f"kind: unknown {kind!r}, expected one of {KINDS}")
    prompt_id = f"{kind}-" + "-".join(str(x) for x in operands)
    return Problem(prompt_id, kind, tuple(operands), f"{text}\n{INSTRUCTION}", str(answer))


def _random_operands(kind: str, rng: random.Random) -> tuple[int, ...]:
    if kind == "add":
        numbers = (rng.randint(2, 60), rng.randint(2, 40))
    elif kind == "take":
        a = rng.randint(5, 80)
        numbers = (a, rng.randint(1, a - 1))
    elif kind in ("groups", "share"):
        numbers = (rng.randint(2, 12), rng.randint(2, 9))
    elif kind == "packs":
        a, b = rng.randint(2, 8), rng.randint(2, 10)
        numbers = (a, b, rng.randint(1, a * b - 1))
    elif kind == "change":
        a, b = rng.randint(2, 9), rng.randint(2, 5)
        numbers = (a, b, rng.choice([c for c in (10, 20, 50, 100) if c > a * b]))  # some change
    else:
        raise ValueError(f"kind: unknown {kind!r}, expected one of {KINDS}")
    return (*numbers, rng.randrange(len(NAMES)), rng.randrange(len(ITEMS)))


def sample_problems(num: int, seed: int) -> list[Problem]:
    """`num` problems drawn independently (repeats possible), the same for the same seed."""
    rng = random.Random(seed)
    problems = []
    for _ in range(num):
        kind = rng.choice(KINDS)
        problems.append(make_problem(kind, _random_operands(kind, rng)))
    return problems


def make_prompts(num: int, seed: int) -> list[Problem]:
    """`num` distinct problems (ids unique), the same for the same (num, seed); the kinds
    take turns, so any set of six or more has every kind."""
    rng = random.Random(seed)
    problems: dict[str, Problem] = {}
    while len(problems) < num:
        kind = KINDS[len(problems) % len(KINDS)]
        problem = make_problem(kind, _random_operands(kind, rng))
        problems.setdefault(problem.prompt_id, problem)
    return list(problems.values())


def final_answer(response_text: str) -> str | None:
    """The integer the response gives as its answer (commas dropped), or None.

    The last `Answer: N` (also `answer is N`, `answer = $N`) wins; without one, the last
    number in the response.
    """
    matches = _ANSWER_LINE.findall(response_text)
    if not matches:
        matches = _NUMBER.findall(response_text)
    if not matches:
        return None
    value = matches[-1].replace(",", "")
    return value if value.lstrip("-").isdigit() else None


def reward(problem: Problem, response_text: str, partial_credit: float = 0.0) -> float:
    """1.0 when the final answer equals the problem's; else `partial_credit` when the
    right number appears anywhere in the response (a step reached it, but the reply ended
    elsewhere or was cut off), else 0.0. With the default 0.0 the reward is binary.

    The partial reward is still verifiable, and it separates the samples of a group when
    a small model's replies are cut off before their last line (short rollouts on a CPU).
    """
    answer = final_answer(response_text)
    if answer is not None and int(answer) == int(problem.answer):
        return 1.0
    if partial_credit > 0.0 and int(problem.answer) in _numbers(response_text):
        return partial_credit
    return 0.0


def _numbers(text: str) -> set[int]:
    return {int(m.replace(",", "")) for m in _NUMBER.findall(text) if m.replace(",", "").lstrip("-").isdigit()}
