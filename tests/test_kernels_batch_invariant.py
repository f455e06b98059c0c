"""Deterministic mode's batch-invariant kernels on the CPU via TRITON_INTERPRET=1 (arrangement of
test_kernels_fused.py): each against its torch reference (float32, to a tolerance), and each
row or query bit for bit the same whether it is computed alone or inside a larger call.

The interpreter runs every program with numpy, so bit equality here proves the kernels' own
logic (which rows a program reads, how a tree query's keys are laid out in blocks and splits)
but not the GPU's reduction order; tests/gpu/test_deterministic_gpu.py proves that in bf16 on
CUDA, kernel by kernel and through the whole model and engine.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
in_interpreter = pytest.mark.triton_interpreter


def test_kernels_in_an_interpreter_subprocess(triton_interpreter_child):
    triton_interpreter_child()


from spectool.kernels import batch_invariant as bi  # noqa: E402  (after the importorskip)
from spectool.kernels.attention_triton import cached_attention_reference  # noqa: E402
from spectool.kernels.gemv import gemv_reference, gemv_triton  # noqa: E402


@in_interpreter
def test_kernels_really_run_in_the_interpreter():
    assert type(bi._attn_invariant_kernel).__name__ == "InterpretedFunction"


# ---------------------------------------------------------------------------------
# linear_invariant: the one-row GEMV over every row

PROLOGUE_CASES = [  # prologue, residual, bias
    ("none", False, False), ("none", False, True), ("silu_mul", False, False),
    ("rms_norm", False, False), ("rms_norm", True, True),
]


def linear_inputs(gen, m, n, k, prologue, with_residual, with_bias):
    width = 2 * k if prologue == "silu_mul" else k
    scale = torch.logspace(-2, 2, m, base=2.0)[:, None]  # each row its own scale: per-row rstd matters
    x = torch.randn(m, width, generator=gen) * scale
    res = torch.randn(m, k, generator=gen) if with_residual else None
    nw = 1 + 0.1 * torch.randn(k, generator=gen) if prologue == "rms_norm" else None
    w = torch.randn(n, k, generator=gen) / k**0.5
    bias = torch.randn(n, generator=gen) if with_bias else None
    return x, res, nw, w, bias


@in_interpreter
@pytest.mark.parametrize("prologue,with_residual,with_bias", PROLOGUE_CASES)
@pytest.mark.parametrize("m", [1, 5, 23])
def test_linear_matches_reference(m, prologue, with_residual, with_bias):
    gen = torch.Generator().manual_seed(m)
    n, k = 40, 72  # off the block sizes: masks at both edges
    x, res, nw, w, bias = linear_inputs(gen, m, n, k, prologue, with_residual, with_bias)
    y, s = bi.linear_invariant(x, w, bias, prologue, res, nw, 1e-5)
    ref_y, ref_s = gemv_reference(x, w, bias, prologue, res, nw, 1e-5)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref_y, atol=1e-4, rtol=1e-4)
    if with_residual:
        assert torch.equal(s, x + res)
    else:
        assert s is None
    y16, _ = bi.linear_invariant(x.half(), w.half(), None if bias is None else bias.half(), prologue,
                                 None if res is None else res.half(), None if nw is None else nw.half(), 1e-5,
                                 torch.float32)
    assert y16.dtype == torch.float32
    torch.testing.assert_close(y16, ref_y, atol=3e-2, rtol=3e-2)


@in_interpreter
@pytest.mark.parametrize("prologue,with_residual,with_bias", PROLOGUE_CASES)
def test_a_linear_row_is_the_same_bits_alone_and_in_any_batch(prologue, with_residual, with_bias):
    """Row i of an M-row call equals the one-row call on row i, at every position and for batches
    of any size (strided and unaligned views included), and equals the default mode's one-row GEMV:
    deterministic batch-1 decoding runs the very kernel of the default mode."""
    gen = torch.Generator().manual_seed(5)
    n, k = 24, 37  # K odd: a row view starts off a 16-byte boundary
    x, res, nw, w, bias = linear_inputs(gen, 9, n, k, prologue, with_residual, with_bias)
    alone = [bi.linear_invariant(x[i:i + 1], w, bias, prologue, None if res is None else res[i:i + 1], nw,
                                 1e-5) for i in range(9)]
    for i, (y1, s1) in enumerate(alone):
        y_default, s_default = gemv_triton(x[i:i + 1], w, bias, prologue, None if res is None else res[i:i + 1],
                                           nw, 1e-5)
        assert torch.equal(y1, y_default) and (s1 is None or torch.equal(s1, s_default))
    for rows in (slice(0, 9), slice(2, 7), slice(8, 9), slice(1, 9, 3)):
        y, s = bi.linear_invariant(x[rows], w, bias, prologue, None if res is None else res[rows], nw, 1e-5)
        for j, i in enumerate(range(9)[rows]):
            assert torch.equal(y[j], alone[i][0][0]), (rows, i)
            if s is not None:
                assert torch.equal(s[j], alone[i][1][0])
    y3, _ = bi.linear_invariant(x.view(3, 3, -1), w, bias, prologue, None if res is None else res.view(3, 3, -1),
                                nw, 1e-5)
    assert y3.shape == (3, 3, n) and all(torch.equal(y3.reshape(9, n)[i], alone[i][0][0]) for i in range(9))


@in_interpreter
def test_linear_bad_input_is_a_clear_error():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="rows of 32 values"):
        bi.linear_invariant(torch.randn(3, 16), w, prologue="silu_mul")
    with pytest.raises(ValueError, match="norm_weight"):
        bi.linear_invariant(torch.randn(3, 16), w, prologue="rms_norm")
    with pytest.raises(ValueError, match="contiguous along K"):
        bi.linear_invariant(torch.randn(16, 3).t(), w)
    assert bi.linear_invariant(torch.randn(0, 16), w)[0].shape == (0, 8)


# ---------------------------------------------------------------------------------
# attention_invariant: one logical key sequence per query, cut the same way in every forward

def tree_mask_of(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
    return mask


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 8 keys over 3 split-KV programs, so a short sequence gives each program several
    blocks (the interpreter's time goes by programs, not by their size)."""
    monkeypatch.setattr(bi, "BLOCK_N", 8)
    monkeypatch.setattr(bi, "KEY_SPLITS", 3)


