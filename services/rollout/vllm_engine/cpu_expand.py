"""Repairs of vLLM's CPU speculative sampling (vLLM 0.32), installed only where broken.

vLLM's rejection sampler spreads each request's temperature, top-k and top-p over
its draft positions with ``expand_batch_to_tokens``. On the CPU (vLLM 0.32) the
Triton kernel behind it is replaced by a C++ one that works on int64 tensors only;
its Python wrapper converts float32 temperatures (and int32 top-k) to an int64
*copy*, fills the copy and drops it. The real output stays uninitialised memory, so
the target logits of every drafted position are divided by garbage: verification
draws from a distorted distribution, drafts are rarely accepted and the sample is
no longer a sample of the policy (tokens with log-probability -16 appear). Greedy
requests never reach that code, which is why greedy output stayed identical.

`repair` checks vLLM's function on a float input and, only if it is wrong, swaps
in the same expansion written with torch.repeat_interleave. It runs in the process
holding vLLM's model runner (through collective_rpc), where the sampler lives.

A second repair, same place: with speculation on, vLLM runs every step through the
rejection sampler, also a step in which no request has a draft (a prompt's prefill).
Its CPU top-k then takes ``k.max()`` of an empty tensor and raises, so every request
with top_k failed in such a step. With no drafted position there is nothing to mask:
the wrapper returns the (empty) logits as they are.
"""

from __future__ import annotations

import torch


def _expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                            replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """vLLM's contract: x = [a, b, c], cu_num_tokens = [2, 5, 6] -> [a, a, b, b, b, c],
    with values equal to `replace_from` replaced by `replace_to`."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(values, counts, output_size=num_tokens)


def expands_correctly(fn) -> bool:
    """Whether `fn` expands a float32 batch as vLLM's contract says (a kernel that
    cannot run in this process counts as broken: ours then replaces it)."""
    x = torch.tensor([1.0, 0.5, 0.0])
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    try:
        got = fn(x, cu, 6, replace_from=0, replace_to=1)
    except Exception:  # noqa: BLE001
        return False
    return torch.equal(got, torch.tensor([1.0, 1.0, 0.5, 0.5, 0.5, 1.0]))


def masks_no_rows(fn) -> bool:
    """Whether `fn` (vLLM's apply_top_k_top_p) takes a step with no drafted position."""
    try:
        fn(torch.empty(0, 8), torch.empty(0, dtype=torch.int32), None)
    except Exception:  # noqa: BLE001
        return False
    return True


def _skipping_empty(fn):
    def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
        return logits if logits.shape[0] == 0 else fn(logits, k, p)

    return apply_top_k_top_p


def repair(worker=None) -> list[str]:
    """Installs our versions of vLLM's functions that are broken here; the names repaired."""
    from vllm.v1.sample import rejection_sampler

    repaired = []
    if not expands_correctly(rejection_sampler.expand_batch_to_tokens):
        rejection_sampler.expand_batch_to_tokens = _expand_batch_to_tokens
        repaired.append("expand_batch_to_tokens")
    if not masks_no_rows(rejection_sampler.apply_top_k_top_p):
        rejection_sampler.apply_top_k_top_p = _skipping_empty(rejection_sampler.apply_top_k_top_p)
        repaired.append("apply_top_k_top_p")
    return repaired
