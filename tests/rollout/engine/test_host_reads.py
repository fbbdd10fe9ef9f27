"""The engine's step reads the device's results on the host once: the sampled tokens.

Every other host read of a device tensor (``.item``, ``.tolist``, a blocking copy, an
index built from a Python list) makes the host wait for the GPU in the middle of a step,
and the GPU then waits for the host's next launch. ``HostReads`` (host_reads.py) counts
them on the CPU, by what the calls are; tests/gpu counts real synchronisations with
``torch.cuda.set_sync_debug_mode``.

If these fail, a change put a host<->device synchronisation back on the step's path.
"""

from __future__ import annotations

import pytest
import torch

from services.rollout.engine import LLMEngine
from tests.rollout.engine.host_reads import HostReads, counting_host_reads
from tests.rollout.engine.test_engine import CONFIG, OracleDrafter, make_request, prompt_of, run_to_end


def mixed_requests():
    """Greedy and sampled rows; top-k, top-p, min-p; processed logprobs; stop tokens
    masked before min_tokens (a masked row), prompts shorter and longer than a block."""
    rows = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_k=5),
            dict(temperature=1.0, top_p=0.9, logprobs_mode="processed"), dict(temperature=1.0, min_p=0.05),
            dict(temperature=1.0, min_tokens=6, stop_token_ids=frozenset({3, 7}), ignore_eos=False)]
    return [make_request(i, prompt_of(5 + 4 * i, i), max_tokens=12, max_new_tokens=12, **kw)
            for i, kw in enumerate(rows)]


def engine(model, **kw) -> LLMEngine:
    return LLMEngine(model, device="cpu", num_kv_blocks=64, block_size=16, max_num_batched_tokens=256,
                     max_num_seqs=8, **kw)


def reads_per_step(e: LLMEngine) -> list[tuple[bool, list]]:
    """Runs ``e`` to the end; per step: (whether it fed a prompt chunk, its counted calls)."""
    steps = []
    while e.has_unfinished():
        with counting_host_reads(e) as reads:
            e.step()
        steps.append((e.metrics.counters.num_prompt_tokens, list(reads.calls)))
    prompts = [0] + [n for n, _ in steps]
    return [(after > before, calls) for before, after, (_, calls) in zip(prompts, prompts[1:], steps)]


@pytest.fixture(scope="module")
def model():
    from services.rollout.loader import init_random_model

    torch.manual_seed(0)
    return init_random_model(CONFIG, seed=1)


def test_decode_steps_read_the_device_once(model):
    e = engine(model, speculative=False)
    for r in mixed_requests():
        e.add_request(r)
    steps = reads_per_step(e)
    decodes = [calls for prefill, calls in steps if not prefill]
    assert len(decodes) >= 8
    for calls in decodes:
        assert len(calls) <= 1, calls
    for prefill, calls in steps:  # a prefill step samples too: the same one read
        assert len(calls) <= 1, calls


def test_verify_steps_read_the_device_once(model):
    reqs = mixed_requests()
    ref = engine(model, speculative=False)
    for r in reqs:
        ref.add_request(r)
    truth = run_to_end(ref)
    e = engine(model, drafter=OracleDrafter({k: o.token_ids for k, o in truth.items()}, wrong_every=3),
               max_draft_len=4)
    for r in reqs:
        e.add_request(r)
    steps = reads_per_step(e)
    assert e.metrics.counters.num_drafts >= 8 and e.metrics.counters.num_accepted_tokens > 0
    for _, calls in steps:
        assert len(calls) <= 1, calls


def test_the_counter_sees_each_kind_of_host_read():
    """The hook itself: each kind of call that synchronises on a GPU is counted, and
    what does not (device-side ops, non-blocking copies, dtype casts) is not."""
    t = torch.arange(6)
    with HostReads() as reads:
        t.tolist(), t[0].item(), bool(t[1]), int(t[2]), float(t[3]), t.cpu(), t.numpy()
        t.to("cpu"), torch.tensor([1, 2], device="cpu"), t.nonzero(), t[t > 2], t[[0, 1]]
        torch.empty(6, dtype=torch.int64).copy_(t, non_blocking=True)
    assert len(reads.calls) == 12, reads.calls
    with HostReads() as reads:
        t.to(torch.float32), t + 1, t.sum(), t[1:3], t.to("cpu", non_blocking=True), t.index_select(0, t[:2])
        with reads.pause():
            t.tolist()
    assert reads.calls == []
