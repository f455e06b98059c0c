"""Batch-invariant kernels for deterministic mode: the projections and the cached attention.

In deterministic mode (``Engine(..., deterministic=True)``, docs/INTERNALS.md "Deterministic
mode") a token's logits are the same bits whether the token is computed in a prefill, a
one-token decode or an N-token tree verify, at any batch size and any position in the batch.
So every float32 sum the forward makes for one token runs in an order fixed by that token's own
data, never by how many rows share the call:

* ``linear_invariant``: ``y = f(x) @ W.T`` for any number of rows is the one-row GEMV of
  kernels/gemv.py launched once over all rows (its grid has a row axis): each row is computed
  by the same program as a batch-1 decode step computes it (same config, chosen from the
  weight's K alone; same BLOCK_K order; same [BLOCK_N, BLOCK_K] float32 partial sums; same
  final reduction tree), fused prologue included (residual add + RMSNorm, SiLU·mul). Batch-1
  decoding therefore runs at the default mode's speed. The price is elsewhere: M rows read the
  weight M times (from L2 when the rows of one weight slab run together, which the grid's row
  axis arranges), so a prefill or a wide verify of a large model is slower than cuBLAS.
  Reference: ``gemv.gemv_reference``.
* ``attention_invariant``: a query attends to its visible keys taken as one logical sequence:
  the cached prefix, then the new tokens it sees in index order (in a tree: its ancestors, root
  first, then itself). That is the sequence plain decoding sees at the same position (the same
  K/V, which the commit moved to contiguous cache indices), and it is always cut the same way:
  blocks of ``BLOCK_N`` keys from logical index 0, block b to split-KV program b mod
  ``KEY_SPLITS`` (each program runs its blocks in order through one online softmax), then the
  ``KEY_SPLITS`` partial results merged by the log-sum-exp merge of kernels/attention_triton.py.
  Both constants are fixed, so the cut depends on the query's key count alone: not on T, the
  batch, the tree, nor the cache's length (engines with other ``max_seq_len`` agree too). The
  tree mask only chooses the cache index each logical key is read from. One program serves the
  query heads of one kv head for one query, so its tile holds the same rows in every forward.
  Reference: ``attention_triton.cached_attention_reference``.

The attention kernel compiles in variants (with and without a tree mask, per tree size) that must
agree: they run the same arithmetic on the same tiles, and with FMA contraction off (``enable_fp_fusion
=False``) no compiler choice can fuse a multiply and an add in one variant only.

The other per-layer ops are batch invariant as they are (one program per row: embedding, RMSNorm,
RoPE + cache write; elementwise: the residual adds) and the greedy argmax is exact.

Triton specialises a kernel on its integer arguments (== 1, divisible by 16) and on pointer
alignment. The kernels here see the same values whatever the batch: the call sizes that vary
(rows, T) are grid sizes or unspecialised arguments, and inputs are passed as contiguous rows
from a 16-byte boundary (``_rows``), so no call compiles another reduction layout.
"""

from __future__ import annotations

import math

import torch

from spectool.kernels.attention_triton import _attn_merge_kernel, check_attention_args
from spectool.kernels.gemv import check_gemv_args, launch_row_gemv
from spectool.kernels.triton_import import tl, triton

# Keys per block and split-KV programs per (row, kv head, query); both fixed, so a query's split
# depends on its key count alone. At the 8B shape's batch-1 decode (8 kv heads) 16 splits are one
# wave of programs on the H200's 132 SMs, each with one 64-key block per 1024 keys.
BLOCK_N = 64
KEY_SPLITS = 16
# A long causal call (prefill) runs its queries in slices whose float32 partials fit this.
PARTIALS_BYTES = 256 << 20


