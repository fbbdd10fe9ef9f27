"""LLMEngine against a plain reference loop (full recompute, dense attention, one token at
a time, the same sampler): continuous batching, chunked prefill, prefix sharing,
speculation, chunked execution and resume, stops, aborts and KV exhaustion.

If these fail, the engine's output is no longer the policy's own sample for the seed:
the trainer would get tokens or logprobs that differ with batch composition, drafting or
where a chunk ran.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from kernels.sampling import sample
from services.rollout.engine import CostModel, EngineRequest, LLMEngine
from services.rollout.engine.engine import cost_clock
from services.rollout.engine.model_runner import CUDAGraphs
from services.rollout.loader import init_random_model
from services.rollout.models.base import DenseCausalAttention
from services.rollout.models.config import ModelConfig

EOS = 0
CONFIG = ModelConfig(
    architecture="qwen2", vocab_size=61, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling=None, max_position_embeddings=128, tie_word_embeddings=False, attention_bias=True,
    qk_norm=False, eos_token_ids=(EOS,), bos_token_id=None, dtype="float32")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return init_random_model(CONFIG, seed=1)


def make_request(i: int, prompt: list[int], **kw) -> EngineRequest:
    fields = dict(request_id=f"r{i}", prompt_id=f"p{len(prompt)}", step_id="s0", sample_index=i,
                  prompt_token_ids=list(prompt), generated_token_ids=[], temperature=1.0, top_p=1.0, top_k=0,
                  min_p=0.0, seed=1000 + i, max_tokens=24, max_new_tokens=24, stop_token_ids=frozenset(),
                  min_tokens=0, ignore_eos=True, logprobs=True)
    fields.update(kw)
    return EngineRequest(**fields)


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [1 + (7 * j + 3 * salt) % (CONFIG.vocab_size - 1) for j in range(n)]


@torch.inference_mode()
def reference_generate(model, req: EngineRequest) -> tuple[list[int], list[float], str | None]:
    """One token per full forward over the whole sequence, dense attention, no cache."""
    tokens = list(req.prompt_token_ids) + list(req.generated_token_ids)
    stops = set(req.stop_token_ids) | (set() if req.ignore_eos else set(CONFIG.eos_token_ids))
    out, logprobs = [], []
    while True:
        gen_index = len(tokens) - len(req.prompt_token_ids)
        ids = torch.tensor(tokens)
        attn = DenseCausalAttention(torch.tensor([0, len(tokens)]))
        logits = model.compute_logits(model.forward(ids, torch.arange(len(tokens)), attn)[-1:])
        if gen_index < req.min_tokens:
            logits[0, sorted(stops)] = float("-inf")
        tok, lp = sample(logits, torch.tensor([req.temperature]), torch.tensor([max(req.top_k, 0)], dtype=torch.int32),
                         torch.tensor([req.top_p]), torch.tensor([req.min_p]), torch.tensor([req.seed]),
                         torch.tensor([len(tokens)]))
        tokens.append(int(tok))
        out.append(int(tok))
        logprobs.append(float(lp))
        if int(tok) in stops and gen_index >= req.min_tokens:
            return out, logprobs, "stop"
        if gen_index + 1 >= req.max_tokens or len(tokens) >= CONFIG.max_position_embeddings:
            return out, logprobs, "length"
        if len(out) >= req.max_new_tokens:
            return out, logprobs, None


def run_to_end(engine: LLMEngine, late: dict[int, list[EngineRequest]] | None = None, max_steps: int = 2000):
    """Step until idle; `late[k]` requests join before step k. Returns {request_id: output}."""
    outputs, step = {}, 0
    late = dict(late or {})
    while engine.has_unfinished() or late:
        for req in late.pop(step, []):
            engine.add_request(req)
        for out in engine.step():
            assert out.request_id not in outputs, "a request finished twice"
            outputs[out.request_id] = out
        step += 1
        assert step < max_steps
    return outputs


class OracleDrafter:
    """Proposes the true continuation (known from the reference), optionally corrupted
    at every `wrong_every`-th draft position."""

    def __init__(self, continuations: dict[str, list[int]], wrong_every: int = 0):
        self.continuations = continuations
        self.wrong_every = wrong_every
        self.generated: dict[str, list[int]] = {}
        self.acceptance: list[tuple[int, int]] = []
        self.budgets: list[int | None] = []

    def start_request(self, request_id, prompt_id, prompt_token_ids, generated_token_ids=()):
        assert request_id not in self.generated
        self.generated[request_id] = list(generated_token_ids)

    def add_tokens(self, request_id, token_ids):
        self.generated[request_id].extend(token_ids)

    def propose(self, request_ids, max_lens, stop_token_ids=None, budget=None):
        self.budgets.append(budget)
        drafts = []
        for rid, max_len in zip(request_ids, max_lens):
            done = len(self.generated[rid])
            draft = list(self.continuations[rid][done:done + max_len])
            if self.wrong_every:
                draft = [(t + 1) % CONFIG.vocab_size if (done + j) % self.wrong_every == self.wrong_every - 1 else t
                         for j, t in enumerate(draft)]
            drafts.append(draft)
        return drafts

    def record_acceptance(self, request_id, num_draft, num_accepted):
        self.acceptance.append((num_draft, num_accepted))

    def stop_request(self, request_id):
        del self.generated[request_id]


def new_engine(model, **kw) -> LLMEngine:
    # The H100 table, not this machine's measured speed, sizes the drafts: the same on every machine.
    args = dict(device="cpu", num_kv_blocks=256, block_size=4, max_num_batched_tokens=64, max_draft_len=6,
                measure_cost=False)
    args.update(kw)
    return LLMEngine(model, **args)


def mixed_requests() -> list[EngineRequest]:
    """Greedy and sampled rows, top-k/top-p/min-p, prompts shorter and longer than a block."""
    reqs = []
    for i, (n, temp, top_k, top_p, min_p, max_tokens) in enumerate([
            (3, 0.0, 0, 1.0, 0.0, 20), (17, 1.0, 0, 1.0, 0.0, 24), (40, 0.8, 10, 1.0, 0.0, 12),
            (9, 1.2, 0, 0.9, 0.0, 30), (1, 1.0, 0, 1.0, 0.05, 16), (25, 0.0, 0, 1.0, 0.0, 8)]):
        reqs.append(make_request(i, prompt_of(n, i), temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                                 max_tokens=max_tokens, max_new_tokens=max_tokens))
    return reqs


def assert_same(outputs, references, tol=1e-4):
    for rid, (tokens, logprobs, reason) in references.items():
        out = outputs[rid]
        assert out.token_ids == tokens, rid
        assert out.finish_reason == reason, rid
        assert torch.allclose(torch.tensor(out.logprobs), torch.tensor(logprobs), atol=tol), rid


# ---------------------------------------------------------------------- batching


def test_continuous_batching_matches_reference(model):
    """Mixed lengths and sampling settings, chunked prefill (budget 16 tokens), requests
    joining mid-run: every sample equals its one-at-a-time reference."""
    reqs = mixed_requests()
    refs = {r.request_id: reference_generate(model, r) for r in reqs}
    engine = new_engine(model, max_num_batched_tokens=16, speculative=False)
    for r in reqs[:3]:
        engine.add_request(r)
    outputs = run_to_end(engine, late={3: reqs[3:5], 9: reqs[5:]})
    assert_same(outputs, refs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.num_running() == engine.num_waiting() == 0


def test_max_num_seqs_queues_the_rest(model):
    """With room for 2 running sequences, the others wait and still come out right."""
    reqs = mixed_requests()[:4]
    refs = {r.request_id: reference_generate(model, r) for r in reqs}
    engine = new_engine(model, max_num_seqs=2, speculative=False)
    for r in reqs:
        engine.add_request(r)
    engine.step()
    assert engine.num_running() == 2 and engine.num_waiting() == 2
    assert_same(run_to_end(engine), refs)


# ---------------------------------------------------------------------- speculation


@pytest.mark.parametrize("wrong_every", [0, 3])
def test_speculation_is_lossless(model, wrong_every):
    """Oracle (all accepted) and partly wrong drafts: tokens identical and logprobs within
    1e-5 of speculation off; drafts were really verified (and accepted when right)."""
    reqs = mixed_requests()
    plain = run_to_end(_engine_with(model, reqs, speculative=False))
    continuations = {rid: out.token_ids for rid, out in plain.items()}
    drafter = OracleDrafter(continuations, wrong_every)
    engine = _engine_with(model, reqs, drafter=drafter)
    spec = run_to_end(engine)
    for rid, out in plain.items():
        assert spec[rid].token_ids == out.token_ids
        assert spec[rid].finish_reason == out.finish_reason
        assert torch.allclose(torch.tensor(spec[rid].logprobs), torch.tensor(out.logprobs), atol=1e-5)
    c = engine.metrics.counters
    assert c.num_draft_tokens > 0
    if wrong_every == 0:
        assert c.num_accepted_tokens == c.num_draft_tokens
        assert c.num_steps < run_steps(model, reqs) // 2
    else:
        assert 0 < c.num_accepted_tokens < c.num_draft_tokens
    assert sum(o.num_draft_tokens for o in spec.values()) == c.num_draft_tokens
    assert sum(o.num_accepted_tokens for o in spec.values()) == c.num_accepted_tokens
    assert all(sum(o.accepted_per_pos[:1]) <= o.num_verify_steps for o in spec.values())
    assert not drafter.generated, "every request was stopped in the drafter"


def _engine_with(model, reqs, **kw):
    engine = new_engine(model, **kw)
    for r in reqs:
        engine.add_request(r)
    return engine


def run_steps(model, reqs) -> int:
    engine = _engine_with(model, reqs, speculative=False)
    run_to_end(engine)
    return engine.metrics.counters.num_steps


def test_stop_token_inside_draft_ends_the_sample(model):
    """A draft running past a stop token (and past min_tokens) never emits beyond it; stop
    tokens before min_tokens are masked exactly as without speculation."""
    base = make_request(0, prompt_of(6), temperature=1.0, max_tokens=30, max_new_tokens=30)
    free_run = reference_generate(model, base)[0]
    stop = free_run[6]
    reqs = [dataclasses.replace(base, stop_token_ids=frozenset({stop})),
            dataclasses.replace(base, request_id="r1", stop_token_ids=frozenset({stop}), min_tokens=10),
            dataclasses.replace(base, request_id="r2", ignore_eos=False, seed=7)]
    refs = {r.request_id: reference_generate(model, r) for r in reqs}
    assert refs["r0"][2] == "stop" and refs["r0"][0][-1] == stop
    longer = {rid: tokens + [stop] * 40 for rid, (tokens, _, _) in refs.items()}  # drafts run past the stop
    engine = _engine_with(model, reqs, drafter=OracleDrafter(longer))
    assert_same(run_to_end(engine), refs, tol=1e-5)


def test_draft_budget_follows_the_cost_curve(model):
    """The draft budget shrinks as the batch grows and is 0 past the flat part of the curve."""
    cost = CostModel()
    assert cost.draft_budget(1) > cost.draft_budget(64) > 0
    assert cost.draft_budget(512) == 0
    reqs = [make_request(i, prompt_of(5, i), max_tokens=10, max_new_tokens=10) for i in range(3)]
    plain = run_to_end(_engine_with(model, reqs, speculative=False))
    drafter = OracleDrafter({rid: o.token_ids for rid, o in plain.items()})
    tight = CostModel(((1, 1.0), (2, 1.0), (3, 10.0), (4, 100.0)), tolerance=0.0)  # 2 tokens per forward
    engine = _engine_with(model, reqs, drafter=drafter, cost_model=tight)
    run_to_end(engine)
    assert all(b is not None and b <= 1 for b in drafter.budgets)


def test_a_measuring_cost_model_prices_with_its_latest_curve():
    """The curve and its flat part are cached per version (the engine reads them every
    step): each observed step time must reach the next answer, as a model built fresh
    from the same observations gives it."""
    live = CostModel(measure=True, min_samples=1, tolerance=0.5)
    steps = [(1, 1.0), (64, 1.2), (256, 1.4), (1024, 9.0), (64, 6.0), (256, 7.0), (1, 0.5), (1024, 0.6)]
    for i, (num_tokens, ms) in enumerate(steps):
        live.observe(num_tokens, ms)
        fresh = CostModel(measure=True, min_samples=1, tolerance=0.5)
        for seen in steps[:i + 1]:
            fresh.observe(*seen)
        assert live.curve() == fresh.curve() and live.flat_tokens() == fresh.flat_tokens(), i
        assert live.draft_budget(8) == fresh.draft_budget(8)
    live.tolerance = 0.0  # a changed tolerance is a different flat part
    curve = live.curve()
    assert live.flat_tokens() == CostModel(zip(curve.num_tokens, curve.ms), tolerance=0.0).flat_tokens()


def test_on_a_cpu_a_drafter_pricing_its_tokens_on_the_engines_curve_is_not_held_to_the_flat_part(model):
    """On a CPU the engine leaves the draft length past the curve's flat part to a drafter
    that prices each draft token on the engine's own cost model (its gain rule); one that
    does not is held to the flat part (above). Issue 29: a CPU's curve rises from the
    first tokens, and the flat-part cap cut every draft beside a batch of 16, sure ones too."""
    reqs = [make_request(i, prompt_of(5, i), max_tokens=10, max_new_tokens=10) for i in range(3)]
    plain = run_to_end(_engine_with(model, reqs, speculative=False))
    tight = CostModel(((1, 1.0), (2, 1.0), (3, 10.0), (4, 100.0)), tolerance=0.0)  # 2 tokens per forward
    drafter = OracleDrafter({rid: o.token_ids for rid, o in plain.items()})
    drafter.config = dataclasses.make_dataclass("Config", ["cost_model"])(tight)
    engine = _engine_with(model, reqs, drafter=drafter, cost_model=tight)
    assert_same(run_to_end(engine), {rid: (o.token_ids, o.logprobs, o.finish_reason) for rid, o in plain.items()},
                tol=1e-5)
    assert max(drafter.budgets) > 1  # the flat part allows 1 (the test above)
    assert engine.metrics.counters.num_accepted_tokens > 0
    engine.device = torch.device("cuda")  # a GPU keeps the flat part: its forward is memory-bound
    assert engine._held_to_flat_part()


def test_a_cpu_step_is_priced_by_the_cpu_time_it_took(model, monkeypatch):
    """On a CPU the cost curve is fed the step's CPU time, not its wall time: time the
    engine thread spent off the cores (other processes running, here a sleep in the
    forward) is the machine's load, not the forward's cost (issue 29: a wall-time curve
    flipped the draft budget between none and hundreds from run to run)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the engine thread's own CPU time
    engine = _engine_with(model, [make_request(0, prompt_of(5), max_tokens=4, max_new_tokens=4)],
                          cost_model=CostModel(measure=True), speculative=False)
    observed = []
    monkeypatch.setattr(engine.cost_model, "observe", lambda tokens, ms: observed.append(ms))
    run = engine.runner.run
    sleep_s = 0.2

    def descheduled(seqs, fed=None):
        time.sleep(sleep_s)  # off the CPU, as when other processes hold the cores
        return run(seqs, fed)

    monkeypatch.setattr(engine.runner, "run", descheduled)
    started = time.perf_counter()
    engine.step()
    wall_ms = (time.perf_counter() - started) * 1e3
    monkeypatch.setattr(engine.runner, "run", run)
    engine.step()  # (the first step's tokens are read, and its cost recorded, behind this one's forward)
    assert len(observed) >= 1
    assert observed[0] <= wall_ms - sleep_s * 1e3  # the sleep is not priced in


