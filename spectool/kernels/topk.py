"""Top-k of each row, optionally of its softmax, in one launch: a Triton kernel and its torch reference.

Drafting picks a few tokens per row many times per iteration: EAGLE the top-k children of
every frontier node (softmax over the vocabulary, then top-k) and the best k of the k·k
path scores; multi-layer EAGLE the argmax of each layer with its probability. On the H200,
``torch.softmax`` followed by ``torch.topk`` is three kernels (softmax, a radix select, a
sort of the k results) and the select alone took 8–25 µs for k = 4 over 4096 logits, most of
an EAGLE draft step. Here one program per row keeps a running max and sum of exponentials
(the online softmax) and a k-slot buffer of the best (value, index) pairs while it streams
the row once, then writes the k best in descending order.

Semantics, shared by both versions: NaN counts as -inf (a broken draft layer's NaN logits
never win, and never poison the scores); under softmax +inf counts as the largest float32, so
the +inf entries share the probability mass instead of making it NaN; ties go to the smaller
index; the ranking is by the entries (logits), whose probabilities can round equal, and the
values are float32 (probabilities: 0 for a row with no logit above -inf). The torch reference
is the CPU path.
"""

from __future__ import annotations

import torch

from spectool.kernels.tree_indices import triton_on_cpu
from spectool.kernels.triton_import import tl, triton

# Rows longer than this stream through in several chunks of BLOCK_MAX; the buffer merge costs
# k reductions per chunk, so vocabularies much larger than this are left to torch (one program
# per row would have to walk 128k logits alone).
TRITON_MAX_ROW = 32768
BLOCK_MAX = 4096
TRITON_MAX_K = 16  # the kernel unrolls k selection rounds per chunk
FLOAT32_MAX = 3.4028234663852886e38  # +inf logits under softmax: the +inf entries share the mass


