"""The trained tiny policy widened to a real shape samples on the GPU what it samples on the CPU.

The GPU campaign's speed figures (benchmarks/spec_sweep.py, e2e_bench --widen) time the
policy widened to Qwen2.5 shapes; they mean something only if the engine computes the
policy there. In the H200 window of 2026-11-26 the sweep's plain runs at the 1.5B shape
ran to the 256-token limit where the CPU policy stops after about 50 tokens, while the
e2e baseline's did not: these checks say which engine paths (plain or speculative, CUDA
graphs or eager, float32 or bfloat16) keep the policy at a real shape, against the CPU
float32 run of the unwidened policy (the reference: the widening computes the same
function, tests/rollout/models/test_widen.py).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from benchmarks.engine_grpo import TRACES, grpo_requests
from services.common.traces import read_traces
from services.rollout.drafter import HistoDrafter
from services.rollout.engine import LLMEngine, run_to_completion
from services.rollout.loader import load_model
from services.rollout.models.widen import Shape, named_shape, widen_model
from tests.gpu.conftest import ON_CPU

pytestmark = pytest.mark.gpu

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny"
# On a GPU, the 0.5B shape with 8 of its 24 layers (the layers past the policy's 4 are
# identities: more of them change the cost, not the function); on the CPU dry run a shape
# a few times the policy's.
SHAPE = Shape(256, 512, 5, 8, 2, 32, 64) if ON_CPU else named_shape("Qwen2.5-0.5B", num_layers=8)
MAX_TOKENS = 128


@pytest.fixture(scope="module")
def reference():
    """The unwidened policy on the CPU, float32, plain: the samples to match."""
    if not (MODEL / "config.json").exists():
        pytest.skip("models/tiny is not trained here (make run trains it; the GPU call carries it)")
    model = load_model(MODEL, "cpu", torch.float32)
    reqs = requests(model)
    engine = LLMEngine(model, device="cpu", max_num_seqs=16, num_kv_blocks=512, speculative=False)
    return {k: o.token_ids for k, o in run_to_completion(engine, reqs).items()}


def requests(model):
    records = read_traces(TRACES)
    return grpo_requests(records, 4, 4, 1.0, MAX_TOKENS, tuple(model.config.eos_token_ids))


def history_drafter() -> HistoDrafter:
    records = read_traces(TRACES)
    last = max(r.epoch for r in records)
    drafter = HistoDrafter()
    for r in records:
        if r.epoch < last:
            drafter.load_history(r.prompt_id, [[int(t) for t in r.token_ids]])
    return drafter


def run(device: str, dtype: torch.dtype, speculative: bool, graphs: bool) -> dict[str, list[int]]:
    source = load_model(MODEL, "cpu", torch.float32)
    model = widen_model(source, SHAPE, seed=0, device=device, dtype=dtype)
    engine = LLMEngine(model, device=device, max_num_seqs=16, num_kv_blocks=512, max_num_batched_tokens=2048,
                       speculative=speculative, drafter=history_drafter() if speculative else None,
                       use_cuda_graphs=graphs)
    out = run_to_completion(engine, requests(source))
    if device == "cuda" and graphs:
        assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
    return {k: o.token_ids for k, o in out.items()}


def agreement(got: dict[str, list[int]], want: dict[str, list[int]]) -> tuple[float, float, float]:
    """(share of samples identical, share whose first 4 tokens are, mean length over the reference's)."""
    same = statistics.fmean(got[k] == want[k] for k in want)
    start = statistics.fmean(got[k][:4] == want[k][:4] for k in want)
    length = sum(len(got[k]) for k in want) / sum(len(want[k]) for k in want)
    return same, start, length


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_the_widened_policy_in_float32_samples_the_cpu_policys_tokens(device, reference, speculative, graphs):
    """float32: the widened policy's logits are the policy's to about 1e-5, so with the
    same seeds nearly every sample is the same token for token."""
    same, start, length = agreement(run(device, torch.float32, speculative, graphs), reference)
    assert same >= 0.75 and start == 1.0, (same, start, length)
    assert 0.9 <= length <= 1.1, (same, start, length)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_the_widened_policy_in_bfloat16_stays_the_policy(device, reference, speculative, graphs):
    """bfloat16 rounds the logits (about 1e-2), so samples part from the reference's at
    some token; but they start the same and end about as long. A path that breaks the
    model (in the H200 window: plain runs that never stopped) fails here."""
    same, start, length = agreement(run(device, torch.bfloat16, speculative, graphs), reference)
    assert start >= 0.75, (same, start, length)
    assert 0.7 <= length <= 1.4, (same, start, length)
