"""The fused one-row GEMV kernels against their torch reference and the unfused ops they
replace, on the CPU via TRITON_INTERPRET=1 (arrangement of test_kernels_fused.py).

The unfused oracle is what the model computes without them: ``F.linear`` after
``ops.silu_mul`` or after the residual add + ``F.rms_norm``. The fused norm skips one
rounding of the normalised input, so it matches that oracle to the activation dtype's
precision, not exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")
in_interpreter = pytest.mark.triton_interpreter


def test_kernels_in_an_interpreter_subprocess(triton_interpreter_child):
    triton_interpreter_child()


from spectool.kernels import gemv  # noqa: E402  (after the importorskip)

DTYPES = [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)]
# N and K off the block sizes on purpose: masks at both edges.
SHAPES = [(40, 72), (16, 256), (33, 300)]
CONFIGS = [(16, 64, 4, 2), (8, 128, 2, 1), None]  # None: the shape's default config


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@in_interpreter
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_plain_and_bias(n, k, dtype, tol, config):
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, 1, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    y, s = gemv.gemv_triton(x, w, bias, config=config)
    assert s is None
    close(y, gemv.gemv_reference(x, w, bias)[0], tol)
    close(y, F.linear(x.float(), w.float(), bias.float()).to(dtype), tol)
    y32, _ = gemv.gemv_triton(x, w, out_dtype=torch.float32, config=config)
    close(y32, F.linear(x.float(), w.float()), tol)


@in_interpreter
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_silu_mul_prologue(n, k, dtype, tol, config):
    from spectool.kernels.fused import silu_mul_reference

    gen = torch.Generator().manual_seed(n + k)
    gate_up = (2 * torch.randn(1, 1, 2 * k, generator=gen)).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    y, _ = gemv.gemv_triton(gate_up, w, prologue="silu_mul", config=config)
    close(y, gemv.gemv_reference(gate_up, w, prologue="silu_mul")[0], tol)
    unfused = F.linear(silu_mul_reference(gate_up).float(), w.float()).to(dtype)
    close(y, unfused, tol)


@in_interpreter
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("exact_norm", [True, False])
def test_rms_norm_prologue(n, k, dtype, tol, config, with_residual, exact_norm):
    gen = torch.Generator().manual_seed(3 * n + k)
    x = torch.randn(1, 1, k, generator=gen).to(dtype)
    res = torch.randn(1, 1, k, generator=gen).to(dtype) if with_residual else None
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    y, s = gemv.gemv_triton(x, w, bias, prologue="rms_norm", residual=res, norm_weight=nw, eps=1e-5,
                            config=config, exact_norm=exact_norm)
    ref_y, ref_s = gemv.gemv_reference(x, w, bias, prologue="rms_norm", residual=res, norm_weight=nw, eps=1e-5,
                                       exact_norm=exact_norm)
    close(y, ref_y, tol)
    summed = x if res is None else (x.float() + res.float()).to(dtype)
    if with_residual:  # the interpreter truncates to bfloat16 where the GPU rounds: one step apart
        close(s, ref_s, tol)
        close(s, summed, tol)
    else:
        assert s is None
    unfused = F.linear(F.rms_norm(summed.float(), (k,), nw.float(), 1e-5), w.float(), bias.float())
    close(y, unfused.to(dtype), tol)
    if exact_norm:  # the model's unfused path itself: same roundings of the normalised input
        from spectool.kernels.fused import add_rms_norm_reference
        normed = add_rms_norm_reference(summed, None, nw, 1e-5)[0]
        close(y, F.linear(normed.float(), w.float(), bias.float()).to(dtype), tol)


@in_interpreter
def test_bad_input_is_a_clear_error():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="one row"):
        gemv.gemv_triton(torch.randn(2, 16), w)
    with pytest.raises(ValueError, match="one row"):
        gemv.gemv_triton(torch.randn(1, 16), w, prologue="silu_mul")
    with pytest.raises(ValueError, match="prologue"):
        gemv.gemv_triton(torch.randn(1, 16), w, prologue="gelu")
    with pytest.raises(ValueError, match="norm_weight"):
        gemv.gemv_triton(torch.randn(1, 16), w, prologue="rms_norm")
    with pytest.raises(ValueError, match="residual"):
        gemv.gemv_triton(torch.randn(1, 16), w, residual=torch.randn(1, 16))
