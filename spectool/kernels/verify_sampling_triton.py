"""The vocabulary-wide parts of the sampling verify in Triton, never materialising [B, N, V]
probabilities (the torch reference is ``spectool.verify.verify_sampling``).

The torch version softmaxes, sorts (top-p) and cumsums the whole [B, N, V] tensor. A node's
distribution is fixed by three numbers of its row, so here:

1. ``_row_chunks_kernel``: one program per (node, vocabulary chunk) finds the chunk's maximum of
   ``x = logits / temperature``, its first index, and the sum of ``exp(x - chunk max)``; the
   chunks combine into the row's maximum ``m``, argmax and normaliser ``z``.
2. ``_row_cut_kernel`` (only with top-k or top-p): one program per node finds the row's cut ``c``
   by bisection over the float32 order (the ordered integer keys of the floats, 32 steps each, no
   sort): for top-k the largest value with at least k values ``>= c``; for top-p the smallest cut
   whose mass strictly above it is below ``top_p``; then the normaliser of the kept values.
   Values equal to the cut are kept (the reference's sort may drop some of a tie at top-p).
3. ``_bonus_kernel``: one program per request walks the last accepted node's row once, in
   vocabulary order, for the inverse CDF of its residual (float64 running sum, as the reference).

so ``p(t | node) = exp(x_t - m) / z`` when ``x_t >= c``, else 0. The tree decision between 2 and 3
takes the children's probabilities only, a [B, N] gather (``spectool.verify``). No host sync.
"""

from __future__ import annotations

import torch

from spectool.kernels.triton_import import tl, triton

CHUNK = 4096  # vocabulary entries per program of the row pass
CUT_BLOCK = 4096  # vocabulary entries per step of the cut's and the bonus's loops


