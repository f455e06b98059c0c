"""The sampling verify with every vocabulary pass split over (row, chunk) programs (the torch
reference is ``spectool.verify.verify_sampling``; the rows it finds give ``spectool.verify.target_probs``
through ``spectool.verify.target_probs_at``).

A node's distribution after temperature, top-k and top-p is fixed by five numbers of its row:
its maximum ``m`` of ``x = logits / temperature``, its argmax, a cut value ``c``, a cut id and the
normaliser ``z``: token t has ``p = exp(x_t - m) / z`` when ``x_t > c``, or ``x_t == c`` and
``t <= cut id``, else 0. They are found without sorting the row, each pass one program per (row, chunk):

1. ``_stats_kernel``: per chunk the maximum, its first index and the sum of ``exp(x - max)``; and,
   with a cut, the maximum of every ``sub`` entries, so a later pass skips the groups wholly below
   what it counts. ``_k_start_kernel`` (top-k), one program per row, sorts those group maxima: k
   groups whose maxima are at or above v hold k values at or above v, so the k-th largest starts the
   top-k search, and its rounds read only the k groups (and ties) that can hold the cut.
2. ``_cut_round_kernel`` (top-k, then top-p): a search over the floats' ordered integer keys with
   ``probes`` thresholds per round, so a fixed number of rounds (8 for 16 probes) covers the 2**32
   keys and the step stays graph-capturable; the last of a row's programs to finish a round combines
   their per-chunk counts (top-k) or masses (top-p) into the row's next interval. Top-k: the largest
   key with at least k values at or above it (all of a tie at the k-th value is kept, as the
   reference's ``x < kth`` mask). Top-p: the smallest key whose mass strictly above it is below
   ``top_p`` of the top-k mass. A last round measures the kept mass and the count of values equal to
   the cut, and a round whose interval is already one key reads nothing.
3. ``_finish_kernel``, one program per row: the five numbers. At a top-p cut the reference sorts
   stably, so equal values keep token-id order and only the first of a tie whose mass before them
   is below ``top_p`` are kept: the cut id is the last of those, found by the per-chunk tie counts
   and a scan of one chunk.
4. ``_decide_kernel``, one program per request: the tree decision (``_tree_decision``, the same as
   the one-program-per-request verify's), the last accepted node and the coin left for its residual.
   ``_residual_kernel``, per (request, chunk): the mass of that node's residual (its children's
   tokens zeroed) in each group of ``G`` tokens, float64; a chunk that holds none of the children's
   tokens skips the test for them.
5. ``_bonus_kernel``, one program per request: the group that holds the coin, then the residual's
   inverse CDF within that one group, in vocabulary order (float64, as the reference's cumsum).

No host sync, and a fixed launch sequence for given (top_k > 0, top_p < 1). The launch shape is one
of ``CONFIGS`` (``benchmarks/tree_kernels.py --sampling-configs sweep`` times them all).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spectool.kernels.triton_import import tl, triton
from spectool.kernels.verify_sampling_triton import _tree_decision, decision_outputs


@dataclass(frozen=True)
class LaunchConfig:
    """How the vocabulary is split: ``chunk`` entries per program, ``sub`` per step inside it (the
    [sub, probes] tiles of the cut rounds), ``probes`` thresholds per cut round, ``warps`` per program."""

    chunk: int
    sub: int
    probes: int
    warps: int


CONFIGS = {
    "c1024-p16-w4": LaunchConfig(1024, 256, 16, 4),
    "c2048-p16-w4": LaunchConfig(2048, 256, 16, 4),
    "c4096-p16-w4": LaunchConfig(4096, 256, 16, 4),
    "c4096-p16-w8": LaunchConfig(4096, 512, 16, 8),
    "c8192-p16-w8": LaunchConfig(8192, 512, 16, 8),
    "c4096-p32-w8": LaunchConfig(4096, 256, 32, 8),
    "c8192-p64-w8": LaunchConfig(8192, 128, 64, 8),
    "c16384-p16-w16": LaunchConfig(16384, 512, 16, 16),
}
# The launch shape for many rows, and for few: on the H200 (V 128256, N 16, temperature) 1,024-entry
# chunks span 18.8 µs per graphed call at bs 1 against 20.4 with 2,048, and 200 µs against 175 at
# bs 64 (``benchmarks/tree_kernels.py --profile sampling``): a few rows need more, shorter programs.
DEFAULT_CONFIG = "c2048-p16-w4"
FEW_ROWS_CONFIG = "c1024-p16-w4"
FEW_ROWS = 256  # rows (requests x nodes) up to which FEW_ROWS_CONFIG is taken; bs 16 at N 16


def default_config(rows: int) -> str:
    """The launch shape the engine takes for ``rows`` node rows (requests x nodes)."""
    return FEW_ROWS_CONFIG if rows <= FEW_ROWS else DEFAULT_CONFIG


def cut_rounds(probes: int) -> int:
    """Search rounds that narrow the 2**32 float keys to one with ``probes`` thresholds a round."""
    size, rounds = 2**32, 0
    while size > 1:
        size = -(-size // (probes + 1))
        rounds += 1
    return rounds


@triton.jit
def _key(x):
    """float32 -> int64 keys in the same order (negative floats reversed, -0 the same as +0)."""
    bits = x.to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(x == 0, 0, tl.where(bits < 0, -(bits & 0x7FFFFFFF) - 1, bits))


@triton.jit
def _value(key):
    """The float32 of a key (the inverse of ``_key``)."""
    bits = tl.where(key < 0, -(key + 1) | -2147483648, key).to(tl.int32)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _stats_kernel(Logits, Temp, Max, Arg, Sum, GMax, N, V, NC, NG, CHUNK: tl.constexpr, SUB: tl.constexpr,
                  GROUPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(Temp + row // N)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(Logits + row * V + offs, mask=offs < V, other=-float("inf")).to(tl.float32) / t
    best = tl.max(x, axis=0)
    # The first index of the maximum (a plain min: cheaper than max's index-tracking reduction).
    i = tl.min(tl.where(x == best, offs, 2**31 - 1), axis=0)
    # A chunk may be all -inf: its sum is then 0, not exp(-inf - -inf).
    s = tl.sum(tl.exp(x - tl.where(best > -float("inf"), best, 0.0)), axis=0)
    tl.store(Max + row * NC + c, best)
    tl.store(Arg + row * NC + c, tl.where(i < 2**31 - 1, i, c * CHUNK).to(tl.int64))
    tl.store(Sum + row * NC + c, s)
    if GROUPS:  # only the cut rounds skip groups
        groups = tl.max(tl.reshape(x, (CHUNK // SUB, SUB)), axis=1)
        tl.store(GMax + row * NG + c * (CHUNK // SUB) + tl.arange(0, CHUNK // SUB), groups)


@triton.jit
def _k_start_kernel(GMax, KStart, NG, top_k, BLOCK_G: tl.constexpr):
    """The key where the row's top-k search starts: with at least k groups, k of their maxima at or
    above v are k values at or above v, so the k-th largest group maximum is at or below the cut
    (fewer groups than k leave -inf)."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_G)
    vals = tl.sort(tl.load(GMax + row * NG + j, mask=j < NG, other=-float("inf")), descending=True)
    kth = tl.sum(tl.where(j == top_k - 1, vals, 0.0), axis=0)
    tl.store(KStart + row, tl.where(top_k <= NG, _key(kth), _key(tl.full((), -float("inf"), tl.float32))))