def test_the_cost_clock_is_cpu_time_on_a_cpu_and_wall_time_on_a_gpu(monkeypatch):
    assert cost_clock(torch.device("cuda")) is time.perf_counter
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert cost_clock(torch.device("cpu")) is time.thread_time
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # intra-op threads: the whole process's
    assert cost_clock(torch.device("cpu")) is time.process_time


# ---------------------------------------------------------------------- chunks


def test_chunked_execution_resumes_identically(model):
    """A sample run as chunks of 5 tokens, each chunk on a fresh engine resuming from the
    tokens so far (with a drafter on alternate chunks), equals the uninterrupted run."""
    reqs = mixed_requests()[:4]
    refs = {r.request_id: reference_generate(model, r) for r in reqs}
    for req in reqs:
        tokens, logprobs, reason, chunk = [], [], None, 0
        while True:
            r = dataclasses.replace(req, generated_token_ids=list(tokens), max_new_tokens=5)
            drafter = OracleDrafter({req.request_id: refs[req.request_id][0]}) if chunk % 2 else None
            out = run_to_end(_engine_with(model, [r], drafter=drafter))[req.request_id]
            assert len(out.token_ids) <= 5
            tokens += out.token_ids
            logprobs += out.logprobs
            chunk += 1
            if out.finish_reason is not None:
                reason = out.finish_reason
                break
            assert len(out.token_ids) == 5
        assert tokens == refs[req.request_id][0]
        assert reason == refs[req.request_id][2]
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(refs[req.request_id][1]), atol=1e-4)


