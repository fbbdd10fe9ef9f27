"""The overlapped decode (engine.py, ``overlap``): a step without drafts leaves its
sampled tokens on the device, the next step's forward is launched on them, and only then
are they read and committed. Its samples must be those of an engine that reads each
step's tokens at once, whatever happens between steps: stop tokens found one step late
(the finished sequence's extra row discarded), requests joining, aborted, preempted,
chunks ending, weights reloaded."""

from __future__ import annotations

import random

import pytest
import torch

from services.rollout.engine import LLMEngine
from tests.rollout.engine.test_engine import CONFIG, make_request, prompt_of, run_to_end


@pytest.fixture(scope="module")
def model():
    from services.rollout.loader import init_random_model

    torch.manual_seed(0)
    return init_random_model(CONFIG, seed=3)


def engine(model, overlap: bool, **kw) -> LLMEngine:
    args = dict(device="cpu", num_kv_blocks=26, block_size=4, max_num_seqs=4, max_num_batched_tokens=24,
                speculative=False, measure_cost=False, batch_invariant=True, overlap=overlap)
    args.update(kw)
    return LLMEngine(model, **args)


def lifecycle_requests(rng: random.Random, n: int) -> list:
    """Greedy and sampled requests; stop tokens (EOS and others) with and without
    min_tokens; chunks that end before the sample (max_new_tokens < max_tokens); prompts
    shorter and longer than a block and than the token budget."""
    reqs = []
    for i in range(n):
        stops = frozenset(rng.sample(range(1, CONFIG.vocab_size), rng.choice([0, 2, 6])))
        reqs.append(make_request(
            i, prompt_of(rng.randrange(1, 30), i), temperature=rng.choice([0.0, 1.0, 1.0]),
            max_tokens=rng.randrange(4, 30), max_new_tokens=rng.choice([30, 30, rng.randrange(2, 10)]),
            stop_token_ids=stops, ignore_eos=rng.random() < 0.3, min_tokens=rng.choice([0, 0, 3])))
    return reqs


def outputs_of(outputs) -> dict:
    return {rid: (o.token_ids, o.logprobs, o.finish_reason) for rid, o in outputs.items()}


class Spies:
    """Counts the overlap's cases in one engine: forwards fed the last step's tokens from
    the device, steps whose sequences included some that the last step's tokens had
    finished (their rows discarded), and aborts that found a step's tokens unread."""

    def __init__(self, e: LLMEngine):
        self.fed = self.with_finished = self.aborts_pending = 0
        run, leave, abort = e.runner.run, e._leave, e.abort

        def spied_run(seqs, fed=None):
            self.fed += fed is not None
            return run(seqs, fed)

        def spied_leave(*args):
            self.with_finished += bool(args[-1])
            return leave(*args)

        def spied_abort(request_id):
            self.aborts_pending += e._pending is not None
            return abort(request_id)

        e.runner.run, e._leave, e.abort = spied_run, spied_leave, spied_abort


@pytest.mark.parametrize("seed", range(4))
def test_overlapped_steps_sample_what_steps_reading_at_once_do(model, seed):
    """Two engines (overlap on and off) through the same random lifecycle: requests joining
    at random steps, aborts, a weight reload, too few KV blocks (preemption) and too few
    rows (a queue). Overlap can change when a request is admitted (a finish is seen one
    step later), so an aborted request's chunk is held to its run without aborts: a
    prefix of it, logprobs and all; every other chunk equals it exactly (batch-invariant
    mode: a row's numbers do not depend on its batch)."""
    rng = random.Random(seed)
    reqs = lifecycle_requests(rng, 14)
    truth = outputs_of(run_to_end(_with(engine(model, overlap=False), reqs)))
    engines = {overlap: engine(model, overlap) for overlap in (True, False)}
    spies = Spies(engines[True])
    results = {overlap: {} for overlap in engines}
    waiting, aborted, step = list(reqs), set(), 0
    while waiting or any(e.has_unfinished() for e in engines.values()):
        event = rng.random()
        joining = [waiting.pop(0) for _ in range(min(len(waiting), rng.randrange(1, 4)))] if event < 0.3 else []
        live = [s.request_id for s in engines[True].scheduler.running]
        victim = rng.choice(live) if live and 0.3 <= event < 0.38 else None
        for overlap, e in engines.items():
            for r in joining:
                e.add_request(r)
            if victim is not None:
                e.abort(victim)
            if event > 0.995:
                e.load_weights(model.state_dict())  # (the same weights: the cached prefixes dropped)
            for out in e.step():
                assert out.request_id not in results[overlap]
                results[overlap][out.request_id] = out
        if victim is not None:
            aborted.add(victim)
        step += 1
        assert step < 3000
    for overlap, got in results.items():
        got = outputs_of(got)
        assert got.keys() == truth.keys()
        for rid, (tokens, logprobs, reason) in got.items():
            want_tokens, want_logprobs, want_reason = truth[rid]
            if reason == "abort":
                assert rid in aborted
                assert (tokens, logprobs) == (want_tokens[:len(tokens)], want_logprobs[:len(tokens)]), (overlap, rid)
            else:
                assert (tokens, logprobs, reason) == (want_tokens, want_logprobs, want_reason), (overlap, rid)
        e = engines[overlap]
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
    # the overlap's cases all happened
    assert spies.fed > 5 and spies.with_finished > 0 and spies.aborts_pending > 0
    assert engines[True].metrics.counters.num_preemptions + engines[False].metrics.counters.num_preemptions > 0


