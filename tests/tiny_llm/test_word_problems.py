"""The English word-problem task (clients/python/examples/word_problems.py): problems
generated with their answers, answer extraction, the reward, and the example trainer's
chat-template encoding of its prompts.

If these fail, GRPO on a pretrained chat model learns from a wrong reward (an answer
misread or a right one refused), or the model sees its prompts outside its chat format.
"""

from __future__ import annotations

import re

import pytest

from benchmarks.tiny_llm.examples import load_example

task = load_example("word_problems")
grpo = load_example("grpo_trainer")


def numbers_in(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text.split("\n")[0])]


def test_prompts_are_deterministic_distinct_and_cover_every_kind():
    a, b = task.make_prompts(60, seed=1), task.make_prompts(60, seed=1)
    assert a == b and a != task.make_prompts(60, seed=2)
    assert len({p.prompt_id for p in a}) == 60
    assert {p.kind for p in a} == set(task.KINDS)
    assert task.sample_problems(20, seed=5) == task.sample_problems(20, seed=5)


@pytest.mark.parametrize("kind", task.KINDS)
def test_the_answer_is_what_the_text_asks(kind):
    """Recomputes each answer from the numbers the English text states (not from the
    operands the generator kept), so a template whose wording and answer disagree fails."""
    for problem in [p for p in task.make_prompts(120, seed=0) if p.kind == kind]:
        n = numbers_in(problem.prompt)
        expected = {
            "add": lambda: n[0] + n[1], "take": lambda: n[0] - n[1], "groups": lambda: n[0] * n[1],
            "share": lambda: n[0] // n[1], "packs": lambda: n[0] * n[1] - n[2], "change": lambda: n[2] - n[0] * n[1],
        }[kind]()
        assert int(problem.answer) == expected > 0, problem.prompt
        if kind == "share":
            assert n[0] % n[1] == 0, problem.prompt
        assert problem.prompt.endswith(task.INSTRUCTION)


def test_make_problem_is_a_function_of_kind_and_operands():
    p = task.make_problem("packs", (3, 4, 5, 0, 1))
    assert p.answer == "7" and p.prompt_id == "packs-3-4-5-0-1"
    assert p.prompt.startswith("Tom buys 3 packs of marbles with 4 marbles in each pack, then gives away 5.")
    assert task.make_problem("packs", (3, 4, 5, 0, 1)) == p
    with pytest.raises(ValueError, match="kind"):
        task.make_problem("divide", (1, 2, 0, 0))


@pytest.mark.parametrize(("text", "expected"), [
    ("3 + 5 = 8\nAnswer: 8", "8"),
    ("First 12, then 7.\nThe answer is 19.", "19"),
    ("answer = $1,250", "1250"),
    ("Answer: 4\nWait, no. Answer: 6", "6"),  # the last answer line wins
    ("He has 8 apples now, 3 more than before.", "3"),  # no answer line: the last number
    ("Answer: 12 apples, since 4 x 3 = 12", "12"),  # an answer line beats later numbers
    ("I do not know.", None),
    ("", None),
])
def test_final_answer(text, expected):
    assert task.final_answer(text) == expected


def test_reward_is_binary_by_default_with_optional_credit_for_reaching_the_answer():
    problem = task.make_problem("add", (3, 5, 0, 0))
    assert problem.answer == "8"
    assert task.reward(problem, "3 + 5 = 8\nAnswer: 8") == 1.0
    assert task.reward(problem, "Tom has 8 apples.") == 1.0
    assert task.reward(problem, "Answer: 08") == 1.0
    assert task.reward(problem, "Answer: 9") == 0.0
    wrong_end = "3 + 5 = 8, and 8 + 1 = 9.\nAnswer: 9"
    assert task.reward(problem, wrong_end) == 0.0
    assert task.reward(problem, wrong_end, partial_credit=0.25) == 0.25  # a step reached 8
    assert task.reward(problem, "3 + 5 = 8 so Tom has 8 and then", partial_credit=0.25) == 1.0  # last number: 8
    assert task.reward(problem, "3 + 5 = 80\nAnswer: 80", partial_credit=0.25) == 0.0  # 80 is not 8
    assert task.reward(problem, "Answer: 9", partial_credit=0.25) == 0.0


class ChatTokenizer:
    """A tokenizer with a chat template, standing in for a real one's two calls."""

    chat_template = "<chat>"

    def apply_chat_template(self, messages, add_generation_prompt, return_dict):
        assert add_generation_prompt and not return_dict
        return [1] + [ord(c) for c in messages[0]["content"]] + [2]

    def __call__(self, text):
        raise AssertionError("a chat model's prompt must go through its template")


def test_trainer_wraps_prompts_in_the_chat_template():
    problems = task.make_prompts(3, seed=0)
    prompts = grpo.encode_prompts(ChatTokenizer(), problems)
    assert [p.prompt_id for p in prompts] == [p.prompt_id for p in problems]
    assert prompts[0].token_ids == [1] + [ord(c) for c in problems[0].prompt] + [2]
    assert grpo.TASKS["words"] is task