def test_max_tokens_and_max_position(model):
    """max_tokens counts earlier chunks; the context limit ends a sample with 'length'."""
    engine = new_engine(model, speculative=False)
    engine.add_request(make_request(0, prompt_of(4), generated_token_ids=[5, 6, 7], max_tokens=5))
    engine.add_request(make_request(1, prompt_of(120), max_tokens=50, max_new_tokens=50))
    outs = run_to_end(engine)
    assert len(outs["r0"].token_ids) == 2 and outs["r0"].finish_reason == "length"
    assert len(outs["r1"].token_ids) == 8 and outs["r1"].finish_reason == "length"


# ---------------------------------------------------------------------- KV cache


def test_siblings_prefill_the_prompt_once(model):
    """n=8 samples of one 37-token prompt: the prompt's 9 full blocks are computed once and
    held by all 8 (ref count 8); each sibling computes only the partial last block; all
    blocks are free at the end."""
    prompt = prompt_of(37)
    reqs = [make_request(i, prompt, prompt_id="p", max_tokens=6, max_new_tokens=6) for i in range(8)]
    engine = _engine_with(model, reqs, speculative=False)
    bm = engine.block_manager
    leader_blocks = None
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
        running = engine.scheduler.running
        if len(running) == 8 and leader_blocks is None:
            leader_blocks = running[0].block_table[:9]
            assert all(s.block_table[:9] == leader_blocks for s in running)
            assert all(bm.ref_counts[b] == 8 for b in leader_blocks)
            assert len({s.block_table[9] for s in running}) == 8  # own partial blocks
    assert leader_blocks is not None
    assert engine.metrics.counters.num_prompt_tokens == 37 + 7 * 1
    assert bm.num_free_blocks == bm.num_blocks
    refs = {r.request_id: reference_generate(model, r) for r in reqs[:3]}
    assert_same(outputs, refs)


