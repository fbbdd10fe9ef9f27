"""vLLM's engine runs the real checkpoint (SmolLM2-135M-Instruct) behind the same
service: one vLLM worker process (RHYMERL_WORKER_ENGINE=vllm, CPU build, float32) serving
models/smollm2-135m, reached through the scheduler with the SDK, as in a deployment.

If this fails, a checkpoint written by `make model-smollm2` is not one vLLM serves (its
config, tokenizer-free ids, the chat model's stop token), or vLLM's greedy policy differs
from the one our engine and transformers run. vLLM runs eager (VLLM_ENFORCE_EAGER): its
compile warm-up for a 30-layer model takes minutes on a busy 2-core machine.
"""

from __future__ import annotations

import pytest
import torch
from rhymerl import Prompt, RolloutClient, SamplingParams

pytest.importorskip("vllm", reason="make install-vllm")
transformers = pytest.importorskip("transformers")

from services.local import LocalCluster  # noqa: E402
from services.rollout.engine import CostModel, EngineRequest, LLMEngine, run_to_completion  # noqa: E402
from services.rollout.loader import load_model  # noqa: E402
from tests.smollm2 import CHAT_PROMPTS, IM_END, chat_prompt_ids, smollm2_checkpoint  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint():
    return smollm2_checkpoint()


@pytest.fixture(scope="module")
def prompts(checkpoint):
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    return [Prompt(f"q{i}", chat_prompt_ids(tokenizer, text)) for i, text in enumerate(CHAT_PROMPTS)]


def our_greedy(checkpoint, prompts) -> dict[str, list[int]]:
    engine = LLMEngine(load_model(checkpoint, dtype=torch.float32), device="cpu", num_kv_blocks=64, block_size=16,
                       max_num_seqs=8, speculative=False, cost_model=CostModel(((1, 1.0), (512, 1.0))))
    reqs = [EngineRequest(request_id=p.prompt_id, prompt_id=p.prompt_id, step_id="s", sample_index=0,
                          prompt_token_ids=list(p.token_ids), generated_token_ids=[], temperature=0.0, top_p=1.0,
                          top_k=0, min_p=0.0, seed=0, max_tokens=NEW_TOKENS, max_new_tokens=NEW_TOKENS,
                          stop_token_ids=frozenset(), min_tokens=0, ignore_eos=False, logprobs=True)
            for p in prompts]  # fmt: skip
    return {rid: out.token_ids for rid, out in run_to_completion(engine, reqs).items()}


def test_vllm_worker_serves_the_real_checkpoint_with_our_greedy_output(checkpoint, prompts, tmp_path):
    expected = our_greedy(checkpoint, prompts)
    cluster = LocalCluster(model_dir=str(checkpoint), num_workers=1, chunk_tokens=8, log_dir=tmp_path / "logs",
                           extra_env={"RHYMERL_WORKER_ENGINE": "vllm", "RHYMERL_WORKER_MAX_DRAFT_LEN": "4",
                                      "RHYMERL_WORKER_MAX_NUM_SEQS": "16",
                                      # vLLM's compile warm-up of 30 layers: ~110 s here, eager ~6 s
                                      "RHYMERL_WORKER_VLLM_ENFORCE_EAGER": "true"})
    cluster.start(timeout_s=800)
    try:
        with RolloutClient(cluster.scheduler_address, timeout_s=600) as client:
            greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, seed=1)
            result = client.rollout("vllm-greedy", prompts, n=1, sampling=greedy)
            sampled = client.rollout("vllm-sampled", prompts[:2], n=2, sampling=SamplingParams(
                temperature=1.0, max_tokens=NEW_TOKENS, seed=5))
    finally:
        cluster.stop()
    got = {s.prompt_id: list(s.token_ids) for s in result.samples}
    assert got == expected  # EOS (<|im_end|>, from generation_config.json) ends a turn as in our engine
    assert any(tokens[-1] == IM_END for tokens in got.values())
    for s in sampled.samples:
        assert 0 < len(s.token_ids) <= NEW_TOKENS and len(s.logprobs) == len(s.token_ids)
        assert all(lp <= 0.0 for lp in s.logprobs) and all(0 <= t < 49152 for t in s.token_ids)
