"""The reasoning task: heavy-tailed worked answers, a reward that checks them, and the
suffix-match predictor behind the cross-epoch similarity numbers."""

from __future__ import annotations

import random
import statistics

from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.tiny_llm.examples import load_example
from benchmarks.tiny_llm.tokenizer import build_tokenizer

task = load_example("reasoning_task")


def test_prompts_are_deterministic_and_distinct():
    """Same seed, same problems (RL epochs revisit the same prompt ids); ids unique."""
    a, b = task.make_prompts(200, seed=3), task.make_prompts(200, seed=3)
    assert a == b
    assert len({p.prompt_id for p in a}) == 200
    assert a != task.make_prompts(200, seed=4)
    assert {p.kind for p in a} == set(task.KINDS)


def test_training_samples_follow_the_kind_weights():
    """Training draws repeat problems freely, so even Collatz (99 distinct starts) keeps its share."""
    problems = task.sample_problems(3000, seed=0)
    assert problems == task.sample_problems(3000, seed=0)
    share = sum(p.kind == "collatz" for p in problems) / len(problems)
    assert 0.17 < share < 0.23


def test_worked_answer_lengths_are_heavy_tailed():
    """The longest worked answer is >= 8x the median in tokens, or the scheduler has no tail to fix."""
    tokenizer = build_tokenizer()
    for seed in (0, 1):
        lengths = [
            len(tokenizer.encode(task.worked_answer(p), add_special_tokens=False).ids)
            for p in task.make_prompts(256, seed)
        ]
        assert max(lengths) >= 8 * statistics.median(lengths), (max(lengths), statistics.median(lengths))


def test_worked_examples_by_hand():
    """The step formats the policy learns, spelled out."""
    assert task.worked_answer(task.make_problem("add", (478, 95))) == (
        "8 + 5 + 0 = 13 digit 3 carry 1\n7 + 9 + 1 = 17 digit 7 carry 1\n4 + 0 + 1 = 5 digit 5 carry 0\nanswer 573\n"
    )
    assert task.worked_answer(task.make_problem("gcd", (84, 36))) == "84 = 2 * 36 + 12\n36 = 3 * 12 + 0\nanswer 12\n"
    assert task.worked_answer(task.make_problem("collatz", (4,))) == "4 even 2\n2 even 1\nanswer 2 steps\n"
    assert task.worked_answer(task.make_problem("sort", (3, 1, 2))) == (
        "pass 1 swap 2 : 1 2 3\npass 2 swap 0 : 1 2 3\nanswer 1 2 3\n"
    )
    mul = task.worked_answer(task.make_problem("mul", (478, 95)))
    assert "= 4302 shift 1 = 43020\n" in mul and mul.endswith("sum 2390 + 43020 = 45410\nanswer 45410\n")


def test_reward_accepts_worked_answers_and_rejects_corrupted_ones():
    """Reward 1 for every worked answer; 0 when the final answer is changed or missing."""
    rng = random.Random(0)
    for problem in task.make_prompts(300, seed=5):
        text = task.worked_answer(problem)
        assert task.reward(problem, text) == 1.0
        assert task.reward(problem, text.removesuffix("\n")) == 1.0  # no trailing newline (stopped at <eos>)
        lines = text.split("\n")
        value = problem.answer.split()
        i = rng.choice([k for k, word in enumerate(value) if word.isdigit()])
        value[i] = str(int(value[i]) + rng.randint(1, 9))
        corrupted = "\n".join(lines[:-2] + [f"answer {' '.join(value)}", ""])
        assert task.reward(problem, corrupted) == 0.0, corrupted
        assert task.reward(problem, "\n".join(lines[:-2])) == 0.0  # steps without the answer line
    assert task.reward(problem, "") == 0.0


def test_partial_credit_counts_correct_steps():
    """With partial credit, a wrong answer earns credit x the share of right step lines
    (each counted once, in any order), below 1."""
    problem = task.make_problem("gcd", (84, 36))
    half = "84 = 2 * 36 + 12\n36 = 3 * 12 + 1\nanswer 1\n"
    assert task.reward(problem, half) == 0.0
    assert task.reward(problem, half, partial_credit=0.2) == 0.2 * 1 / 2
    swapped = "36 = 3 * 12 + 0\n84 = 2 * 36 + 12\n84 = 2 * 36 + 12\nanswer 1\n"
    assert task.reward(problem, swapped, partial_credit=0.2) == 0.2  # both lines, the repeat not twice
    assert task.reward(problem, "84 = 2 * 36 + 13\nanswer 1\n", partial_credit=0.2) == 0.0
    assert task.reward(problem, task.worked_answer(problem), partial_credit=0.2) == 1.0


def test_suffix_match_by_hand():
    """Longest-suffix prediction: the start context, ties to the smaller id, back-off, no unigram guesses."""
    predictor = task.SuffixMatchPredictor([[1, 2, 3, 4, 5], [1, 2, 9]])
    assert predictor.count_hits([1, 2, 3, 4, 5]) == 5
    # after "1 2" both 3 and 9 followed once: the tie goes to 3
    assert predictor.count_hits([1, 2, 9]) == 2
    # "7" never occurred: nothing is predicted after it; "7 2" backs off to "2" -> 3
    assert predictor.count_hits([7, 2, 3]) == 1
    # the most frequent continuation wins
    assert task.SuffixMatchPredictor([[5, 6], [5, 7], [5, 7]]).count_hits([5, 7]) == 2
    # a context seen only at the end of a reference backs off to a shorter one
    assert task.SuffixMatchPredictor([[1, 2], [2, 3]]).count_hits([1, 2, 3]) == 3
    assert task.SuffixMatchPredictor([]).count_hits([1, 2]) == 0


def _brute_force_hits(references: list[list[int]], response: list[int]) -> int:
    """The definition, quadratically: longest suffix with a continuation, most frequent follower."""
    texts = [[-1, *r] for r in references]
    hits = 0
    for i, token in enumerate(response):
        context = [-1, *response[:i]]
        for length in range(len(context), 0, -1):
            suffix = context[-length:]
            followers: dict[int, int] = {}
            for text in texts:
                for j in range(len(text) - length):
                    if text[j : j + length] == suffix:
                        followers[text[j + length]] = followers.get(text[j + length], 0) + 1
            if followers:
                best = min(followers, key=lambda t: (-followers[t], t))
                hits += best == token
                break
    return hits


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=4),
    st.lists(st.integers(0, 3), max_size=12),
)
def test_suffix_match_equals_brute_force(references, response):
    """The suffix automaton predicts exactly what the definition does."""
    assert task.SuffixMatchPredictor(references).count_hits(response) == _brute_force_hits(references, response)
