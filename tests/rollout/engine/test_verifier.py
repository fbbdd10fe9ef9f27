"""The verifier on its own (services/rollout/engine/verifier.py), in the style of vLLM's
rejection-sampler tests: a greedy table of draft tokens vs the target's argmax with the
expected accepted / recovered / bonus output, and a sampled case whose draws are fixed by
the seed (the keyed sampler plays the role of fixed uniforms)."""

import pytest
import torch

from services.rollout.engine.request import EngineRequest
from services.rollout.engine.sequence import Sequence
from services.rollout.engine.verifier import verify

VOCAB = 16


def _seq(draft: list[int], temperature: float = 0.0, prompt: tuple[int, ...] = (1, 2, 3), seed: int = 7) -> Sequence:
    req = EngineRequest(request_id="r", prompt_id="p", step_id="s", sample_index=0, prompt_token_ids=list(prompt),
                        generated_token_ids=[], temperature=temperature, top_p=1.0, top_k=0, min_p=0.0, seed=seed,
                        max_tokens=32, max_new_tokens=32, stop_token_ids=frozenset(), min_tokens=0,
                        ignore_eos=True, logprobs=True)
    seq = Sequence(req, (), 128)
    seq.draft_token_ids = list(draft)
    return seq


def _logits(argmax: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(argmax), VOCAB)  # [num_rows, vocab]
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 10.0
    return logits


# (draft, target argmax per row (one more row than the draft), expected output tokens, accepted)
GREEDY = [
    ([], [5], [5], 0),                          # no draft: the target's token
    ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8], 3),  # all accepted, then the bonus token
    ([5, 6, 7], [5, 9, 7, 8], [5, 9], 1),        # rejected at 2: the recovered token ends it
    ([4, 6, 7], [5, 6, 7, 8], [5], 0),           # rejected at once: only the recovered token
    ([5, 6], [5, 6, 3], [5, 6, 3], 2),
    ([5, 5, 5], [5, 5, 2, 5], [5, 5, 2], 2),     # a later match after a rejection does not count
]


@pytest.mark.parametrize("draft,argmax,expected,accepted", GREEDY)
def test_greedy_table(draft, argmax, expected, accepted):
    [verdict] = verify(_logits(argmax), [_seq(draft)])
    assert verdict.token_ids == expected
    assert (verdict.num_draft, verdict.num_accepted) == (len(draft), accepted)
    assert len(verdict.logprobs) == len(expected) and all(lp <= 0 for lp in verdict.logprobs)


def test_rows_are_split_per_sequence_in_batch_order():
    seqs = [_seq([5, 6]), _seq([]), _seq([9])]
    verdicts = verify(_logits([5, 1, 2, 3, 9, 4]), seqs)
    assert [v.token_ids for v in verdicts] == [[5, 1], [3], [9, 4]]
    assert [v.num_accepted for v in verdicts] == [1, 0, 1]


def test_sampled_tokens_are_those_a_plain_run_draws_at_each_position():
    """Temperature 1: the token at each position is keyed on (seed, position), so a draft
    equal to the plain run's draws is accepted whole, and a draft that departs from them
    gets the plain run's token at the first difference. Breaks if verification is lossy."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))  # [4, vocab]
    prompt = [1, 2, 3]
    plain = []  # the plain run: one position at a time, each sequence one token longer
    for j in range(4):
        [v] = verify(logits[j:j + 1], [_seq([], 1.0, tuple(prompt + plain))])
        plain.append(v.token_ids[0])
    [whole] = verify(logits, [_seq(plain[:3], 1.0, tuple(prompt))])
    assert whole.token_ids == plain and whole.num_accepted == 3
    wrong = (plain[1] + 1) % VOCAB
    [cut] = verify(logits, [_seq([plain[0], wrong, plain[2]], 1.0, tuple(prompt))])
    assert cut.token_ids == plain[:2] and cut.num_accepted == 1
    [again] = verify(logits, [_seq(plain[:3], 1.0, tuple(prompt))])
    assert again.token_ids == whole.token_ids and again.logprobs == whole.logprobs  # reproducible


def test_sampling_rows_runs_equal_rows_one_at_a_time():
    """SamplingRows.add with count= (a run of positions) gives the sampler the same inputs
    as adding each row alone; masked rows included."""
    from services.rollout.engine.logprobs import SamplingRows

    reqs = [_seq([], temperature=0.5 * i, seed=i).req for i in range(4)]
    runs = [(reqs[0], 10, frozenset(), 1), (reqs[1], 3, frozenset({2, 5}), 2), (reqs[1], 5, frozenset(), 3),
            (reqs[2], 7, frozenset(), 4), (reqs[3], 40, frozenset({1}), 1)]
    together, alone = SamplingRows(), SamplingRows()
    for req, position, masked, count in runs:
        together.add(req, position, masked, count)
        for j in range(count):
            alone.add(req, position + j, masked)
    assert len(together) == len(alone) == 11
    for a, b in zip([*together.params("cpu"), *together.keys("cpu"), together.processed_rows("cpu")],
                    [*alone.params("cpu"), *alone.keys("cpu"), alone.processed_rows("cpu")]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    logits = torch.randn(11, VOCAB)
    assert torch.equal(together.mask(logits), alone.mask(logits))
    assert alone.keys("cpu")[1].tolist() == [10, 3, 4, 5, 6, 7, 7, 8, 9, 10, 40]