@triton.jit
def _row_stats(Max, Arg, Sum, row, NC, BLOCK_C: tl.constexpr):
    """The row's maximum, first argmax and sum of exp(x - maximum) from its chunks'."""
    j = tl.arange(0, BLOCK_C)
    ok = j < NC
    vals = tl.load(Max + row * NC + j, mask=ok, other=-float("inf"))
    m = tl.max(vals, axis=0)
    arg = tl.min(tl.where(ok & (vals == m), tl.load(Arg + row * NC + j, mask=ok, other=0), 2**62), axis=0)
    z = tl.sum(tl.where(ok, tl.load(Sum + row * NC + j, mask=ok, other=0.0) * tl.exp(vals - m), 0.0), axis=0)
    return m, arg, z


@triton.jit
def _chunk_total(Parts, row, NC, col, BLOCK_C: tl.constexpr):
    """Sum over the row's chunks of column ``col`` of a [R, NC, 2] table."""
    j = tl.arange(0, BLOCK_C)
    return tl.sum(tl.load(Parts + (row * NC + j) * 2 + col, mask=j < NC, other=0.0), axis=0)


@triton.jit
def _probes(lo, hi, S: tl.constexpr):
    """``S`` thresholds splitting the keys [lo, hi] into S + 1 parts of nearly equal size."""
    j = tl.arange(0, S).to(tl.int64) + 1
    return lo + ((hi - lo + 1) * j) // (S + 1)


