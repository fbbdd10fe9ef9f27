"""When two runs of the policy count as the same sample: token for token, except where
the exact (float32 CPU) policy itself is within rounding of a tie.

On the GPU, bf16 arithmetic, other batch shapes (verify vs decode, CUDA-graph padding,
recompute after preemption) and other kernels round differently. A sample may then leave
the reference at a position where two tokens' scores differ by less than that rounding,
and only there: at any other position a difference is a bug (wrong KV, wrong position,
wrong sampler), and so is a logprob off by more than the dtype's tolerance.
"""

from __future__ import annotations

import torch

from kernels.sampling import uniform_noise
from services.rollout.models.base import DenseCausalAttention

# (logit tolerance: how close two tokens' scores may be for a divergence to be a tie,
#  logprob tolerance before the first divergence) per dtype
TOLERANCE = {torch.float32: (2e-3, 1e-3), torch.bfloat16: (0.1, 0.1)}


@torch.inference_mode()
def reference_scores(model, req, generated: list[int]) -> torch.Tensor:  # [vocab] float32
    """The sampler's scores (logits / T + Gumbel noise; logits when greedy) for the token
    after prompt + generated, computed by the float32 model with dense attention."""
    tokens = list(req.prompt_token_ids) + list(generated)
    attn = DenseCausalAttention(torch.tensor([0, len(tokens)]))
    logits = model.compute_logits(model.forward(torch.tensor(tokens), torch.arange(len(tokens)), attn)[-1:])[0].float()
    if req.temperature == 0:
        return logits
    u = uniform_noise(torch.tensor([req.seed]), torch.tensor([len(tokens)]), logits.shape[-1])[0]  # [vocab]
    return logits / req.temperature - torch.log(-torch.log(u))


def assert_agree(got: dict, want: dict, reqs, cpu_model, dtype: torch.dtype) -> int:
    """got / want: request id -> (token ids, logprobs). Returns how many samples diverged
    (each at a tie of the float32 policy)."""
    logit_tol, logprob_tol = TOLERANCE[dtype]
    num_diverged = 0
    for req in reqs:
        (a, lp_a), (b, lp_b) = got[req.request_id], want[req.request_id]
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        same = min(len(a), len(b)) if i is None else i
        diff = max((abs(x - y) for x, y in zip(lp_a[:same], lp_b[:same])), default=0.0)
        assert diff <= logprob_tol, f"{req.request_id}: logprobs differ by {diff:.4f} before any divergence"
        if i is None:
            assert len(a) == len(b), f"{req.request_id}: {len(a)} vs {len(b)} tokens"
            continue
        scores = reference_scores(cpu_model, req, a[:i])
        margin = float((scores[a[i]] - scores[b[i]]).abs())
        scale = 1 / req.temperature if req.temperature else 1.0
        assert margin <= logit_tol * scale, (
            f"{req.request_id}: diverges at generated token {i} ({a[i]} vs {b[i]}) where the float32 policy's "
            f"scores differ by {margin:.4f}: not a tie")
        num_diverged += 1
    return num_diverged


def outputs(engine_outputs: dict) -> dict:
    return {rid: (o.token_ids, o.logprobs) for rid, o in engine_outputs.items()}