def _rows(t: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``t`` as ``rows`` contiguous rows of ``width`` that start at a 16-byte boundary (a view when it
    already is one, else a copy), so every call compiles to the same kernel specialisation."""
    t2 = t.reshape(rows, width)
    if not t2.is_contiguous():
        return t2.contiguous()
    return t2.clone() if t2.data_ptr() % 16 else t2


def linear_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     prologue: str = "none", residual: torch.Tensor | None = None,
                     norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                     out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``y = f(x) @ weight.T (+ bias)`` for any number of rows, each row computed exactly as alone.

    Same arguments and results as ``gemv.gemv_triton`` (with the exact-norm prologue), without its
    row limit: x is [..., K] (2K wide for ``silu_mul``), weight [N, K]. Returns ``(y, s)``, s = x +
    residual for ``rms_norm`` with a residual, else None.
    """
    check_gemv_args(x, weight, bias, prologue, residual, norm_weight)
    N, K = weight.shape
    width = 2 * K if prologue == "silu_mul" else K
    if x.shape[-1] != width:
        raise ValueError(f"x must be rows of {width} values for weight {tuple(weight.shape)} and prologue "
                         f"{prologue!r}, got shape {tuple(x.shape)}")
    rows = x.numel() // width
    y = torch.empty(*x.shape[:-1], N, device=x.device, dtype=out_dtype or x.dtype)
    s = torch.empty(x.shape, device=x.device, dtype=x.dtype) if residual is not None else None
    if rows:
        launch_row_gemv(_rows(x, rows, width), None if residual is None else _rows(residual, rows, K), weight,
                        bias, prologue, norm_weight, eps, y, s, rows)
    return y, s


@triton.jit(do_not_specialize=["T", "t_offset"])
def _attn_invariant_kernel(
    Q, K, V, Slots, Starts, Mask, OutPart, LsePart,
    sq_b, sq_t, sq_h, sq_d,
    sk_b, sk_h, sk_n, sk_d,
    sv_b, sv_h, sv_n, sv_d,
    sm_b, sm_q, sm_k,
    T, t_offset, NUM_KV_HEADS, sm_scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    t = tl.program_id(1)  # the query, among this call's T
    split = tl.program_id(2)
    b = pid_bh // NUM_KV_HEADS
    kvh = pid_bh % NUM_KV_HEADS
    slot = tl.load(Slots + b).to(tl.int64)
    start = tl.load(Starts + b).to(tl.int32)

    # The new tokens this query sees: with a mask, the set bits of its row (and itself) in index
    # order, rank[k] = place of new token k among them; causally, new tokens 0 .. t_offset + t.
    if HAS_MASK:
        offs_t = tl.arange(0, BLOCK_T)
        seen = tl.load(Mask + b * sm_b + t * sm_q + offs_t * sm_k, mask=offs_t < T, other=0) != 0
        seen = seen | (offs_t == t)
        seen_i = seen.to(tl.int32)
        rank = tl.cumsum(seen_i, 0) - 1
        n_new = tl.sum(seen_i, 0)
    else:
        n_new = t_offset + t + 1
    n_keys = start + n_new

    g = tl.arange(0, BLOCK_M)
    row_ok = g < GROUP
    head = kvh * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + b * sq_b + t * sq_t + head[:, None] * sq_h + offs_d[None, :] * sq_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + slot * sk_b + kvh * sk_h
    v_base = V + slot * sv_b + kvh * sv_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for block in range(split, tl.cdiv(n_keys, BLOCK_N), NUM_SPLITS):  # this program's blocks, in order
        j = block * BLOCK_N + tl.arange(0, BLOCK_N)  # logical key indices; at least one is live
        ok = j < n_keys
        if HAS_MASK:  # logical start + r is the new token of rank r
            r = j - start
            pick = (rank[None, :] == r[:, None]) & seen[None, :]
            idx = tl.where(r >= 0, start + tl.sum(tl.where(pick, offs_t[None, :], 0), 1), j)
        else:
            idx = j
        k = tl.load(k_base + idx[None, :] * sk_n + offs_d[:, None] * sk_d, mask=ok[None, :] & d_ok[:, None],
                    other=0.0)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * sm_scale_log2  # [BLOCK_M, BLOCK_N], log2 units
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + idx[:, None] * sv_n + offs_d[None, :] * sv_d, mask=ok[:, None] & d_ok[None, :],
                    other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # The split's result normalised within it, and its log2-sum-exp (-inf: a split with no block).
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    part = ((b * NUM_KV_HEADS * GROUP + head) * T + t) * NUM_SPLITS + split
    tl.store(OutPart + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LsePart + part, lse, mask=row_ok)


def attention_invariant(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                        starts: torch.Tensor, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of T new queries per row over that row's cache slot, each query's sums in an order
    fixed by its own key count (module docstring).

    Same contract as ``attention_triton.cached_attention_triton`` (q [B, T, Hq, D]; one layer's
    cache [max_batch, Hkv, max_seq_len, D] with the new K/V already written; slots, starts [B];
    tree_mask [B, T, T] bool or None = causal; a token always sees itself), for any T: long causal
    calls (prefill) run in slices of queries. Returns [B, T, Hq, D] in q's dtype.
    """
    check_attention_args(q, k_cache, v_cache, slots, starts, tree_mask)
    slots, starts = slots.contiguous(), starts.contiguous()  # the kernel reads them at stride 1
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    group = Hq // Hkv
    out = torch.empty(B, T, Hq, D, device=q.device, dtype=q.dtype)
    if B == 0 or T == 0:
        return out
    num_splits = KEY_SPLITS
    block_d = triton.next_power_of_2(D)
    if tree_mask is not None:
        mask = tree_mask if tree_mask.dtype != torch.bool else tree_mask.view(torch.uint8)
        mask_strides, step = mask.stride(), T
    else:
        mask, mask_strides = q, (0, 0, 0)  # never read: HAS_MASK is False
        step = max(1, min(T, 65535, PARTIALS_BYTES // (B * Hq * num_splits * (D + 1) * 4)))
    out_part = torch.empty(B * Hq * step * num_splits * D, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(B * Hq * step * num_splits, device=q.device, dtype=torch.float32)
    sm_scale_log2 = (1.0 / math.sqrt(D)) * 1.4426950408889634
    for t0 in range(0, T, step):
        n = min(step, T - t0)
        q_slice, out_slice = q[:, t0:t0 + n], out[:, t0:t0 + n]
        _attn_invariant_kernel[(B * Hkv, n, num_splits)](
            q_slice, k_cache, v_cache, slots, starts, mask, out_part, lse_part,
            *q_slice.stride(), *k_cache.stride(), *v_cache.stride(), *mask_strides,
            n, t0, Hkv, sm_scale_log2,
            GROUP=group, HEAD_DIM=D, NUM_SPLITS=num_splits, HAS_MASK=tree_mask is not None,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N, BLOCK_D=block_d,
            BLOCK_T=triton.next_power_of_2(T) if tree_mask is not None else 1, num_warps=4, num_stages=2,
            enable_fp_fusion=False,  # each multiply and add rounded as written, whatever variant compiles
        )
        _attn_merge_kernel[(B * Hq * n,)](
            out_part, lse_part, out_slice, *out_slice.stride(), n, Hq,
            HEAD_DIM=D, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d, PDL=False, num_warps=4 if block_d >= 128 else 2, enable_fp_fusion=False,
        )
    return out