def test_abort_frees_blocks_and_reports(model):
    """An aborted request returns its partial chunk as 'abort' and frees its blocks."""
    engine = _engine_with(model, [make_request(0, prompt_of(20)), make_request(1, prompt_of(9, 1))],
                          speculative=False)
    for _ in range(4):
        engine.step()
    assert engine.abort("r0") and not engine.abort("nope")
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "r0"]
    assert aborted and aborted[0].finish_reason == "abort" and len(aborted[0].token_ids) == 4  # prefill + 3 decodes
    outs = run_to_end(engine)
    assert "r0" not in outs and outs["r1"].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_kv_exhaustion_preempts_and_recomputes(model):
    """With too few blocks for all sequences at once, sequences are preempted and
    recomputed, and every output still equals the reference."""
    reqs = mixed_requests()
    refs = {r.request_id: reference_generate(model, r) for r in reqs}
    engine = _engine_with(model, reqs, num_kv_blocks=24, speculative=False)
    assert_same(run_to_end(engine), refs)
    assert engine.metrics.counters.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == 24


def test_bad_requests_name_the_field(model):
    engine = new_engine(model, num_kv_blocks=8)
    cases = [
        (dict(prompt_token_ids=list(range(1, 40))), "prompt_token_ids"),  # 10 blocks > 8
        (dict(prompt_token_ids=[1] * 130), "prompt_token_ids"),  # past max_position_embeddings
        (dict(prompt_token_ids=[1, 999]), "prompt_token_ids"),
        (dict(max_tokens=100, max_new_tokens=100), "max_new_tokens"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(generated_token_ids=[1, 2], max_tokens=2), "max_tokens"),
    ]
    every_but_eos = frozenset(range(1, CONFIG.vocab_size))
    cases += [  # stop tokens masking every token before min_tokens: nothing to sample (token 0, a NaN logprob)
        (dict(stop_token_ids=frozenset(range(CONFIG.vocab_size)), min_tokens=2), "stop_token_ids"),
        (dict(stop_token_ids=every_but_eos, min_tokens=2, ignore_eos=False), "stop_token_ids"),  # EOS masked too
    ]
    for kw, field in cases:
        with pytest.raises(ValueError, match=field):
            engine.add_request(make_request(0, [1, 2, 3], **kw))
    engine.add_request(make_request(0, [1, 2, 3], stop_token_ids=every_but_eos, min_tokens=2, max_tokens=4,
                                    max_new_tokens=4))  # ignore_eos: EOS is left to sample
    assert engine.abort("r0")
    engine.add_request(make_request(0, [1, 2, 3], max_tokens=4, max_new_tokens=4))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(make_request(0, [1, 2, 3]))


