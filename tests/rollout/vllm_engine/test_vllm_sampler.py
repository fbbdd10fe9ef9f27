"""vLLM's speculative sampling at temperature > 0, on the CPU, inside a VllmEngine built the
way the worker builds it: verification must scale each drafted position's logits by its
request's temperature (vLLM 0.32's CPU kernel left them divided by uninitialised memory,
so drafts were rarely accepted and samples were not the policy's; see cpu_expand.py).

End to end on the engine: with rhymerl's history drafter proposing, the tokens vLLM
samples at T > 0 follow the policy's distribution (a goodness-of-fit test against the
exact distribution our own model code computes), their logprobs are rhymerl's in the
mode asked for, and a drafter that raises costs drafts, never a sample."""

from __future__ import annotations

import dataclasses
import math
import struct
import types

import pytest
import torch
from rhymerl import SamplingParams

pytest.importorskip("vllm", reason="make install-vllm")

from services.rollout.engine import run_to_completion
from services.rollout.settings import WorkerSettings
from services.rollout.vllm_engine.cpu_expand import _expand_batch_to_tokens
from services.rollout.vllm_engine.smoke import request

pytestmark = pytest.mark.timeout(300)


LM_HEAD_SCALE = 3.0  # sharper next-token distributions: drafts get accepted, a wrong T shows


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """The tiny vLLM model (with a scaled LM head), saved; and the same weights in memory."""
    from services.rollout.loader import init_random_model, save_model
    from services.rollout.models.config import ModelConfig
    from services.rollout.vllm_engine.smoke import TINY_VLLM

    model = init_random_model(ModelConfig(**TINY_VLLM), 0)
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    path = tmp_path_factory.mktemp("vllm") / "tiny"
    save_model(model, path)
    return path, model


@pytest.fixture(scope="module")
def engine(policy):
    from services.rollout.vllm_engine.builder import build_vllm_engine

    settings = WorkerSettings(model_path=str(policy[0]), engine="vllm", max_num_seqs=8, max_draft_len=4,
                              speculative=True)
    return build_vllm_engine(settings, "rhymerl")


