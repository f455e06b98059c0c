"""row_topk: the torch reference against a brute-force oracle, and the Triton kernel against the
reference on the CPU via TRITON_INTERPRET=1 (this file re-runs itself in that child, conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch

from spectool.kernels.topk import row_topk, row_topk_torch, row_topk_triton


def brute_force(row: list[float], k: int, softmax: bool) -> tuple[list[float], list[int]]:
    """The k best (value, index) pairs of one row, ranked by the entries: NaN as -inf, +inf
    (under softmax) above every finite entry, ties to the smaller index."""
    vals = [float("-inf") if math.isnan(v) else v for v in row]
    order = sorted(range(len(vals)), key=lambda i: (-vals[i], i))[:k]
    if softmax:
        if float("inf") in vals:  # the limit of softmax: the +inf entries share the mass
            share = 1.0 / vals.count(float("inf"))
            vals = [share if v == float("inf") else 0.0 for v in vals]
        elif any(v > float("-inf") for v in vals):
            m = max(vals)
            z = sum(math.exp(v - m) for v in vals)
            vals = [math.exp(v - m) / z for v in vals]
        else:
            vals = [0.0] * len(vals)
    return [vals[i] for i in order], order


def cases():
    g = torch.Generator().manual_seed(0)
    out = []
    for shape, k, softmax, rounded in [((3, 4, 4096), 4, True, False), ((5, 16), 4, False, False),
                                       ((7, 100), 1, True, False), ((2, 3, 9000), 5, True, False),
                                       ((50,), 3, False, False), ((6, 40), 6, False, True),
                                       ((4, 4, 300), 4, True, True), ((2, 17), 16, False, True)]:
        x = torch.randn(*shape, generator=g)
        if rounded:  # many exact ties
            x = x.round()
        out.append((x, k, softmax))
    poisoned = torch.randn(4, 20, generator=g)
    poisoned[0, 5] = float("nan")
    poisoned[1] = float("nan")
    poisoned[2] = float("-inf")
    poisoned[2, 7] = 1.0
    poisoned[3, :3] = float("-inf")
    poisoned[3, 10] = float("inf")
    poisoned[0, 12] = float("inf")
    poisoned[0, 15] = float("inf")
    poisoned[1, 3:6] = -0.0  # equal to 0.0: ties by index
    poisoned[1, 8] = 0.0
    out += [(poisoned, 4, True), (poisoned, 4, False)]
    inside = torch.randn(6, 64, generator=g)  # ties among the k best, none at the cut
    inside[:, 40] = inside[:, 9] = 5.0
    inside[:3, 2] = 5.0
    out += [(inside, 4, True), (inside, 4, False)]
    # Vocabulary-long rows, ranked from their best chunks of 64 on the CPU: ties within the best,
    # between chunk maxima at the cut, whole chunks of -inf, a NaN.
    spread = torch.randn(8, 4096, generator=g) * 0.1
    spread[:4, 5] = spread[:4, 700] = 4.0  # a tie among the best, in two chunks
    spread[2:6, 3000] = spread[2:6, 3001] = 3.0  # a tie inside one chunk
    spread[4, ::64] = 9.0  # every chunk's maximum equal
    spread[5, :2048] = float("-inf")
    spread[6] = float("-inf")
    spread[6, 100] = spread[6, 4000] = 1.0
    spread[7, 64 * 7 + 5] = float("nan")
    spread[7, 64 * 9 + 1] = float("inf")
    spread[0, 64 * 40 + 3] = 9.0  # one entry above 4.0, which tops 30 chunks: fewer chosen than tied
    for c in range(10, 40):
        spread[0, 64 * c + (7 * c) % 64] = 4.0
    out += [(spread, 4, True), (spread, 8, False), (torch.randn(2, 3, 2048, generator=g).round(), 3, False)]
    return out


@pytest.mark.parametrize("x,k,softmax", cases())
def test_reference_matches_brute_force(x, k, softmax):
    values, indices = row_topk_torch(x, k, softmax)
    rows = x.reshape(-1, x.shape[-1])
    for r, (v, i) in enumerate(zip(values.reshape(-1, k), indices.reshape(-1, k))):
        want_v, want_i = brute_force(rows[r].tolist(), k, softmax)
        assert i.tolist() == want_i, r
        assert v.tolist() == pytest.approx(want_v, rel=1e-5, abs=1e-7)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="k must be"):
        row_topk(torch.zeros(2, 3), 4)
    with pytest.raises(ValueError, match="floating point"):
        row_topk(torch.zeros(2, 3, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="non-empty"):
        row_topk(torch.zeros(2, 0), 1)


def test_kernels_in_an_interpreter_subprocess(triton_interpreter_child):
    triton_interpreter_child()


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("x,k,softmax", cases())
def test_triton_matches_reference(x, k, softmax):
    want_v, want_i = row_topk_torch(x, k, softmax)
    got_v, got_i = row_topk_triton(x, k, softmax)
    assert got_i.dtype == torch.int64 and got_v.dtype == torch.float32
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_v, want_v, rtol=1e-6, atol=1e-7)


@pytest.mark.triton_interpreter
def test_triton_writes_into_views_and_reads_bf16():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 257, generator=g).bfloat16()
    # The EAGLE draft writes each step's children straight into slices of its candidate buffers.
    tokens = torch.full((3, 30), -7, dtype=torch.long)
    values = torch.empty(3, 4, 4)
    row_topk(x, 4, softmax=True, out=(values, tokens[:, 5:21].view(3, 4, 4)))
    want_v, want_i = row_topk_torch(x, 4, softmax=True)
    assert torch.equal(tokens[:, 5:21].view(3, 4, 4), want_i)
    assert (tokens[:, :5] == -7).all() and (tokens[:, 21:] == -7).all()
    torch.testing.assert_close(values, want_v, rtol=1e-6, atol=1e-7)
    # A strided input row (a slice of the last dim's parent) is read as such.
    wide = torch.randn(5, 64, generator=g)
    got = row_topk(wide[:, ::2], 3)
    assert torch.equal(got[1], row_topk_torch(wide[:, ::2], 3)[1])
