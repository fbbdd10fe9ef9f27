"""Sequence.append_tokens (a verify step's tokens at once) against append_token one at a
time: the same tokens, logprobs, finish reason and chunk end, whatever the stop tokens,
min_tokens, max_tokens, max_new_tokens and max_model_len.

If this fails, a verify step commits a different output than plain decoding would."""

from __future__ import annotations

import random

from services.rollout.engine.request import EngineRequest
from services.rollout.engine.sequence import Sequence


def make_seq(rng: random.Random) -> Sequence:
    generated = [rng.randrange(1, 9) for _ in range(rng.randrange(0, 4))]
    req = EngineRequest(request_id="r", prompt_id="p", step_id="s", sample_index=0, prompt_token_ids=[1, 2, 3],
                        generated_token_ids=generated, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=0,
                        max_tokens=len(generated) + rng.randrange(1, 12), max_new_tokens=rng.randrange(1, 10),
                        stop_token_ids=frozenset(rng.sample(range(1, 9), rng.randrange(0, 3))),
                        min_tokens=rng.randrange(0, 6), ignore_eos=rng.random() < 0.5, logprobs=True)
    return Sequence(req, (0,), 3 + len(generated) + rng.randrange(1, 14))


def one_at_a_time(seq: Sequence, tokens: list[int], logprobs: list[float]) -> tuple[int, bool]:
    for i, (t, lp) in enumerate(zip(tokens, logprobs)):
        if seq.append_token(t, lp):
            return i + 1, True
    return len(tokens), False


def state(seq: Sequence) -> tuple:
    return seq.token_ids, seq.out_token_ids, seq.out_logprobs, seq.finish_reason, seq.chunk_done


def test_append_tokens_equals_one_at_a_time():
    rng = random.Random(0)
    for _ in range(3000):
        seed = rng.random()
        a, b = make_seq(random.Random(seed)), make_seq(random.Random(seed))
        for _ in range(rng.randrange(1, 5)):  # a few steps of 1..6 tokens each
            tokens = [rng.randrange(0, 9) for _ in range(rng.randrange(1, 7))]
            logprobs = [-rng.random() for _ in tokens]
            assert a.append_tokens(tokens, logprobs) == one_at_a_time(b, tokens, logprobs)
            assert state(a) == state(b)
            if a.chunk_done:
                break