def test_verification_divides_each_drafted_position_by_its_requests_temperature(engine):
    from vllm.v1.sample.rejection_sampler import apply_sampling_constraints

    logits = torch.randn(5, 96, generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([2, 5], dtype=torch.int32)  # request 0: 2 drafted positions, request 1: 3
    meta = types.SimpleNamespace(all_greedy=False, temperature=torch.tensor([1.0, 0.5]), top_k=None, top_p=None)
    got = apply_sampling_constraints(logits.clone(), cu, meta)
    want = logits / torch.tensor([1.0, 1.0, 0.5, 0.5, 0.5]).unsqueeze(-1)
    assert torch.allclose(got, want)


def test_a_step_without_drafts_under_top_k_is_verified_not_raised(engine):
    # speculation on: a prefill step (no request has a draft) still goes through the
    # rejection sampler; vLLM's CPU top-k raised on its empty rows (cpu_expand.py)
    from vllm.v1.sample.rejection_sampler import apply_sampling_constraints

    cu = torch.tensor([0, 0], dtype=torch.int32)
    meta = types.SimpleNamespace(all_greedy=False, temperature=torch.tensor([1.0, 0.5]),
                                 top_k=torch.tensor([5, 5], dtype=torch.int32), top_p=None)
    assert apply_sampling_constraints(torch.empty(0, 96), cu, meta).shape == (0, 96)


def test_expansion_keeps_dtype_and_replaces_greedy_temperature():
    cu = torch.tensor([1, 1, 4], dtype=torch.int32)  # the middle request has no draft
    top_k = _expand_batch_to_tokens(torch.tensor([5, 7, 9], dtype=torch.int32), cu, 4)
    assert top_k.dtype == torch.int32 and top_k.tolist() == [5, 9, 9, 9]
    temperature = _expand_batch_to_tokens(torch.tensor([0.0, 2.0, 0.7]), cu, 4, replace_from=0, replace_to=1)
    assert torch.allclose(temperature, torch.tensor([1.0, 0.7, 0.7, 0.7]))



def test_vllm_engine_core_process_is_refused_naming_the_setting(monkeypatch):
    from pydantic import ValidationError

    monkeypatch.setenv("RHYMERL_WORKER_VLLM_MULTIPROCESSING", "true")
    with pytest.raises(ValidationError, match="RHYMERL_WORKER_VLLM_MULTIPROCESSING"):
        WorkerSettings(engine="vllm")


def test_enforce_eager_reaches_vllm_from_the_environment_and_is_off_by_default(monkeypatch):
    from services.rollout.vllm_engine.builder import engine_args

    assert engine_args(WorkerSettings(engine="vllm"), None)["enforce_eager"] is False
    monkeypatch.setenv("RHYMERL_WORKER_VLLM_ENFORCE_EAGER", "true")
    assert engine_args(WorkerSettings(engine="vllm"), "rhymerl")["enforce_eager"] is True


def test_vllm_workers_get_intel_openmp_preloaded_once(monkeypatch, tmp_path):
    # without it vLLM's speculative steps on the CPU wait on two OpenMP runtimes (docs/vllm.md)
    from services.rollout.vllm_engine.builder import intel_openmp_env

    (tmp_path / "lib").mkdir()
    lib = tmp_path / "lib" / "libiomp5.so"
    monkeypatch.setattr("sys.prefix", str(tmp_path))
    assert intel_openmp_env({"A": "1"}) == {"A": "1"}  # no Intel OpenMP here: nothing to preload
    lib.touch()
    assert intel_openmp_env({"A": "1"}) == {"A": "1", "LD_PRELOAD": str(lib)}
    assert intel_openmp_env({"LD_PRELOAD": "/x/libtcmalloc.so"})["LD_PRELOAD"] == f"{lib}:/x/libtcmalloc.so"
    assert intel_openmp_env({"LD_PRELOAD": "/y/libiomp5.so"})["LD_PRELOAD"] == "/y/libiomp5.so"


PROMPT = [5, 6, 7, 8, 9, 10]
TEMPERATURE = 0.7


def sampled(engine, seeds, max_new: int, **fields) -> list:
    """One sample per seed of PROMPT (prompt id "p"), in seed order."""
    reqs = [dataclasses.replace(request(f"t{seed}", PROMPT, seed=seed, max_new=max_new), **fields) for seed in seeds]
    out = run_to_completion(engine, reqs)
    return [out[r.request_id] for r in reqs]


def dkw_bound(num_values: int, false_failure: float) -> float:
    """The distance between an empirical CDF of ``num_values`` i.i.d. draws and their true
    CDF that is exceeded with probability at most ``false_failure`` (Dvoretzky-Kiefer-
    Wolfowitz with Massart's constant: P(sup |F_n - F| > e) <= 2 exp(-2 n e^2))."""
    return math.sqrt(math.log(2 / false_failure) / (2 * num_values))


def ks_distance(values: torch.Tensor) -> float:
    """sup |F_n - F| of ``values`` against the uniform distribution on [0, 1]."""
    v = torch.sort(values).values
    i = torch.arange(1, len(v) + 1, dtype=v.dtype)
    return float(torch.maximum(i / len(v) - v, v - (i - 1) / len(v)).max())


@pytest.mark.slow
@pytest.mark.timeout(900)  # a hang guard: the engine's start and 4096 tokens on a busy 2-core machine
def test_samples_at_temperature_follow_the_policy_with_drafts_verified(engine, policy):
    """512 seeded samples of 8 tokens at T = 0.7, drafted from the history of 32 earlier
    ones. Each token's randomised probability integral transform under the exact
    distribution softmax(logits / T) our model code computes for its context (tokens
    ordered by probability, a uniform draw within the token's own mass) is uniform and
    independent of the others exactly when every token was drawn from the policy, drafts
    or not. The test fails when the 4096 values' empirical CDF is further from the
    uniform's than the DKW bound for a false-failure probability of 1e-6 (over the
    choice of seeds; the seeds are fixed, so the outcome repeats). Sampling at 1.15 T
    fails it, and so does vLLM's CPU verifier without its temperature repair
    (cpu_expand.py).

    The returned logprobs are rhymerl's raw (= processed, no filter) logprob, recomputed
    by the trainer's reference on the same tokens, up to vLLM's float32 rounding.
    """
    from services.rollout.engine.logprobs import reference_logprobs, sequence_logits

    _, model = policy
    history = sampled(engine, range(1000, 1032), 8, temperature=TEMPERATURE)
    engine.drafter.load_history("p", [o.token_ids for o in history])
    outs = sampled(engine, range(512), 8, temperature=TEMPERATURE)
    assert all(len(o.token_ids) == 8 for o in outs)
    assert sum(o.num_accepted_tokens for o in outs) > 0, "no draft was accepted: the verifier went untested"
    assert sum(o.num_draft_tokens - o.num_accepted_tokens for o in outs) > 0, "no draft was rejected"

    noise = torch.Generator().manual_seed(0)
    pit = []
    with torch.no_grad():
        for o in outs:
            logits = sequence_logits(model, PROMPT + o.token_ids)[len(PROMPT) - 1:-1]
            probs = torch.softmax(logits.double() / TEMPERATURE, dim=-1)
            for p, token in zip(probs, o.token_ids):
                order = torch.sort(-p, stable=True).indices
                rank = int((order == token).nonzero())
                below = p[order[:rank]].sum()
                pit.append(below + torch.rand((), generator=noise, dtype=torch.float64) * p[token])
    assert ks_distance(torch.stack(pit)) <= dkw_bound(len(pit), 1e-6), "the samples are not the policy's"

    sampling = SamplingParams(temperature=TEMPERATURE, logprobs_mode="raw")
    expected = reference_logprobs(model, [(PROMPT, o.token_ids) for o in outs[:32]], sampling)
    for o, want in zip(outs, expected):
        assert o.logprobs == pytest.approx(want, abs=1e-4)


def test_processed_logprobs_are_rhymerls_over_the_allowed_tokens(engine, policy):
    """top_k = 5 in processed mode: each returned logprob is log softmax(logits / T) over the
    5 allowed tokens, renormalised, as the reference computes it (and well above raw)."""
    from services.rollout.engine.logprobs import reference_logprobs

    _, model = policy
    outs = sampled(engine, range(16), 8, temperature=TEMPERATURE, top_k=5, logprobs_mode="processed")
    processed = SamplingParams(temperature=TEMPERATURE, top_k=5, logprobs_mode="processed")
    raw = dataclasses.replace(processed, logprobs_mode="raw")
    pairs = [(PROMPT, o.token_ids) for o in outs]
    for o, want, below in zip(outs, reference_logprobs(model, pairs, processed), reference_logprobs(model, pairs, raw)):
        assert o.logprobs == pytest.approx(want, abs=1e-4)
        assert sum(w - b for w, b in zip(want, below)) > 1e-3  # the modes differ here: the check can tell


@pytest.mark.parametrize("failing", ["add_tokens", "record_acceptance", "commit_step", "propose", "start_request"])
def test_a_failing_drafter_costs_speed_never_samples(engine, failing):
    """A drafter that raises on every third call (a bug under load) inside vLLM's step: the
    affected requests decode without drafts, every sample comes back whole with the greedy
    tokens it has without the fault, and the errors are counted. A failing per-request
    commit (add_tokens, record_acceptance) is a drafter without ``commit_step``, which the
    proposer then commits request by request; a failing ``commit_step`` is retried so."""
    proposer = engine.llm.collective_rpc(lambda worker: worker.model_runner.drafter)[0]
    healthy = proposer.drafter
    plain = sampled(engine, range(8), 16, temperature=0.0)
    engine.drafter.load_history("p", [o.token_ids for o in plain])

    class Flaky:
        calls = 0

        def __getattr__(self, name):
            if name == "commit_step" and failing in ("add_tokens", "record_acceptance"):
                raise AttributeError(name)  # commits go request by request, through the failing call
            return getattr(healthy, name)

    def broken(*args, **kw):
        Flaky.calls += 1
        if Flaky.calls % 3 == 0 or failing == "propose":
            raise TypeError("injected drafter bug")
        return getattr(healthy, failing)(*args, **kw)

    flaky = Flaky()
    setattr(flaky, failing, broken)
    errors = proposer.num_drafter_errors
    proposer.drafter = flaky
    try:
        drafted = sampled(engine, range(8), 16, temperature=0.0)
    finally:
        proposer.drafter = healthy
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert all(len(o.token_ids) == 16 for o in drafted)
    assert Flaky.calls > 0 and proposer.num_drafter_errors > errors


def test_a_chunk_shorter_than_the_min_tokens_left_masks_its_stop_tokens_instead_of_failing(engine):
    """Divided rollout hands the engine chunks of chunk_tokens; a sample's min_tokens may be
    longer than one (min_tokens 10, chunks of 4). vLLM refuses min_tokens > max_tokens, which
    aborted every such sample with no token; the chunk must instead run with its stop tokens
    masked throughout, and the next chunk with what is left of min_tokens."""
    plain = sampled(engine, [0], 12, temperature=0.0)[0].token_ids
    stops = frozenset(plain[:6])  # the tokens greedy picks first: masking them changes the output
    first = sampled(engine, [0], 4, temperature=0.0, min_tokens=10, stop_token_ids=stops)[0]
    assert len(first.token_ids) == 4 and first.finish_reason is None, first
    assert not stops & set(first.token_ids)
    second = sampled(engine, [0], 8, temperature=0.0, min_tokens=10, stop_token_ids=stops,
                     generated_token_ids=first.token_ids)[0]
    assert len(second.token_ids) >= 6 and not stops & set(second.token_ids[:6]), second


def test_a_temperature_vllm_would_raise_to_its_floor_is_refused_naming_it(engine):
    """vLLM's SamplingParams samples any temperature in (0, 0.01) at 0.01, logprobs included,
    without a word: a T = 0.005 sample would not be the one asked for. The engine refuses it
    (the worker returns the sample's error), and still runs 0 (greedy) and 0.01."""
    from vllm import SamplingParams as VllmParams

    assert VllmParams(temperature=0.005).temperature == 0.01  # what the refusal guards against
    with pytest.raises(ValueError, match=r"^temperature: 0\.005 is below 0\.01"):
        engine.add_request(dataclasses.replace(request("t-low", PROMPT, seed=1, max_new=4), temperature=0.005))
    assert not engine.has_unfinished()
    for t in (0.0, 0.01, struct.unpack("<f", struct.pack("<f", 0.01))[0]):  # 0.01 as the wire's float32 has it
        out = sampled(engine, [1], 4, temperature=t)[0]
        assert len(out.token_ids) == 4, (t, out)


def test_processed_logprobs_of_greedy_samples_under_a_filter_are_refused(engine, policy):
    """Greedy (T' = 1) with top_k and processed logprobs: rhymerl's logprob is over the top-k
    tokens, renormalised; vLLM samples greedy requests without the filters and returns the
    logprob over the whole vocabulary (rhymerl's raw), so the request is refused naming
    logprobs_mode; raw logprobs of the same greedy sample are the reference's."""
    from services.rollout.engine.logprobs import reference_logprobs

    _, model = policy
    greedy = dict(temperature=0.0, top_k=3)
    with pytest.raises(ValueError, match=r"^logprobs_mode: processed logprobs of greedy samples"):
        engine.add_request(dataclasses.replace(request("g-proc", PROMPT, seed=1, max_new=4), **greedy,
                                               logprobs_mode="processed"))
    assert not engine.has_unfinished()
    out = sampled(engine, [1], 4, **greedy, logprobs_mode="raw")[0]
    want = reference_logprobs(model, [(PROMPT, out.token_ids)], SamplingParams(**greedy, logprobs_mode="raw"))[0]
    assert out.logprobs == pytest.approx(want, abs=1e-4)
