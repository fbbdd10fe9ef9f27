"""An in-process stand-in for `rhymerl.RolloutClient`: samples with an HF model directly.

It has the client's rollout / report_rewards / push_weights surface and returns the
SDK's own result types, so the example GRPO trainer runs unchanged without any service:
its tests check the RL math against it, and it records small CPU traces.

    python -m benchmarks.tiny_llm.local_client --model-dir models/tiny --steps 4 \\
        --record benchmarks/data/tiny_grpo.npz

Sampling is plain HF `generate` (temperature, top-p, top-k, min-p; seeded), no
speculation, so the draft counters in its summaries are zero.
"""

from __future__ import annotations

import argparse
import time
import zlib

import safetensors.torch
import torch
from rhymerl import Prompt, Sample, SamplingParams, StepResult, StepSummary

from benchmarks.tiny_llm.examples import load_example


def step_seed(step_id: str, sampling: SamplingParams) -> int:
    """The sampling seed, or without one a value fixed by the step id (fresh every step)."""
    return sampling.seed if sampling.seed is not None else zlib.crc32(step_id.encode())


class LocalRolloutClient:
    """Holds its own copy of the policy, updated by push_weights like a real worker's."""

    def __init__(self, model_dir: str, max_batch: int = 64):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.version = 0
        self.max_batch = max_batch  # sequences per generate call
        self.rewards: dict[str, list[tuple[str, int, float]]] = {}  # step id -> reported rewards

    @torch.no_grad()
    def rollout(
        self, step_id: str, prompts: list[Prompt], n: int, sampling: SamplingParams, policy_version: int = 0
    ) -> StepResult:
        start = time.perf_counter()
        requests = [(p, i) for p in prompts for i in range(n)]
        samples = []
        for chunk_start in range(0, len(requests), self.max_batch):
            chunk = requests[chunk_start : chunk_start + self.max_batch]
            # One seed per chunk (not per sample, unlike the service): enough for a stand-in.
            # No seed: fresh noise per step, from the step id, as the service does.
            torch.manual_seed(step_seed(step_id, sampling) * 7919 + chunk_start)
            samples += self._generate(step_id, chunk, sampling)
        makespan = time.perf_counter() - start
        summary = StepSummary(
            step_id=step_id, num_samples=len(samples), num_generated_tokens=sum(len(s.token_ids) for s in samples),
            makespan_s=makespan, bubble_ratio=0.0, tail_time_s=0.0, num_verify_steps=0, num_draft_tokens=0,
            num_accepted_tokens=0, num_migrations=0, worker_busy_s={"local": makespan},
            history_hit_rate=0.0, policy="local",
        )  # fmt: skip
        order = {p.prompt_id: i for i, p in enumerate(prompts)}
        samples.sort(key=lambda s: (order[s.prompt_id], s.sample_index))
        return StepResult(samples=samples, summary=summary)

    def _generate(self, step_id: str, chunk: list[tuple[Prompt, int]], sampling: SamplingParams) -> list[Sample]:
        pad = self.tokenizer.pad_token_id
        width = max(len(p.token_ids) for p, _ in chunk)
        input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, (p, _) in enumerate(chunk):  # left padding
            input_ids[row, width - len(p.token_ids) :] = torch.tensor(p.token_ids)
            attention_mask[row, width - len(p.token_ids) :] = 1
        stop_ids = list(sampling.stop_token_ids) + ([] if sampling.ignore_eos else [self.tokenizer.eos_token_id])
        greedy = sampling.temperature == 0
        out = self.model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=sampling.max_tokens,
            min_new_tokens=sampling.min_tokens or None, do_sample=not greedy,
            temperature=None if greedy else sampling.temperature, top_p=None if greedy else sampling.top_p,
            top_k=None if greedy else sampling.top_k, min_p=None if greedy or not sampling.min_p else sampling.min_p,
            eos_token_id=stop_ids, pad_token_id=pad, return_dict_in_generate=True, output_logits=True,
        )  # fmt: skip
        generated = out.sequences[:, width:]  # [num_seqs, num_new]
        temperature = 1.0 if greedy else sampling.temperature
        # Logprobs as the service returns them: log_softmax(logits / T), untruncated.
        logits = torch.stack(out.logits, dim=1).float()  # [num_seqs, num_new, vocab]
        logprobs = torch.log_softmax(logits / temperature, dim=-1).gather(2, generated[:, :, None]).squeeze(2)
        samples = []
        for row, (prompt, index) in enumerate(chunk):
            tokens = generated[row].tolist()
            stop_at = next((t for t, tok in enumerate(tokens) if tok in stop_ids), None)
            length = len(tokens) if stop_at is None else stop_at + 1
            samples.append(
                Sample(
                    step_id=step_id, prompt_id=prompt.prompt_id, sample_index=index, token_ids=tokens[:length],
                    logprobs=logprobs[row, :length].tolist(), finish_reason="length" if stop_at is None else "stop",
                    policy_version=self.version, token_policy_versions=[self.version] * length,
                    num_draft_tokens=0, num_accepted_tokens=0, num_verify_steps=length, num_migrations=0,
                    seed=step_seed(step_id, sampling),
                )  # fmt: skip
            )
        return samples

    def report_rewards(self, step_id: str, rewards) -> int:
        self.rewards[step_id] = list(rewards)
        return len(self.rewards[step_id])

    def push_weights(self, version: int, data: bytes) -> int:
        """Loads the safetensors bytes into the local model (a tied lm_head may be absent)."""
        tensors = safetensors.torch.load(data)
        missing, unexpected = self.model.load_state_dict(tensors, strict=False)
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        if unexpected or set(missing) - ({"lm_head.weight"} if tied else set()):
            raise ValueError(f"push_weights: missing {missing}, unexpected {unexpected}")
        self.version = version
        return version

    def close(self) -> None:
        pass


def main(argv: list[str] | None = None) -> None:
    trainer = load_example("grpo_trainer")
    parser = argparse.ArgumentParser(description="the example GRPO trainer against the local stand-in client")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=trainer.GRPOConfig.lr)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--record")
    args = parser.parse_args(argv)
    config = trainer.GRPOConfig(
        steps=args.steps, num_prompts=args.prompts, n=args.n, max_tokens=args.max_tokens,
        temperature=args.temperature, lr=args.lr, seed=args.seed, record=args.record,
    )  # fmt: skip
    trainer.run(LocalRolloutClient(args.model_dir), args.model_dir, config)


if __name__ == "__main__":
    main()
