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
3. ``_sampling_decide_kernel``: one program per request makes the whole decision with its tree in
   registers as [N, N] tiles (each child's probability read from its parent's three numbers, the
   coin's interval among its siblings, the deepest all-good path as in greedy verify), then walks
   the last accepted node's row once, in vocabulary order, for the inverse CDF of its residual
   (float64 running sum, as the reference).

so ``p(t | node) = exp(x_t - m) / z`` when ``x_t >= c``, else 0. No host sync.
"""

from __future__ import annotations

import torch

from spectool.kernels.triton_import import tl, triton

CHUNK = 4096  # vocabulary entries per program of the row pass
CUT_BLOCK = 4096  # vocabulary entries per step of the cut's and the bonus's loops


@triton.jit
def _scaled(logits, t):
    """``logits / t`` in float32, rounded as torch rounds it: Triton's ``/`` on CUDA is an approximate
    division (up to 2 ulp), which moved the value at a cut off the one the reference compares with."""
    return tl.math.div_rn(logits.to(tl.float32), t)


@triton.jit
def _row_chunks_kernel(Logits, Temp, Vals, Idx, Sums, N, V, C, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(Temp + row // N)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = _scaled(tl.load(Logits + row * V + offs, mask=offs < V, other=-float("inf")), t)
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
                x = _scaled(tl.load(base + offs, mask=offs < V, other=-float("inf")), t)
                count += tl.sum(((_key(x) >= mid) & (offs < V)).to(tl.int32), axis=0)
            go_up = count >= top_k
            lo = tl.where(go_up, mid, lo)
            hi = tl.where(go_up, hi, mid - 1)
        hi = _key(m)
    z = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _scaled(tl.load(base + offs, mask=offs < V, other=-float("inf")), t)
        z += tl.sum(tl.where((_key(x) >= lo) & (offs < V), tl.exp(x - m), 0.0), axis=0)
    if top_p < 1.0:
        # The smallest key (>= the top-k cut) whose mass strictly above it is below top_p.
        k_lo = lo
        for _ in range(33):
            mid = lo + (hi - lo) // 2
            above = 0.0
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = _scaled(tl.load(base + offs, mask=offs < V, other=-float("inf")), t)
                k = _key(x)
                above += tl.sum(tl.where((k > mid) & (k >= k_lo) & (offs < V), tl.exp(x - m), 0.0), axis=0)
            below = above / z < top_p
            hi = tl.where(below, mid, hi)
            lo = tl.where(below, lo, mid + 1)
        z = 0.0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = _scaled(tl.load(base + offs, mask=offs < V, other=-float("inf")), t)
            z += tl.sum(tl.where((_key(x) >= lo) & (offs < V), tl.exp(x - m), 0.0), axis=0)
    bits = tl.where(lo < 0, -(lo + 1) | -2147483648, lo).to(tl.int32)
    tl.store(Cut + row, bits.to(tl.float32, bitcast=True))
    tl.store(Z + row, z)


@triton.jit
def _node_probs(Logits, M, Cut, Z, b, parents, tokens, live, t, N, V):
    """p(token | parent) of the given nodes (0 where not live; a padding node reads the root)."""
    par = b * N + tl.maximum(parents, 0)
    x = _scaled(tl.load(Logits + par * V + tokens, mask=live, other=0.0), t)
    m = tl.load(M + par, mask=live, other=0.0)
    cut = tl.load(Cut + par, mask=live, other=0.0)
    z = tl.load(Z + par, mask=live, other=1.0)
    return tl.where(x >= cut, tl.exp(x - m) / z, 0.0)


@triton.jit
def _tree_decision(b, flat, Tokens, Parents, Depth, Valid, Mask, Coins, N, W, BLOCK: tl.constexpr):
    """The tree decision of request ``b`` given ``flat`` [BLOCK], p(token | parent) of each node, with
    the tree in registers as [N, N] tiles: the coin's interval among each node's siblings, then the
    deepest all-good path as in greedy verify. Returns (status, accept path [BLOCK] (-1 past it),
    accept length, coins (NaN where not accepted), child probabilities (NaN at the root), the last
    accepted node, the coin left for its residual (float64), and its children's tokens (-1 elsewhere))."""
    rows = tl.arange(0, BLOCK)  # node j of the [j, k] tiles
    cols = tl.arange(0, BLOCK)  # node k
    in_r = rows < N
    in_c = cols < N
    tok_r = tl.load(Tokens + b * N + rows, mask=in_r, other=0)
    tok_c = tl.load(Tokens + b * N + cols, mask=in_c, other=0)
    par_r = tl.load(Parents + b * N + rows, mask=in_r, other=-1)
    par_c = tl.load(Parents + b * N + cols, mask=in_c, other=-1)
    live_r = (tl.load(Valid + b * N + rows, mask=in_r, other=0) != 0) & (rows > 0)
    live_c = (tl.load(Valid + b * N + cols, mask=in_c, other=0) != 0) & (cols > 0)
    depth_r = tl.load(Depth + b * N + rows, mask=in_r, other=0)
    depth_c = tl.load(Depth + b * N + cols, mask=in_c, other=0)
    coin_par_r = tl.load(Coins + b * N + tl.maximum(par_r, 0), mask=in_r, other=1.0)
    coin_par_c = tl.load(Coins + b * N + tl.maximum(par_c, 0), mask=in_c, other=1.0)

    # Siblings in node order, a repeated token counted once (its first occurrence): the child whose
    # share of [0, 1) holds its parent's coin is the one taken there. Each quantity is made along
    # both tile axes (reductions over k for node j, over j for node k).
    sib = (par_r[:, None] == par_c[None, :]) & live_r[:, None] & live_c[None, :]
    k_before = cols[None, :] < rows[:, None]
    j_before = rows[:, None] < cols[None, :]
    same_tok = tok_r[:, None] == tok_c[None, :]
    dup_r = tl.sum((sib & k_before & same_tok).to(tl.int32), axis=1) > 0
    dup_c = tl.sum((sib & j_before & same_tok).to(tl.int32), axis=0) > 0
    q_r = tl.where(live_r & ~dup_r, flat, 0.0)
    q_c = tl.where(live_c & ~dup_c, flat, 0.0)
    cum_r = tl.sum(tl.where(sib & ~j_before, q_c[None, :], 0.0), axis=1)  # k <= j
    cum_c = tl.sum(tl.where(sib & ~k_before, q_r[:, None], 0.0), axis=0)  # j <= k
    hit_r = (q_r > 0) & (coin_par_r < cum_r)
    hit_c = (q_c > 0) & (coin_par_c < cum_c)
    good_c = hit_c & (tl.sum((sib & j_before & hit_r[:, None]).to(tl.int32), axis=0) == 0)
    ok = good_c | (cols == 0)

    # Accept the deepest node whose root path is all good (ties: the lowest index), as greedy.
    tile = Mask + b * N * N
    m = tl.load(tile + rows[:, None] * N + cols[None, :], mask=in_r[:, None] & in_c[None, :], other=0) != 0
    agree = tl.sum((m & ~ok[None, :]).to(tl.int32), axis=1) == 0
    key = tl.where(agree & in_r, tl.maximum(depth_r, 0) * N + (N - 1 - rows), -1)
    top = tl.max(key, axis=0)
    last = N - 1 - top % N
    accepted_c = tl.load(tile + last * N + cols, mask=in_c, other=0) != 0
    accepted_r = tl.load(tile + last * N + rows, mask=in_r, other=0) != 0
    dc = tl.maximum(depth_c, 0)
    path = tl.max(tl.where(accepted_c[None, :] & (dc[None, :] == rows[:, None]), cols[None, :], -1), axis=1)
    path = tl.where(rows < W, path, -1)
    taken = tl.max(tl.where(rows[:, None] == dc[None, :], path[:, None], -1), axis=0)
    taken = tl.where(taken < 0, N, taken)
    is_parent = rows[:, None] == par_c[None, :]
    parent_accepted = tl.sum((is_parent & accepted_r[:, None]).to(tl.int32), axis=0) > 0
    valid_c = tl.load(Valid + b * N + cols, mask=in_c, other=0) != 0
    rejected = valid_c & parent_accepted & ~accepted_c & (cols < taken) & (cols > 0)
    status = accepted_c.to(tl.int8) + 2 * rejected.to(tl.int8)
    coins_c = tl.load(Coins + b * N + cols, mask=in_c, other=0.0)
    coins_out = tl.where(accepted_c, coins_c, float("nan"))
    child_probs = tl.where(cols > 0, flat, float("nan"))

    # What the residual at the last accepted node needs: its children's tokens and the coin left
    # past their mass (float64, as the reference).
    child_of_last = live_c & (par_c == last)
    child_mass = tl.sum(tl.where(child_of_last, q_c, 0.0), axis=0)
    coin_last = tl.sum(tl.where(cols == last, coins_c, 0.0), axis=0)
    u = tl.maximum(coin_last - child_mass, 0.0).to(tl.float64)
    children = tl.where(child_of_last, tok_c, -1)
    return status, path, (top // N).to(tl.int64), coins_out, child_probs, last, u, children


@triton.jit
def _sampling_decide_kernel(
    Logits, Temp, M, Cut, Z, Argmax, Tokens, Parents, Depth, Valid, Mask, Coins,
    Status, Path, AcceptLength, Bonus, BonusCdf, ChildProbs, CoinsOut,
    N, V, W, BLOCK: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    t = tl.load(Temp + b)
    nodes = tl.arange(0, BLOCK)
    in_n = nodes < N
    tok = tl.load(Tokens + b * N + nodes, mask=in_n, other=0)
    par = tl.load(Parents + b * N + nodes, mask=in_n, other=-1)
    flat = _node_probs(Logits, M, Cut, Z, b, par, tok, in_n, t, N, V)
    status, path, length, coins_out, child_probs, last, u, children = _tree_decision(
        b, flat, Tokens, Parents, Depth, Valid, Mask, Coins, N, W, BLOCK)
    tl.store(AcceptLength + b, length)
    tl.store(Path + b * W + nodes, path.to(tl.int64), mask=nodes < W)
    tl.store(Status + b * N + nodes, status, mask=in_n)
    tl.store(CoinsOut + b * N + nodes, coins_out, mask=in_n)
    tl.store(ChildProbs + b * N + nodes, child_probs, mask=in_n)

    # Bonus: the inverse CDF of the last accepted node's residual (its children's tokens zeroed),
    # in vocabulary order, at the coin left past its children's mass (float64 sums, as the reference).
    row = b * N + last
    m_l = tl.load(M + row)
    cut_l = tl.load(Cut + row)
    z_l = tl.load(Z + row)
    cdf = tl.full((), 0.0, tl.float64)
    count = 0
    found = 0
    at_cdf = tl.full((), 0.0, tl.float64)
    at_p = tl.full((), 0.0, tl.float64)
    last_nonzero = -1
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = _scaled(tl.load(Logits + row * V + offs, mask=offs < V, other=-float("inf")), t)
        p = tl.where((x >= cut_l) & (offs < V), tl.exp(x - m_l) / z_l, 0.0)
        is_child = tl.sum((offs[:, None] == children[None, :]).to(tl.int32), axis=1) > 0
        r = tl.where(is_child, 0.0, p).to(tl.float64)
        c = cdf + tl.cumsum(r, axis=0)
        below = c <= u
        n_below = tl.sum(below.to(tl.int32), axis=0)
        first = ~below & (tl.arange(0, BLOCK_V) == n_below)  # the first entry past u in this block
        take = found == 0
        at_cdf = tl.where(take, tl.sum(tl.where(first, c, 0.0), axis=0), at_cdf)
        at_p = tl.where(take, tl.sum(tl.where(first, r, 0.0), axis=0), at_p)
        found = tl.where(take & (n_below < BLOCK_V), 1, found)
        count += n_below
        last_nonzero = tl.maximum(last_nonzero, tl.max(tl.where(r > 0, offs, -1), axis=0))
        cdf = tl.max(tl.where(offs < V, c, 0.0), axis=0)
    total = cdf
    # Rounding can put u past the residual's total (take its last token); an all-zero residual
    # falls back to the argmax, whose residual probability is 0.
    past = count >= V
    bonus = tl.where(total > 0, tl.where(past, last_nonzero, count), tl.load(Argmax + row))
    xl = _scaled(tl.load(Logits + row * V + tl.maximum(last_nonzero, 0)), t)
    pl = tl.where(xl >= cut_l, tl.exp(xl - m_l) / z_l, 0.0).to(tl.float64)
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


def decision_outputs(bs: int, n: int, width: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The decision kernels' outputs, uninitialised: status int8 [B, N], accept_path int64 [B, width],
    accept_length and bonus int64 [B], bonus_cdf float32 [B, 2], child_probs and coins float32 [B, N]."""
    i64, f32 = {"dtype": torch.int64, "device": device}, {"dtype": torch.float32, "device": device}
    return (torch.empty(bs, n, dtype=torch.int8, device=device), torch.empty(bs, width, **i64),
            torch.empty(bs, **i64), torch.empty(bs, **i64), torch.empty(bs, 2, **f32),
            torch.empty(bs, n, **f32), torch.empty(bs, n, **f32))


def sampling_decide_triton(logits: torch.Tensor, temperature: torch.Tensor, rows: tuple, tokens: torch.Tensor,
                           parents: torch.Tensor, depth: torch.Tensor, valid: torch.Tensor, mask: torch.Tensor,
                           coins: torch.Tensor, width: int):
    """The whole tree decision and bonus from each node's ``rows`` (``sampling_rows_triton``), one
    program per request. Returns ``(status int8 [B, N], accept_path int64 [B, width], accept_length
    int64 [B], bonus int64 [B], bonus_cdf float32 [B, 2], child_probs float32 [B, N], coins float32
    [B, N])`` as ``spectool.verify.verify_sampling``."""
    bs, n, vocab = logits.shape
    dev = logits.device
    m, cut, z, argmax = rows
    status, path, length, bonus, bonus_cdf, child_probs, coins_out = decision_outputs(bs, n, width, dev)
    if bs:
        block = max(16, triton.next_power_of_2(max(n, width)))
        _sampling_decide_kernel[(bs,)](
            logits.contiguous(), temperature.float().contiguous(), m.contiguous(), cut.contiguous(), z.contiguous(),
            argmax.contiguous(), tokens.contiguous(), parents.contiguous(), depth.contiguous(),
            valid.contiguous().view(torch.uint8), mask.contiguous().view(torch.uint8), coins.float().contiguous(),
            status, path, length, bonus, bonus_cdf, child_probs, coins_out, n, vocab, width,
            BLOCK=block, BLOCK_V=min(CUT_BLOCK, triton.next_power_of_2(vocab)), num_warps=4 if block <= 64 else 8)
    return status, path, length, bonus, bonus_cdf, child_probs, coins_out
