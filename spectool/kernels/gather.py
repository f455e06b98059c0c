"""Row gathers of the decode step: the token embedding and the KV commit after a verify.

Both are a handful of rows copied from one place to another, so in a batch-1 iteration
their cost is the launch, not the bytes. torch spends more launches than the copy
needs (profiled on the H200, inside a CUDA graph):

* ``embedding``: ``nn.Embedding`` on CUDA runs ``indexSelectSmallIndex``, 6-10 µs for
  1-16 tokens of a 768-wide bf16 table where a plain row copy takes about 2 µs;
* ``commit_kv``: two gathers and two index_put's (k and v), four kernels and ~17 µs
  per iteration, for at most depth+1 rows per (layer, slot, kv head).

Each has a Triton kernel (one launch) and the plain-torch reference beside it; the
references are the CPU path and the tests' oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spectool.kernels.triton_import import tl, triton

# ---------------------------------------------------------------------------------
# token embedding

# Columns per program: a 768-wide row is one program, an 8B model's 4096-wide row four,
# so even one token spreads its copy over a few SMs.
EMBEDDING_BLOCK = 1024


@triton.jit
def _embedding_kernel(Ids, W, Out, T, V, H, stride_ib, stride_it, stride_w, stride_o,
                      BLOCK: tl.constexpr):
    tok = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    # Ids may be a strided [B, T] view (e.g. one column of a token buffer): no copy to flatten it.
    row = tl.load(Ids + (tok // T).to(tl.int64) * stride_ib + (tok % T).to(tl.int64) * stride_it)
    # Clamped, not checked: a device-side check would need a host sync to report it, and a
    # clamped id never reads outside the table (see embedding_triton).
    row = tl.minimum(tl.maximum(row.to(tl.int64), 0), V - 1)
    x = tl.load(W + row * stride_w + cols, mask=ok)
    tl.store(Out + tok.to(tl.int64) * stride_o + cols, x, mask=ok)


def embedding_triton(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight[ids]``: rows of the [V, H] table for integer ``ids`` of any shape, as
    ``ids.shape + (H,)`` in weight's dtype. One launch, no host sync (CUDA-graph safe).

    Ids outside [0, V) are clamped to the nearest valid row (0 or V-1) instead of raising as
    :func:`embedding_torch` does: the kernel never reads outside the table, and a check would
    need a host sync to report it (the engine checks prompt ids on the host; off CUDA the
    model's ``check_forward_args`` does).
    """
    if weight.dim() != 2 or weight.stride(-1) != 1:
        raise ValueError(f"weight must be [V, H] with a contiguous last dimension, got {tuple(weight.shape)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"ids must be an integer tensor, got {ids.dtype}")
    V, H = weight.shape
    out = torch.empty(*ids.shape, H, dtype=weight.dtype, device=weight.device)
    ids2 = ids if ids.dim() == 2 else ids.reshape(1, -1)
    n = ids2.numel()
    if n == 0 or H == 0:
        return out
    block = min(EMBEDDING_BLOCK, triton.next_power_of_2(H))
    # Enough warps that every thread moves one 16-byte vector per instruction.
    warps = max(1, min(8, block * weight.element_size() // 512))
    _embedding_kernel[(n, triton.cdiv(H, block))](
        ids2, weight, out, ids2.shape[1], V, H, ids2.stride(0), ids2.stride(1), weight.stride(0), H,
        BLOCK=block, num_warps=warps)
    return out


def embedding_torch(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference of :func:`embedding_triton` (raises on ids outside [0, V))."""
    return F.embedding(ids, weight)


# ---------------------------------------------------------------------------------
# KV commit

# Accepted entries moved per chunk; a tree deeper than this takes several chunks, in order.
COMMIT_CHUNK = 16


@triton.jit
def _commit_kv_kernel(K, V, Slots, SeqLens, Path, Length,
                      sk_l, sk_b, sk_h, sk_s, sv_l, sv_b, sv_h, sv_s, stride_pb, stride_pj,
                      HEADS, S, W, D, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per (request, kv head) along axis 0 and layer along axis 1; it moves that
    # head's accepted rows of k and v.
    pid = tl.program_id(0)
    b = pid // HEADS
    h = (pid % HEADS).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    slot = tl.load(Slots + b).to(tl.int64)
    base = tl.load(SeqLens + b).to(tl.int64)
    last = tl.minimum(tl.load(Length + b).to(tl.int32), W - 1)  # j runs 0..last
    k_row = K + layer * sk_l + slot * sk_b + h * sk_h
    v_row = V + layer * sv_l + slot * sv_b + h * sv_h
    d = tl.arange(0, BLOCK_D)
    # Sources and destinations overlap within a row (path [0, 2, 3]: j = 1 reads index 2, which
    # j = 2 writes). Each chunk reads all its sources, waits at a barrier, then writes: within a
    # chunk that is the reference's gather-then-scatter, and across chunks it is safe because
    # path[j] >= j, so a later chunk never reads what an earlier one wrote (it reads at or past
    # its own first j, above every earlier destination), and what it writes was read already.
    for j0 in range(0, last + 1, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        live = j <= last
        p = tl.load(Path + b * stride_pb + j * stride_pj, mask=live, other=0).to(tl.int64)
        # The reference clamps both ends to the cache; valid inputs never reach the clamp.
        src = tl.minimum(tl.maximum(base + p, 0), S - 1)
        dst = tl.minimum(base + j, S - 1)
        move = (live & (src != dst))[:, None] & (d[None, :] < D)
        ks = tl.load(k_row + src[:, None] * sk_s + d[None, :], mask=move)
        vs = tl.load(v_row + src[:, None] * sv_s + d[None, :], mask=move)
        # A thread may write an entry another thread of this program read: all reads land first.
        tl.debug_barrier()
        tl.store(k_row + dst[:, None] * sk_s + d[None, :], ks, mask=move)
        tl.store(v_row + dst[:, None] * sv_s + d[None, :], vs, mask=move)


def commit_kv_triton(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
                     accept_path: torch.Tensor, accept_length: torch.Tensor) -> None:
    """Triton version of :func:`commit_kv_torch` (CUDA, or CPU under ``TRITON_INTERPRET=1``):
    k and v in one launch, no host sync, so it can sit in a CUDA graph.

    Only entries j = 0 .. accept_length[b] are touched (the reference rewrites the rest onto
    themselves); the row's last index bounds both ends as in the reference, and a
    negative source index is clamped to 0 (the reference would wrap it), so nothing outside
    the slot's row is read or written. Arguments are not validated (``spectool.verify.commit_kv``
    does).
    """
    L, _, heads, S, D = k.shape
    bs, width = accept_path.shape
    if bs == 0 or L == 0 or heads == 0 or width == 0 or D == 0:
        return
    block_d = triton.next_power_of_2(D)
    block_j = min(COMMIT_CHUNK, triton.next_power_of_2(width))
    warps = max(1, min(4, block_j * block_d * k.element_size() // 2048))
    _commit_kv_kernel[(bs * heads, L)](
        k, v, slots.contiguous(), seq_lens.contiguous(), accept_path, accept_length.contiguous(),
        k.stride(0), k.stride(1), k.stride(2), k.stride(3), v.stride(0), v.stride(1), v.stride(2), v.stride(3),
        accept_path.stride(0), accept_path.stride(1), heads, S, width, D,
        BLOCK_J=block_j, BLOCK_D=block_d, num_warps=warps)


def commit_kv_torch(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
                    accept_path: torch.Tensor, accept_length: torch.Tensor) -> None:
    """Plain-torch reference of ``spectool.verify.commit_kv`` (arguments already validated):
    one gather and one scatter per cache, all reads before any write."""
    bs, width = accept_path.shape
    j = torch.arange(width, device=k.device)
    base = seq_lens.long()[:, None]
    # Entries past the accept length copy onto themselves (a no-op) so shapes stay static.
    src = base + torch.where(j <= accept_length[:, None], accept_path.long(), j)
    dst = (base + j).clamp(max=k.shape[3] - 1)
    src = src.clamp(max=k.shape[3] - 1)
    slot = slots.long()[:, None].expand(bs, width)
    for cache in (k, v):
        # Advanced indices on dims 1 and 3 (split by a slice) put [B, D+1] in front: [B, D+1, L, H, hd].
        cache[:, slot, :, dst] = cache[:, slot, :, src]