def _check(x: torch.Tensor, k: int) -> None:
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if not 1 <= k <= x.shape[-1]:
        raise ValueError(f"k must be in [1, {x.shape[-1]}] for rows of {x.shape[-1]}, got {k}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"x must be floating point, got {x.dtype}")


def row_topk_torch(x: torch.Tensor, k: int, softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`row_topk`."""
    _check(x, k)
    v = x.float().nan_to_num(nan=float("-inf"), posinf=FLOAT32_MAX if softmax else float("inf"),
                             neginf=float("-inf"))
    indices = _keyed_topk(v, k) if v.is_cuda else _untied_topk(v, k)
    if not softmax:
        return v.gather(-1, indices), indices
    # A row with no entry above -inf has NaN probabilities: 0 instead.
    return torch.softmax(v, dim=-1).gather(-1, indices).nan_to_num(nan=0.0), indices


def _keyed_topk(v: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k best entries, ranked by the (cleaned) entries themselves, not their
    probabilities, which can round equal; equal entries in index order."""
    # One top-k over unique int64 keys (the float's bits made order-preserving, then the reversed
    # index), several times faster on the CPU than a stable sort of the row. + 0.0 turns -0.0 into
    # 0.0, which compares equal to it.
    bits = (v + 0.0).view(torch.int32).long()
    n = v.shape[-1]
    key = ((bits ^ ((bits >> 31) & 0x7FFFFFFF)) << 32) | (n - 1 - torch.arange(n, device=v.device))
    return key.topk(k, dim=-1).indices


def _untied_topk(v: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`_keyed_topk` from a top-k of the floats (a few times cheaper on the CPU than the
    int64 keys), whose order among equal entries is unspecified: rows where one of the k best
    equals its successor in the float ranking (the (k+1)-th included, a tie at the cut) are
    re-ranked by their keys. A long row's float top-k runs over its best chunks (``_chunked_topk``).
    Reads the tie count on the host, so the CPU only."""
    rows = v.reshape(-1, v.shape[-1])
    n = rows.shape[-1]
    m = min(k + 1, n)
    top, indices = _chunked_topk(rows, m) if n % CHUNK == 0 and n >= 4 * m * CHUNK else rows.topk(m, dim=-1)
    tied = (top[:, 1:] == top[:, :-1]).any(-1)
    indices = indices[:, :k]
    if tied.any():
        indices[tied] = _keyed_topk(rows[tied], k)
    return indices.reshape(*v.shape[:-1], k)


# A long row is ranked from its best chunks of this many entries (``_chunked_topk``).
CHUNK = 64


def _chunked_topk(rows: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For :func:`_untied_topk`: ``rows.topk(m)`` [R, n] (n a multiple of CHUNK) from the m chunks
    with the largest maxima, one pass over the row instead of a top-k over all of it (several
    times dearer on the CPU at a vocabulary's length).

    Every entry above the m-th best chunk maximum c lies in those chunks, and so does one equal
    to c. So where at least m - 1 entries of a row exceed c its m best are the chosen entries' m
    best; where fewer do, the row's m best and the chosen entries' m best both hold two entries
    equal to c, a tie, which ``_untied_topk`` re-ranks over the whole row.
    """
    r, n = rows.shape
    best = rows.reshape(r, n // CHUNK, CHUNK).amax(-1).topk(m, dim=-1).indices
    chosen = (best[:, :, None] * CHUNK + torch.arange(CHUNK, device=rows.device)).view(r, m * CHUNK)
    top, at = rows.gather(1, chosen).topk(m, dim=-1)
    return top, chosen.gather(1, at)


@triton.jit
def _row_topk_kernel(X, OutV, OutI, V, G, sx_b, sx_g, so_b, so_g, si_b, si_g,
                     K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, SOFTMAX: tl.constexpr):
    row = tl.program_id(0)
    b = row // G
    g = row % G
    x_row = X + b.to(tl.int64) * sx_b + g * sx_g
    slots = tl.arange(0, KP)
    big = V + BLOCK  # an index no element has: worse than any real one on ties
    # Padding slots (>= K) hold +inf so they are never the worst slot and never replaced.
    top_v = tl.where(slots < K, float("-inf"), float("inf"))
    top_i = tl.full([KP], 0, tl.int32) + big
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < V
        x = tl.load(x_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("-inf"), x)
        if SOFTMAX:
            x = tl.where(x == float("inf"), 3.4028234663852886e38, x)  # FLOAT32_MAX (no globals in a kernel)
            new_m = tl.maximum(m, tl.max(x, axis=0))
            shift = tl.where(new_m == float("-inf"), 0.0, new_m)  # all -inf so far: exp(-inf) = 0, no NaN
            s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
            m = new_m
        taken = offs < 0
        for _ in tl.static_range(K):
            cand = tl.where(taken | ~valid, float("-inf"), x)
            cv = tl.max(cand, axis=0)
            ci = tl.min(tl.where((cand == cv) & valid & ~taken, offs, big), axis=0)
            taken = taken | (offs == ci)
            # Replace the worst slot (lowest value, then highest index) when the candidate beats it.
            wv = tl.min(top_v, axis=0)
            wi = tl.max(tl.where(top_v == wv, top_i, -1), axis=0)
            ws = tl.min(tl.where((top_v == wv) & (top_i == wi), slots, KP), axis=0)
            better = (ci < big) & ((cv > wv) | ((cv == wv) & (ci < wi)))
            hit = (slots == ws) & better
            top_v = tl.where(hit, cv, top_v)
            top_i = tl.where(hit, ci, top_i)
    # Write the K slots best first (value descending, index ascending).
    out_v = OutV + b.to(tl.int64) * so_b + g * so_g
    out_i = OutI + b.to(tl.int64) * si_b + g * si_g
    done = slots >= K
    for j in tl.static_range(K):
        cand = tl.where(done, float("-inf"), top_v)
        bv = tl.max(cand, axis=0)
        bi = tl.min(tl.where((cand == bv) & ~done, top_i, big), axis=0)
        done = done | ((top_i == bi) & ~done)
        if SOFTMAX:
            # Both branches are evaluated: keep the unused one finite (no 0/0, no -inf - -inf).
            bv = tl.where(s > 0, tl.exp(bv - tl.where(m == float("-inf"), 0.0, m)) / tl.where(s > 0, s, 1.0), 0.0)
        tl.store(out_v + j, bv)
        tl.store(out_i + j, bi.to(tl.int64))


def row_topk_triton(x: torch.Tensor, k: int, softmax: bool = False,
                    out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`row_topk` for x of 1 to 3 dims (CUDA, or CPU under
    ``TRITON_INTERPRET=1``); ``out`` = (values, indices) of shape [..., k] with unit last
    stride may be views into larger buffers (written in place, no copy kernel)."""
    _check(x, k)
    if x.dim() > 3:
        raise ValueError(f"x must have at most 3 dims, got shape {tuple(x.shape)}")
    lead = x.shape[:-1]
    values, indices = out if out is not None else (
        torch.empty(*lead, k, dtype=torch.float32, device=x.device),
        torch.empty(*lead, k, dtype=torch.int64, device=x.device))
    for name, t, dtype in (("values", values, torch.float32), ("indices", indices, torch.int64)):
        if t.shape != (*lead, k) or t.dtype != dtype or t.device != x.device or (k > 1 and t.stride(-1) != 1):
            raise ValueError(f"out {name} must be {dtype} of shape {(*lead, k)} with unit last stride on "
                             f"{x.device}, got {t.dtype} {tuple(t.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    v = x.shape[-1]
    # [B, G, V] with any row strides; a 1-D or 2-D x gets unit leading dims.
    x3, v3, i3 = (t.view((1,) * (3 - t.dim()) + tuple(t.shape)) if t.dim() < 3 else t for t in (x, values, indices))
    rows = x3.shape[0] * x3.shape[1]
    if rows:
        block = min(BLOCK_MAX, triton.next_power_of_2(v))
        _row_topk_kernel[(rows,)](x3, v3, i3, v, x3.shape[1], x3.stride(0), x3.stride(1), v3.stride(0), v3.stride(1),
                                  i3.stride(0), i3.stride(1), K=k, KP=max(2, triton.next_power_of_2(k)),
                                  BLOCK=block, SOFTMAX=softmax, num_warps=8 if block >= 2048 else 4)
    return values, indices


def row_topk(x: torch.Tensor, k: int, softmax: bool = False,
             out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row of ``x`` [..., V] (of ``softmax(x)`` when ``softmax``).

    Returns ``(values, indices)`` [..., k]: float32 values in descending order (probabilities
    with ``softmax``), int64 indices; NaN counts as -inf and ties go to the smaller index.
    On CUDA (or under ``TRITON_INTERPRET=1``) one Triton launch for rows of at most
    ``TRITON_MAX_ROW`` entries, k up to ``TRITON_MAX_K`` and up to 3 dims; otherwise the torch
    reference. ``out`` (values, indices) receives the result in place. No host sync: usable
    inside CUDA graphs.
    """
    if (x.is_cuda or triton_on_cpu()) and x.shape[-1] <= TRITON_MAX_ROW and 1 <= x.dim() <= 3 \
            and k <= TRITON_MAX_K:
        return row_topk_triton(x, k, softmax, out)
    values, indices = row_topk_torch(x, k, softmax)
    if out is None:
        return values, indices
    out[0].copy_(values)
    out[1].copy_(indices)
    return out