def _with(e: LLMEngine, reqs) -> LLMEngine:
    for r in reqs:
        e.add_request(r)
    return e


def test_a_steady_batch_feeds_each_step_the_last_ones_tokens_from_the_device(model):
    """Past their prefill, a batch whose sequences all decode runs every step but the
    last on the tokens the step before left on the device (no read before the launch),
    and the samples equal the engine's that reads them at once."""
    reqs = [make_request(i, prompt_of(3 + i, i), temperature=[0.0, 1.0][i % 2], max_tokens=20,
                         max_new_tokens=20) for i in range(4)]
    want = outputs_of(run_to_end(_with(engine(model, overlap=False), reqs)))
    e = _with(engine(model, overlap=True), reqs)
    spies = Spies(e)
    got = outputs_of(run_to_end(e))
    assert got == want
    assert spies.fed == 19  # every decode step after the prefill's (20 tokens: 1 prefill + 19 decodes)


def test_an_abort_reads_the_pending_tokens_first(model):
    """An abort between steps reads the tokens the last step left on the device: the
    aborted chunk carries its last sampled token, never the placeholder, and a sequence
    that token finished comes back finished, not aborted."""
    req = make_request(0, prompt_of(6), temperature=0.0, max_tokens=12, max_new_tokens=12)
    want = run_to_end(_with(engine(model, overlap=False), [req]))["r0"]
    e = _with(engine(model, overlap=True), [req])
    for _ in range(4):
        assert e.step() == []
    assert e._pending is not None
    assert e.abort("r0")
    (out,) = e.step()
    assert out.finish_reason == "abort"
    assert out.token_ids == want.token_ids[:4] and out.logprobs == want.logprobs[:4]
    assert not e.has_unfinished() and e.block_manager.num_free_blocks == e.block_manager.num_blocks


def test_a_stop_token_found_one_step_late_discards_the_extra_row(model):
    """A sequence whose pending token is a stop token ran one more row in the overlapped
    step; that row is dropped and the sequence ends where the engine reading at once
    ends it, while its batch mates go on."""
    probe = run_to_end(_with(engine(model, overlap=False), [make_request(
        0, prompt_of(4), temperature=0.0, max_tokens=30, max_new_tokens=30)]))["r0"].token_ids
    stop = probe[6]  # greedy: the 7th token, made a stop token
    reqs = [make_request(0, prompt_of(4), temperature=0.0, max_tokens=30, max_new_tokens=30,
                         stop_token_ids=frozenset({stop})),
            make_request(1, prompt_of(9, 1), temperature=1.0, max_tokens=30, max_new_tokens=30)]
    want = outputs_of(run_to_end(_with(engine(model, overlap=False), reqs)))
    e = _with(engine(model, overlap=True), reqs)
    spies = Spies(e)
    got = outputs_of(run_to_end(e))
    assert got == want
    assert want["r0"][0][-1] == stop and want["r0"][2] == "stop" and len(want["r1"][0]) == 30
    assert spies.with_finished >= 1


def test_without_overlap_no_step_leaves_tokens_unread(model):
    e = _with(engine(model, overlap=False), [make_request(0, prompt_of(5), max_tokens=6, max_new_tokens=6)])
    spies = Spies(e)
    while e.has_unfinished():
        e.step()
        assert e._pending is None
    assert spies.fed == 0