@in_interpreter
@pytest.mark.parametrize("case", ["decode", "tree", "causal", "causal_sliced"])
def test_attention_matches_reference(case, small_blocks, monkeypatch):
    gen = torch.Generator().manual_seed(len(case))
    B, Hq, Hkv, D, max_seq = 2, 6, 2, 24, 90  # GQA 3, head_dim not a power of two
    T = {"decode": 1, "tree": 6}.get(case, 9)
    kc, vc = torch.randn(3, Hkv, max_seq, D, generator=gen), torch.randn(3, Hkv, max_seq, D, generator=gen)
    q = torch.randn(B, T, Hq, D, generator=gen)
    slots, starts = torch.tensor([2, 0]), torch.tensor([70, 3])
    mask = torch.stack([tree_mask_of([-1, 0, 0, 1, 3, 2]), tree_mask_of([-1, 0, 1, 2, 0, 0])]) \
        if case == "tree" else None
    if case == "causal_sliced":  # room for the partials of 4 queries: three slices of the 9
        monkeypatch.setattr(bi, "PARTIALS_BYTES", B * Hq * bi.KEY_SPLITS * (D + 1) * 4 * 4)
    out = bi.attention_invariant(q, kc, vc, slots, starts, mask)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, cached_attention_reference(q, kc, vc, slots, starts, mask),
                               atol=1e-5, rtol=1e-5)


@in_interpreter
def test_attention_reads_slots_and_starts_given_as_table_columns(small_blocks):
    # As multi-layer EAGLE passes them: each layer's starts are one column of a [B, layers] table.
    gen = torch.Generator().manual_seed(5)
    B, T, Hq, Hkv, D, max_seq = 2, 4, 4, 2, 16, 60
    kc, vc = torch.randn(3, Hkv, max_seq, D, generator=gen), torch.randn(3, Hkv, max_seq, D, generator=gen)
    q = torch.randn(B, T, Hq, D, generator=gen)
    starts = torch.tensor([[40, 9, 1], [3, 9, 30]])
    slots = torch.tensor([[2, 0], [0, 0]])
    out = bi.attention_invariant(q, kc, vc, slots[:, 0], starts[:, 2])
    ref = cached_attention_reference(q, kc, vc, torch.tensor([2, 0]), torch.tensor([1, 30]))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@in_interpreter