def test_load_weights_drops_the_prefix_cache(model):
    """After a weight update a repeated prompt is recomputed, not served from stale KV."""
    engine = new_engine(model, speculative=False)
    engine.add_request(make_request(0, prompt_of(20), max_tokens=2, max_new_tokens=2))
    run_to_end(engine)
    engine.load_weights({k: v.clone() for k, v in model.state_dict().items()})
    engine.add_request(make_request(1, prompt_of(20), max_tokens=2, max_new_tokens=2))
    before = engine.metrics.counters.num_prompt_tokens
    run_to_end(engine)
    assert engine.metrics.counters.num_prompt_tokens - before == 20


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("kind", ["compiled", "python"])
def test_history_drafter_is_lossless(model, kind, temperature):
    """The real history drafter (the compiled core, the Python reference) fed last epoch's
    responses: same output as no speculation (greedy, and seeded sampling at T=0.7 and
    T=1), and it gets drafts accepted."""
    from services.rollout.drafter import DrafterConfig
    from services.rollout.drafter.compiled import make_drafter

    prompt = prompt_of(10)
    reqs = [make_request(i, prompt, prompt_id="p", temperature=temperature, max_tokens=24, max_new_tokens=24)
            for i in range(4)]
    plain = run_to_end(_engine_with(model, reqs, speculative=False))
    drafter = make_drafter(kind, DrafterConfig())
    drafter.load_history("p", [plain[f"r{i}"].token_ids for i in range(4)])
    engine = _engine_with(model, reqs, drafter=drafter)
    spec = run_to_end(engine)
    for rid in plain:
        assert spec[rid].token_ids == plain[rid].token_ids
    assert engine.metrics.counters.num_accepted_tokens > 0


