"""The fused GEMVs on CUDA, against their torch reference and the unfused ops they replace: one
row at the 8B layer shapes, 2 and 16 rows at the 107M model's shapes and one 8B-shaped weight
(bf16: the float32 sums run in another order than cuBLAS's, so outputs agree to the last bit
almost everywhere, not bit for bit)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spectool.kernels.fused import add_rms_norm_reference, silu_mul_reference
from spectool.kernels.gemv import gemv_reference, gemv_triton

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = [(6144, 4096, "rms_norm"), (28672, 4096, "rms_norm"), (4096, 14336, "silu_mul"),
          (4096, 4096, "none"), (1000, 300, "rms_norm")]


@pytest.mark.parametrize("n,k,prologue", SHAPES)
def test_fused_gemv_matches_reference_and_unfused_ops(n, k, prologue):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    dt = torch.bfloat16
    width = 2 * k if prologue == "silu_mul" else k
    x = torch.randn(1, 1, width, device="cuda", generator=gen).to(dt)
    res = torch.randn(1, 1, k, device="cuda", generator=gen).to(dt) if prologue == "rms_norm" else None
    nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(dt)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dt)
    y, s = gemv_triton(x, w, None, prologue, res, nw if prologue == "rms_norm" else None, 1e-5)
    ref, ref_s = gemv_reference(x, w, None, prologue, res, nw, 1e-5)
    torch.testing.assert_close(y.float(), ref.float(), atol=2e-2, rtol=2e-2)
    if prologue == "rms_norm":
        assert torch.equal(s, ref_s)  # the residual stream is exact: one add, one rounding
        unfused = F.linear(add_rms_norm_reference(s, None, nw, 1e-5)[0], w)
        # The default rounds the normalised input where the unfused kernels do: only the order of
        # the float32 sums differs, which flips an output's last bit rarely.
        assert (y == unfused).float().mean() > 0.98
    elif prologue == "silu_mul":
        unfused = F.linear(silu_mul_reference(x), w)
    else:
        unfused = F.linear(x, w)
    torch.testing.assert_close(y.float(), unfused.float(), atol=3e-2, rtol=3e-2)
    y32, _ = gemv_triton(x, w, None, prologue, res, nw if prologue == "rms_norm" else None, 1e-5,
                         out_dtype=torch.float32)
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32, ref.float(), atol=2e-2, rtol=2e-2)


# The few-row kernel (tree verify, EAGLE draft steps) at the 107M model's weights (hidden 768, MLP
# 2048, 256-wide k/v, vocab 4096; the lm_head writes float32), one 8B-shaped weight, and the 8B
# qkv's 6144 outputs (the wide-output default config).
ROW_SHAPES = [(1280, 768, "rms_norm", False), (768, 768, "none", False), (4096, 768, "rms_norm", False),
              (768, 2048, "silu_mul", False), (4096, 768, "rms_norm", True),
              (4096, 4096, "rms_norm", False), (4096, 4096, "silu_mul", False), (4096, 4096, "none", False),
              (6144, 4096, "rms_norm", False)]


@pytest.mark.parametrize("m", [2, 16])
@pytest.mark.parametrize("n,k,prologue,lm_head", ROW_SHAPES)
def test_few_row_gemv_matches_unfused_ops(n, k, prologue, lm_head, m):
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    dt = torch.bfloat16
    width = 2 * k if prologue == "silu_mul" else k
    scale = torch.logspace(-2, 2, m, base=2.0, device="cuda")[:, None]  # each row its own rstd
    x = (torch.randn(m, width, device="cuda", generator=gen) * scale).to(dt)[None]
    res = None
    if prologue == "rms_norm" and not lm_head:
        res = torch.randn(1, m, k, device="cuda", generator=gen).to(dt)
    nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(dt)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dt)
    out_dtype = torch.float32 if lm_head else None
    y, s = gemv_triton(x, w, None, prologue, res, nw if prologue == "rms_norm" else None, 1e-5, out_dtype)
    if prologue == "rms_norm":
        summed = x if res is None else x + res
        if res is not None:
            assert torch.equal(s, summed)  # the residual stream is exact: one add, one rounding
        unfused = F.linear(add_rms_norm_reference(summed, None, nw, 1e-5)[0], w)
    elif prologue == "silu_mul":
        unfused = F.linear(silu_mul_reference(x), w)
    else:
        unfused = F.linear(x, w)
    if lm_head:  # the unfused head: cuBLAS in bf16, then float32; the kernel rounds only once
        torch.testing.assert_close(y, unfused.float(), atol=2e-2, rtol=2e-2)
    else:
        torch.testing.assert_close(y.float(), unfused.float(), atol=3e-2, rtol=3e-2)
        # Same inputs, same roundings: only the order of the float32 sums differs from cuBLAS's.
        assert (y == unfused).float().mean() > 0.95
    # Row by row through the one-row kernel: the same inputs to the last bit, sums in another order.
    for i in (0, m - 1):
        one, _ = gemv_triton(x[:, i:i + 1], w, None, prologue, None if res is None else res[:, i:i + 1],
                             nw if prologue == "rms_norm" else None, 1e-5, out_dtype)
        torch.testing.assert_close(y[:, i:i + 1], one, atol=2e-2, rtol=2e-2)
