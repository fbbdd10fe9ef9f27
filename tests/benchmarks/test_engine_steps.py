"""The GPU step benchmark's floor (benchmarks/engine_gpu_steps.py): the weight-read floor
a decode step is compared with must read every weight matrix the forward multiplies.

The GPU window of 2026-11-26 measured a floor of 0.72 ms for the 1.5B shape where
cost_probe measured 1.86 ms for the same matrices: the floor was taken from the model's
``nn.Linear`` modules, and the fused q/k/v and gate/up projections and the tied LM head
are not ``nn.Linear``, so it read less than half of the weights."""

import pytest
import torch

from benchmarks.cost_probe import weight_matrices
from benchmarks.engine_gpu_steps import floor_dims, qwen_shape
from benchmarks.engine_random_model import TINY
from services.rollout.models.transformer import CausalLM


@pytest.mark.parametrize("config", [TINY, qwen_shape("0.5B"), qwen_shape("1.5B")], ids=["tiny", "0.5B", "1.5B"])
def test_the_floor_reads_every_matrix_the_forward_multiplies(config):
    with torch.device("meta"):
        model = CausalLM(config)
        floor = weight_matrices(floor_dims(config), "meta", torch.bfloat16)
    # every 2-D parameter is a matrix a forward multiplies (the tied embedding table as the
    # LM head); the embedding lookup of an untied model reads only its rows
    matrices = {name: p for name, p in model.named_parameters() if p.dim() == 2}
    if not config.tie_word_embeddings:
        matrices = {n: p for n, p in matrices.items() if "embed_tokens" not in n}
    # the fused projections hold the same weights in fewer, larger matrices: compare the sums
    assert sum(w.numel() for w in floor) == sum(p.numel() for p in matrices.values())