@triton.jit
def _row_chunks_kernel(Logits, Temp, Vals, Idx, Sums, N, V, C, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(Temp + row // N)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(Logits + row * V + offs, mask=offs < V, other=-float("inf")).to(tl.float32) / t
    best, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    s = tl.sum(tl.where(offs < V, tl.exp(x - best), 0.0), axis=0)
    tl.store(Vals + row * C + c, best)
    tl.store(Idx + row * C + c, (c * CHUNK + i).to(tl.int64))
    tl.store(Sums + row * C + c, s)


@triton.jit
def _key(x):
    """The float32 values as int64 keys in the same order (negative floats reversed)."""
    bits = x.to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(bits < 0, -(bits & 0x7FFFFFFF) - 1, bits)


@triton.jit
def _row_cut_kernel(Logits, Temp, M, Cut, Z, N, V, top_k, top_p, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(Temp + row // N)
    m = tl.load(M + row)
    base = Logits + row * V
    lo = _key(tl.full((), -float("inf"), tl.float32))
    hi = _key(m)
    if top_k > 0:
        # The largest key with at least top_k values at or above it.
        for _ in range(33):
            mid = lo + (hi - lo + 1) // 2
            count = 0
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = tl.load(base + offs, mask=offs < V, other=-float("inf")).to(tl.float32) / t
                count += tl.sum(((_key(x) >= mid) & (offs < V)).to(tl.int32), axis=0)
            go_up = count >= top_k
            lo = tl.where(go_up, mid, lo)
            hi = tl.where(go_up, hi, mid - 1)
        hi = _key(m)
    z = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=-float("inf")).to(tl.float32) / t
        z += tl.sum(tl.where((_key(x) >= lo) & (offs < V), tl.exp(x - m), 0.0), axis=0)
    if top_p < 1.0:
        # The smallest key (>= the top-k cut) whose mass strictly above it is below top_p.
        k_lo = lo
        for _ in range(33):
            mid = lo + (hi - lo) // 2
            above = 0.0
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = tl.load(base + offs, mask=offs < V, other=-float("inf")).to(tl.float32) / t
                k = _key(x)
                above += tl.sum(tl.where((k > mid) & (k >= k_lo) & (offs < V), tl.exp(x - m), 0.0), axis=0)
            below = above / z < top_p
            hi = tl.where(below, mid, hi)
            lo = tl.where(below, lo, mid + 1)
        z = 0.0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < V, other=-float("inf")).to(tl.float32) / t
            z += tl.sum(tl.where((_key(x) >= lo) & (offs < V), tl.exp(x - m), 0.0), axis=0)
    bits = tl.where(lo < 0, -(lo + 1) | -2147483648, lo).to(tl.int32)
    tl.store(Cut + row, bits.to(tl.float32, bitcast=True))
    tl.store(Z + row, z)


@triton.jit
def _bonus_kernel(Logits, Temp, M, Cut, Z, Argmax, Last, ChildTokens, U, Bonus, BonusCdf, N, V,
                  BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    row = b * N + tl.load(Last + b)
    t = tl.load(Temp + b)
    m = tl.load(M + row)
    cut = tl.load(Cut + row)
    z = tl.load(Z + row)
    u = tl.load(U + b)
    j = tl.arange(0, BLOCK_N)
    children = tl.load(ChildTokens + b * N + j, mask=j < N, other=-1)  # -1: not a child of the last node
    cdf = tl.zeros((), tl.float64)
    count = 0
    found = 0
    at_cdf = tl.zeros((), tl.float64)
    at_p = tl.zeros((), tl.float64)
    last_nonzero = -1
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(Logits + row * V + offs, mask=offs < V, other=-float("inf")).to(tl.float32) / t
        p = tl.where((x >= cut) & (offs < V), tl.exp(x - m) / z, 0.0)
        is_child = tl.sum((offs[:, None] == children[None, :]).to(tl.int32), axis=1) > 0
        r = tl.where(is_child, 0.0, p).to(tl.float64)
        c = cdf + tl.cumsum(r, axis=0)
        below = c <= u
        n_below = tl.sum(below.to(tl.int32), axis=0)
        first = ~below & (tl.arange(0, BLOCK) == n_below)  # the first entry past u in this block
        take = found == 0
        at_cdf = tl.where(take, tl.sum(tl.where(first, c, 0.0), axis=0), at_cdf)
        at_p = tl.where(take, tl.sum(tl.where(first, r, 0.0), axis=0), at_p)
        found = tl.where(take & (n_below < BLOCK), 1, found)
        count += n_below
        last_nonzero = tl.maximum(last_nonzero, tl.max(tl.where(r > 0, offs, -1), axis=0))
        cdf = tl.max(tl.where(offs < V, c, 0.0), axis=0)
    total = cdf
    # Rounding can put u past the residual's total (take its last token); an all-zero residual
    # falls back to the argmax, whose residual probability is 0.
    past = count >= V
    bonus = tl.where(total > 0, tl.where(past, last_nonzero, count), tl.load(Argmax + row))
    # The last token's own residual probability, for the rounding case.
    xl = tl.load(Logits + row * V + tl.maximum(last_nonzero, 0)).to(tl.float32) / t
    pl = tl.where(xl >= cut, tl.exp(xl - m) / z, 0.0).to(tl.float64)
    bonus_p = tl.where(total > 0, tl.where(past, pl, at_p), 0.0)
    before = tl.where(total > 0, tl.where(past, total - pl, at_cdf - at_p), 0.0)
    tl.store(Bonus + b, bonus.to(tl.int64))
    tl.store(BonusCdf + b * 2, before.to(tl.float32))
    tl.store(BonusCdf + b * 2 + 1, bonus_p.to(tl.float32))


def sampling_rows_triton(logits: torch.Tensor, temperature: torch.Tensor, top_k: int, top_p: float):
    """Each node's distribution as ``(m, cut, z, argmax)``, [B, N] each (float32, int64): see the
    module docstring. ``temperature`` is [B] float32."""
    bs, n, vocab = logits.shape
    dev = logits.device
    logits = logits.contiguous()
    temperature = temperature.float().contiguous()
    chunk = min(CHUNK, triton.next_power_of_2(vocab))
    chunks = triton.cdiv(vocab, chunk)
    vals = torch.empty(bs * n, chunks, dtype=torch.float32, device=dev)
    idx = torch.empty(bs * n, chunks, dtype=torch.int64, device=dev)
    sums = torch.empty(bs * n, chunks, dtype=torch.float32, device=dev)
    _row_chunks_kernel[(bs * n, chunks)](logits, temperature, vals, idx, sums, n, vocab, chunks, CHUNK=chunk)
    m = vals.max(1).values
    argmax = torch.where(vals == m[:, None], idx, vocab).min(1).values
    z = (sums * torch.exp(vals - m[:, None])).sum(1)
    cut = torch.full_like(m, -float("inf"))
    if (0 < top_k < vocab) or top_p < 1:
        _row_cut_kernel[(bs * n,)](logits, temperature, m, cut, z, n, vocab, top_k if top_k < vocab else 0,
                                   float(top_p), BLOCK=min(CUT_BLOCK, triton.next_power_of_2(vocab)))
    return m.view(bs, n), cut.view(bs, n), z.view(bs, n), argmax.view(bs, n)


def sampling_bonus_triton(logits: torch.Tensor, temperature: torch.Tensor, rows: tuple, last: torch.Tensor,
                          child_tokens: torch.Tensor, u: torch.Tensor):
    """The bonus token at each request's last accepted node ``last`` [B]: the inverse CDF of its
    residual (its distribution with ``child_tokens`` [B, N] zeroed, -1 = none) at ``u`` [B] float64.
    Returns ``(bonus int64 [B], bonus_cdf float32 [B, 2])`` as ``spectool.verify.verify_sampling``."""
    bs, n, vocab = logits.shape
    m, cut, z, argmax = rows
    bonus = torch.empty(bs, dtype=torch.int64, device=logits.device)
    bonus_cdf = torch.empty(bs, 2, dtype=torch.float32, device=logits.device)
    _bonus_kernel[(bs,)](logits.contiguous(), temperature.float().contiguous(), m, cut, z, argmax,
                         last.contiguous(), child_tokens.contiguous(), u.double().contiguous(), bonus, bonus_cdf,
                         n, vocab, BLOCK=min(CUT_BLOCK, triton.next_power_of_2(vocab)),
                         BLOCK_N=max(16, triton.next_power_of_2(n)))
    return bonus, bonus_cdf