def _four_requests_decoded_plainly(model):
    """Four sampled requests of one prompt ("p", T=0.7, 24 tokens) and their outputs
    without speculation: the drafter-fault tests' batch and its expected tokens."""
    prompt = prompt_of(10)
    reqs = [make_request(i, prompt, prompt_id="p", temperature=0.7, max_tokens=24, max_new_tokens=24)
            for i in range(4)]
    return reqs, run_to_end(_engine_with(model, reqs, speculative=False))


@pytest.mark.parametrize("failing", ["propose", "add_tokens", "record_acceptance", "start_request"])
def test_a_failing_drafter_costs_speed_never_samples(model, failing):
    """A drafter that raises (a bug under load) must not fail the step or the batch: the
    affected requests decode without drafts, the output is unchanged, the error counted."""
    from services.rollout.drafter import HistoDrafter

    reqs, plain = _four_requests_decoded_plainly(model)

    class Flaky(HistoDrafter):
        calls = 0

    def broken(self, request_id, *args, **kw):
        Flaky.calls += 1
        if Flaky.calls % 3 == 0 or failing == "propose":
            raise TypeError("injected drafter bug")
        return getattr(HistoDrafter, failing)(self, request_id, *args, **kw)
    setattr(Flaky, failing, broken)
    drafter = Flaky()
    drafter.load_history("p", [plain[f"r{i}"].token_ids for i in range(4)])
    engine = _engine_with(model, reqs, drafter=drafter)
    spec = run_to_end(engine)
    assert {rid: out.token_ids for rid, out in spec.items()} == {rid: out.token_ids for rid, out in plain.items()}
    assert engine.metrics.counters.num_drafter_errors > 0


def test_a_failing_commit_step_goes_again_request_by_request(model):
    """The engine sends a step's verdicts and tokens in one commit_step; where that raises
    (it applies nothing) they go again one call per request, so drafting goes on."""
    from services.rollout.drafter import HistoDrafter

    reqs, plain = _four_requests_decoded_plainly(model)

    class NoBatch(HistoDrafter):
        tries = 0

        def commit_step(self, *args):
            NoBatch.tries += 1
            raise RuntimeError("injected commit_step bug")
    drafter = NoBatch()
    drafter.load_history("p", [plain[f"r{i}"].token_ids for i in range(4)])
    engine = _engine_with(model, reqs, drafter=drafter)
    spec = run_to_end(engine)
    assert {rid: out.token_ids for rid, out in spec.items()} == {rid: out.token_ids for rid, out in plain.items()}
    assert NoBatch.tries > 0 and engine.metrics.counters.num_accepted_tokens > 0
    assert drafter.stats().num_accepted_tokens > 0  # the verdicts reached it one by one
    assert engine.metrics.counters.num_drafter_errors == NoBatch.tries  # each failed batch counted as a drafter error