@triton.jit
def _cut_state(KStart, Bounds, KCut, KParts, row, m, z, r, R, NC, TOP_P: tl.constexpr, HAS_K: tl.constexpr,
               BLOCK_C: tl.constexpr):
    """The row's search interval [lo, hi] for round r (round 0 starts it, a later round reads what the
    round before left) and, for top-p, the mass it is a fraction of (the top-k mass, else the whole row's)."""
    lo = tl.full((), -2139095041, tl.int64)  # the key of -inf (a jitted function reads no plain global)
    zk = z
    if TOP_P:
        if HAS_K:
            lo = tl.load(KCut + row)
            zk = _chunk_total(KParts, row, NC, 0, BLOCK_C)
    else:
        lo = tl.load(KStart + row)
    hi = _key(m)
    if r > 0:
        base = Bounds + (r * R + row) * 2
        lo = tl.load(base)
        hi = tl.load(base + 1)
    return lo, hi, zk


@triton.jit
def _narrow(Parts, row, lo, hi, zk, NC, top_k, top_p, TOP_P: tl.constexpr, S: tl.constexpr, BLOCK_C: tl.constexpr):
    """The interval left of [lo, hi] by the row's per-chunk counts (top-k) or masses (top-p) at its probes."""
    thr = _probes(lo, hi, S)
    cc = tl.arange(0, BLOCK_C)
    tile = Parts + (row * NC + cc[:, None]) * S + tl.arange(0, S)[None, :]
    tot = tl.sum(tl.load(tile, mask=(cc < NC)[:, None], other=0.0), axis=0)
    if TOP_P:
        below = tot < top_p * zk  # mass strictly above the threshold
        new_lo = tl.max(tl.where(below, lo, thr + 1), axis=0)
        new_hi = tl.min(tl.where(below, thr, hi), axis=0)
    else:
        enough = tot >= top_k  # values at or above the threshold
        new_lo = tl.max(tl.where(enough, thr, lo), axis=0)
        new_hi = tl.min(tl.where(enough, hi, thr - 1), axis=0)
    return new_lo, new_hi


