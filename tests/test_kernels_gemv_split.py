"""The split-K product of several sequences' rows (kernels/gemv_split.py) against its torch reference
(``gemv.gemv_reference``) and ``F.linear``, and the property the engine relies on: a row's output is
the same bits whatever the other rows are and however many there are, so a padded CUDA graph bucket
and an eager call agree. On the CPU via TRITON_INTERPRET=1 (arrangement of test_kernels_gemv.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")
in_interpreter = pytest.mark.triton_interpreter


def test_kernels_in_an_interpreter_subprocess(triton_interpreter_child):
    triton_interpreter_child()


from spectool.kernels import gemv, gemv_split  # noqa: E402  (after the importorskip)

# N and K off the block sizes on purpose (masks at both edges); K over spans of uneven tile counts.
SHAPES = [(40, 72), (33, 300), (64, 512)]
# (BLOCK_N, BLOCK_K, split, warps, stages): one span, spans of whole tiles, more spans than tiles.
CONFIGS = [(16, 64, 1, 4, 2), (16, 32, 3, 4, 2), (32, 64, 16, 4, 2), None]


@in_interpreter
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_split_product_equals_reference(n, k, dtype, tol, config):
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(5, 1, k, generator=gen).to(dtype)  # five sequences of one token
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    y = gemv_split.gemv_split(x, w, bias, config=config)
    assert y.shape == (5, 1, n) and y.dtype == dtype
    torch.testing.assert_close(y.float(), gemv.gemv_reference(x, w, bias)[0].float(), atol=tol, rtol=tol)
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float(), bias.float()), atol=tol, rtol=tol)
    y32 = gemv_split.gemv_split(x, w, out_dtype=torch.float32, config=config)
    torch.testing.assert_close(y32, F.linear(x.float(), w.float()), atol=tol, rtol=tol)


@in_interpreter
@pytest.mark.parametrize("config", [(16, 32, 3, 4, 2), None])
def test_a_row_rounds_alike_whatever_the_other_rows(config):
    gen = torch.Generator().manual_seed(7)
    n, k = 48, 200
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(16, 1, k, generator=gen).to(torch.bfloat16)
    full = gemv_split.gemv_split(x, w, config=config)
    for rows in (1, 2, 9):  # a batch and its padded buckets
        assert torch.equal(gemv_split.gemv_split(x[:rows], w, config=config), full[:rows])
    other = x.clone()
    other[1:] = torch.randn(15, 1, k, generator=gen).to(torch.bfloat16)
    assert torch.equal(gemv_split.gemv_split(other, w, config=config)[0], full[0])
    # The slab counts are reset by each slab's last program: the same call again gives the same bits.
    assert torch.equal(gemv_split.gemv_split(x, w, config=config), full)


def test_bad_inputs_are_refused_with_a_clear_error():
    w = torch.randn(32, 64)
    with pytest.raises(ValueError, match="1 to 16 rows"):
        gemv_split.gemv_split(torch.randn(17, 1, 64), w)
    with pytest.raises(ValueError, match="1 to 16 rows"):
        gemv_split.gemv_split(torch.randn(2, 1, 63), w)
    with pytest.raises(ValueError, match="contiguous"):
        gemv_split.gemv_split(torch.randn(2, 1, 128)[..., ::2], w)
    with pytest.raises(ValueError, match="bias"):
        gemv_split.gemv_split(torch.randn(2, 1, 64), w, torch.randn(31))
