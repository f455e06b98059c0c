"""The Triton cached attention against its torch reference, on the CPU via TRITON_INTERPRET=1.

Triton picks interpreter or compiler when it is imported (its own helpers such as
``tl.cdiv`` are jit functions too), so unless this process started with
TRITON_INTERPRET=1 the file re-runs itself in a child pytest that does; the parent
never sets the variable, so other tests (and compiled GPU kernels) are untouched.
The interpreter's bfloat16 arithmetic is not faithful, so dtypes here are float32 and
float16; bfloat16 is covered by tests/gpu/test_attention_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
in_interpreter = pytest.mark.triton_interpreter  # skipped here, run by the launcher below (conftest.py)


def test_kernels_in_an_interpreter_subprocess(triton_interpreter_child):
    triton_interpreter_child()


from spectool.kernels import attention_triton as attn  # noqa: E402  (after the importorskip)


@in_interpreter
def test_kernels_really_run_in_the_interpreter():
    assert type(attn._attn_split_kernel).__name__ == "InterpretedFunction"
    assert type(attn._attn_merge_kernel).__name__ == "InterpretedFunction"


def random_tree_mask(B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor masks of random trees in topological order (parent index < child index)."""
    mask = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            mask[b, i, i] = True
            if i:
                parent = int(torch.randint(0, i, (1,), generator=gen))
                mask[b, i] |= mask[b, parent]
    return mask


def make_case(B, T, Hq, Hkv, D, max_seq, dtype, gen, max_batch=5):
    k_cache = torch.randn(max_batch, Hkv, max_seq, D, generator=gen).to(dtype)
    v_cache = torch.randn(max_batch, Hkv, max_seq, D, generator=gen).to(dtype)
    q = torch.randn(B, T, Hq, D, generator=gen).to(dtype)
    slots = torch.randperm(max_batch, generator=gen)[:B]
    starts = torch.randint(0, max_seq - T + 1, (B,), generator=gen)
    return q, k_cache, v_cache, slots, starts


CASES = [  # B, T, Hq, Hkv, D, max_seq, tree mask, num_splits
    (1, 1, 8, 2, 64, 300, False, None),    # decode, GQA 4
    (3, 1, 4, 4, 32, 100, False, 3),       # MHA, several rows
    (2, 5, 8, 2, 64, 120, True, None),     # tree verify
    (2, 6, 6, 2, 40, 90, True, 2),         # head_dim not a power of two, GQA 3
    (1, 12, 4, 1, 128, 80, False, 1),      # causal block of new tokens, one split
    (2, 9, 16, 2, 16, 70, True, 4),        # GQA 8 x T 9 = 72 rows: more than one row tile
]


