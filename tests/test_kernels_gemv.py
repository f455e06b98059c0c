"""The fused GEMV kernels (one row, and 2 to 16 rows) against their torch reference and the
unfused ops they replace, on the CPU via TRITON_INTERPRET=1 (arrangement of
test_kernels_fused.py).

The unfused oracle is what the model computes without them: ``F.linear`` after
``ops.silu_mul`` or after the residual add + ``F.rms_norm``. The float32 sums run in
another order than torch's, and the interpreter truncates float32 -> bfloat16 where the
GPU rounds, so they match that oracle to the activation dtype's precision, not exactly.
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
    with pytest.raises(ValueError, match="1 to 16 rows"):
        gemv.gemv_triton(torch.randn(17, 16), w)
    with pytest.raises(ValueError, match="1 to 16 rows"):
        gemv.gemv_triton(torch.randn(1, 16), w, prologue="silu_mul")
    with pytest.raises(ValueError, match="prologue"):
        gemv.gemv_triton(torch.randn(1, 16), w, prologue="gelu")
    with pytest.raises(ValueError, match="norm_weight"):
        gemv.gemv_triton(torch.randn(1, 16), w, prologue="rms_norm")
    with pytest.raises(ValueError, match="residual"):
        gemv.gemv_triton(torch.randn(1, 16), w, residual=torch.randn(1, 16))
    with pytest.raises(ValueError, match="one row only"):
        gemv.gemv_triton(torch.randn(2, 16), w, prologue="rms_norm", norm_weight=torch.ones(16), exact_norm=False)
    with pytest.raises(ValueError, match="contiguous along K"):
        gemv.gemv_triton(torch.randn(16, 2).t(), w)


# ---------------------------------------------------------------------------------
# 2 to 16 rows (tree verify, EAGLE draft steps): one weight tile read serves every row

ROWS = [1, 2, 5, 16]  # 1: the one-row kernel behind the same entry point
ROW_CONFIGS = [(16, 64, 4, 2), None]  # several N tiles and K chunks with ragged edges; the default
ROW_SHAPES = [(40, 72), (33, 300)]


def rows_of(gen: torch.Generator, m: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, m, width] (one sequence of m tokens), each row at its own scale: a kernel that normalised
    every row by another row's rstd would be off by up to 16x."""
    scale = torch.logspace(-2, 2, m, base=2.0)[:, None]
    return (torch.randn(m, width, generator=gen) * scale).to(dtype)[None]


