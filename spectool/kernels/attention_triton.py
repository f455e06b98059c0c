"""Triton attention for the cached forward: decode (T=1) and tree verify (T=N).

One call attends T new queries per row to that row's KV-cache slot. Keys at cache
indices ``< starts[b]`` are the prefix and always visible; the T new tokens sit at
``starts[b] .. starts[b]+T-1`` (already written) and new token k is visible to new
token q iff ``tree_mask[b, q, k]`` (causal when the mask is None).

Why it looks like this (decode is memory bound, see docs/INTERNALS.md, "Why it is built this way"):

* ``starts`` is read on the device, so a CUDA graph captured once replays for every
  sequence length, and only the live blocks ``[0, starts+T)`` are ever loaded --
  never the whole ``max_seq_len`` cache.
* Split-KV ("flash-decoding"): the live keys of each (row, kv head) are cut into
  ``num_splits`` contiguous chunks processed by separate programs, and a second
  small kernel merges the partial results by their log-sum-exp. At batch 1 there are
  only 8 kv heads; without splits 8 programs would leave most of the 132 SMs idle.
  The number of splits depends on shapes only (never on ``starts``), so the launch
  grid is fixed and graph safe; splits that find no live block exit after writing an
  empty partial.
* GQA: one program serves all ``G = Hq / Hkv`` query heads of a kv head (rows of the
  tile are (head, query) pairs), so each K/V block is read from memory once.
* A decode step (one new token per row) takes RoPE and the cache write in the split kernel
  (``rope_cached_attention_triton``): each program rotates its q heads and the new k itself,
  uses the new k and v from registers at index ``starts[b]`` and one program per kv head writes
  them to the cache. A layer then has one launch fewer than with a RoPE kernel before the split.
"""

from __future__ import annotations

import math

import torch

from spectool.kernels import pdl
from spectool.kernels.fused import _check_rope_args, rope_write_kv_reference, rotate_half
from spectool.kernels.triton_import import tl, triton


@triton.jit
def _rotate(X, partner, d_ok, cos, signed_sin):
    """RoPE of the head vectors at ``X`` (rotate-half layout; ``X + partner`` is each element's partner
    in the other half) in float32, as ``_rope_kernel`` rotates them (``rotate_half``), to the bit."""
    x = tl.load(X, mask=d_ok, other=0.0).to(tl.float32)
    return rotate_half(x, tl.load(X + partner, mask=d_ok, other=0.0).to(tl.float32), cos, signed_sin, True)


