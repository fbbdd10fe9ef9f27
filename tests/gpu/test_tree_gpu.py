"""Draft trees on the GPU: the Triton tree mask, the verify CUDA graphs reading the static
tree mask, and the accepted paths' KV moves, in bf16 and float32.

If these fail, tree speculation on a GPU worker returns samples that are not the
policy's, or a tree step falls out of the verify graphs (the CPU suite checks the graph
buffers' logic with eager replays, not real captures)."""

from __future__ import annotations

import pytest
import torch

from services.rollout.drafter import DrafterConfig, HistoDrafter
from tests.gpu.agreement import assert_agree, outputs
from tests.gpu.test_engine_gpu import DTYPES, engine, graph_replays, models, requests
from tests.rollout.engine.test_engine import run_to_end
from tests.rollout.engine.test_tree_engine import TreeOracleDrafter

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_speculation_equals_plain_decoding(device, dtype):
    """Random trees around the true continuation (accepted paths behind wrong siblings, so
    their KV moves) and the Python drafter's trees on last epoch's responses: plain
    decoding's samples, tree steps replaying verify graphs."""
    model, cpu_model = models(dtype)
    reqs = requests(truncation=dtype == torch.float32)
    plain = run_to_end(engine(model, device, reqs, speculative=False))
    history = HistoDrafter(DrafterConfig(tree=True))
    for r in reqs:
        history.load_history(r.prompt_id, [plain[r.request_id].token_ids])
    for drafter in (TreeOracleDrafter({rid: o.token_ids for rid, o in plain.items()}, 7, true_last=True), history):
        e = engine(model, device, reqs, drafter=drafter)
        assert e.tree_drafts
        replays = []
        if e.runner.graphs is not None:
            replay = e.runner.graphs.replay
            e.runner.graphs.replay = lambda inputs: replays.append(inputs.metadata.tree_mask is not None) or replay(
                inputs)
        spec = run_to_end(e)
        assert_agree(outputs(spec), outputs(plain), reqs, cpu_model, dtype)
        c = e.metrics.counters
        assert c.num_tree_drafts > 0 and c.num_accepted_tokens > 0
        graph_replays(e, device)
        if device == "cuda":
            assert any(replays) and not e.runner.graphs.failed  # tree steps replayed graphs


def test_batch_invariant_mode_keeps_trees_off_on_the_gpu(device):
    """In batch-invariant mode on CUDA a node's keys would sit in other lanes than in a
    plain decode: the engine drafts linearly there (on the CPU, trees stay bitwise)."""
    model, _ = models(torch.bfloat16)
    e = engine(model, device, [], drafter=HistoDrafter(DrafterConfig(tree=True)), batch_invariant=True)
    assert e.tree_drafts == (device != "cuda")