class EagerGraphs(CUDAGraphs):
    """CUDAGraphs whose "graph" re-runs the captured forward on the static buffers: the
    bucketing and padding logic of graph replay, checked on CPU."""

    def _record(self, forward):
        forward()
        return forward


def test_graph_buffers_and_padding_match_eager(model):
    """Decode and ragged verify steps through the static, padded graph buffers (padding
    tokens with slot -1, padding sequences with query length 0) give the eager output."""
    reqs = mixed_requests()
    plain = run_to_end(_engine_with(model, reqs, speculative=False))
    query_lens = set()
    for drafter in (None, OracleDrafter({rid: o.token_ids for rid, o in plain.items()}, wrong_every=3)):
        engine = new_engine(model, drafter=drafter, speculative=drafter is not None, max_num_seqs=8)
        graphs = engine.runner.graphs = EagerGraphs(engine.runner, 8, engine.max_draft_len)
        graphs.capture_all()
        captured = set(graphs.graphs)
        for r in reqs:
            engine.add_request(r)
        out = run_to_end(engine)
        assert set(graphs.graphs) == captured  # every step found its graph captured up front
        for rid, ref in plain.items():
            assert out[rid].token_ids == ref.token_ids
            assert torch.allclose(torch.tensor(out[rid].logprobs), torch.tensor(ref.logprobs), atol=1e-5)
        assert graphs.num_replays > 0
        query_lens |= {q for _, _, q in graphs.graphs}
    assert query_lens == {1, 1 + engine.max_draft_len}  # decode and verify buckets
    assert graphs.bucket(3, 3, 1) == (4, 4, 1)
    # Verify graphs are chosen by token count alone: one per token bucket, whatever the ragged mix.
    assert graphs.bucket(3, 9, 4) == graphs.bucket(1, 9, 7) == graphs.bucket(8, 16, 2) == (8, 16, 7)
    assert graphs.bucket(2, 3, 2) == (4, 4, 7)
    assert graphs.bucket(9, 9, 1) is None


def _with_eager_graphs(engine: LLMEngine, max_num_seqs: int) -> list[tuple[int, int, bool]]:
    """Gives the engine EagerGraphs (captured up front) and returns the list each forward
    appends to: (tokens fed, longest query, whether it replayed a graph)."""
    runner = engine.runner
    runner.graphs = EagerGraphs(runner, max_num_seqs, engine.max_draft_len)
    runner.graphs.capture_all()
    forwards, prepare, run = [], runner.prepare, runner.run
    shapes = []

    def recording_prepare(seqs):
        inputs = prepare(seqs)
        shapes.append((inputs.num_tokens, inputs.metadata.max_query_len))
        return inputs

    def recording_run(seqs, fed=None):
        logits = run(seqs, fed)
        forwards.append((*shapes[-1], runner.last_graphed))
        return logits

    runner.prepare, runner.run = recording_prepare, recording_run
    return forwards


def test_a_short_prefill_beside_decodes_replays_a_verify_graph(model):
    """A prompt no longer than a verify (the few tokens of a divided rollout's chunk that
    resumes on its cached prefix, or a short prompt) joining running decodes: that step
    replays a verify graph instead of running the whole batch eagerly (at a real model's
    size an eager step costs several graph replays). A long prompt still runs eagerly.
    The samples are those of the engine without graphs."""
    reqs = [make_request(i, prompt_of(n, i), max_tokens=16, max_new_tokens=16) for i, n in enumerate(
        [5, 3, 30, 6, 2, 4])]
    late = {0: reqs[:2], 4: reqs[2:3], 6: reqs[3:5], 9: reqs[5:]}
    plain = run_to_end(new_engine(model, speculative=False, max_num_seqs=8), late=dict(late))
    drafter = OracleDrafter({rid: o.token_ids for rid, o in plain.items()}, wrong_every=3)
    engine = new_engine(model, drafter=drafter, max_num_seqs=8)
    forwards = _with_eager_graphs(engine, 8)
    out = run_to_end(engine, late=dict(late))
    assert {rid: o.token_ids for rid, o in out.items()} == {rid: o.token_ids for rid, o in plain.items()}
    verify_len = 1 + engine.max_draft_len
    short_prefills = [f for f in forwards if 1 < f[1] <= verify_len and f[0] > f[1]]  # beside other sequences
    assert short_prefills and all(graphed for _, _, graphed in short_prefills)
    assert all(not graphed for _, q, graphed in forwards if q > verify_len)  # the 30-token prompt: eager
    assert any(q > verify_len for _, q, _ in forwards)


