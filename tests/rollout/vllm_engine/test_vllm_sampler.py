"""vLLM's speculative sampling at temperature > 0, on the CPU, inside a VllmEngine built the
way the worker builds it: verification must scale each drafted position's logits by its
request's temperature (vLLM 0.32's CPU kernel left them divided by uninitialised memory,
so drafts were rarely accepted and samples were not the policy's; see cpu_expand.py)."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm", reason="make install-vllm")

from services.rollout.settings import WorkerSettings
from services.rollout.vllm_engine.cpu_expand import _expand_batch_to_tokens
from services.rollout.vllm_engine.smoke import save_tiny_vllm_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from services.rollout.vllm_engine.builder import build_vllm_engine

    model = save_tiny_vllm_model(tmp_path_factory.mktemp("vllm") / "tiny")
    settings = WorkerSettings(model_path=str(model), engine="vllm", max_num_seqs=8, max_draft_len=4,
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