def test_a_query_is_the_same_bits_in_prefill_decode_and_tree_verify(small_blocks, monkeypatch):
    """The oracle of deterministic mode at the attention: a token's output from a prefill (alone,
    or in a batch, or in slices), from a one-token decode (at any batch position) and from a tree
    verify (its ancestors scattered among siblings at other cache indices) is the same bits.
    The sequence (40 tokens) is 5 blocks over the 3 splits."""
    gen = torch.Generator().manual_seed(11)
    Hq, Hkv, D, max_seq, L = 2, 1, 16, 48, 40
    k_seq, v_seq = torch.randn(Hkv, L, D, generator=gen), torch.randn(Hkv, L, D, generator=gen)
    q_seq = torch.randn(L, Hq, D, generator=gen)
    kc, vc = torch.zeros(4, Hkv, max_seq, D), torch.zeros(4, Hkv, max_seq, D)
    kc[1, :, :L], vc[1, :, :L] = k_seq, v_seq
    kc[3], vc[3] = torch.randn(Hkv, max_seq, D, generator=gen), torch.randn(Hkv, max_seq, D, generator=gen)

    def run(q, slots, starts, mask=None):
        return bi.attention_invariant(q, kc, vc, torch.tensor(slots), torch.tensor(starts), mask)

    prefill = run(q_seq[None], [1], [0])[0]  # [L, Hq, D]
    other = torch.randn(1, L, Hq, D, generator=gen)  # a second row in the batch, another slot
    batched = run(torch.cat([other, q_seq[None]]), [3, 1], [0, 0])[1]
    assert torch.equal(batched, prefill)
    monkeypatch.setattr(bi, "PARTIALS_BYTES", Hq * bi.KEY_SPLITS * (D + 1) * 4 * 16)
    assert torch.equal(run(q_seq[None], [1], [0])[0], prefill)  # 16 queries a slice
    continued = run(q_seq[None, 29:], [1], [29])[0]  # a prefill of the rest after a cached prefix
    assert torch.equal(continued, prefill[29:])

    for p in (0, 7, 8, 23, 24, 39):  # single decode steps, first and last keys of blocks
        assert torch.equal(run(q_seq[None, p:p + 1], [1], [p])[0, 0], prefill[p]), p
    p = 27  # the same step at batch position 2 of 4
    q4 = torch.randn(4, 1, Hq, D, generator=gen)
    q4[2, 0] = q_seq[p]
    assert torch.equal(run(q4, [3, 0, 1, 2], [39, 5, p, 0])[2, 0], prefill[p])

    # Tree verify after a 30-token prefix: path 0 -> 2 -> 3 -> 6 carries the true tokens 30..33
    # (across a block boundary); the other nodes are siblings with their own K/V in between.
    parents = [-1, 0, 0, 2, 1, 3, 3, 4]
    mask = tree_mask_of(parents)
    on_path = {0: 30, 2: 31, 3: 32, 6: 33}
    S, N = 30, len(parents)
    kc[2, :, :S], vc[2, :, :S] = k_seq[:, :S], v_seq[:, :S]
    q_tree = torch.randn(1, N, Hq, D, generator=gen)
    for node in range(N):
        src = on_path.get(node)
        kc[2, :, S + node] = k_seq[:, src] if src is not None else torch.randn(Hkv, D, generator=gen)
        vc[2, :, S + node] = v_seq[:, src] if src is not None else torch.randn(Hkv, D, generator=gen)
        if src is not None:
            q_tree[0, node] = q_seq[src]
    alone = run(q_tree, [2], [S], mask[None])[0]
    in_batch = run(torch.cat([torch.randn(1, N, Hq, D, generator=gen), q_tree]), [3, 2], [20, S],
                   torch.stack([tree_mask_of([-1, 0, 1, 1, 0, 4, 5, 2]), mask]))[1]
    for node, src in on_path.items():
        assert torch.equal(alone[node], prefill[src]), node
        assert torch.equal(in_batch[node], prefill[src]), node


@in_interpreter
def test_a_query_is_the_same_bits_whatever_the_cache_length(small_blocks):
    """A plain engine and a speculative one have caches of different lengths (room for their
    trees): the cut of a query's keys must not depend on it."""
    gen = torch.Generator().manual_seed(12)
    Hq, Hkv, D, L = 2, 1, 16, 37
    k, v, q = torch.randn(Hkv, L, D, generator=gen), torch.randn(Hkv, L, D, generator=gen), \
        torch.randn(1, 1, Hq, D, generator=gen)
    outs = []
    for max_seq in (40, 90):
        kc, vc = torch.zeros(1, Hkv, max_seq, D), torch.zeros(1, Hkv, max_seq, D)
        kc[0, :, :L], vc[0, :, :L] = k, v
        outs.append(bi.attention_invariant(q, kc, vc, torch.tensor([0]), torch.tensor([L - 1])))
    assert torch.equal(outs[0], outs[1])