@in_interpreter
@pytest.mark.parametrize("B,T,Hq,Hkv,D,max_seq,with_mask,splits", CASES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_matches_reference(B, T, Hq, Hkv, D, max_seq, with_mask, splits, dtype, tol):
    gen = torch.Generator().manual_seed(B * 100 + T * 10 + D)
    q, kc, vc, slots, starts = make_case(B, T, Hq, Hkv, D, max_seq, dtype, gen)
    mask = random_tree_mask(B, T, gen) if with_mask else None
    out = attn.cached_attention_triton(q, kc, vc, slots, starts, mask, num_splits=splits)
    ref = attn.cached_attention_reference(q, kc, vc, slots, starts, mask)
    assert out.shape == (B, T, Hq, D) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


ROPE_CASES = [  # B, Hq, Hkv, D, max_seq, num_splits
    (1, 8, 2, 64, 300, None),   # a batch-1 decode step, GQA 4
    (3, 4, 4, 32, 100, 3),      # MHA, several rows
    (2, 6, 2, 40, 90, 2),       # head_dim not a power of two (the halves straddle no block edge)
    (2, 16, 2, 16, 70, 64),     # GQA 8, more splits than live blocks
]


@in_interpreter
@pytest.mark.parametrize("B,Hq,Hkv,D,max_seq,splits", ROPE_CASES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_rope_in_attention_matches_rope_write_then_attention(B, Hq, Hkv, D, max_seq, splits, dtype, tol):
    # Oracle: the torch references of the two kernels it replaces, RoPE + cache write, then attention.
    # The cache entry at starts[b] holds NaN before the call: the kernel must take the new token from
    # its registers, never from the cache it writes in the same launch.
    gen = torch.Generator().manual_seed(B * 100 + D)
    q, kc, vc, slots, starts = make_case(B, 1, Hq, Hkv, D, max_seq, dtype, gen)
    qkv = torch.randn(B, 1, Hq + 2 * Hkv, D, generator=gen).to(dtype)  # a fused projection's output
    q, k, v = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hkv], qkv[:, :, Hq + Hkv:]
    angle = torch.rand(B, 1, D // 2, generator=gen) * 6.3
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    for b in range(B):
        kc[slots[b], :, starts[b]] = vc[slots[b], :, starts[b]] = float("nan")
    ref_kc, ref_vc = kc.clone(), vc.clone()
    ref = attn.rope_cached_attention_reference(q, k, v, cos, sin, ref_kc, ref_vc, slots, starts)
    out = attn.rope_cached_attention_triton(q, k, v, cos, sin, kc, vc, slots, starts, num_splits=splits)
    assert out.shape == (B, 1, Hq, D) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    # The rotated k and the v are written where the reference writes them, and nothing else moves.
    torch.testing.assert_close(kc, ref_kc, atol=tol, rtol=tol, equal_nan=True)
    assert torch.equal(vc.nan_to_num(), ref_vc.nan_to_num())


@in_interpreter
def test_rope_in_attention_drops_writes_past_the_cache():
    # A padding row of a graph bucket may start at max_seq_len: its new token is not written.
    gen = torch.Generator().manual_seed(4)
    B, Hq, Hkv, D, max_seq = 2, 4, 2, 32, 40
    q, kc, vc, slots, _ = make_case(B, 1, Hq, Hkv, D, max_seq, torch.float32, gen)
    starts = torch.tensor([7, max_seq])
    k, v = torch.randn(B, 1, Hkv, D, generator=gen), torch.randn(B, 1, Hkv, D, generator=gen)
    cos, sin = torch.ones(B, 1, D // 2), torch.zeros(B, 1, D // 2)
    before = kc.clone(), vc.clone()
    attn.rope_cached_attention_triton(q, k, v, cos, sin, kc, vc, slots, starts)
    assert torch.equal(kc[slots[0], :, 7], k[0, 0]) and torch.equal(vc[slots[0], :, 7], v[0, 0])
    kc[slots[0], :, 7], vc[slots[0], :, 7] = before[0][slots[0], :, 7], before[1][slots[0], :, 7]
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


@in_interpreter
def test_rope_in_attention_checks_its_arguments():
    gen = torch.Generator().manual_seed(5)
    q, kc, vc, slots, starts = make_case(2, 1, 4, 2, 16, 40, torch.float32, gen)
    k = v = torch.randn(2, 1, 2, 16, generator=gen)
    cos = sin = torch.randn(2, 1, 8, generator=gen)
    with pytest.raises(ValueError, match="one new token"):
        attn.rope_cached_attention_triton(q.expand(2, 2, 4, 16), k, v, cos, sin, kc, vc, slots, starts)
    with pytest.raises(ValueError, match="cos/sin"):
        attn.rope_cached_attention_triton(q, k, v, cos[..., :4], sin[..., :4], kc, vc, slots, starts)


@in_interpreter
def test_slots_and_starts_may_be_columns_of_a_table():
    # Multi-layer EAGLE passes each layer's starts as one column of a [B, layers] table: a row's
    # value sits `layers` elements after the previous row's, not next to it.
    gen = torch.Generator().manual_seed(3)
    q, kc, vc, slots, starts = make_case(3, 5, 4, 2, 64, 90, torch.float32, gen)
    table = torch.stack([starts, starts + 7, starts // 2], 1)  # [B, 3]
    slot_table = torch.stack([slots, slots.flip(0)], 1)
    out = attn.cached_attention_triton(q, kc, vc, slot_table[:, 0], table[:, 2])
    ref = attn.cached_attention_reference(q, kc, vc, slots, (starts // 2).contiguous())
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@in_interpreter
def test_never_reads_past_the_live_length():
    # NaN everywhere past starts+T (and in other slots): one read of it would poison the output.
    gen = torch.Generator().manual_seed(1)
    B, T, Hq, Hkv, D, max_seq = 2, 3, 4, 2, 32, 200
    q, kc, vc, slots, starts = make_case(B, T, Hq, Hkv, D, max_seq, torch.float32, gen)
    starts = torch.tensor([5, 70])
    poisoned_k, poisoned_v = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
    for b in range(B):
        live = int(starts[b]) + T
        poisoned_k[slots[b], :, :live] = kc[slots[b], :, :live]
        poisoned_v[slots[b], :, :live] = vc[slots[b], :, :live]
    for splits in (1, 7, 64):  # 64 splits: most of them find no live block at all
        out = attn.cached_attention_triton(q, poisoned_k, poisoned_v, slots, starts, None, num_splits=splits)
        torch.testing.assert_close(out, attn.cached_attention_reference(q, kc, vc, slots, starts), atol=1e-5,
                                   rtol=1e-5)


@in_interpreter
def test_tree_node_equals_decode_of_its_root_path():
    # Independent oracle: a tree node attends exactly like the last token of its root path
    # decoded alone (T=1) over a cache holding prefix + path. The worked example tree of docs/INTERNALS.md.
    gen = torch.Generator().manual_seed(2)
    Hq, Hkv, D, prefix = 4, 2, 32, 10
    parents = [-1, 0, 0, 1, 1]
    N = len(parents)
    mask = torch.zeros(1, N, N, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[0, i, i] = True
        if p >= 0:
            mask[0, i] |= mask[0, p]
    q = torch.randn(1, N, Hq, D, generator=gen)
    kc = torch.randn(1, Hkv, 32, D, generator=gen)
    vc = torch.randn(1, Hkv, 32, D, generator=gen)
    slot, start = torch.tensor([0]), torch.tensor([prefix])
    tree_out = attn.cached_attention_triton(q, kc, vc, slot, start, mask)
    for node in range(N):
        path = [k for k in range(N) if mask[0, node, k]]  # ancestors in topological order, node last
        kp, vp = kc.clone(), vc.clone()
        kp[0, :, prefix:prefix + len(path)] = kc[0, :, [prefix + k for k in path]]
        vp[0, :, prefix:prefix + len(path)] = vc[0, :, [prefix + k for k in path]]
        decode = attn.cached_attention_triton(q[:, node:node + 1], kp, vp, slot,
                                              torch.tensor([prefix + len(path) - 1]))
        torch.testing.assert_close(tree_out[:, node], decode[:, 0], atol=1e-5, rtol=1e-5)


@in_interpreter
def test_split_count_depends_on_shapes_only():
    # Graph safety: the grid is fixed by shapes; more splits for small batches, never more than blocks.
    assert attn.choose_num_splits(1, 8, 1, 4096, 64, 132) == 33
    assert attn.choose_num_splits(64, 8, 1, 4096, 64, 132) == 1
    assert attn.choose_num_splits(1, 8, 1, 128, 64, 132) == 2


@in_interpreter
@pytest.mark.parametrize("change", ["heads", "slots", "mask", "cache"])
def test_bad_shapes_raise_value_error(change):
    gen = torch.Generator().manual_seed(3)
    q, kc, vc, slots, starts = make_case(2, 3, 4, 2, 16, 40, torch.float32, gen)
    mask = None
    if change == "heads":
        q = torch.randn(2, 3, 5, 16)
    elif change == "slots":
        slots = slots[:1]
    elif change == "mask":
        mask = torch.ones(2, 3, 4, dtype=torch.bool)
    else:
        vc = vc[:, :, :20]
    with pytest.raises(ValueError):
        attn.cached_attention_triton(q, kc, vc, slots, starts, mask)


def _matmul_rounds_rows_alike(rows: int, k: int, gen: torch.Generator) -> bool:
    """Whether this CPU's BLAS rounds the last k rows of a rows-row product as a k-row one (not so
    with MKL on an AVX-512 EPYC: the kernel it picks depends on the row count)."""
    a, b = torch.randn(rows, 32, generator=gen), torch.randn(32, 60, generator=gen)
    return torch.equal((a @ b)[-k:], a[-k:] @ b)


def test_wide_tree_mask_sees_the_tree_nodes_already_in_the_cache():
    # A tree fed a few nodes at a time (the EAGLE what-if's steps): the newest k queries, with a
    # mask over all n nodes whose first n - k are already in the cache, attend as the last k of one
    # forward over all n; to the bit where the CPU's BLAS rounds a row alike whatever the row count.
    from spectool.kernels import ops

    gen = torch.Generator().manual_seed(3)
    B, n, k, max_seq = 3, 9, 3, 60
    q, kc, vc, slots, starts = make_case(B, n, 4, 2, 32, max_seq, torch.float32, gen)
    mask = random_tree_mask(B, n, gen)
    newest = ops.cached_attention(q[:, -k:], kc, vc, slots, starts + n - k, mask[:, -k:], max_seq)
    whole = attn.cached_attention_reference(q, kc, vc, slots, starts, mask)[:, -k:]
    torch.testing.assert_close(newest, whole, atol=1e-5, rtol=1e-5)
    forward = ops.cached_attention(q, kc, vc, slots, starts, mask, max_seq)[:, -k:]
    if _matmul_rounds_rows_alike(n, k, gen):
        assert torch.equal(newest, forward)
    else:  # the products' last-bit rounding, nothing more
        torch.testing.assert_close(newest, forward, atol=2e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="tree_mask"):
        ops.cached_attention(q, kc, vc, slots, starts, mask[:, :, :k], max_seq)
