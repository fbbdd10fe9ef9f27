"""Runs VllmEngine on a tiny random Qwen2 from token ids: the check after `make install-vllm`.

    python -m services.rollout.vllm_engine.smoke [--proposer rhymerl|ngram|none]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

# vLLM's CPU attention takes head_dim 64 (it refuses 16): 2 layers, hidden 128.
TINY_VLLM = dict(architecture="qwen2", vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                 rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=False, attention_bias=True,
                 qk_norm=False, eos_token_ids=(1,), bos_token_id=None, dtype="float32")


def save_tiny_vllm_model(path: Path, seed: int = 0) -> Path:
    from services.rollout.loader import init_random_model, save_model
    from services.rollout.models.config import ModelConfig

    save_model(init_random_model(ModelConfig(**TINY_VLLM), seed), path)
    return path


def request(rid: str, prompt: list[int], seed: int, max_new: int = 16, generated=(), temperature=1.0):
    from services.rollout.engine.request import EngineRequest

    return EngineRequest(request_id=rid, prompt_id="p", step_id="s", sample_index=0, prompt_token_ids=prompt,
                         generated_token_ids=list(generated), temperature=temperature, top_p=1.0, top_k=0,
                         min_p=0.0, seed=seed, max_tokens=64, max_new_tokens=max_new, stop_token_ids=frozenset(),
                         min_tokens=0, ignore_eos=True, logprobs=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--proposer", default="rhymerl", choices=["rhymerl", "ngram", "none"])
    args = parser.parse_args()
    from services.rollout.settings import WorkerSettings
    from services.rollout.engine import run_to_completion
    from services.rollout.vllm_engine.builder import build_vllm_engine

    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_vllm_model(Path(tmp) / "tiny")
        settings = WorkerSettings(model_path=str(path), engine="vllm", max_num_seqs=16, max_draft_len=4,
                                  speculative=args.proposer != "none")
        started = time.monotonic()
        engine = build_vllm_engine(settings, None if args.proposer == "none" else args.proposer)
        print(f"engine up in {time.monotonic() - started:.1f}s")
        prompt = [5, 6, 7, 8, 9, 10]
        whole = run_to_completion(engine, [request(f"s{i}", prompt, seed=i, max_new=32) for i in range(4)])
        first = run_to_completion(engine, [request("c0", prompt, seed=0, max_new=16)])["c0"]
        resume = [request("c1", prompt, seed=0, max_new=16, generated=first.token_ids)]
        rest = run_to_completion(engine, resume)["c1"]
        for rid, out in sorted(whole.items()):
            print(rid, out.finish_reason, out.token_ids[:12], f"logprob[0]={out.logprobs[0]:.3f}",
                  f"drafts={out.num_draft_tokens} accepted={out.num_accepted_tokens}")
        again = run_to_completion(engine, [request("c1b", prompt, seed=0, max_new=16,
                                                   generated=first.token_ids)])["c1b"]
        print("vLLM's scheduler stats:", engine.stats)
        print("first chunk == first 16 of the whole sample:", first.token_ids == whole["s0"].token_ids[:16])
        print("resumed chunk identical on rerun:", rest.token_ids == again.token_ids)


if __name__ == "__main__":
    main()
