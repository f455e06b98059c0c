"""The decode step's kernels compile for an H100/H200 (sm_90) with programmatic dependent launch.

The interpreter never takes a kernel's PDL branch (it runs on no GPU), so a wrong PDL instruction
would first fail on the GPU. Here every kernel that launches with PDL (the decode step's and the
sampling verify's) is compiled by Triton for CUDA (tests/cuda_compile.py) from the wrapper calls the
engine makes, with PDL on, and its PTX is checked for the two instructions PDL needs, with no load
or store of global memory before the wait. tests/gpu/test_pdl_gpu.py
checks on the GPU that the results are the same bits with and without it.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="the test extras install triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for CUDA; the interpreter replaces the kernels", allow_module_level=True)

from cuda_compile import compiling_for_cuda  # noqa: E402

from spectool.kernels import attention_triton, fused, gemv, pdl  # noqa: E402


@pytest.fixture
def pdl_on(monkeypatch):
    monkeypatch.setattr(pdl, "use_pdl", lambda x: True)
    monkeypatch.setattr(attention_triton, "_sm_count", lambda device: 132)


def assert_pdl(compiled, name: str) -> None:
    ptx = compiled.ptx[name]
    assert "griddepcontrol.launch_dependents" in ptx and "griddepcontrol.wait" in ptx, name
    # Nothing may be read or written before the wait (a read could see the kernel before's
    # half-written output, a write could land under one of its reads).
    before_wait = ptx.split("griddepcontrol.wait")[0]
    assert "st.global" not in before_wait and "ld.global" not in before_wait, name


# (prologue, input rows) as the model launches them: more rows with silu_mul go to cuBLAS (ops._fused).
CASES = [("none", 1), ("rms_norm", 1), ("silu_mul", 1), ("none", 16), ("rms_norm", 16)]


@pytest.mark.parametrize("prologue,rows", CASES)
def test_projection_kernels_compile_with_pdl(pdl_on, prologue, rows):
    k, n = 2048, 3072
    weight = torch.randn(n, k, dtype=torch.bfloat16)
    x = torch.randn(1, rows, 2 * k if prologue == "silu_mul" else k, dtype=torch.bfloat16)
    norm = dict(residual=x.clone(), norm_weight=torch.randn(k, dtype=torch.bfloat16)) if prologue == "rms_norm" else {}
    with compiling_for_cuda() as compiled:
        gemv.gemv_triton(x, weight, prologue=prologue, **norm)
    name = "_gemv_kernel" if rows == 1 else "_gemv_rows_kernel"
    assert compiled == [name]
    assert_pdl(compiled, name)


def test_rope_and_attention_kernels_compile_with_pdl(pdl_on):
    b, t, hq, hkv, d = 1, 1, 32, 8, 128
    q = torch.randn(b, t, hq, d, dtype=torch.bfloat16)
    k, v = torch.randn(b, t, hkv, d, dtype=torch.bfloat16), torch.randn(b, t, hkv, d, dtype=torch.bfloat16)
    cos, sin = torch.randn(b, t, d // 2, dtype=torch.bfloat16), torch.randn(b, t, d // 2, dtype=torch.bfloat16)
    k_cache, v_cache = (torch.zeros(2, hkv, 1024, d, dtype=torch.bfloat16) for _ in range(2))
    slots, starts = torch.zeros(b, dtype=torch.long), torch.full((b,), 10)
    with compiling_for_cuda() as compiled:
        fused.rope_write_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slots, starts)
        attention_triton.cached_attention_triton(q, k_cache, v_cache, slots, starts)
    assert compiled == ["_rope_kernel", "_attn_split_kernel", "_attn_merge_kernel"]
    for name in compiled:
        assert_pdl(compiled, name)
    with compiling_for_cuda() as compiled:  # a decode step's: RoPE and the cache write in the split kernel
        attention_triton.rope_cached_attention_triton(q, k, v, cos, sin, k_cache, v_cache, slots, starts)
    assert compiled == ["_attn_split_kernel", "_attn_merge_kernel"]
    for name in compiled:
        assert_pdl(compiled, name)


def test_pdl_is_off_without_a_hopper_gpu():
    assert not pdl.use_pdl(torch.zeros(1))


def test_sampling_verify_kernels_compile_with_pdl(pdl_on):
    from test_kernels_compile_cuda import sampling_inputs

    from spectool.kernels.sampling import _coins_kernel
    from spectool.kernels.verify_sampling_chunked import FEW_ROWS_CONFIG
    from spectool.verify import verify_sampling_chunked

    tree, logits, temps, coins = sampling_inputs(torch.float32)
    with compiling_for_cuda() as compiled:
        # The coins' wrapper takes its torch reference on CPU tensors: the kernel as it launches on CUDA.
        _coins_kernel[(2,)](torch.zeros(1, dtype=torch.long), torch.arange(2), tree.seq_lens, coins,
                            tree.num_nodes, BLOCK=16, PDL=True, launch_pdl=True)
        verify_sampling_chunked(tree, logits, temps, 50, 0.9, coins, FEW_ROWS_CONFIG)
    assert compiled == ["_coins_kernel", "_stats_kernel", "_cut_kernel", "_decide_kernel", "_residual_kernel",
                        "_bonus_kernel"]
    for name in compiled:
        assert_pdl(compiled, name)