def test_drafts_never_push_a_step_past_the_largest_graph(model):
    """Drafts beyond the largest captured token bucket would turn a graph-replayed verify
    step into an eager one: the engine's draft budget stops at that bucket (here 40
    sequences x 16 drafts would feed 680 tokens; the largest bucket is 512)."""
    reqs = [make_request(i, prompt_of(2 + i % 3, i), max_tokens=20, max_new_tokens=20) for i in range(40)]
    plain = run_to_end(_engine_with(model, reqs, speculative=False, max_num_seqs=40, num_kv_blocks=1024))
    drafter = OracleDrafter({rid: o.token_ids for rid, o in plain.items()})
    engine = new_engine(model, drafter=drafter, max_num_seqs=40, max_draft_len=16, num_kv_blocks=1024,
                        max_num_batched_tokens=2048, cost_model=CostModel(tolerance=100.0))
    forwards = _with_eager_graphs(engine, 40)
    assert engine.runner.graphs.token_buckets[-1] == 512
    for r in reqs:
        engine.add_request(r)
    out = run_to_end(engine)
    assert {rid: o.token_ids for rid, o in out.items()} == {rid: o.token_ids for rid, o in plain.items()}
    drafted = [f for f in forwards if f[1] > 1]
    assert drafted and max(tokens for tokens, _, _ in drafted) == 512  # drafts filled the largest bucket
    assert all(graphed for _, q, graphed in forwards if q <= 17)  # and no drafted step ran eagerly


@pytest.mark.gpu
def test_cuda_graphs_match_eager():
    """Decode and verify steps replayed from CUDA graphs equal the eager CUDA run."""
    model = init_random_model(dataclasses.replace(CONFIG, dtype="float32"), seed=1).cuda()
    reqs = mixed_requests()
    plain = run_to_end(_engine_with(model, reqs, device="cuda", use_cuda_graphs=False, speculative=False))
    drafter = OracleDrafter({rid: o.token_ids for rid, o in plain.items()}, wrong_every=3)
    engine = _engine_with(model, reqs, device="cuda", use_cuda_graphs=True, drafter=drafter)
    spec = run_to_end(engine)
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs
    for rid, out in plain.items():
        assert spec[rid].token_ids == out.token_ids


@pytest.mark.parametrize("speculative", [False, True])
def test_a_request_admitted_right_after_a_block_filled_shares_it(model, speculative):
    """A decode's filled blocks are hashed after the next forward is launched
    (BlockManager.commit_later); breaks if an admission in the very next step's schedule
    misses them (a resumed chunk's generated tokens recomputed instead of shared), or if
    the hashing put off is never done. Block size 4."""
    prompt = prompt_of(6)
    drafter = OracleDrafter({"r0": reference_generate(model, make_request(0, prompt, max_tokens=12,
                                                                          max_new_tokens=12))[0]})
    engine = new_engine(model, speculative=speculative, drafter=drafter if speculative else None)
    engine.add_request(make_request(0, prompt, max_tokens=12, max_new_tokens=12))
    seq = engine.seqs["r0"]
    while seq.num_computed_tokens < 12:  # until the step whose commit fills the third block
        engine.step()
    engine.sync()  # (the last sampled token read: a plain step reads it behind the next forward)
    assert seq.num_computed_tokens // 4 > engine.block_manager.num_hashed_blocks[seq.seq_id]  # not hashed yet
    known = list(seq.token_ids)  # KV computed for all but the last (sampled, not fed yet)
    assert len(known) - 1 == seq.num_computed_tokens
    before = engine.metrics.counters.num_prompt_tokens
    engine.add_request(make_request(1, known[:6], generated_token_ids=known[6:], max_tokens=14, max_new_tokens=2))
    engine.step()  # admits r1 on r0's blocks
    engine.sync()  # (its counts are taken when its tokens are read)
    shared = (len(known) - 1) // 4 * 4
    assert engine.metrics.counters.num_prompt_tokens - before == len(known) - shared
    run_to_end(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
