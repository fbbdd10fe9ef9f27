"""A synthetic reasoning task with a verifiable reward, for RL of small language models.

Each problem asks for a worked, step-by-step answer: column addition with carries, long
multiplication, Euclid's GCD, a Collatz trace, or bubble-sort passes. How long the worked
answer is depends strongly on the problem (a two-digit GCD takes two lines, a Collatz
trace from 27 takes 111), so response lengths are heavy-tailed, as in real reasoning RL.

Text uses a small closed vocabulary (digits, a few operators and words, space, newline),
so `benchmarks.tiny_llm.tokenizer` can tokenize it exactly. The last line of every worked
answer is `answer <value>`; `reward` checks that value.

Also here: `SuffixMatchPredictor`, the "how much of this response could the previous
epoch have drafted" measure the example trainer prints and `benchmarks.trace_similarity`
reports, so both compute it the same way.

Pure Python: no torch, no numpy. Knows nothing about tokenizers, models or rhymerl.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

KINDS = ("add", "mul", "gcd", "collatz", "sort")
# Sampling weights of the kinds: short problems dominate, long ones make the tail.
_KIND_WEIGHTS = (0.35, 0.10, 0.20, 0.20, 0.15)
ANSWER_WORD = "answer"


@dataclass(frozen=True)
class Problem:
    """One task instance. `prompt` is the text the policy is conditioned on."""

    prompt_id: str  # derived from the content, so the same problem has the same id in any set
    kind: str
    operands: tuple[int, ...]
    prompt: str
    answer: str  # the value after "answer " on the last line of a correct response


# ---- the problems ---------------------------------------------------------------------


def _random_operands(kind: str, rng: random.Random) -> tuple[int, ...]:
    if kind == "add":
        return (_random_number(rng, rng.randint(1, 6)), _random_number(rng, rng.randint(1, 6)))
    if kind == "mul":
        return (_random_number(rng, rng.randint(1, 3)), _random_number(rng, rng.randint(1, 2)))
    if kind == "gcd":
        return (rng.randint(2, 999), rng.randint(2, 999))
    if kind == "collatz":
        # Mostly short trajectories, a few very long ones (27 -> 111 steps).
        return (rng.randint(2, 40) if rng.random() < 0.8 else rng.randint(2, 100),)
    if kind == "sort":
        return tuple(rng.randint(0, 99) for _ in range(rng.randint(2, 7)))
    raise ValueError(f"kind: unknown {kind!r}, expected one of {KINDS}")


def _random_number(rng: random.Random, num_digits: int) -> int:
    if num_digits == 1:
        return rng.randint(0, 9)
    return rng.randint(10 ** (num_digits - 1), 10**num_digits - 1)


def make_problem(kind: str, operands: tuple[int, ...]) -> Problem:
    """The problem of `kind` on `operands` (e.g. make_problem("gcd", (84, 36)))."""
    if kind in ("add", "mul"):
        op = "+" if kind == "add" else "*"
        prompt = f"{kind} {operands[0]} {op} {operands[1]}\n"
    else:
        prompt = f"{kind} " + " ".join(str(x) for x in operands) + "\n"
    prompt_id = f"{kind}-" + "-".join(str(x) for x in operands)
    return Problem(prompt_id, kind, tuple(operands), prompt, _solve(kind, tuple(operands)))


def sample_problems(num: int, seed: int) -> list[Problem]:
    """`num` problems drawn independently (repeats possible), the same for the same seed.

    Kinds follow their sampling weights exactly; training data comes from here.
    """
    rng = random.Random(seed)
    problems = []
    for _ in range(num):
        kind = rng.choices(KINDS, weights=_KIND_WEIGHTS)[0]
        problems.append(make_problem(kind, _random_operands(kind, rng)))
    return problems


def make_prompts(num: int, seed: int) -> list[Problem]:
    """`num` distinct problems (a prompt set: ids unique), the same for the same (num, seed).

    For small sets (up to a few hundred) the kinds follow their weights; a large set runs
    out of distinct Collatz starts (there are 99) and fills up with the other kinds.
    """
    rng = random.Random(seed)
    problems: dict[str, Problem] = {}
    while len(problems) < num:
        kind = rng.choices(KINDS, weights=_KIND_WEIGHTS)[0]
        problem = make_problem(kind, _random_operands(kind, rng))
        problems.setdefault(problem.prompt_id, problem)
    return list(problems.values())


def _solve(kind: str, operands: tuple[int, ...]) -> str:
    if kind == "add":
        return str(operands[0] + operands[1])
    if kind == "mul":
        return str(operands[0] * operands[1])
    if kind == "gcd":
        a, b = operands
        while b:
            a, b = b, a % b
        return str(a)
    if kind == "collatz":
        return f"{len(_collatz_steps(operands[0]))} steps"
    return " ".join(str(x) for x in sorted(operands))


# ---- worked answers -------------------------------------------------------------------


def worked_answer(problem: Problem) -> str:
    """The step-by-step response a perfect policy writes, ending in `answer <value>\\n`."""
    lines = _WORKERS[problem.kind](problem.operands)
    lines.append(f"{ANSWER_WORD} {problem.answer}")
    return "\n".join(lines) + "\n"


def _column_lines(digits_a: list[int], digits_b: list[int], op: str) -> tuple[list[str], int]:
    """Right-to-left column addition (op '+') or digit-times-number (op '*', b one digit)."""
    lines, carry, result = [], 0, []
    for i in range(len(digits_a) if op == "*" else max(len(digits_a), len(digits_b))):
        a = digits_a[i] if i < len(digits_a) else 0
        if op == "+":
            b = digits_b[i] if i < len(digits_b) else 0
            total = a + b + carry
            lines.append(f"{a} + {b} + {carry} = {total} digit {total % 10} carry {total // 10}")
        else:
            b = digits_b[0]
            total = a * b + carry
            lines.append(f"{a} * {b} + {carry} = {total} digit {total % 10} carry {total // 10}")
        result.append(total % 10)
        carry = total // 10
    value = int("".join(str(d) for d in reversed(result))) + carry * 10 ** len(result)
    return lines, value


def _digits(x: int) -> list[int]:
    return [int(c) for c in reversed(str(x))]


def _work_add(operands: tuple[int, ...]) -> list[str]:
    lines, _ = _column_lines(_digits(operands[0]), _digits(operands[1]), "+")
    return lines


def _work_mul(operands: tuple[int, ...]) -> list[str]:
    a, b = operands
    lines, partials = [], []
    for shift, digit in enumerate(_digits(b)):
        lines.append(f"row {a} * {digit}")
        row_lines, value = _column_lines(_digits(a), [digit], "*")
        lines.extend(row_lines)
        shifted = value * 10**shift
        lines.append(f"= {value} shift {shift} = {shifted}")
        partials.append(shifted)
    if len(partials) > 1:
        lines.append("sum " + " + ".join(str(p) for p in partials) + f" = {sum(partials)}")
    return lines


def _work_gcd(operands: tuple[int, ...]) -> list[str]:
    a, b = operands
    lines = []
    while b:
        lines.append(f"{a} = {a // b} * {b} + {a % b}")
        a, b = b, a % b
    return lines


def _collatz_steps(n: int) -> list[tuple[int, str, int]]:
    steps = []
    while n != 1:
        nxt, parity = (n // 2, "even") if n % 2 == 0 else (3 * n + 1, "odd")
        steps.append((n, parity, nxt))
        n = nxt
    return steps


def _work_collatz(operands: tuple[int, ...]) -> list[str]:
    return [f"{n} {parity} {nxt}" for n, parity, nxt in _collatz_steps(operands[0])]


def _work_sort(operands: tuple[int, ...]) -> list[str]:
    """Bubble sort, one line per pass, stopping after the first pass without a swap."""
    values, lines = list(operands), []
    for pass_index in range(1, len(values) + 1):
        swaps = 0
        for i in range(len(values) - pass_index):
            if values[i] > values[i + 1]:
                values[i], values[i + 1] = values[i + 1], values[i]
                swaps += 1
        lines.append(f"pass {pass_index} swap {swaps} : " + " ".join(str(x) for x in values))
        if swaps == 0:
            break
    return lines


_WORKERS = {"add": _work_add, "mul": _work_mul, "gcd": _work_gcd, "collatz": _work_collatz, "sort": _work_sort}


# ---- the reward -----------------------------------------------------------------------


def final_answer(response_text: str) -> str | None:
    """The value on the last `answer ...` line, or None when there is none."""
    for line in reversed(response_text.strip().split("\n")):
        words = line.split()
        if words and words[0] == ANSWER_WORD:
            return " ".join(words[1:])
    return None


def reward(problem: Problem, response_text: str, partial_credit: float = 0.0) -> float:
    """1.0 when the final answer is right, else `partial_credit` x the share of the worked
    answer's step lines that the response contains (each expected line matched at most
    once, in any order; 0.0 by default: a binary reward).

    Every step line is checkable on its own ("14 even 7", "84 = 2 * 36 + 12"), so the
    partial reward is still verifiable, and it separates the samples of a group long
    before a small policy gets whole answers right.

    Text after the first `answer` line is ignored (a policy that stopped without <eos>
    still gets its answer checked); a response with no `answer` line is wrong.
    """
    head, sep, tail = response_text.partition(ANSWER_WORD + " ")
    if sep:
        answer_line = ANSWER_WORD + " " + tail.split("\n", 1)[0]
        if final_answer(answer_line) == problem.answer:
            return 1.0
    if partial_credit <= 0.0:
        return 0.0
    expected = worked_answer(problem).split("\n")[:-2]  # the step lines, without the answer
    unmatched = Counter(expected)
    num_right = 0
    for line in head.split("\n"):
        if unmatched[line] > 0:
            unmatched[line] -= 1
            num_right += 1
    return partial_credit * num_right / max(1, len(expected))


# ---- how much of a response the previous epoch predicts -------------------------------

_START = -1  # marks the start of every sequence, so the first token has a context too


class SuffixMatchPredictor:
    """Predicts the next token of a response from earlier responses to the same prompt.

    At each position it takes the longest suffix of the response so far (the start marker
    included) that occurs in one of the reference responses, and predicts the token that
    most often followed that suffix there (ties: the smaller token id). Suffixes that
    occur only at the very end of a reference are skipped for the next shorter one; when
    no non-empty suffix matches, nothing is predicted.

    A suffix automaton over the references makes this O(1) amortised per token.
    """

    def __init__(self, references: list[list[int]]):
        self._link = [-1]
        self._length = [0]
        self._trans: list[dict[int, int]] = [{}]
        self._count = [0]  # number of end positions of the state's strings
        # One text "START r0 sep0 START r1 sep1 ...": the separators are unique, so no
        # match spans two references.
        last, separator = 0, -2
        for sequence in references:
            for token in (_START, *sequence, separator):
                last = self._extend(last, token)
            separator -= 1
        self._best = self._best_continuations()

    def _extend(self, last: int, token: int) -> int:
        cur = len(self._length)
        self._link.append(-1)
        self._length.append(self._length[last] + 1)
        self._trans.append({})
        self._count.append(1)
        p = last
        while p != -1 and token not in self._trans[p]:
            self._trans[p][token] = cur
            p = self._link[p]
        if p == -1:
            self._link[cur] = 0
            return cur
        q = self._trans[p][token]
        if self._length[p] + 1 == self._length[q]:
            self._link[cur] = q
            return cur
        clone = len(self._length)
        self._link.append(self._link[q])
        self._length.append(self._length[p] + 1)
        self._trans.append(dict(self._trans[q]))
        self._count.append(0)
        while p != -1 and self._trans[p].get(token) == q:
            self._trans[p][token] = clone
            p = self._link[p]
        self._link[q] = clone
        self._link[cur] = clone
        return cur

    def _best_continuations(self) -> list[int | None]:
        # Occurrence counts flow up the suffix-link tree, longest states first.
        for state in sorted(range(1, len(self._length)), key=self._length.__getitem__, reverse=True):
            self._count[self._link[state]] += self._count[state]
        best: list[int | None] = []
        for trans in self._trans:
            real = [(-self._count[nxt], token) for token, nxt in trans.items() if token >= 0]
            best.append(min(real)[1] if real else None)
        return best

    def count_hits(self, response: list[int]) -> int:
        """How many tokens of `response` the references would have predicted."""
        state, hits = self._advance(0, _START), 0
        for token in response:
            hits += self._predict(state) == token
            state = self._advance(state, token)
        return hits

    def _predict(self, state: int) -> int | None:
        # The root is the empty suffix: no context, no prediction.
        while state > 0 and self._best[state] is None:
            state = self._link[state]
        return self._best[state] if state > 0 else None

    def _advance(self, state: int, token: int) -> int:
        while state != -1 and token not in self._trans[state]:
            state = self._link[state]
        return 0 if state == -1 else self._trans[state][token]
