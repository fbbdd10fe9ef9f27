"""The engine's batch scheduler on its own (services/rollout/engine/batch_scheduler.py):
admission, prefill chunking, KV pressure and preemption, the token budget left for drafts.
No model: a step's "forward" is the bookkeeping the engine does after it."""

from services.rollout.engine.batch_scheduler import BatchScheduler
from services.rollout.engine.block_manager import BlockManager
from services.rollout.engine.request import EngineRequest
from services.rollout.engine.sequence import Sequence, SequenceStatus


def _seq(i: int, prompt_len: int, prompt_id: str | None = None, max_tokens: int = 32) -> Sequence:
    req = EngineRequest(request_id=f"r{i}", prompt_id=prompt_id or f"p{i}", step_id="s", sample_index=i,
                        prompt_token_ids=[1 + (i + j) % 50 for j in range(prompt_len)], generated_token_ids=[],
                        temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=i, max_tokens=max_tokens,
                        max_new_tokens=max_tokens, stop_token_ids=frozenset(), min_tokens=0, ignore_eos=True,
                        logprobs=False)
    return Sequence(req, (), 256)


def _scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64) -> BatchScheduler:
    return BatchScheduler(BlockManager(num_blocks, block_size), max_num_seqs, max_num_batched_tokens)


def _step(sched: BatchScheduler):
    """Schedule, then what the engine does after the forward: prefill chunks advance,
    sampling sequences commit their fed tokens and one new token."""
    batch = sched.schedule()
    sampling = batch.sampling_seqs()
    sched.postprocess(batch, 0.0)
    for seq in sampling:
        seq.num_computed_tokens += seq.num_scheduled_tokens
        seq.num_scheduled_tokens = 0
        seq.append_token(7, 0.0)
        sched.block_manager.commit(seq)
    return batch, sampling


def test_admission_is_in_arrival_order_up_to_max_num_seqs():
    sched = _scheduler(max_num_seqs=2)
    seqs = [_seq(i, 5) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch, sampling = _step(sched)
    assert batch.seqs == seqs[:2] and sampling == seqs[:2] and batch.num_decodes == 0
    assert list(sched.waiting) == [seqs[2]] and seqs[2].status == SequenceStatus.WAITING


def test_a_long_prompt_is_prefilled_in_chunks_beside_the_running_decodes():
    """Breaks if a long prompt stalls decodes or a chunk is scheduled past the budget."""
    sched = _scheduler(max_num_batched_tokens=16)
    short, long = _seq(0, 4), _seq(1, 40)
    sched.add(short)
    _step(sched)  # short prefilled, now decoding
    sched.add(long)
    chunks = []
    while not long.num_generated:
        batch, sampling = _step(sched)
        assert batch.seqs[0] is short and batch.num_decodes == 1  # the decode goes first, every step
        assert batch.num_tokens <= 16 and sched.budget_left(batch) == 16 - batch.num_tokens
        chunks.append(batch.num_tokens - 1)
    assert chunks == [15, 15, 10] and long.num_computed_tokens == 40


def test_chunks_account_for_every_prompt_token_once():
    sched = _scheduler(max_num_batched_tokens=16)
    seq = _seq(0, 40)
    sched.add(seq)
    fed = []
    while not seq.num_generated:
        batch, _ = _step(sched)
        fed.append(batch.num_tokens)
    assert fed == [16, 16, 8]


def test_kv_pressure_preempts_the_most_recently_admitted_and_requeues_it_first():
    """Breaks if preemption picks the wrong victim, loses it, or frees nothing."""
    sched = _scheduler(num_blocks=4, block_size=4)  # 16 token slots in all
    a, b = _seq(0, 8), _seq(1, 8)
    sched.add(a)
    sched.add(b)
    _step(sched)  # both prefilled: 2 full blocks each, and one sampled token
    batch, _ = _step(sched)  # each needs a third block to decode: a takes the last, b is preempted
    assert batch.num_preempted == 1 and b.status == SequenceStatus.WAITING
    assert sched.waiting[0] is b and sched.running == [a] and batch.seqs == [a]
    assert sched.block_manager.num_free_blocks == 4 - 3


def test_a_sibling_waits_for_the_shared_prompt_then_reuses_its_blocks():
    sched = _scheduler(max_num_batched_tokens=8)
    first, sibling = _seq(0, 16, prompt_id="p"), _seq(1, 16, prompt_id="p")
    sibling.req.prompt_token_ids[:] = first.req.prompt_token_ids
    sched.add(first)
    sched.add(sibling)
    batch, _ = _step(sched)
    assert batch.seqs == [first]  # the sibling would recompute the same blocks: it waits
    assert list(sched.waiting) == [sibling]


def test_the_draft_budget_is_what_the_scheduled_tokens_leave():
    sched = _scheduler(max_num_batched_tokens=10)
    for i in range(3):
        sched.add(_seq(i, 2))
    _step(sched)
    batch = sched.schedule()
    assert batch.num_decodes == 3 and batch.num_tokens == 3 and sched.budget_left(batch) == 7