def unfused_norm(summed: torch.Tensor, nw: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm`` of the (rounded) sum with the unfused kernels' roundings: normalised, then
    times the weight."""
    normed = F.rms_norm(summed.float(), (summed.shape[-1],), None, eps).to(summed.dtype)
    return (normed.float() * nw.float()).to(summed.dtype)


@in_interpreter
@pytest.mark.parametrize("config", ROW_CONFIGS)
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("n,k", ROW_SHAPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_rows_plain(m, n, k, dtype, tol, config, with_bias):
    gen = torch.Generator().manual_seed(m * n + k)
    x = rows_of(gen, m, k, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    y, s = gemv.gemv_triton(x, w, bias, config=config)
    assert s is None
    expected = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    close(y, expected.to(dtype), tol)
    y32, _ = gemv.gemv_triton(x, w, bias, out_dtype=torch.float32, config=config)
    close(y32, expected, tol)


@in_interpreter
@pytest.mark.parametrize("config", ROW_CONFIGS)
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("n,k", ROW_SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_rows_silu_mul(m, n, k, dtype, tol, config):
    gen = torch.Generator().manual_seed(m + n + k)
    gate_up = (2 * torch.randn(1, m, 2 * k, generator=gen)).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    y, s = gemv.gemv_triton(gate_up, w, prologue="silu_mul", config=config)
    assert s is None
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = (F.silu(gate) * up).to(dtype)  # the unfused kernel's output, in the activation dtype
    close(y, F.linear(act.float(), w.float()).to(dtype), tol)


@in_interpreter
@pytest.mark.parametrize("config", ROW_CONFIGS)
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("n,k", ROW_SHAPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("with_residual,with_bias", [(False, False), (True, False), (True, True)])
def test_rows_rms_norm(m, n, k, dtype, tol, config, with_residual, with_bias):
    gen = torch.Generator().manual_seed(3 * m + n + k)
    x = rows_of(gen, m, k, dtype)
    res = rows_of(gen, m, k, dtype).flip(1) if with_residual else None
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    y, s = gemv.gemv_triton(x, w, bias, prologue="rms_norm", residual=res, norm_weight=nw, eps=1e-5,
                            config=config)
    summed = x if res is None else (x.float() + res.float()).to(dtype)
    if res is None:
        assert s is None
    elif dtype == torch.float32:
        assert torch.equal(s, x + res)
    else:  # the interpreter truncates to bfloat16 where torch (and the GPU) round: one step apart
        close(s, summed, tol)
    b = None if bias is None else bias.float()
    close(y, F.linear(unfused_norm(summed, nw, 1e-5).float(), w.float(), b).to(dtype), tol)
    close(y, F.linear(F.rms_norm(summed.float(), (k,), nw.float(), 1e-5), w.float(), b).to(dtype), tol)


@in_interpreter
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rows_strided_and_mixed_dtype_inputs(dtype, tol):
    """Slices as the model passes them (``hidden[:, -1:]``, ``normed[:, -k:]``): the same result as
    their contiguous copies, whether the rows collapse to one stride or not."""
    gen = torch.Generator().manual_seed(7)
    k, n = 72, 40
    hidden = torch.randn(3, 5, k, generator=gen).to(dtype)
    other = torch.randn(3, 5, k, generator=gen).to(dtype)
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    for last in (1, 2):  # [3, 1, k]: one row stride (a view); [3, 2, k]: two strides (a copy)
        x, res = hidden[:, -last:], other[:, -last:]
        y, s = gemv.gemv_triton(x, w, None, "rms_norm", res, nw, 1e-5, torch.float32)
        y_ref, s_ref = gemv.gemv_triton(x.contiguous(), w, None, "rms_norm", res.contiguous(), nw, 1e-5,
                                        torch.float32)
        assert torch.equal(y, y_ref) and torch.equal(s, s_ref) and s.is_contiguous()
        summed = (x.float() + res.float()).to(dtype)
        close(y, F.linear(unfused_norm(summed, nw, 1e-5).float(), w.float()), tol)
    # An activation in another dtype than the weight: float32 products, no tl.dot dtype clash.
    x = hidden[0].float()
    close(gemv.gemv_triton(x, w)[0], F.linear(x, w.float()), tol)


@in_interpreter
def test_ops_send_1_to_16_rows_to_the_fused_gemv(monkeypatch):
    """The dispatch in ops.py, with its CUDA condition lifted so the interpreter stands in: 1 to 16
    tokens of one sequence take one fused launch with a small weight, 17 fall back to the unfused
    ops; SiLU·mul and weights above FEW_ROWS_MAX_WEIGHT are fused for one row only."""
    from spectool.kernels import ops

    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return gemv_triton(*args, **kwargs)

    gemv_triton = gemv.gemv_triton
    monkeypatch.setattr(ops, "_triton", lambda x: x.stride(-1) == 1 and not torch.is_grad_enabled())
    monkeypatch.setattr(gemv, "gemv_triton", spy)
    gen = torch.Generator().manual_seed(11)
    k, n, tol = 64, 48, 1e-4
    w = torch.randn(n, k, generator=gen) / k**0.5
    w_down = torch.randn(n, n // 2, generator=gen) / n**0.5
    nw = 1 + 0.1 * torch.randn(k, generator=gen)
    with torch.no_grad():
        for m, fused in ((1, True), (5, True), (16, True), (17, False)):
            calls.clear()
            x = torch.randn(1, m, k, generator=gen)
            res = torch.randn(1, m, k, generator=gen)
            close(ops.linear(x, w), F.linear(x, w), tol)
            y, s = ops.rms_norm_linear(x, res, nw, 1e-5, w, None, torch.float32)
            assert torch.equal(s, x + res)
            close(y, F.linear(F.rms_norm(x + res, (k,), nw, 1e-5), w), tol)
            gate_up = torch.randn(1, m, n, generator=gen)
            gate, up = gate_up.chunk(2, dim=-1)
            close(ops.silu_mul_linear(gate_up, w_down), F.linear(F.silu(gate) * up, w_down), tol)
            assert len(calls) == (0 if not fused else 3 if m == 1 else 2), (m, calls)
        with monkeypatch.context() as small:  # w just above the few-row limit: one row only is fused
            small.setattr(ops, "FEW_ROWS_MAX_WEIGHT", w.numel() - 1)
            for m in (1, 2):
                calls.clear()
                x = torch.randn(1, m, k, generator=gen)
                close(ops.linear(x, w), F.linear(x, w), tol)
                assert len(calls) == (m == 1)
        hidden = torch.randn(1, 9, k, generator=gen)  # an EAGLE step's head over normed[:, -4:]: strided rows
        calls.clear()
        logits = ops.rms_norm_linear(hidden[:, -4:], None, nw, 1e-5, w, None, torch.float32)[0]
        assert len(calls) == 1
        close(logits, F.linear(F.rms_norm(hidden[:, -4:], (k,), nw, 1e-5), w), tol)
        # Rows of several sequences go to cuBLAS however few: the kernel must not change with the
        # batch a CUDA graph pads to. One row of each (decode) is fused only at batch 1.
        calls.clear()
        for x in (torch.randn(2, 3, k, generator=gen), torch.randn(4, 1, k, generator=gen)):
            close(ops.linear(x, w), F.linear(x, w), tol)
        assert not calls
        monkeypatch.setattr(ops, "FUSED_GEMV", False)
        ops.linear(hidden[:, -1:], w)
        assert not calls