@triton.jit
def _cut_round_kernel(Logits, Temp, Max, Arg, Sum, GMax, KStart, KCut, KParts, Bounds, Parts, Done, CutOut,
                      MeasureOut, N, V, NC, NG, R, r, ROUNDS, top_k, top_p, TOP_P: tl.constexpr,
                      HAS_K: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, S: tl.constexpr,
                      BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(Temp + row // N)
    m, _, z = _row_stats(Max, Arg, Sum, row, NC, BLOCK_C)
    lo, hi, zk = _cut_state(KStart, Bounds, KCut, KParts, row, m, z, r, R, NC, TOP_P, HAS_K, BLOCK_C)
    base = Logits + row * V
    if r < ROUNDS:
        nxt = Bounds + ((r + 1) * R + row) * 2
        if lo < hi:
            thr = _probes(lo, hi, S)
            acc = tl.zeros([S], tl.float32)
            for start in range(0, CHUNK, SUB):
                # Every threshold is at or above lo: a group wholly below it adds nothing.
                if _key(tl.load(GMax + row * NG + (c * CHUNK + start) // SUB)) >= lo:
                    offs = c * CHUNK + start + tl.arange(0, SUB)
                    inb = offs < V
                    x = tl.load(base + offs, mask=inb, other=-float("inf")).to(tl.float32) / t
                    k = _key(x)
                    if TOP_P:
                        e = tl.where(inb, tl.exp(x - m), 0.0)
                        acc += tl.sum(tl.where(k[:, None] > thr[None, :], e[:, None], 0.0), axis=0)
                    else:
                        acc += tl.sum(((k[:, None] >= thr[None, :]) & inb[:, None]).to(tl.float32), axis=0)
            tl.store(Parts + (row * NC + c) * S + tl.arange(0, S), acc)
            # The row's last program to finish combines every chunk's part into the next round's
            # interval, once: when each program of the next round combined them itself, re-reading
            # the [chunks, probes] table per program was most of a round's time at many rows.
            tl.debug_barrier()  # the whole program's part is stored before it counts itself done
            if tl.atomic_add(Done + row, 1, sem="acq_rel") == NC - 1:
                new_lo, new_hi = _narrow(Parts, row, lo, hi, zk, NC, top_k, top_p, TOP_P, S, BLOCK_C)
                tl.store(nxt, new_lo)
                tl.store(nxt + 1, new_hi)
                tl.store(Done + row, 0)  # ready for the next round
        elif c == 0:
            tl.store(nxt, lo)
            tl.store(nxt + 1, hi)
    else:
        # The interval is one key: the cut. Measure the kept mass (top-k: at or above it; top-p:
        # strictly above it) and the values equal to it.
        cut = hi if TOP_P else lo
        if c == 0:
            tl.store(CutOut + row, cut)
        mass = 0.0
        ties = 0.0
        for start in range(0, CHUNK, SUB):
            if _key(tl.load(GMax + row * NG + (c * CHUNK + start) // SUB)) >= cut:
                offs = c * CHUNK + start + tl.arange(0, SUB)
                inb = offs < V
                x = tl.load(base + offs, mask=inb, other=-float("inf")).to(tl.float32) / t
                k = _key(x)
                e = tl.where(inb, tl.exp(x - m), 0.0)
                if TOP_P:
                    mass += tl.sum(tl.where(k > cut, e, 0.0), axis=0)
                else:
                    mass += tl.sum(tl.where(k >= cut, e, 0.0), axis=0)
                ties += tl.sum(((k == cut) & inb).to(tl.float32), axis=0)
        tl.store(MeasureOut + (row * NC + c) * 2, mass)
        tl.store(MeasureOut + (row * NC + c) * 2 + 1, ties)


@triton.jit
def _finish_kernel(Logits, Temp, Max, Arg, Sum, GMax, KCut, KParts, PCut, PParts, M, Z, Cut, CutId, Argmax,
                   N, V, NC, NG, top_p, HAS_K: tl.constexpr, HAS_P: tl.constexpr,
                   CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    m, arg, z = _row_stats(Max, Arg, Sum, row, NC, BLOCK_C)
    cut = -float("inf")
    cut_id = V.to(tl.int64)
    if HAS_K:
        cut = _value(tl.load(KCut + row))
        z = _chunk_total(KParts, row, NC, 0, BLOCK_C)
    if HAS_P:
        key = tl.load(PCut + row)
        cut = _value(key)
        above = _chunk_total(PParts, row, NC, 0, BLOCK_C)
        ties = _chunk_total(PParts, row, NC, 1, BLOCK_C)
        e = tl.exp(cut - m)
        # The reference keeps the r-th of the tie (0-based, token-id order) while the mass before it,
        # above + r * e, is below top_p of the top-k mass.
        keep = tl.minimum(tl.maximum(tl.ceil((top_p * z - above) / e), 1.0), ties)
        z = above + keep * e
        if keep < ties:
            # The keep-th tie: its chunk from the per-chunk counts, then its place in that chunk.
            j = tl.arange(0, BLOCK_C)
            counts = tl.load(PParts + (row * NC + j) * 2 + 1, mask=j < NC, other=0.0)
            held = tl.cumsum(counts, axis=0)
            chunk = tl.sum((held < keep).to(tl.int32), axis=0)
            need = keep - tl.sum(tl.where(j < chunk, counts, 0.0), axis=0)
            t = tl.load(Temp + row // N)
            seen = 0.0
            found = tl.full((), -1, tl.int64)
            for start in range(0, CHUNK, SUB):
                if _key(tl.load(GMax + row * NG + (chunk * CHUNK + start) // SUB)) >= key:
                    offs = chunk * CHUNK + start + tl.arange(0, SUB)
                    x = tl.load(Logits + row * V + offs, mask=offs < V, other=-float("inf")).to(tl.float32) / t
                    tie = ((_key(x) == key) & (offs < V)).to(tl.float32)
                    upto = seen + tl.cumsum(tie, axis=0)
                    found = tl.maximum(found, tl.max(tl.where((tie > 0) & (upto == need), offs, -1), axis=0))
                    seen += tl.sum(tie, axis=0)
            cut_id = found
    tl.store(M + row, m)
    tl.store(Z + row, z)
    tl.store(Cut + row, cut)
    tl.store(CutId + row, cut_id)
    tl.store(Argmax + row, arg)


@triton.jit
def _kept(x, ids, m, z, cut, cut_id):
    """p = exp(x - m) / z of tokens ``ids`` (their ``x``) where the row's cut keeps them, else 0."""
    kept = (x > cut) | ((x == cut) & (ids <= cut_id))
    return tl.where(kept, tl.exp(x - m) / z, 0.0)


@triton.jit
def _kept_probs(Logits, M, Z, Cut, CutId, row, ids, mask, t, V):
    """p(ids | row) of the kept distribution (0 where not ``mask``)."""
    row = row + ids * 0  # a row per id (a scalar row is broadcast)
    x = tl.load(Logits + row * V + ids, mask=mask, other=0.0).to(tl.float32) / t
    m = tl.load(M + row, mask=mask, other=0.0)
    z = tl.load(Z + row, mask=mask, other=1.0)
    cut = tl.load(Cut + row, mask=mask, other=0.0)
    cut_id = tl.load(CutId + row, mask=mask, other=0)
    return tl.where(mask, _kept(x, ids, m, z, cut, cut_id), 0.0)


@triton.jit
def _decision(Logits, Temp, M, Z, Cut, CutId, Tokens, Parents, Depth, Valid, Mask, Coins, b, N, V, W,
              BLOCK: tl.constexpr):
    t = tl.load(Temp + b)
    nodes = tl.arange(0, BLOCK)
    in_n = nodes < N
    tok = tl.load(Tokens + b * N + nodes, mask=in_n, other=0)
    par = tl.load(Parents + b * N + nodes, mask=in_n, other=-1)
    flat = _kept_probs(Logits, M, Z, Cut, CutId, b * N + tl.maximum(par, 0), tok, in_n, t, V)
    status, path, length, coins_out, child_probs, last, u, children = _tree_decision(
        b, flat, Tokens, Parents, Depth, Valid, Mask, Coins, N, W, BLOCK)
    return t, status, path, length, coins_out, child_probs, last, u, children


@triton.jit
def _residual_tile(Logits, row, offs, m, z, cut, cut_id, children, t, V, HAS_CHILD, BLOCK: tl.constexpr):
    """The residual at ``offs`` of ``row`` (its kept probabilities given the row's five numbers, the
    tokens of ``children`` [BLOCK] zeroed when ``HAS_CHILD``), float64."""
    inb = offs < V
    x = tl.load(Logits + row * V + offs, mask=inb, other=-float("inf")).to(tl.float32) / t
    p = tl.where(inb, _kept(x, offs, m, z, cut, cut_id), 0.0)
    if HAS_CHILD:
        # One child at a time: a [tile, BLOCK] comparison would not fit a long tile's registers.
        for j in tl.static_range(BLOCK):
            child = tl.sum(tl.where(tl.arange(0, BLOCK) == j, children, 0), axis=0)
            p = tl.where(offs == child, 0.0, p)
    return p.to(tl.float64)


@triton.jit
def _decide_kernel(Logits, Temp, M, Z, Cut, CutId, Tokens, Parents, Depth, Valid, Mask, Coins,
                   Status, Path, AcceptLength, ChildProbs, CoinsOut, Last, U, N, V, W, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    _, status, path, length, coins_out, child_probs, last, u, _ = _decision(
        Logits, Temp, M, Z, Cut, CutId, Tokens, Parents, Depth, Valid, Mask, Coins, b, N, V, W, BLOCK)
    nodes = tl.arange(0, BLOCK)
    tl.store(AcceptLength + b, length)
    tl.store(Path + b * W + nodes, path.to(tl.int64), mask=nodes < W)
    tl.store(Status + b * N + nodes, status, mask=nodes < N)
    tl.store(CoinsOut + b * N + nodes, coins_out, mask=nodes < N)
    tl.store(ChildProbs + b * N + nodes, child_probs, mask=nodes < N)
    tl.store(Last + b, last.to(tl.int64))
    tl.store(U + b, u)


@triton.jit
def _children_of(Tokens, Parents, Valid, b, N, last, BLOCK: tl.constexpr):
    """The tokens of node ``last``'s valid children (-1 elsewhere), as ``_tree_decision`` finds them."""
    nodes = tl.arange(0, BLOCK)
    in_n = nodes < N
    live = (tl.load(Valid + b * N + nodes, mask=in_n, other=0) != 0) & (nodes > 0)
    par = tl.load(Parents + b * N + nodes, mask=in_n, other=-1)
    return tl.where(live & (par == last), tl.load(Tokens + b * N + nodes, mask=in_n, other=0), -1)


@triton.jit
def _residual_node(Temp, M, Z, Cut, CutId, Tokens, Parents, Valid, Last, b, N, BLOCK: tl.constexpr):
    """What request ``b``'s residual is made from (``_decide_kernel``'s last accepted node): its
    temperature, that node's row, its children's tokens and the row's m, z, cut and cut id."""
    last = tl.load(Last + b)
    row = b * N + last
    children = _children_of(Tokens, Parents, Valid, b, N, last, BLOCK)
    return (tl.load(Temp + b), row, children, tl.load(M + row), tl.load(Z + row), tl.load(Cut + row),
            tl.load(CutId + row))


@triton.jit
def _residual_kernel(Logits, Temp, M, Z, Cut, CutId, Tokens, Parents, Valid, Last, ResGroups, N, V, NG,
                     CHUNK: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t, row, children, m, z, cut, cut_id = _residual_node(Temp, M, Z, Cut, CutId, Tokens, Parents, Valid, Last, b,
                                                         N, BLOCK)
    lo = c * CHUNK
    # Most chunks hold none of the children's tokens and skip the test for them.
    has_child = tl.sum(((children >= lo) & (children < lo + CHUNK)).to(tl.int32), axis=0) > 0
    r = _residual_tile(Logits, row, lo + tl.arange(0, CHUNK), m, z, cut, cut_id, children, t, V, has_child, BLOCK)
    tl.store(ResGroups + b * NG + lo // G + tl.arange(0, CHUNK // G), tl.sum(tl.reshape(r, (CHUNK // G, G)), axis=1))


@triton.jit
def _bonus_kernel(Logits, Temp, M, Z, Cut, CutId, Argmax, Tokens, Parents, Valid, Last, U, ResGroups, Bonus,
                  BonusCdf, N, V, NG, G: tl.constexpr, BLOCK: tl.constexpr, BLOCK_G: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t, row, children, m, z, cut, cut_id = _residual_node(Temp, M, Z, Cut, CutId, Tokens, Parents, Valid, Last, b,
                                                         N, BLOCK)
    u = tl.load(U + b)
    j = tl.arange(0, BLOCK_G)
    sums = tl.load(ResGroups + b * NG + j, mask=j < NG, other=0.0)
    total = tl.sum(sums, axis=0)
    ends = tl.cumsum(sums, axis=0)
    g = tl.sum(((ends <= u) & (j < NG)).to(tl.int32), axis=0)  # the group whose mass holds u
    # Rounding can put u past the residual's total: its last token with mass, in the last group with mass.
    at = tl.where(g < NG, g, tl.max(tl.where((sums > 0) & (j < NG), j, 0), axis=0))
    offs = at * G + tl.arange(0, G)
    r = _residual_tile(Logits, row, offs, m, z, cut, cut_id, children, t, V, True, BLOCK)
    cdf = tl.sum(tl.where(j == at - 1, ends, 0.0), axis=0) + tl.cumsum(r, axis=0)
    last_with_mass = tl.max(tl.where(r > 0, offs, -1), axis=0)
    found = tl.min(tl.where((cdf > u) & (r > 0), offs, V), axis=0)
    bonus = tl.where((g < NG) & (found < V), found, last_with_mass)
    p = tl.sum(tl.where(offs == bonus, r, 0.0), axis=0)
    before = tl.where(g < NG, tl.sum(tl.where(offs == bonus, cdf, 0.0), axis=0), total) - p
    # An all-zero residual (the children hold all the mass) falls back to the argmax, probability 0.
    has_mass = total > 0
    tl.store(Bonus + b, tl.where(has_mass, bonus.to(tl.int64), tl.load(Argmax + row)))
    tl.store(BonusCdf + b * 2, tl.where(has_mass, before, 0.0).to(tl.float32))
    tl.store(BonusCdf + b * 2 + 1, tl.where(has_mass, p, 0.0).to(tl.float32))


def sampling_rows_chunked(logits: torch.Tensor, temperature: torch.Tensor, top_k: int, top_p: float,
                          config: LaunchConfig) -> tuple[torch.Tensor, ...]:
    """Each node's distribution as ``(m, z, cut, cut_id, argmax)``, [B, N] each (float32 for the first
    three, int64): see the module docstring. ``temperature`` is [B] float32."""
    bs, n, vocab = logits.shape
    dev = logits.device
    rows = bs * n
    logits = logits.contiguous()
    temperature = temperature.float().contiguous()
    chunk = min(config.chunk, triton.next_power_of_2(vocab))
    sub = min(config.sub, chunk)
    nc = triton.cdiv(vocab, chunk)
    block_c = max(2, triton.next_power_of_2(nc))
    f32 = dict(dtype=torch.float32, device=dev)
    vals, sums = torch.empty(rows, nc, **f32), torch.empty(rows, nc, **f32)
    idx = torch.empty(rows, nc, dtype=torch.int64, device=dev)
    warps = config.warps
    ng = nc * (chunk // sub)
    gmax = torch.empty(rows, ng, **f32)
    has_k, has_p = 0 < top_k < vocab, top_p < 1
    _stats_kernel[(rows, nc)](logits, temperature, vals, idx, sums, gmax, n, vocab, nc, ng, CHUNK=chunk, SUB=sub,
                              GROUPS=has_k or has_p, num_warps=warps)
    k_cut, p_cut = (torch.empty(rows if has else 1, dtype=torch.int64, device=dev) for has in (has_k, has_p))
    k_parts, p_parts = (torch.empty(rows if has else 1, nc, 2, **f32) for has in (has_k, has_p))
    if has_k or has_p:
        s = config.probes
        rounds = cut_rounds(s)
        # bounds[r]: round r's interval, written by round r - 1 (round 0 starts its own).
        bounds = torch.empty(rounds + 1, rows, 2, dtype=torch.int64, device=dev)
        parts = torch.empty(rows, nc, s, **f32)
        done = torch.zeros(rows, dtype=torch.int32, device=dev)  # each round's last program sets it back to 0
        phases = ([(False, k_cut, k_parts)] if has_k else []) + ([(True, p_cut, p_parts)] if has_p else [])
        k_start = torch.empty(rows if has_k else 1, dtype=torch.int64, device=dev)
        if has_k:
            _k_start_kernel[(rows,)](gmax, k_start, ng, top_k, BLOCK_G=max(2, triton.next_power_of_2(ng)),
                                     num_warps=warps)
        for is_p, cut_out, measure in phases:
            for r in range(rounds + 1):
                _cut_round_kernel[(rows, nc)](
                    logits, temperature, vals, idx, sums, gmax, k_start, k_cut, k_parts, bounds, parts, done, cut_out,
                    measure, n, vocab, nc, ng, rows, r, rounds, top_k, float(top_p), TOP_P=is_p, HAS_K=has_k,
                    CHUNK=chunk, SUB=sub, S=s, BLOCK_C=block_c, num_warps=warps)
    m, z, cut = (torch.empty(rows, **f32) for _ in range(3))
    cut_id, argmax = (torch.empty(rows, dtype=torch.int64, device=dev) for _ in range(2))
    _finish_kernel[(rows,)](logits, temperature, vals, idx, sums, gmax, k_cut, k_parts, p_cut, p_parts, m, z, cut,
                            cut_id, argmax, n, vocab, nc, ng, float(top_p), HAS_K=has_k, HAS_P=has_p, CHUNK=chunk,
                            SUB=sub, BLOCK_C=block_c, num_warps=warps)
    return tuple(a.view(bs, n) for a in (m, z, cut, cut_id, argmax))


def sampling_decide_chunked(logits: torch.Tensor, temperature: torch.Tensor, rows: tuple, tokens: torch.Tensor,
                            parents: torch.Tensor, depth: torch.Tensor, valid: torch.Tensor, mask: torch.Tensor,
                            coins: torch.Tensor, width: int, config: LaunchConfig):
    """The tree decision and bonus from each node's ``rows`` (:func:`sampling_rows_chunked`). Returns
    ``(status int8 [B, N], accept_path int64 [B, width], accept_length int64 [B], bonus int64 [B],
    bonus_cdf float32 [B, 2], child_probs float32 [B, N], coins float32 [B, N])`` as
    ``spectool.verify.verify_sampling``."""
    bs, n, vocab = logits.shape
    dev = logits.device
    m, z, cut, cut_id, argmax = (a.contiguous() for a in rows)
    status, path, length, bonus, bonus_cdf, child_probs, coins_out = decision_outputs(bs, n, width, dev)
    if bs:
        chunk = min(config.chunk, triton.next_power_of_2(vocab))
        nc = triton.cdiv(vocab, chunk)
        block = max(16, triton.next_power_of_2(max(n, width)))
        # The bonus kernel's inverse CDF reads one group of G tokens: the cut rounds' tile size, less
        # for wide trees.
        group = min(chunk, max(16, config.sub * 16 // block))
        ng = nc * (chunk // group)
        res_groups = torch.empty(bs, ng, dtype=torch.float64, device=dev)
        last = torch.empty(bs, dtype=torch.int64, device=dev)
        u = torch.empty(bs, dtype=torch.float64, device=dev)
        tree = (tokens.contiguous(), parents.contiguous(), depth.contiguous(), valid.contiguous().view(torch.uint8),
                mask.contiguous().view(torch.uint8), coins.float().contiguous())
        logits, temperature = logits.contiguous(), temperature.float().contiguous()
        warps = max(config.warps, 4 if block <= 64 else 8)
        _decide_kernel[(bs,)](logits, temperature, m, z, cut, cut_id, *tree, status, path, length, child_probs,
                              coins_out, last, u, n, vocab, width, BLOCK=block, num_warps=warps)
        _residual_kernel[(bs, nc)](logits, temperature, m, z, cut, cut_id, tree[0], tree[1], tree[3], last, res_groups,
                                   n, vocab, ng, CHUNK=chunk, G=group, BLOCK=block, num_warps=warps)
        _bonus_kernel[(bs,)](logits, temperature, m, z, cut, cut_id, argmax, tree[0], tree[1], tree[3], last, u,
                             res_groups, bonus, bonus_cdf, n, vocab, ng, G=group, BLOCK=block,
                             BLOCK_G=max(2, triton.next_power_of_2(ng)), num_warps=warps)
    return status, path, length, bonus, bonus_cdf, child_probs, coins_out