@triton.jit
def _attn_split_kernel(
    Q, K, V, Slots, Starts, Mask, OutPart, LsePart, KNew, VNew, Cos, Sin,
    sq_b, sq_t, sq_h, sq_d,
    sk_b, sk_h, sk_n, sk_d,
    sv_b, sv_h, sv_n, sv_d,
    sm_b, sm_q, sm_k,
    snk_b, snk_h, snv_b, snv_h, sc_b, ss_b,
    T, NUM_KV_HEADS, MAX_SEQ_LEN, sm_scale_log2,
    NUM_SPLITS,  # not a constexpr: it follows the query count, and a new prompt length must not recompile
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_MASK: tl.constexpr, ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    # ROPE (T == 1, no mask): Q and KNew / VNew are the projection's q, k and v before RoPE; the new
    # token's k and v are not in the cache yet (module docstring).
    pdl.wait(PDL)
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // NUM_KV_HEADS
    kvh = pid_bh % NUM_KV_HEADS
    slot = tl.load(Slots + b).to(tl.int64)
    start = tl.load(Starts + b).to(tl.int32)
    kv_len = start + T

    # This split's contiguous share of the live blocks.
    n_blocks = tl.cdiv(kv_len, BLOCK_N)
    per_split = tl.cdiv(n_blocks, NUM_SPLITS)
    lo = pid_s * per_split * BLOCK_N
    hi = tl.minimum(lo + per_split * BLOCK_N, kv_len)

    # Tile rows are (query head in the group, new token) pairs: row = g * T + t.
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * T
    g = rows // T
    t = rows % T
    head = kvh * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_ptrs = Q + b * sq_b + t[:, None] * sq_t + head[:, None] * sq_h + offs_d[None, :] * sq_d
    k_base = K + slot * sk_b + kvh * sk_h
    v_base = V + slot * sv_b + kvh * sv_h
    if ROPE:
        half: tl.constexpr = HEAD_DIM // 2
        lo_half = offs_d < half
        partner = tl.where(lo_half, half, -half)
        at = tl.where(lo_half, offs_d, offs_d - half)
        cos = tl.load(Cos + b * sc_b + at, mask=d_ok, other=0.0).to(tl.float32)
        sin = tl.load(Sin + b * ss_b + at, mask=d_ok, other=0.0).to(tl.float32)
        sin = tl.where(lo_half, -sin, sin)
        qd_ok = row_ok[:, None] & d_ok[None, :]
        q = _rotate(q_ptrs, partner[None, :] * sq_d, qd_ok, cos[None, :], sin[None, :]).to(Q.dtype.element_ty)
        k_new = _rotate(KNew + b * snk_b + kvh * snk_h + offs_d, partner, d_ok, cos, sin)
        k_new = k_new.to(K.dtype.element_ty)
        v_new = tl.load(VNew + b * snv_b + kvh * snv_h + offs_d, mask=d_ok, other=0.0).to(V.dtype.element_ty)
    else:
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        cached = n_ok
        if ROPE:  # the new token's cache entry is written by this launch: taken from registers instead
            cached = n_ok & (offs_n < start)
        k = tl.load(k_base + offs_n[None, :] * sk_n + offs_d[:, None] * sk_d,
                    mask=cached[None, :] & d_ok[:, None], other=0.0)
        if ROPE:
            k = tl.where((offs_n == start)[None, :], k_new[:, None], k)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * sm_scale_log2  # [BLOCK_M, BLOCK_N], log2 units

        # Visibility: the prefix always; new token k by the tree mask (or causally).
        new_k = offs_n - start
        is_new = (new_k >= 0) & n_ok
        if HAS_MASK:
            tree = tl.load(Mask + b * sm_b + t[:, None] * sm_q + new_k[None, :] * sm_k,
                           mask=row_ok[:, None] & is_new[None, :], other=0)
            see_new = (tree != 0) | (new_k[None, :] == t[:, None])  # a token always sees itself
        else:
            see_new = new_k[None, :] <= t[:, None]
        visible = (new_k[None, :] < 0) | (is_new[None, :] & see_new)
        visible = visible & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may see nothing in this block (tree masks); keep the shift finite.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * sv_n + offs_d[None, :] * sv_d,
                    mask=cached[:, None] & d_ok[None, :], other=0.0)
        if ROPE:
            v = tl.where((offs_n == start)[:, None], v_new[None, :], v)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    pdl.launch_dependents(PDL)
    # Partial result normalised within the split, plus its log2-sum-exp for the merge.
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    part = ((b * NUM_KV_HEADS * GROUP + head) * T + t) * NUM_SPLITS + pid_s
    tl.store(OutPart + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LsePart + part, lse, mask=row_ok)
    if ROPE:
        if (pid_m == 0) & (pid_s == 0):  # one program per kv head writes the new token
            new_ok = d_ok & ((offs_d * 0 + start) < MAX_SEQ_LEN)  # never past the cache's end: padding rows
            tl.store(k_base + start * sk_n + offs_d * sk_d, k_new, mask=new_ok)
            tl.store(v_base + start * sv_n + offs_d * sv_d, v_new, mask=new_ok)


