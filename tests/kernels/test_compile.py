"""The Triton kernels compile for an H100 (sm_90) on a machine without a GPU.

The interpreter runs kernels with numpy: it neither type-checks nor lowers them the way
the compiler does (dot tile minimums, dtype rules, which math instructions are used).
If this fails, kernels that pass every interpreter test would not build on the GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

# Runs in a fresh process: this one decorated the kernels for the interpreter.
COMPILE_ALL = r'''
import inspect, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import fused as fu, matmul as mm, paged_attention as pa, rms_norm as rn, sampling as sp

def build(kernel, types, constexprs):
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32))

for dtype in ("bf16", "fp16", "fp32"):
    precision = "ieee" if dtype == "fp32" else "tf32"
    for (splits, invariant), tree in zip(((1, False), (4, False), (64, True), (1, False), (4, False)),
                                         (False, False, False, True, True)):  # draft trees: their mask
        types = {p: "*" + dtype for p in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
        types.update(part_out_ptr="*fp32", part_lse_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i32",
                     cu_q_ptr="*i32", tree_mask_ptr="*i64", scale_log2="fp32")
        build(pa._paged_attention_kernel, types, dict(
            GROUP=7, HEAD_DIM=64, BLOCK_D=64, BLOCK_SIZE=16, BLOCK_M=64 if invariant else 16, BLOCK_N=64,
            NUM_KV_SPLITS=splits, MERGE=splits > 1 or invariant, INVARIANT=invariant, SPLIT_TOKENS=512,
            HAS_TREE=tree, TREE_BITS=pa.TREE_BITS, DOT_F32=False, DOT_PRECISION=precision))
    build(mm._linear_kernel, {"x_ptr": "*" + dtype, "w_ptr": "*" + dtype, "b_ptr": "*" + dtype,
                              "out_ptr": "*" + dtype}, dict(HAS_BIAS=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64,
                                                            DOT_F32=False, DOT_PRECISION=precision))
    build(rn._rms_norm_kernel, {"x_ptr": "*" + dtype, "w_ptr": "*" + dtype, "out_ptr": "*" + dtype,
                                "eps": "fp32"}, dict(BLOCK=1024))
    build(fu._add_rms_norm_kernel, {p: "*" + dtype for p in ("x_ptr", "res_ptr", "w_ptr", "normed_ptr",
                                                              "summed_ptr")} | {"eps": "fp32"}, dict(BLOCK=1024))
    build(fu._silu_mul_kernel, {p: "*" + dtype for p in ("gate_ptr", "up_ptr", "out_ptr")}, dict(BLOCK=1024))
for in_order in (False, True):
    build(pa._merge_splits_kernel, {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16",
                                    "cu_q_ptr": "*i32"},
          dict(HEAD_DIM=64, BLOCK_D=64, NUM_KV_SPLITS=4, BLOCK_S=4, IN_ORDER=in_order))
build(pa._write_kv_kernel, {p: "*bf16" for p in ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")}
      | {"slot_ptr": "*i64"}, dict(ROW_SIZE=128, BLOCK=128))
for has_mask in (True, False):
    types = {"logits_ptr": "*bf16", "mask_ptr": "*i1", "temperature_ptr": "*fp32", "processed_ptr": "*i8",
             "seeds_ptr": "*i64", "positions_ptr": "*i64", "tokens_ptr": "*i64", "logprobs_ptr": "*fp32",
             "best_ptr": "*fp32", "best_token_ptr": "*i64", "block_max_ptr": "*fp32", "block_sum_ptr": "*fp32"}
    for kernel, extra in ((sp._sample_kernel, {}), (sp._logprob_kernel, {}), (sp._split_max_kernel, {}),
                          (sp._split_sum_kernel, dict(BLOCKS=128)), (sp._split_combine_kernel, None)):
        if extra is None:  # no mask, no block size: built once
            if not has_mask:
                continue
            compiled = build(kernel, types, {})
        else:
            compiled = build(kernel, types, dict(HAS_MASK=has_mask, BLOCK_V=2048, **extra))
        # logits / T (and the noise's log ratio) must round like torch's IEEE division, or
        # tokens drift from the reference.
        assert "div.full.f32" not in compiled.asm["ptx"], "approximate division in a sampling kernel"
print("compiled")
'''


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests build the kernels for real")
def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence 3.9's default-change warning
    result = subprocess.run([sys.executable, "-c", COMPILE_ALL], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=240)
    if result.returncode != 0 and "ptxas" in result.stderr and "not found" in result.stderr.lower():
        pytest.skip("this Triton build has no bundled ptxas")
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]
