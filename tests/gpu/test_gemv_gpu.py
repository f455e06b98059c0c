"""The fused one-row GEMVs on CUDA at the 8B layer shapes, against their torch reference and the
unfused ops they replace (bf16: the float32 sums run in another order than cuBLAS's, so outputs
agree to the last bit almost everywhere, not bit for bit)."""

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