@triton.jit
def _attn_merge_kernel(
    OutPart, LsePart, Out,
    so_b, so_t, so_h, so_d,
    T, NUM_HEADS, NUM_SPLITS,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    pdl.wait(PDL)
    pid = tl.program_id(0)  # ((b * NUM_HEADS) + head) * T + t
    t = pid % T
    head = (pid // T) % NUM_HEADS
    b = pid // (T * NUM_HEADS)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(LsePart + pid * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.math.exp2(lse - m)  # every row sees at least itself, so m is finite
    parts = tl.load(OutPart + (pid * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    pdl.launch_dependents(PDL)
    tl.store(Out + b * so_b + t * so_t + head * so_h + offs_d * so_d, out.to(Out.dtype.element_ty), mask=d_ok)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: a few splits are enough to exercise the merge


def choose_num_splits(batch: int, num_kv_heads: int, m_blocks: int, max_seq_len: int,
                      block_n: int, sm_count: int) -> int:
    """Splits per (row, kv head) so the grid holds about two programs per SM.

    Depends on shapes only, never on the live lengths, so it is fixed for a CUDA graph.
    """
    base = batch * num_kv_heads * m_blocks
    want = max(1, math.ceil(2 * sm_count / base))
    return max(1, min(want, triton.cdiv(max_seq_len, block_n), 64))


def check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                         starts: torch.Tensor, tree_mask: torch.Tensor | None) -> None:
    """Shape checks of a cached attention call (a clear ValueError naming the misfit)."""
    B, T, Hq, D = q.shape
    _, Hkv, _, Dk = k_cache.shape
    if Dk != D or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"cache shapes {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads is not a multiple of {Hkv} kv heads")
    if slots.shape != (B,) or starts.shape != (B,):
        raise ValueError(f"slots {tuple(slots.shape)} and starts {tuple(starts.shape)} must both be ({B},)")
    if tree_mask is not None and tree_mask.shape != (B, T, T):
        raise ValueError(f"tree_mask must be ({B}, {T}, {T}), got {tuple(tree_mask.shape)}")


def cached_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    tree_mask: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of T new queries per row over that row's cache slot.

    Args:
        q: [B, T, Hq, D] queries (any strides), already rotated.
        k_cache, v_cache: [max_batch, Hkv, max_seq_len, D] one layer's cache, with the T
            new tokens already written at ``starts[b] .. starts[b]+T-1`` of slot ``slots[b]``.
        slots: [B] int cache slot per row.
        starts: [B] int cache length before the new tokens, read on the device.
        tree_mask: [B, T, T] bool, ``tree_mask[b, q, k]``: new token q sees new token k
            (a token always sees itself); None = causal.
        num_splits: split-KV factor; None picks one from the shapes and the SM count.

    Returns:
        [B, T, Hq, D] attention output in q's dtype.
    """
    check_attention_args(q, k_cache, v_cache, slots, starts, tree_mask)
    return _launch(q, k_cache, v_cache, slots, starts, tree_mask, num_splits, None)


def rope_cached_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    num_splits: int | None = None,
) -> torch.Tensor:
    """A decode step's attention with RoPE and the cache write in it: ``rope_write_kv_triton`` then
    ``cached_attention_triton`` (no mask) in the kernels of the second alone.

    Args:
        q: [B, 1, Hq, D] queries before RoPE; k, v: [B, 1, Hkv, D] the new token's key and value
            before RoPE (views into a fused qkv output are fine; contiguous in D).
        cos, sin: [B, 1, D/2] for the new token's position.
        k_cache, v_cache: [max_batch, Hkv, max_seq_len, D]; the new k (rotated) and v are written at
            ``[slots[b], :, starts[b]]`` (dropped past max_seq_len, as padding rows' are).
        slots, starts, num_splits: as ``cached_attention_triton``.

    Returns:
        [B, 1, Hq, D] attention output in q's dtype.
    """
    check_attention_args(q, k_cache, v_cache, slots, starts, None)
    B, T, _, D = q.shape
    if T != 1 or k.shape != (B, 1, k_cache.shape[1], D) or v.shape != k.shape or v.stride(-1) != 1:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must be one new "
                         f"token per row with the cache's {k_cache.shape[1]} kv heads, v contiguous in D")
    _check_rope_args(q, k, cos, sin)
    return _launch(q, k_cache, v_cache, slots, starts, None, num_splits, (k, v, cos, sin))


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
            starts: torch.Tensor, tree_mask: torch.Tensor | None, num_splits: int | None,
            rope: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    """The split and merge launches (arguments checked); ``rope``: (k, v, cos, sin) of the new token."""
    slots, starts = slots.contiguous(), starts.contiguous()  # the kernel reads them at stride 1
    B, T, Hq, D = q.shape
    _, Hkv, max_seq_len, _ = k_cache.shape
    group = Hq // Hkv
    block_d = triton.next_power_of_2(D)
    block_m = max(16, min(64, triton.next_power_of_2(group * T)))
    block_n = 64 if block_d <= 64 else 32 if block_m >= 64 else 64
    m_blocks = triton.cdiv(group * T, block_m)
    if num_splits is None:
        num_splits = choose_num_splits(B, Hkv, m_blocks, max_seq_len, block_n, _sm_count(q.device))

    out_part = torch.empty(B * Hq * T * num_splits * D, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(B * Hq * T * num_splits, device=q.device, dtype=torch.float32)
    out = torch.empty(B, T, Hq, D, device=q.device, dtype=q.dtype)
    if tree_mask is not None:
        mask = tree_mask if tree_mask.dtype != torch.bool else tree_mask.view(torch.uint8)
        mask_strides = mask.stride()
    else:
        mask, mask_strides = q, (0, 0, 0)  # never read: HAS_MASK is False
    if rope is not None:
        k_new, v_new, cos, sin = rope
        rope_strides = (k_new.stride(0), k_new.stride(2), v_new.stride(0), v_new.stride(2), cos.stride(0),
                        sin.stride(0))
    else:
        k_new = v_new = cos = sin = q  # never read: ROPE is False
        rope_strides = (0,) * 6

    sm_scale_log2 = (1.0 / math.sqrt(D)) * 1.4426950408889634
    on = pdl.use_pdl_one_row(q, B * T)
    _attn_split_kernel[(B * Hkv, m_blocks, num_splits)](
        q, k_cache, v_cache, slots, starts, mask, out_part, lse_part, k_new, v_new, cos, sin,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *mask_strides, *rope_strides,
        T, Hkv, max_seq_len, sm_scale_log2, num_splits,
        GROUP=group, HEAD_DIM=D, HAS_MASK=tree_mask is not None, ROPE=rope is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 models stay exact
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, PDL=on, num_warps=4, num_stages=2,
        **pdl.launch_options(on),
    )
    _attn_merge_kernel[(B * Hq * T,)](
        out_part, lse_part, out, *out.stride(), T, Hq, num_splits,
        HEAD_DIM=D, BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d, PDL=on, num_warps=4 if block_d >= 128 else 2, **pdl.launch_options(on),
    )
    return out


def cached_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch reference of :func:`cached_attention_triton` (same arguments, float32 math)."""
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        start = int(starts[b])
        n = start + T
        k = k_cache[int(slots[b]), :, :n].float().repeat_interleave(Hq // Hkv, dim=0)  # [Hq, n, D]
        v = v_cache[int(slots[b]), :, :n].float().repeat_interleave(Hq // Hkv, dim=0)
        scores = torch.einsum("thd,hnd->htn", q[b].float(), k) / math.sqrt(D)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        new = tree_mask[b].cpu().bool() | torch.eye(T, dtype=torch.bool) if tree_mask is not None else causal
        visible = torch.cat([torch.ones(T, start, dtype=torch.bool), new], dim=1)
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        out[b] = torch.einsum("htn,hnd->thd", scores.softmax(-1), v).to(q.dtype)
    return out


def rope_cached_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                    slots: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference of :func:`rope_cached_attention_triton`: RoPE and the cache write, then
    attention."""
    q = rope_write_kv_reference(q, k, v, cos, sin, k_cache, v_cache, slots, starts)
    return cached_attention_reference(q, k_cache, v_cache, slots, starts)
