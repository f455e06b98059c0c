"""The sampling verify with every vocabulary pass split over (row, chunk) programs (the torch
reference is ``spectool.verify.verify_sampling``; the rows it finds give ``spectool.verify.target_probs``
through ``spectool.verify.target_probs_at``).

A node's distribution after temperature, top-k and top-p is fixed by five numbers of its row:
its maximum ``m`` of ``x = logits / temperature``, its argmax, a cut value ``c``, a cut id and the
normaliser ``z``: token t has ``p = exp(x_t - m) / z`` when ``x_t > c``, or ``x_t == c`` and
``t <= cut id``, else 0. They are found without sorting the row:

1. ``_stats_kernel``, one program per (row, chunk): per chunk the maximum, its first index and,
   without top-k, the sum of ``exp(x - max)`` (top-k's cut measures the mass it keeps from its
   candidates, so that pass reads and compares only); and, with a cut, the maximum of every ``sub``
   entries (the group maxima), from which the chunk's maximum is taken.
2. ``_cut_kernel``, one program per row: the five numbers. A bound at or below the cut comes from
   the sorted group maxima (``_bound``): for top-k the k-th largest (k groups whose maxima are at or
   above v hold k values at or above v); for top-p alone the j-th largest, where the j largest maxima
   first reach ``top_p`` of the mass (the j largest values weigh at least as much). The values at
   or above it lie in the groups whose maxima reach it, a few times k groups for top-k: they are
   copied, with their token ids in order, into a buffer of ``candidates`` entries, and both cuts are
   searched there (``_gather``). Past the buffer (a wide tie at the cut, or top-p over a flat row)
   the whole row is searched instead, so any logits get the exact cut; for top-p alone its first
   rounds also count the values in the range still open (``_narrow``), and once those fit the
   buffer they are copied there (``_gather_range``) and the search goes on over the copy; with
   ``LaunchConfig.spread_rounds`` the first of those rounds run before, as launches of (row, chunk)
   programs that each sum their chunk's partials (``_spread_kernel``), and with
   ``LaunchConfig.spread_gather`` (row, chunk) programs then copy the range they leave, where it
   fits (``_spread_gather_kernel``). With ``LaunchConfig.second``
   the stats pass also keeps each group's second-largest value, and a live group whose second
   value is below the bound gives its maximum alone, unread (``_gather_second``). Each search runs
   over the floats' ordered integer keys with ``probes`` thresholds a round, a fixed number of
   rounds (8 for 16 probes) that covers the 2**32 keys. Top-k: the largest key with at least k values at or above
   it (all of a tie at the k-th value is kept, as the reference's ``x < kth`` mask). Top-p: the
   smallest key whose mass strictly above it is below ``top_p`` of the top-k mass; the reference
   sorts stably, so equal values keep token-id order and only the first of a tie whose mass before
   them is below ``top_p`` are kept, the last of them the cut id.
3. ``_decide_kernel``, one program per request: the tree decision (``_tree_decision``, the same as
   the one-program-per-request verify's), the last accepted node and the coin left for its residual.
   ``_residual_kernel``, per (request, chunk): the mass of that node's residual (its children's
   tokens zeroed) in each group of ``G`` tokens, float64; a chunk that holds none of the children's
   tokens skips the test for them. With top-k, where the node's candidates fit the buffer (with
   their token ids, in order), they hold every token its cut keeps: the request's first program
   draws the bonus from them instead (``_candidate_bonus``) and the others, and the bonus kernel,
   do nothing, so the residual reads no row.
4. ``_bonus_kernel``, one program per request: the group that holds the coin, then the residual's
   inverse CDF within that one group, in vocabulary order (float64, as the reference's cumsum).

With ``LaunchConfig.fused`` the decision and the bonus take no launch of their own: the last of a
request's row programs in ``_cut_kernel`` to finish makes its decision, and the last of its residual
programs its bonus (``_last_of``: a per-request count, zeroed by ``_stats_kernel``).

No host sync, and the same launch sequence for every cut; on Hopper each kernel launches with PDL
(``spectool.kernels.pdl``), so the next one's programs are resident when it ends. The launch shape is one of ``CONFIGS``
(``benchmarks/tree_kernels.py --sampling-configs sweep`` times them all).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spectool.kernels import pdl
from spectool.kernels.triton_import import tl, triton
from spectool.kernels.verify_sampling_triton import _scaled, _tree_decision, decision_outputs


@dataclass(frozen=True)
class LaunchConfig:
    """How the vocabulary is split: ``chunk`` entries per program of the row pass, ``sub`` per group
    maximum (the candidates are read by whole groups), ``probes`` thresholds per cut search round,
    ``warps`` per program, ``candidates`` the entries of a row's candidate buffer, ``gather`` the
    values the copy into it reads a round, ``sorted`` the most candidates that are sorted instead
    of searched, ``prefilter`` the most group maxima top-k's bound is sorted among."""

    chunk: int
    sub: int
    probes: int
    warps: int
    candidates: int = 2048
    gather: int = 2048  # candidates' values read at once (gather // sub groups a round)
    sorted: int = 512  # candidates up to which both cuts are read off one sort of them (a power of two; 0: never)
    # Rows with at most this many candidates sort a block of this size instead (top-k 50 leaves 50-60).
    small_sorted: int = 64
    # Top-k's bound sorts only the group maxima at or above the k-th largest chunk maximum where at
    # most this many are (0: it sorts them all): about a tenth of them for Gaussian logits.
    prefilter: int = 256
    # The stats pass also keeps each group's second-largest value; a live group whose second value is
    # below the bound holds one candidate, its maximum, and only the other live groups are read.
    second: bool = False
    # The last row program of a request to finish makes its tree decision, and the last residual
    # program of a request its bonus (``_last_of``), instead of a kernel each: two launches fewer.
    fused: bool = False
    # Warps of the cut kernel's row programs where top-k bounds the candidates (0: at least 8, as
    # always for top-p alone, whose search may read the whole row): fewer warps let more of the
    # row programs share an SM when there are many rows.
    cut_warps: int = 0
    # Warps of the cut kernel's row programs for top-p alone (0: as above), whose rounds over a flat
    # row's every value are the arithmetic of one program a row; each round's tile grows with them.
    p_warps: int = 0
    # Top-p alone's first search rounds over a flat row (``_narrow``) run as this many launches of
    # (row, chunk) programs (``_spread_kernel``) before the cut kernel, instead of in its one program
    # per row (0: none).
    spread_rounds: int = 0
    # Values each program of a spread round sums (16 programs a row at V 128256): every program first
    # adds up its row's partials of the round before, so fewer, longer programs read fewer of them.
    spread_chunk: int = 8192
    # After the spread rounds, (row, chunk) programs copy a flat row's range still open into its
    # candidate buffer where it fits (``_spread_gather_kernel``), instead of the cut kernel's one
    # program a row reading the whole row for it (``_gather_range``).
    spread_gather: bool = False
    # Registers a thread of the stats pass, and of the cut kernel where top-k bounds the candidates,
    # may take (0: as the compiler chooses): fewer let more programs share an SM (the cut kernel
    # spills some to the stack).
    stats_regs: int = 0
    cut_regs: int = 0
    # Values a cut search round reads where top-k bounds the candidates (0: ``SEARCH_TILE``). Top-k
    # searches only past ``sorted`` candidates (a wide tie), but the search's per-thread sums set
    # the cut kernel's registers whichever path a row takes.
    cut_tile: int = 0


CONFIGS = {
    "c1024-p16-w4": LaunchConfig(1024, 256, 16, 4),
    "c2048-p16-w4": LaunchConfig(2048, 256, 16, 4),
    "c4096-p16-w4": LaunchConfig(4096, 256, 16, 4),
    "c4096-p16-w8": LaunchConfig(4096, 512, 16, 8),
    "c8192-p16-w8": LaunchConfig(8192, 512, 16, 8),
    "c4096-p32-w8": LaunchConfig(4096, 256, 32, 8),
    "c8192-p64-w8": LaunchConfig(8192, 128, 64, 8),
    "c16384-p16-w16": LaunchConfig(16384, 512, 16, 16),
    "c1024-p16-w4-g64": LaunchConfig(1024, 64, 16, 4),
    "c2048-p16-w4-g64": LaunchConfig(2048, 64, 16, 4),
    "c1024-p16-w4-g128": LaunchConfig(1024, 128, 16, 4),
    "c2048-p16-w4-g128": LaunchConfig(2048, 128, 16, 4),
    # The default shape with one sort size for every sorted row (as before the small block), to time the two.
    "c1024-p16-w4-g128-s512": LaunchConfig(1024, 128, 16, 4, small_sorted=512),
    # The default shapes with top-k's bound sorted among every group maximum, to time the prefilter.
    "c1024-p16-w4-g128-f0": LaunchConfig(1024, 128, 16, 4, prefilter=0),
    "c2048-p16-w4-g128-f0": LaunchConfig(2048, 128, 16, 4, prefilter=0),
    # The default shapes with each group's second value kept, to time reading only the groups that
    # hold more than one candidate.
    "c1024-p16-w4-g128-m2": LaunchConfig(1024, 128, 16, 4, second=True),
    "c2048-p16-w4-g128-m2": LaunchConfig(2048, 128, 16, 4, second=True),
    # The default shapes with the decision and the bonus made by the last program of the kernel before.
    "c1024-p16-w4-g128-fused": LaunchConfig(1024, 128, 16, 4, fused=True),
    "c2048-p16-w4-g128-fused": LaunchConfig(2048, 128, 16, 4, fused=True),
    "c1024-p16-w4-g128-m2-fused": LaunchConfig(1024, 128, 16, 4, second=True, fused=True),
    "c2048-p16-w4-g128-m2-fused": LaunchConfig(2048, 128, 16, 4, second=True, fused=True),
    # The many-row shape with top-k's cut programs at 4 warps (the engine's before the register caps).
    "c2048-p16-w4-g128-cw4": LaunchConfig(2048, 128, 16, 4, cut_warps=4),
    # That shape with fewer registers: the stats pass at 64 a thread (8 programs an SM instead of 7
    # or 6), the cut kernel's copy 512 values a round (128 registers instead of 164: 4 programs an SM
    # instead of 3), both, and that with the cut kernel at 96 registers (5 an SM, with spills).
    "c2048-p16-w4-g128-cw4-r64": LaunchConfig(2048, 128, 16, 4, cut_warps=4, stats_regs=64),
    "c2048-p16-w4-g128-cw4-gt512": LaunchConfig(2048, 128, 16, 4, cut_warps=4, gather=512),
    "c2048-p16-w4-g128-cw4-gt512-r64": LaunchConfig(2048, 128, 16, 4, cut_warps=4, gather=512, stats_regs=64),
    "c2048-p16-w4-g128-cw4-gt512-r64-cr96": LaunchConfig(2048, 128, 16, 4, cut_warps=4, gather=512, stats_regs=64,
                                                         cut_regs=96),
    # The few-row shapes with the copy of 512 values a round, which took top-p alone over flat rows
    # from 7.3 to 4.4 ms at bs 64.
    "c1024-p16-w4-g128-gt512": LaunchConfig(1024, 128, 16, 4, gather=512),
    "c1024-p16-w4-g128-m2-fused-gt512": LaunchConfig(1024, 128, 16, 4, second=True, fused=True, gather=512),
    # That shape with the cut kernel's programs all resident at once at bs 64 (1,024 rows, 8 an SM of
    # 132): compiled for sm_90 they take 128 registers at 2 warps with 64-value search rounds (the
    # engine's many-row shape, DEFAULT_CONFIG); 72 at 4 warps with 256 values copied a round (7 an
    # SM), 64 capped (24 bytes spilled).
    "c2048-p16-w4-g128-cw2-gt512-t64-r64": LaunchConfig(2048, 128, 16, 4, cut_warps=2, gather=512, stats_regs=64,
                                                        cut_tile=64),
    "c2048-p16-w4-g128-cw4-gt256-t64-r64": LaunchConfig(2048, 128, 16, 4, cut_warps=4, gather=256, stats_regs=64,
                                                        cut_tile=64),
    "c2048-p16-w4-g128-cw4-gt256-t64-r64-cr64": LaunchConfig(2048, 128, 16, 4, cut_warps=4, gather=256,
                                                             stats_regs=64, cut_tile=64, cut_regs=64),
    # The engine's many-row shape with each group's second value kept (the stats pass then spills 24
    # bytes at its 64-register cap), with the decision and the bonus made by the last programs, and
    # both: to time whether reading only the groups with two candidates, or two launches fewer, pay
    # at bs 64. Neither did (H100, 2026-12-06, ``--sampling-configs default,<these three>
    # --sampling-batches 64``): top-k 50 + top-p 0.9 286.1 and 285.5 µs against 259.2 (temperature
    # 231.3 and 242.8 against 231.3).
    "c2048-p16-w4-g128-cw2-gt512-t64-r64-m2": LaunchConfig(2048, 128, 16, 4, cut_warps=2, gather=512,
                                                           stats_regs=64, cut_tile=64, second=True),
    "c2048-p16-w4-g128-cw2-gt512-t64-r64-fused": LaunchConfig(2048, 128, 16, 4, cut_warps=2, gather=512,
                                                              stats_regs=64, cut_tile=64, fused=True),
    "c2048-p16-w4-g128-cw2-gt512-t64-r64-m2-fused": LaunchConfig(2048, 128, 16, 4, cut_warps=2, gather=512,
                                                                 stats_regs=64, cut_tile=64, second=True,
                                                                 fused=True),
    # One tree's shape with top-k's cut programs at 4 and at 2 warps instead of 8: the cut chain at bs 1
    # is a few sorts of at most 256 values, whose exchanges stay within a warp's registers more often
    # with fewer warps. At 4 warps top-k 50 + top-p 0.9 took 41.6 µs against 37.7 (H100, 2026-12-06,
    # ``--sampling-configs default,<these two> --sampling-batches 1``).
    "c1024-p16-w4-g128-m2-fused-cw4": LaunchConfig(1024, 128, 16, 4, second=True, fused=True, cut_warps=4),
    "c1024-p16-w4-g128-m2-fused-cw2": LaunchConfig(1024, 128, 16, 4, second=True, fused=True, cut_warps=2,
                                                   cut_tile=64),
    # The engine's shapes with top-p alone's cut programs at 16 warps instead of 8, each round's tile
    # of 512 values: at bs 1 a flat row's search rounds are 16 programs' arithmetic on 132 SMs.
    "c1024-p16-w4-g128-m2-fused-pw16": LaunchConfig(1024, 128, 16, 4, second=True, fused=True, p_warps=16),
    "c1024-p16-w4-g128-pw16": LaunchConfig(1024, 128, 16, 4, p_warps=16),
    "c2048-p16-w4-g128-cw2-gt512-t64-r64-pw16": LaunchConfig(2048, 128, 16, 4, cut_warps=2, gather=512,
                                                             stats_regs=64, cut_tile=64, p_warps=16),
    # The engine's shapes with top-p alone's first two search rounds over a flat row spread over (row,
    # chunk) programs (two launches), which narrow the benchmark's rows to a range the buffer holds.
    "c1024-p16-w4-g128-m2-fused-pw16-sp2": LaunchConfig(1024, 128, 16, 4, second=True, fused=True, p_warps=16,
                                                        spread_rounds=2),
    "c1024-p16-w4-g128-sp2": LaunchConfig(1024, 128, 16, 4, spread_rounds=2),
    "c2048-p16-w4-g128-cw2-gt512-t64-r64-sp2": LaunchConfig(2048, 128, 16, 4, cut_warps=2, gather=512,
                                                            stats_regs=64, cut_tile=64, spread_rounds=2),
    # Those shapes with the range still open copied by (row, chunk) programs after the spread rounds.
    "c1024-p16-w4-g128-m2-fused-pw16-sp2g": LaunchConfig(1024, 128, 16, 4, second=True, fused=True, p_warps=16,
                                                         spread_rounds=2, spread_gather=True),
    "c1024-p16-w4-g128-sp2g": LaunchConfig(1024, 128, 16, 4, spread_rounds=2, spread_gather=True),
    "c2048-p16-w4-g128-cw2-gt512-t64-r64-sp2g": LaunchConfig(2048, 128, 16, 4, cut_warps=2, gather=512,
                                                             stats_regs=64, cut_tile=64, spread_rounds=2,
                                                             spread_gather=True),
}
# The launch shape for many rows, and for few: on the H200 (V 128256, N 16, float32, graphed, coins
# included; ``benchmarks/tree_kernels.py --sampling-only --sampling-configs c1024-p16-w4-g128,c2048-p16-w4-g128``,
# 2026-12-04, launched without PDL) 1,024-entry chunks take 27.7 µs at bs 1 against 28.9 with 2,048
# (top-k 50 + top-p 0.9: 41.8 against 42.4), and 244.0 against 221.7 at bs 64 (353.5 against 322.8):
# a few rows need more, shorter programs. Groups of 128 leave fewer candidates than groups of 256
# (``--sampling-configs`` with the g128 shapes against the plain ones).
# With top-k its cut programs take 4 warps instead of 8 (H100, 2026-12-06, ``--sampling-configs
# c2048-p16-w4-g128,c2048-p16-w4-g128-cw4 --sampling-batches 64``): 320.1 against 329.5 µs at bs 64
# with top-k 50 + top-p 0.9, the same with temperature alone. And with fewer registers (H100,
# 2026-12-06, ``--sampling-configs c2048-p16-w4-g128-cw4,c2048-p16-w4-g128-cw4-r64,c2048-p16-w4-g128-cw4-gt512,
# c2048-p16-w4-g128-cw4-gt512-r64,c2048-p16-w4-g128-cw4-gt512-r64-cr96 --sampling-batches 64``, float32):
# 266.7 against 273.7 µs with top-k 50 + top-p 0.9, 226.1 against 236.8 with temperature alone, 4.38
# against 7.29 ms with top-p alone; the cut kernel's 96-register cap gained nothing more. With the cut
# programs all resident at bs 64 (H100, 2026-12-06, ``--sampling-configs default,c2048-p16-w4-g128-cw2-gt512-t64-r64,
# c2048-p16-w4-g128-cw4-gt256-t64-r64,c2048-p16-w4-g128-cw4-gt256-t64-r64-cr64 --sampling-batches 64``): 2 warps
# with 64-value search rounds took top-k 50 + top-p 0.9 to 259.3 µs against 272.2 (bf16: 222.1 against 237.7),
# the same with temperature or top-p alone; at 4 warps, 291.0 and 266.4 (capped at 64 registers).
# Every shape runs a flat row's first two top-p rounds spread over (row, 8,192-value) programs (H100,
# 2026-12-06, ``--sampling-configs default,<shape>-sp2 --sampling-batches 1|16|64``), top-p 0.9 alone over
# the benchmark's flat float32 rows: 259.2 against 558.9 µs at bs 1, 1080.3 against 1876.4 at bs 16,
# 3636.8 against 4403.5 at bs 64 (bf16: 7514.8 against 8020.8); the other cuts within 0.3 µs.
DEFAULT_CONFIG = "c2048-p16-w4-g128-cw2-gt512-t64-r64-sp2"
FEW_ROWS_CONFIG = "c1024-p16-w4-g128-sp2"
FEW_ROWS = 256  # rows (requests x nodes) up to which FEW_ROWS_CONFIG is taken; bs 16 at N 16
# One tree's rows also keep each group's second value and let the last programs decide and draw the
# bonus: on an H100 (2026-12-06, ``--sampling-configs default,c1024-p16-w4-g128-m2-fused
# --sampling-batches 1,16,64``) top-k 50 + top-p 0.9 at bs 1 took 38.8 µs against 41.4 (temperature:
# 25.9 against 26.8), but at bs 16 118.0 against 111.4 (88.9 against 85.9).
# Its top-p-alone cut programs take 16 warps (H100, 2026-12-06, ``--sampling-configs
# default,c1024-p16-w4-g128-m2-fused-pw16 --sampling-batches 1``): 562.5 µs against 698.4 with top-p
# 0.9 over the benchmark's flat rows, the other cuts the same (top-k 50 + top-p 0.9 37.8 against 37.6).
ONE_TREE_CONFIG = "c1024-p16-w4-g128-m2-fused-pw16-sp2"
ONE_TREE_ROWS = 16  # rows up to which ONE_TREE_CONFIG is taken; bs 1 at N 16
# Values a cut round reads at once. Its per-thread sums are [SEARCH_TILE, probes] float32: at 512 the
# cut kernel compiled for sm_90 spilled to the stack at top-k + top-p, at 256 it stays within 128
# registers a thread for every cut, as before the per-thread sums.
SEARCH_TILE = 256
GATHER_TILE = 2048  # values the copy of a narrowed top-p range reads at once (a scan across the program each)


def default_config(rows: int) -> str:
    """The launch shape the engine takes for ``rows`` node rows (requests x nodes)."""
    if rows <= ONE_TREE_ROWS:
        return ONE_TREE_CONFIG
    return FEW_ROWS_CONFIG if rows <= FEW_ROWS else DEFAULT_CONFIG


def _regs(regs: int) -> dict:
    """A launch's register cap (none for 0)."""
    return {"maxnreg": regs} if regs else {}


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
def _near(top):
    """How far below a maximum ``top`` a value may lie and still divide to the same x."""
    return tl.maximum(tl.abs(top) * 2**-20, 1e-30)


@triton.jit
def _first_argmax(raw, offs, top, best, t):
    """The first index (of ``offs``) of the maximum ``top`` of ``raw``, ``best`` its x (a plain min:
    cheaper than max's index-tracking reduction): the first raw == top, unless a smaller raw within a
    few ulps rounds to the same x. 2**31 - 1 where there is none."""
    i = tl.min(tl.where(raw == top, offs, 2**31 - 1), axis=0)
    near = (raw < top) & (raw >= top - _near(top))
    if tl.sum(near.to(tl.int32), axis=0) > 0:
        i = tl.minimum(i, tl.min(tl.where(near & (_scaled(raw, t) == best), offs, 2**31 - 1), axis=0))
    return i


@triton.jit
def _stats_kernel(Logits, Temp, Max, Arg, Sum, GMax, GMax2, Arrived, N, V, NC, NG, CHUNK: tl.constexpr,
                  SUB: tl.constexpr, GROUPS: tl.constexpr, SECOND: tl.constexpr, FUSED: tl.constexpr,
                  SUMS: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    if FUSED:
        # The counts ``_last_of`` takes, zeroed here (the kernels after wait for this one to end),
        # so that a call needs neither a memset launch nor state kept between calls.
        if (c == 0) & (row % N == 0):
            tl.store(Arrived + (row // N) * 2 + tl.arange(0, 2), tl.zeros((2,), tl.int32))
    t = tl.load(Temp + row // N)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    raw = tl.load(Logits + row * V + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
    # x = raw / t rounded as torch rounds it is a long instruction sequence, and this pass reads every
    # logit: division by t > 0 keeps the order, so the maxima are divided once, and the sum (a float
    # sum, compared within its rounding) takes the reciprocal's product.
    if GROUPS:  # the chunk's maximum from its groups': the group maxima reduce within a warp
        tile = tl.reshape(raw, (CHUNK // SUB, SUB))
        group_top = tl.max(tile, axis=1)
        top = tl.max(group_top, axis=0)
    else:
        top = tl.max(raw, axis=0)
    best = _scaled(top, t)
    i = _first_argmax(raw, offs, top, best, t)
    if SUMS:  # a chunk may be all -inf: its sum is then 0, not exp(-inf - -inf)
        s = tl.sum(tl.exp(raw * (1.0 / t) - tl.where(best > -float("inf"), best, 0.0)), axis=0)
    pdl.launch_dependents(PDL)
    tl.store(Max + row * NC + c, best)
    tl.store(Arg + row * NC + c, tl.where(i < 2**31 - 1, i, c * CHUNK).to(tl.int64))
    if SUMS:
        tl.store(Sum + row * NC + c, s)
    if GROUPS:  # only the cut rounds skip groups
        at = row * NG + c * (CHUNK // SUB) + tl.arange(0, CHUNK // SUB)
        tl.store(GMax + at, _scaled(group_top, t))
        if SECOND:  # the second-largest value: the maximum again where it occurs twice
            is_top = tile == group_top[:, None]
            rest = tl.max(tl.where(is_top, -float("inf"), tile), axis=1)
            second = tl.where(tl.sum(is_top.to(tl.int32), axis=1) > 1, group_top, rest)
            tl.store(GMax2 + at, _scaled(second, t))


@triton.jit
def _row_stats(Max, Arg, Sum, row, NC, BLOCK_C: tl.constexpr, SUMS: tl.constexpr):
    """The row's maximum, first argmax and sum of exp(x - maximum) from its chunks' (1 without
    ``SUMS``: top-k's cut measures the mass it keeps itself), and the chunks' maxima ([BLOCK_C], -inf
    past NC)."""
    j = tl.arange(0, BLOCK_C)
    ok = j < NC
    vals = tl.load(Max + row * NC + j, mask=ok, other=-float("inf"))
    m = tl.max(vals, axis=0)
    arg = tl.min(tl.where(ok & (vals == m), tl.load(Arg + row * NC + j, mask=ok, other=0), 2**62), axis=0)
    z = 1.0
    if SUMS:
        z = tl.sum(tl.where(ok, tl.load(Sum + row * NC + j, mask=ok, other=0.0) * tl.exp(vals - m), 0.0), axis=0)
    return m, arg, z, vals


@triton.jit
def _bound(gm, g, m, z, NG, top_k, top_p, HAS_K: tl.constexpr):
    """A value at or below the row's cut, from its group maxima ``gm`` (-inf: none found). Top-k: k
    groups whose maxima are at or above v hold k values at or above v, so the k-th largest group
    maximum is at or below the k-th largest value. Top-p alone: the j largest values weigh at least
    as much as the j largest group maxima, so once those reach top_p of the mass, the kept values
    are among the j largest, all at or above the j-th largest group maximum (reached with a margin
    over float rounding)."""
    srt = tl.sort(gm, descending=True)
    if HAS_K:
        at = top_k - 1
    else:
        e = tl.exp(srt - tl.where(m > -float("inf"), m, 0.0))
        at = tl.sum(((tl.cumsum(e, axis=0) < top_p * z * 1.001) & (g < NG)).to(tl.int32), axis=0)
    v = tl.sum(tl.where(g == at, srt, 0.0), axis=0)
    return tl.where(at < NG, v, -float("inf"))


@triton.jit
def _gather(Logits, Live, CandX, CandId, row, t, live, gid, bound, V, NG, CAP, count, SUB: tl.constexpr,
            GB: tl.constexpr):
    """Copies the row's values at or above ``bound`` (x and token id, ids ascending) from the groups
    ``gid`` where ``live`` (their maxima reach it; ids ascending) into the row's candidate buffer
    after its first ``count`` entries, and returns how many there are then (past CAP they did not
    fit, and the copy stops)."""
    # The live groups' ids, in order, so that GB of them are read at once.
    tl.store(Live + row * NG + tl.cumsum(live.to(tl.int32), axis=0) - 1, gid, mask=live)
    nlive = tl.sum(live.to(tl.int32), axis=0)
    count = nlive * 0 + count  # an int32 whether it came as a literal or as a sum
    tl.debug_barrier()
    for j in range(0, nlive, GB):
        if count <= CAP:
            gi = j + tl.arange(0, GB)
            group = tl.load(Live + row * NG + gi, mask=gi < nlive, other=0)
            offs = tl.reshape(group[:, None] * SUB + tl.arange(0, SUB)[None, :], (GB * SUB,))
            ok = tl.reshape(tl.broadcast_to((gi < nlive)[:, None], (GB, SUB)), (GB * SUB,)) & (offs < V)
            x = _scaled(tl.load(Logits + row * V + offs, mask=ok, other=-float("inf")), t)
            count = _append(CandX, CandId, row, CAP, count, x, offs, ok & (x >= bound))
    return count


@triton.jit
def _append(CandX, CandId, row, CAP, count, x, ids, keep):
    """Appends the values ``x`` where ``keep`` (with their token ids, in order) to the row's candidate
    buffer after its first ``count`` entries, none past CAP; returns the count with them."""
    at = count + tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(CandX + row * CAP + at, x, mask=keep & (at < CAP))
    tl.store(CandId + row * CAP + at, ids, mask=keep & (at < CAP))
    return count + tl.sum(keep.to(tl.int32), axis=0)


@triton.jit
def _gather_second(Logits, GMax2, Live, CandX, CandId, row, t, gm, live, gid, bound, V, NG, CAP, SUB: tl.constexpr,
                   GB: tl.constexpr):
    """``_gather`` from the second values ``GMax2`` too: a live group whose second value is below the
    bound holds one candidate, its maximum ``gm``, which goes to the buffer with its group's first
    token id for an id (``_true_id`` finds the real one where it matters), so only the other live
    groups are read. The singles come first, so the buffer is not in id order; but the groups'
    ids are disjoint ranges, so (value, id) still orders a tie as the token ids do."""
    gm2 = tl.load(GMax2 + row * NG + gid, mask=live, other=-float("inf"))
    single = live & (gm2 < bound)
    at = tl.cumsum(single.to(tl.int32), axis=0) - 1
    tl.store(CandX + row * CAP + at, gm, mask=single & (at < CAP))
    tl.store(CandId + row * CAP + at, (gid * SUB).to(tl.int32), mask=single & (at < CAP))
    count = tl.sum(single.to(tl.int32), axis=0)
    return _gather(Logits, Live, CandX, CandId, row, t, live & (gm2 >= bound), gid, bound, V, NG, CAP, count, SUB, GB)


@triton.jit
def _true_id(Logits, GMax2, row, t, cand_id, value, bound, V, NG, SUB: tl.constexpr):
    """The token id of candidate ``cand_id`` (< V) of value ``value`` from ``_gather_second``: itself,
    unless its group's second value is below the bound, where it stands for the group's one value at
    or above the bound, which is then looked up."""
    g = cand_id // SUB
    if tl.load(GMax2 + row * NG + g) < bound:
        offs, x = _chunk_tile(Logits, row, t, g * SUB, V, SUB)
        cand_id = tl.min(tl.where(x == value, offs, V), axis=0)
    return cand_id


@triton.jit
def _bound_and_gather(Logits, GMax, GMax2, Live, CandX, CandId, row, t, m, z, chunk_max, V, NC, NG, CAP, top_k,
                      top_p, limit, HAS_K: tl.constexpr, SUB: tl.constexpr, GB: tl.constexpr, BLOCK_C: tl.constexpr,
                      BLOCK_G: tl.constexpr, PRE: tl.constexpr, SECOND: tl.constexpr):
    """The row's bound (``_bound``), how many candidates it copied (``_gather``) and whether their ids
    are the token ids (else ``_gather_second``'s, past ``limit`` candidates copied again by
    ``_gather``); ``chunk_max`` are its chunks' maxima (``_row_stats``)."""
    g = tl.arange(0, BLOCK_G)
    gm = tl.load(GMax + row * NG + g, mask=g < NG, other=-float("inf"))
    if HAS_K and PRE > 0:
        # k chunks whose maxima reach v hold k groups whose maxima reach v: the k-th largest chunk
        # maximum is at or below the k-th largest group maximum, so the groups at or above the bound
        # are among those at or above it, and sorting only those gives the same bound.
        c = tl.arange(0, BLOCK_C)
        ranked = tl.sort(chunk_max, descending=True)
        pre = tl.where(top_k <= NC, tl.sum(tl.where(c == top_k - 1, ranked, 0.0), axis=0), -float("inf"))
        over = (gm >= pre) & (g < NG)
        npre = tl.sum(over.to(tl.int32), axis=0)
        if npre <= PRE:
            tl.store(Live + row * NG + tl.cumsum(over.to(tl.int32), axis=0) - 1, g, mask=over)
            tl.debug_barrier()
            p = tl.arange(0, PRE)
            pid = tl.load(Live + row * NG + p, mask=p < npre, other=0)
            pgm = tl.load(GMax + row * NG + pid, mask=p < npre, other=-float("inf"))
            tl.debug_barrier()  # every id is read before the copy writes its own list there
            bound, count, exact = _list_bound_and_gather(Logits, GMax2, Live, CandX, CandId, row, t, pgm, p, pid,
                                                         npre, m, z, V, NG, CAP, top_k, top_p, limit, HAS_K, SUB, GB,
                                                         SECOND)
        else:
            bound, count, exact = _list_bound_and_gather(Logits, GMax2, Live, CandX, CandId, row, t, gm, g, g, NG,
                                                         m, z, V, NG, CAP, top_k, top_p, limit, HAS_K, SUB, GB, SECOND)
    else:
        bound, count, exact = _list_bound_and_gather(Logits, GMax2, Live, CandX, CandId, row, t, gm, g, g, NG, m, z,
                                                     V, NG, CAP, top_k, top_p, limit, HAS_K, SUB, GB, SECOND)
    return bound, count, exact


@triton.jit
def _list_bound_and_gather(Logits, GMax2, Live, CandX, CandId, row, t, gm, at, gid, n, m, z, V, NG, CAP, top_k,
                           top_p, limit, HAS_K: tl.constexpr, SUB: tl.constexpr, GB: tl.constexpr,
                           SECOND: tl.constexpr):
    """The bound and the candidates from ``n`` group maxima ``gm`` (at positions ``at``) of groups ``gid``."""
    bound = _bound(gm, at, m, z, n, top_k, top_p, HAS_K)
    live = (gm >= bound) & (at < n)
    exact = True
    if SECOND:
        count = _gather_second(Logits, GMax2, Live, CandX, CandId, row, t, gm, live, gid, bound, V, NG, CAP, SUB, GB)
        exact = count > limit
        if exact:  # more than the sorted cuts take: the search needs the token ids, in order
            tl.debug_barrier()  # the second copy rewrites the live list the first one read
            count = _gather(Logits, Live, CandX, CandId, row, t, live, gid, bound, V, NG, CAP, 0, SUB, GB)
    else:
        count = _gather(Logits, Live, CandX, CandId, row, t, live, gid, bound, V, NG, CAP, 0, SUB, GB)
    return bound, count, exact


@triton.jit
def _tile(Logits, CandX, CandId, row, t, start, count, fits, V, CAP, T: tl.constexpr):
    """``T`` entries from ``start`` of what the row's cuts are searched in: its candidates where they fit
    the buffer, else the whole row; (x, token ids, in range), ids ascending either way."""
    j = start + tl.arange(0, T)
    ok = j < count
    if fits:
        x = tl.load(CandX + row * CAP + j, mask=ok, other=-float("inf"))
        ids = tl.load(CandId + row * CAP + j, mask=ok, other=0).to(tl.int64)
    else:
        x = _scaled(tl.load(Logits + row * V + j, mask=ok, other=-float("inf")), t)
        ids = j.to(tl.int64)
    return x, ids, ok


@triton.jit
def _probes(lo, hi, S: tl.constexpr):
    """``S`` thresholds splitting the keys [lo, hi] into S + 1 parts of nearly equal size."""
    j = tl.arange(0, S).to(tl.int64) + 1
    return lo + ((hi - lo + 1) * j) // (S + 1)


@triton.jit
def _top_p_round(tot, thr, lo, hi, limit):
    """Top-p's keys [lo, hi] after a round whose thresholds ``thr`` have ``tot`` of mass strictly above
    them: the cut is the smallest key whose mass above is below ``limit``."""
    below = tot < limit
    return tl.max(tl.where(below, lo, thr + 1), axis=0), tl.min(tl.where(below, thr, hi), axis=0)


@triton.jit
def _search(Logits, CandX, CandId, row, t, count, fits, V, CAP, lo, hi, m, limit, rounds, TOP_P: tl.constexpr,
            S: tl.constexpr, T: tl.constexpr):
    """The cut's key in [lo, hi], ``S`` thresholds a round. Top-k (``limit`` k): the largest key with at
    least k values at or above it (a tie at the k-th value is kept whole, as the reference's
    ``x < kth`` mask). Top-p (``limit`` top_p x the mass it is a fraction of): the smallest key whose
    mass strictly above it is below the limit."""
    for _round in range(rounds):
        if lo < hi:
            thr = _probes(lo, hi, S)
            # Each thread sums its own entries over the tiles and the threads' sums meet once a round:
            # a reduction across the program per tile cost more than the tile's arithmetic.
            acc = tl.zeros([T, S], tl.float32)
            for start in range(0, count, T):
                x, _ids, ok = _tile(Logits, CandX, CandId, row, t, start, count, fits, V, CAP, T)
                k = _key(x)
                if TOP_P:
                    e = tl.where(ok, tl.exp(x - m), 0.0)
                    acc += tl.where(k[:, None] > thr[None, :], e[:, None], 0.0)
                else:
                    acc += ((k[:, None] >= thr[None, :]) & ok[:, None]).to(tl.float32)
            tot = tl.sum(acc, axis=0)
            if TOP_P:
                new_lo, hi = _top_p_round(tot, thr, lo, hi, limit)
            else:
                enough = tot >= limit
                new_lo = tl.max(tl.where(enough, thr, lo), axis=0)
                hi = tl.min(tl.where(enough, hi, thr - 1), axis=0)
            lo = new_lo
    cut = lo
    if TOP_P:
        cut = hi
    return cut


@triton.jit
def _measure(Logits, CandX, CandId, row, t, count, fits, V, CAP, cut, m, TOP_P: tl.constexpr, T: tl.constexpr):
    """The mass kept by a cut (top-k: at or above its key; top-p: strictly above it) and how many
    values equal it."""
    mass = tl.zeros([T], tl.float32)
    ties = tl.zeros([T], tl.float32)
    for start in range(0, count, T):  # summed per thread, as in _search
        x, _ids, ok = _tile(Logits, CandX, CandId, row, t, start, count, fits, V, CAP, T)
        k = _key(x)
        e = tl.where(ok, tl.exp(x - m), 0.0)
        if TOP_P:
            mass += tl.where(k > cut, e, 0.0)
        else:
            mass += tl.where(k >= cut, e, 0.0)
        ties += ((k == cut) & ok).to(tl.float32)
    return tl.sum(mass, axis=0), tl.sum(ties, axis=0)


@triton.jit
def _nth_tie(Logits, CandX, CandId, row, t, count, fits, V, CAP, key, nth, T: tl.constexpr):
    """The token id of the ``nth`` (from 1) value whose key is ``key``, in token-id order."""
    seen = 0.0
    found = tl.full((), -1, tl.int64)
    for start in range(0, count, T):
        x, ids, ok = _tile(Logits, CandX, CandId, row, t, start, count, fits, V, CAP, T)
        tie = ((_key(x) == key) & ok).to(tl.float32)
        upto = seen + tl.cumsum(tie, axis=0)
        found = tl.maximum(found, tl.max(tl.where((tie > 0) & (upto == nth), ids, -1), axis=0))
        seen += tl.sum(tie, axis=0)
    return found


@triton.jit
def _narrow_start(m, z, V, top_p, lo):
    """The state a flat row's top-p search starts from (``_narrow_step``'s): the keys from v where V
    values at or below v would weigh less than 1 - top_p of the mass (with a margin over rounding),
    so the cut is above v, or ``lo`` if higher, to the row's maximum; V values at or above lo (at
    most: the count is not known), none above hi and no mass above it."""
    lo = tl.maximum(lo, _key(m + tl.log((1.0 - top_p) * z / V) - 0.01))
    return lo, _key(m), V.to(tl.int64), tl.zeros((), tl.int64), tl.zeros((), tl.float32)


@triton.jit
def _narrow_step(tot, cnt, thr, lo, hi, n_ge_lo, n_gt_hi, above, limit):
    """One top-p search round's new state, from the mass ``tot`` and count ``cnt`` of the values above
    each threshold ``thr`` of the keys [lo, hi]: the keys still open, the values at or above lo and
    above hi (hi moves to a threshold and lo to one past a threshold: their counts are that
    threshold's) and the mass above hi."""
    new_lo, new_hi = _top_p_round(tot, thr, lo, hi, limit)
    if new_hi < hi:
        above = tl.sum(tl.where(thr == new_hi, tot, 0.0), axis=0)
    n_ge_lo, n_gt_hi = _end_counts(cnt, thr, lo, hi, new_lo, new_hi, n_ge_lo, n_gt_hi)
    return new_lo, new_hi, n_ge_lo, n_gt_hi, above


@triton.jit
def _end_counts(cnt, thr, lo, hi, new_lo, new_hi, n_ge_lo, n_gt_hi):
    """The values at or above ``new_lo`` and above ``new_hi`` after a round of thresholds ``thr`` over
    the keys [lo, hi], from ``cnt``, the count above each threshold (its last axis): hi moves to a
    threshold and lo to one past a threshold, so their counts are that threshold's; an end that
    did not move keeps its count ``n_ge_lo`` / ``n_gt_hi``."""
    if new_hi < hi:
        n_gt_hi = tl.sum(tl.where(thr == new_hi, cnt, 0), axis=-1)
    if new_lo > lo:
        n_ge_lo = tl.sum(tl.where(thr + 1 == new_lo, cnt, 0), axis=-1)
    return n_ge_lo, n_gt_hi


@triton.jit
def _over(x, m, thr):
    """The mass exp(x - m) and the count of the values ``x`` above each threshold ``thr``, per value:
    [len(x), len(thr)] each. A -inf (past V) is above none: every threshold is above a finite key."""
    over = _key(x)[:, None] > thr[None, :]
    return tl.where(over, tl.exp(x - m)[:, None], 0.0), over.to(tl.int32)


@triton.jit
def _narrow(Logits, CandX, CandId, row, t, V, CAP, lo, hi, n_ge_lo, n_gt_hi, above, m, z, top_p, rounds,
            S: tl.constexpr, T: tl.constexpr):
    """Top-p's search rounds (``_search``'s, the limit top_p x the row's mass ``z``) over the whole row,
    each also counting the values above its thresholds, until the keys [lo, hi] still open hold at
    most ``CAP`` values (or ``rounds`` have run), from a state ``_narrow_step`` keeps
    (``_narrow_start``'s, or the spread rounds'). Returns lo, hi, whether those values fit the buffer and,
    where they do, the mass of the values above hi (else 0: the whole row is searched)."""
    for _round in range(rounds):
        if (n_ge_lo - n_gt_hi > CAP) & (lo < hi):
            thr = _probes(lo, hi, S)
            mass = tl.zeros([T, S], tl.float32)  # per thread, as in _search
            many = tl.zeros([T, S], tl.int32)
            for start in range(0, V, T):
                x, _ids, _ok = _tile(Logits, CandX, CandId, row, t, start, V, False, V, CAP, T)
                e, c = _over(x, m, thr)
                mass += e
                many += c
            lo, hi, n_ge_lo, n_gt_hi, above = _narrow_step(tl.sum(mass, axis=0), tl.sum(many, axis=0).to(tl.int64),
                                                           thr, lo, hi, n_ge_lo, n_gt_hi, above, top_p * z)
    fits = n_ge_lo - n_gt_hi <= CAP
    return lo, hi, fits, tl.where(fits, above, 0.0)


@triton.jit
def _spread_state(State, Above, PMass, PCnt, r, row, rows, NCS, CAP, top_p, z, S: tl.constexpr,
                  BLOCK_CS: tl.constexpr):
    """Round ``r``'s state of a row's spread top-p search (``_spread_kernel``): round r - 1's (lo, hi,
    values at or above lo, above hi, flat, active), its mass above hi, and, where that round ran,
    its thresholds' mass and counts summed over the chunks' partials (chunk order) and applied."""
    at = ((r - 1) * rows + row) * 6
    lo, hi = tl.load(State + at), tl.load(State + at + 1)
    n_ge_lo, n_gt_hi = tl.load(State + at + 2), tl.load(State + at + 3)
    flat, active = tl.load(State + at + 4), tl.load(State + at + 5)
    above = tl.load(Above + (r - 1) * rows + row)
    if active != 0:
        thr = _probes(lo, hi, S)
        c = tl.arange(0, BLOCK_CS)[:, None]
        j = tl.arange(0, S)[None, :]
        part = (((r - 1) * rows + row) * NCS + c) * S + j
        tot = tl.sum(tl.load(PMass + part, mask=c < NCS, other=0.0), axis=0)
        cnt = tl.sum(tl.load(PCnt + part, mask=c < NCS, other=0), axis=0).to(tl.int64)
        lo, hi, n_ge_lo, n_gt_hi, above = _narrow_step(tot, cnt, thr, lo, hi, n_ge_lo, n_gt_hi, above, top_p * z)
    return lo, hi, n_ge_lo, n_gt_hi, above, flat


@triton.jit
def _chunk_tile(Logits, row, t, start, V, T: tl.constexpr):
    """The token ids from ``start`` and their logits over t (-inf past V), ``T`` of them."""
    offs = start + tl.arange(0, T)
    return offs, _scaled(tl.load(Logits + row * V + offs, mask=offs < V, other=-float("inf")), t)


@triton.jit
def _spread_kernel(Logits, Temp, Max, Arg, Sum, State, Above, PMass, PCnt, PEdge, r, last, rows, N, V, NC, NCS, CAP,
                   top_p, CHUNK: tl.constexpr, S: tl.constexpr, T: tl.constexpr, BLOCK_C: tl.constexpr,
                   BLOCK_CS: tl.constexpr, EDGES: tl.constexpr, PDL: tl.constexpr):
    """Round ``r`` of top-p alone's search over a flat row, one program per ``CHUNK`` values of a row
    (``NCS`` of them; the stats pass's chunks are ``NC``): every program
    of a row finds the round's keys from the last round's partials (``_spread_state``), the same in
    each, and the chunk's mass and count above each threshold are its partial; the row's first
    program records the state. A row is flat where its chunks' maxima weigh less than top_p of the
    mass: the nucleus then holds more values than there are chunks, and the cut kernel's copy of
    the candidates would likely not hold them. With ``EDGES``, the ``last`` round's programs of a flat
    row also count their chunk's values at or above lo and above hi (``PEdge``), whether or not the
    round searches, for ``_spread_gather_kernel``."""
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    m, _arg, z, chunk_max = _row_stats(Max, Arg, Sum, row, NC, BLOCK_C, True)
    if r == 0:
        lo, hi, n_ge_lo, n_gt_hi, above = _narrow_start(m, z, V, top_p, tl.full((), -(1 << 31), tl.int64))
        flat = (tl.sum(tl.exp(chunk_max - m), axis=0) < top_p * z).to(tl.int64)
    else:
        lo, hi, n_ge_lo, n_gt_hi, above, flat = _spread_state(State, Above, PMass, PCnt, r, row, rows, NCS, CAP,
                                                              top_p, z, S, BLOCK_CS)
    active = ((flat != 0) & (n_ge_lo - n_gt_hi > CAP) & (lo < hi)).to(tl.int64)
    pdl.launch_dependents(PDL)
    if c == 0:
        at = (r * rows + row) * 6
        tl.store(State + at, lo)
        tl.store(State + at + 1, hi)
        tl.store(State + at + 2, n_ge_lo)
        tl.store(State + at + 3, n_gt_hi)
        tl.store(State + at + 4, flat)
        tl.store(State + at + 5, active)
        tl.store(Above + r * rows + row, above)
    edges = (r == last) & (flat != 0)  # last is -1 without EDGES
    if (active != 0) | edges:
        t = tl.load(Temp + row // N)
        thr = _probes(lo, hi, S)
        mass = tl.zeros([T, S], tl.float32)
        many = tl.zeros([T, S], tl.int32)
        ge_lo = tl.zeros([T], tl.int32)
        gt_hi = tl.zeros([T], tl.int32)
        for start in range(0, CHUNK, T):
            offs, x = _chunk_tile(Logits, row, t, c * CHUNK + start, V, T)
            if active != 0:
                e, k = _over(x, m, thr)
                mass += e
                many += k
            if EDGES and edges:
                key = _key(x)
                ge_lo += ((offs < V) & (key >= lo)).to(tl.int32)
                gt_hi += ((offs < V) & (key > hi)).to(tl.int32)
        if active != 0:
            part = ((r * rows + row) * NCS + c) * S + tl.arange(0, S)
            tl.store(PMass + part, tl.sum(mass, axis=0))
            tl.store(PCnt + part, tl.sum(many, axis=0))
        if EDGES and edges:
            tl.store(PEdge + (row * NCS + c) * 2, tl.sum(ge_lo, axis=0))
            tl.store(PEdge + (row * NCS + c) * 2 + 1, tl.sum(gt_hi, axis=0))


@triton.jit
def _spread_gather_kernel(Logits, Temp, Max, Arg, Sum, State, Above, PMass, PCnt, PEdge, CandX, CandId, Gathered, r,
                          rows, N, V, NC, NCS, CAP, top_p, CHUNK: tl.constexpr, S: tl.constexpr, T: tl.constexpr,
                          BLOCK_C: tl.constexpr, BLOCK_CS: tl.constexpr, PDL: tl.constexpr):
    """After ``r`` spread rounds, a flat row's values in the keys [lo, hi] still open, copied into its
    candidate buffer where they fit, one program per ``CHUNK`` values of the row: each chunk's count
    in the range comes from the last round's partials at the thresholds the range's ends moved to
    (else from its counts at the ends it kept, ``PEdge``), so each program places its chunk's values
    after those of the chunks before it, token ids ascending as ``_gather_range`` copies them.
    ``Gathered`` [row]: how many were copied, or -1 (not flat, or too many: the cut kernel narrows
    further and copies them itself)."""
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    m, _arg, z, _chunk_max = _row_stats(Max, Arg, Sum, row, NC, BLOCK_C, True)
    at = ((r - 1) * rows + row) * 6
    lo, hi, active = tl.load(State + at), tl.load(State + at + 1), tl.load(State + at + 5)
    new_lo, new_hi, _ge, _gt, _above, flat = _spread_state(State, Above, PMass, PCnt, r, row, rows, NCS, CAP, top_p,
                                                           z, S, BLOCK_CS)
    pdl.launch_dependents(PDL)
    gathered = tl.full((), -1, tl.int32)
    if flat != 0:
        cs = tl.arange(0, BLOCK_CS)
        ge_lo = tl.load(PEdge + (row * NCS + cs) * 2, mask=cs < NCS, other=0)
        gt_hi = tl.load(PEdge + (row * NCS + cs) * 2 + 1, mask=cs < NCS, other=0)
        if active != 0:
            part = (((r - 1) * rows + row) * NCS + cs[:, None]) * S + tl.arange(0, S)[None, :]
            cnt = tl.load(PCnt + part, mask=cs[:, None] < NCS, other=0)
            ge_lo, gt_hi = _end_counts(cnt, _probes(lo, hi, S)[None, :], lo, hi, new_lo, new_hi, ge_lo, gt_hi)
        inside = ge_lo - gt_hi
        n_in = tl.sum(inside, axis=0)
        if n_in <= CAP:
            gathered = n_in
            t = tl.load(Temp + row // N)
            count = tl.sum(tl.where(cs < c, inside, 0), axis=0)
            for start in range(0, CHUNK, T):
                offs, x = _chunk_tile(Logits, row, t, c * CHUNK + start, V, T)
                key = _key(x)
                keep = (offs < V) & (key >= new_lo) & (key <= new_hi)
                count = _append(CandX, CandId, row, CAP, count, x, offs, keep)
    if c == 0:
        tl.store(Gathered + row, gathered)


@triton.jit
def _gather_range(Logits, CandX, CandId, row, t, V, CAP, lo, hi, T: tl.constexpr):
    """Copies the row's values whose keys lie in [lo, hi] (x and token id, ids ascending) into its
    candidate buffer, at most ``CAP`` of them; returns how many there are."""
    count = tl.zeros((), tl.int32)
    for start in range(0, V, T):
        x, ids, ok = _tile(Logits, CandX, CandId, row, t, start, V, False, V, CAP, T)
        k = _key(x)
        count = _append(CandX, CandId, row, CAP, count, x, ids, ok & (k >= lo) & (k <= hi))
    return count


@triton.jit
def _cuts(Logits, CandX, CandId, row, t, count, fits, V, CAP, lo, hi, m, z, base, rounds, top_k, top_p,
          HAS_K: tl.constexpr, HAS_P: tl.constexpr, S: tl.constexpr, T: tl.constexpr):
    """The row's cut value, cut id and kept mass, searched in ``count`` entries (``_tile``) from [lo, hi];
    ``base`` is the mass above hi that those entries leave out (top-p alone, ``_narrow``)."""
    src = (Logits, CandX, CandId, row, t, count, fits, V, CAP)
    cut = -float("inf")
    cut_id = V.to(tl.int64)
    zk = z
    if HAS_K:
        k_key = _search(*src, lo, hi, m, top_k * 1.0, rounds, False, S, T)
        cut = _value(k_key)
        zk, _ = _measure(*src, k_key, m, False, T)
        z = zk
        lo = k_key
    if HAS_P:
        p_key = _search(*src, lo, hi, m, top_p * zk - base, rounds, True, S, T)
        cut = _value(p_key)
        above, ties = _measure(*src, p_key, m, True, T)
        above += base
        e = tl.exp(cut - m)
        # The reference sorts stably, so equal values keep token-id order, and keeps the r-th of the
        # tie (from 0) while the mass before it, above + r * e, is below top_p of the top-k mass.
        keep = tl.minimum(tl.maximum(tl.ceil((top_p * zk - above) / e), 1.0), ties)
        z = above + keep * e
        if keep < ties:
            cut_id = _nth_tie(*src, p_key, keep, T)
    return cut, cut_id, z


ID_BITS = 20  # token ids below 2**20 (checked at launch) share an int64 sort key with their value's


@triton.jit
def _sorted_cuts(CandX, CandId, row, count, m, z, V, CAP, top_k, top_p, HAS_K: tl.constexpr,
                 HAS_P: tl.constexpr, S: tl.constexpr, ID_BITS: tl.constexpr):
    """The row's cut value, cut id and kept mass from its ``count`` <= S candidates, sorted once by
    value (descending) and token id (ascending, as the reference's stable sort ranks a tie)."""
    j = tl.arange(0, S)
    ok = j < count
    x = tl.load(CandX + row * CAP + j, mask=ok, other=-float("inf"))
    ids = tl.load(CandId + row * CAP + j, mask=ok, other=0).to(tl.int64)
    span = 1 << ID_BITS
    packed = tl.sort(tl.where(ok, _key(x) * span + (span - 1 - ids), -(1 << 62)), descending=True)
    x = _value(packed >> ID_BITS)
    ids = span - 1 - (packed & (span - 1))
    e = tl.where(ok, tl.exp(x - m), 0.0)
    kept = ok
    cut = -float("inf")
    cut_id = V.to(tl.int64)
    if HAS_K:  # all of a tie at the k-th value is kept, as the reference's x < kth mask
        cut = tl.max(tl.where(j == top_k - 1, x, -float("inf")), axis=0)
        kept = ok & (x >= cut)
        z = tl.sum(tl.where(kept, e, 0.0), axis=0)
    if HAS_P:
        # As the reference: a token is dropped once the mass before it reaches top_p.
        p = e / z
        keep = kept & (tl.cumsum(p, axis=0) - p < top_p)
        last = tl.sum(keep.to(tl.int32), axis=0) - 1
        cut = tl.max(tl.where(j == last, x, -float("inf")), axis=0)
        after = tl.max(tl.where((j == last + 1) & kept, x, -float("inf")), axis=0)
        # Part of a tie kept: its lowest ids, up to the last one kept.
        cut_id = tl.where(after == cut, tl.max(tl.where(j == last, ids, -1), axis=0), cut_id)
        z = tl.sum(tl.where(keep, e, 0.0), axis=0)
    return cut, cut_id, z


@triton.jit
def _last_of(Arrived, programs):
    """Whether this program is the last of ``programs`` to report at ``Arrived`` (one count per request).
    The count goes up once every thread's stores are made (the barrier) with release and acquire
    at GPU scope, so the last program to arrive sees every other's stores."""
    tl.debug_barrier()
    return tl.atomic_add(Arrived, 1, sem="acq_rel", scope="gpu") == programs - 1


@triton.jit
def _cut_kernel(Logits, Temp, Max, Arg, Sum, GMax, GMax2, Live, CandX, CandId, Count, M, Z, Cut, CutId, Argmax, N, V,
                NC, NG, CAP, rounds, top_k, top_p, Arrived, Tokens, Parents, Depth, Valid, Mask, Coins, Status, Path,
                AcceptLength, ChildProbs, CoinsOut, Last, U, W, State, Above, PMass, PCnt, Gathered, Rows, NCS,
                HAS_K: tl.constexpr, HAS_P: tl.constexpr, SPREAD: tl.constexpr, GATHER: tl.constexpr,
                SUB: tl.constexpr, GB: tl.constexpr, S: tl.constexpr, T: tl.constexpr, GT: tl.constexpr,
                BLOCK_C: tl.constexpr, BLOCK_CS: tl.constexpr, BLOCK_G: tl.constexpr, SORTED: tl.constexpr,
                SORT_BLOCK: tl.constexpr, SMALL_SORT: tl.constexpr,
                PRE: tl.constexpr, ID_BITS: tl.constexpr, SECOND: tl.constexpr, FUSED: tl.constexpr,
                BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    m, arg, z, chunk_max = _row_stats(Max, Arg, Sum, row, NC, BLOCK_C, not HAS_K)
    cut = -float("inf")
    cut_id = V.to(tl.int64)
    whole = -1  # the candidates that hold every value the cut keeps, in token-id order (-1: not so)
    if HAS_K or HAS_P:
        t = tl.load(Temp + row // N)
        gathered = tl.full((), -1, tl.int32)  # the range still open after the spread rounds, copied (-1: not)
        s_lo = tl.zeros((), tl.int64)  # its keys and the mass above it, read only where copied
        s_hi = s_lo
        s_above = tl.zeros((), tl.float32)
        if SPREAD > 0 and HAS_P and not HAS_K:
            s_lo, s_hi, s_ge, s_gt, s_above, flat = _spread_state(State, Above, PMass, PCnt, SPREAD, row, Rows, NCS,
                                                                  CAP, top_p, z, S, BLOCK_CS)
            if GATHER:
                gathered = tl.load(Gathered + row)
        if gathered >= 0:  # the copy holds the range: no bound, its ids are the token ids
            bound = tl.full((), -float("inf"), tl.float32)
            count = gathered
            exact = gathered >= 0
        else:
            bound, count, exact = _bound_and_gather(Logits, GMax, GMax2, Live, CandX, CandId, row, t, m, z, chunk_max,
                                                    V, NC, NG, CAP, top_k, top_p, SORTED, HAS_K, SUB, GB, BLOCK_C,
                                                    BLOCK_G, PRE, SECOND)
            exact = (count >= 0) & exact  # a tensor on both branches, as Triton's if requires
        tl.debug_barrier()  # the buffer is whole before it is read
        if gathered >= 0:
            cut, cut_id, z = _cuts(Logits, CandX, CandId, row, t, count, True, V, CAP, s_lo, s_hi, m, z, s_above,
                                   rounds, top_k, top_p, HAS_K, HAS_P, S, T)
        elif (count <= SMALL_SORT) & (count <= SORTED):  # never with SORTED 0: a row has at least one candidate
            cut, cut_id, z = _sorted_cuts(CandX, CandId, row, count, m, z, V, CAP, top_k, top_p, HAS_K, HAS_P,
                                          SMALL_SORT, ID_BITS)
        elif count <= SORTED:
            cut, cut_id, z = _sorted_cuts(CandX, CandId, row, count, m, z, V, CAP, top_k, top_p, HAS_K, HAS_P,
                                          SORT_BLOCK, ID_BITS)
        else:
            # Too many candidates (a wide tie, or top-p over a flat row): the whole row is searched.
            fits = count <= CAP
            lo = _key(bound)
            hi = _key(m)
            base = tl.zeros((), tl.float32)
            if HAS_P and not HAS_K:
                if not fits:
                    # Top-p over a flat row: the search's first rounds run over the whole row until the
                    # keys still open hold few enough values to copy, the rest over the copy. Those
                    # rounds start where the spread rounds (``_spread_kernel``) left a flat row.
                    lo, hi, n_ge_lo, n_gt_hi, above = _narrow_start(m, z, V, top_p, lo)
                    if SPREAD > 0:
                        if flat != 0:
                            lo, hi, n_ge_lo, n_gt_hi, above = s_lo, s_hi, s_ge, s_gt, s_above
                    lo, hi, fits, base = _narrow(Logits, CandX, CandId, row, t, V, CAP, lo, hi, n_ge_lo, n_gt_hi,
                                                 above, m, z, top_p, rounds, S, T)
                    if fits:
                        count = _gather_range(Logits, CandX, CandId, row, t, V, CAP, lo, hi, GT)
            cut, cut_id, z = _cuts(Logits, CandX, CandId, row, t, tl.where(fits, count, V), fits, V, CAP,
                                   lo, hi, m, z, base, rounds, top_k, top_p, HAS_K, HAS_P, S, T)
        if SECOND:
            if (exact == 0) & (cut_id < V):  # the last kept of a tie at the cut may stand for its group
                cut_id = _true_id(Logits, GMax2, row, t, cut_id, cut, bound, V, NG, SUB)
        if HAS_K:  # every kept value is at or above the bound, so in the buffer where it fits
            whole = tl.where(count <= CAP, count, -1)
            if SECOND:  # and with the token ids, in order
                whole = tl.where(exact, whole, -1)
    pdl.launch_dependents(PDL)
    tl.store(Count + row, whole)
    tl.store(M + row, m)
    tl.store(Z + row, z)
    tl.store(Cut + row, cut)
    tl.store(CutId + row, cut_id)
    tl.store(Argmax + row, arg)
    if FUSED:
        b = row // N
        if _last_of(Arrived + b * 2, N):
            _decide(Logits, Temp, M, Z, Cut, CutId, Tokens, Parents, Depth, Valid, Mask, Coins, Status, Path,
                    AcceptLength, ChildProbs, CoinsOut, Last, U, b, N, V, W, BLOCK)


@triton.jit
def _kept(x, ids, m, z, cut, cut_id):
    """p = exp(x - m) / z of tokens ``ids`` (their ``x``) where the row's cut keeps them, else 0."""
    kept = (x > cut) | ((x == cut) & (ids <= cut_id))
    return tl.where(kept, tl.exp(x - m) / z, 0.0)


@triton.jit
def _kept_probs(Logits, M, Z, Cut, CutId, row, ids, mask, t, V):
    """p(ids | row) of the kept distribution (0 where not ``mask``)."""
    row = row + ids * 0  # a row per id (a scalar row is broadcast)
    x = _scaled(tl.load(Logits + row * V + ids, mask=mask, other=0.0), t)
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
def _residual_of(x, ids, ok, m, z, cut, cut_id, children, HAS_CHILD, BLOCK: tl.constexpr):
    """The residual of tokens ``ids`` (their ``x``; 0 where not ``ok``): their kept probabilities given
    the row's five numbers, the tokens of ``children`` [BLOCK] zeroed when ``HAS_CHILD``, float64."""
    p = tl.where(ok, _kept(x, ids, m, z, cut, cut_id), 0.0)
    if HAS_CHILD:
        # One child at a time: a [tile, BLOCK] comparison would not fit a long tile's registers.
        for j in tl.static_range(BLOCK):
            child = tl.sum(tl.where(tl.arange(0, BLOCK) == j, children, 0), axis=0)
            p = tl.where(ids == child, 0.0, p)
    return p.to(tl.float64)


@triton.jit
def _residual_tile(Logits, row, offs, m, z, cut, cut_id, children, t, V, HAS_CHILD, BLOCK: tl.constexpr):
    """The residual at ``offs`` of ``row`` (``_residual_of`` its logits)."""
    inb = offs < V
    x = _scaled(tl.load(Logits + row * V + offs, mask=inb, other=-float("inf")), t)
    return _residual_of(x, offs, inb, m, z, cut, cut_id, children, HAS_CHILD, BLOCK)


@triton.jit
def _decide(Logits, Temp, M, Z, Cut, CutId, Tokens, Parents, Depth, Valid, Mask, Coins, Status, Path, AcceptLength,
            ChildProbs, CoinsOut, Last, U, b, N, V, W, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Request ``b``'s tree decision from its rows' five numbers, stored: the outputs, and the last
    accepted node and its coin for the residual."""
    _, status, path, length, coins_out, child_probs, last, u, _ = _decision(
        Logits, Temp, M, Z, Cut, CutId, Tokens, Parents, Depth, Valid, Mask, Coins, b, N, V, W, BLOCK)
    nodes = tl.arange(0, BLOCK)
    pdl.launch_dependents(PDL)
    tl.store(AcceptLength + b, length)
    tl.store(Path + b * W + nodes, path.to(tl.int64), mask=nodes < W)
    tl.store(Status + b * N + nodes, status, mask=nodes < N)
    tl.store(CoinsOut + b * N + nodes, coins_out, mask=nodes < N)
    tl.store(ChildProbs + b * N + nodes, child_probs, mask=nodes < N)
    tl.store(Last + b, last.to(tl.int64))
    tl.store(U + b, u)


@triton.jit
def _decide_kernel(Logits, Temp, M, Z, Cut, CutId, Tokens, Parents, Depth, Valid, Mask, Coins,
                   Status, Path, AcceptLength, ChildProbs, CoinsOut, Last, U, N, V, W, BLOCK: tl.constexpr,
                   PDL: tl.constexpr):
    pdl.wait(PDL)
    _decide(Logits, Temp, M, Z, Cut, CutId, Tokens, Parents, Depth, Valid, Mask, Coins, Status, Path, AcceptLength,
            ChildProbs, CoinsOut, Last, U, tl.program_id(0).to(tl.int64), N, V, W, BLOCK, PDL)


@triton.jit
def _children_of(Tokens, Parents, Valid, b, N, last, BLOCK: tl.constexpr):
    """The tokens of node ``last``'s valid children (-1 elsewhere), as ``_tree_decision`` finds them."""
    nodes = tl.arange(0, BLOCK)
    in_n = nodes < N
    live = (tl.load(Valid + b * N + nodes, mask=in_n, other=0) != 0) & (nodes > 0)
    par = tl.load(Parents + b * N + nodes, mask=in_n, other=-1)
    return tl.where(live & (par == last), tl.load(Tokens + b * N + nodes, mask=in_n, other=0), -1)


@triton.jit
def _residual_node(Temp, M, Z, Cut, CutId, Count, Tokens, Parents, Valid, Last, b, N, BLOCK: tl.constexpr,
                   CANDS: tl.constexpr):
    """What request ``b``'s residual is made from (``_decide_kernel``'s last accepted node): its
    temperature, that node's row, its children's tokens, the row's m, z, cut and cut id, and how many
    of its candidates hold its whole kept distribution (``_cut_kernel``'s count; -1 where they do not,
    always without ``CANDS``)."""
    last = tl.load(Last + b)
    row = b * N + last
    children = _children_of(Tokens, Parents, Valid, b, N, last, BLOCK)
    count = -1
    if CANDS:
        count = tl.load(Count + row)
    return (tl.load(Temp + b), row, children, tl.load(M + row), tl.load(Z + row), tl.load(Cut + row),
            tl.load(CutId + row), count)


@triton.jit
def _residual_kernel(Logits, Temp, M, Z, Cut, CutId, Tokens, Parents, Valid, Last, ResGroups, N, V, NG,
                     Arrived, Argmax, U, Bonus, BonusCdf, NC, CandX, CandId, Count, CAP, CHUNK: tl.constexpr,
                     G: tl.constexpr, BLOCK: tl.constexpr, BLOCK_G: tl.constexpr, FUSED: tl.constexpr,
                     CANDS: tl.constexpr, T: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t, row, children, m, z, cut, cut_id, count = _residual_node(Temp, M, Z, Cut, CutId, Count, Tokens, Parents,
                                                                Valid, Last, b, N, BLOCK, CANDS)
    if count >= 0:  # the row's candidates hold its whole kept distribution: one program draws from them
        pdl.launch_dependents(PDL)
        if c == 0:
            _candidate_bonus(CandX, CandId, Argmax, U, Bonus, BonusCdf, b, row, count, children, m, z, cut, cut_id,
                             CAP, V, BLOCK, T)
    else:
        lo = c * CHUNK
        # Most chunks hold none of the children's tokens and skip the test for them.
        has_child = tl.sum(((children >= lo) & (children < lo + CHUNK)).to(tl.int32), axis=0) > 0
        r = _residual_tile(Logits, row, lo + tl.arange(0, CHUNK), m, z, cut, cut_id, children, t, V, has_child,
                           BLOCK)
        pdl.launch_dependents(PDL)
        tl.store(ResGroups + b * NG + lo // G + tl.arange(0, CHUNK // G),
                 tl.sum(tl.reshape(r, (CHUNK // G, G)), axis=1))
        if FUSED:
            if _last_of(Arrived + b * 2 + 1, NC):
                _bonus(Logits, M, Z, Cut, CutId, Argmax, U, ResGroups, Bonus, BonusCdf, b, t, row, children, m, z,
                       cut, cut_id, V, NG, G, BLOCK, BLOCK_G)


@triton.jit
def _candidate_bonus(CandX, CandId, Argmax, U, Bonus, BonusCdf, b, row, count, children, m, z, cut, cut_id, CAP, V,
                     BLOCK: tl.constexpr, T: tl.constexpr):
    """``_bonus`` from the ``count`` candidates of ``row`` (ids ascending) that hold every token its cut
    keeps: the residual's inverse CDF over them in token-id order, ``T`` a round (the tokens between
    them have no mass, so the CDF is the vocabulary-order one)."""
    u = tl.load(U + b)
    total = tl.zeros((), tl.float64)
    bonus = tl.full((), -1, tl.int64)  # the first token whose CDF passes u
    bonus_p = tl.zeros((), tl.float64)
    bonus_before = tl.zeros((), tl.float64)
    last = tl.full((), -1, tl.int64)  # the last token with mass, where rounding puts u past the total
    last_p = tl.zeros((), tl.float64)
    for start in range(0, count, T):
        j = start + tl.arange(0, T)
        ok = j < count
        x = tl.load(CandX + row * CAP + j, mask=ok, other=-float("inf"))
        ids = tl.load(CandId + row * CAP + j, mask=ok, other=0).to(tl.int64)
        r = _residual_of(x, ids, ok, m, z, cut, cut_id, children, True, BLOCK)
        cdf = total + tl.cumsum(r, axis=0)
        first = tl.min(tl.where((cdf > u) & (r > 0), ids, V), axis=0)
        take = (bonus < 0) & (first < V)
        p = tl.sum(tl.where(ids == first, r, 0.0), axis=0)
        bonus_before = tl.where(take, tl.sum(tl.where(ok & (ids == first), cdf, 0.0), axis=0) - p, bonus_before)
        bonus_p = tl.where(take, p, bonus_p)
        bonus = tl.where(take, first, bonus)
        with_mass = tl.max(tl.where(r > 0, ids, -1), axis=0)
        last_p = tl.where(with_mass >= 0, tl.sum(tl.where(ids == with_mass, r, 0.0), axis=0), last_p)
        last = tl.where(with_mass >= 0, with_mass, last)
        total += tl.sum(r, axis=0)
    found = bonus >= 0
    _store_bonus(Argmax, Bonus, BonusCdf, b, row, total, tl.where(found, bonus, last),
                 tl.where(found, bonus_before, total - last_p), tl.where(found, bonus_p, last_p))


@triton.jit
def _store_bonus(Argmax, Bonus, BonusCdf, b, row, total, bonus, before, p):
    """Stores request ``b``'s bonus token and its CDF interval [before, before + p) of a residual of mass
    ``total``. An all-zero residual (the children hold all the mass) falls back to the row's argmax,
    probability 0."""
    has_mass = total > 0
    tl.store(Bonus + b, tl.where(has_mass, bonus.to(tl.int64), tl.load(Argmax + row)))
    tl.store(BonusCdf + b * 2, tl.where(has_mass, before, 0.0).to(tl.float32))
    tl.store(BonusCdf + b * 2 + 1, tl.where(has_mass, p, 0.0).to(tl.float32))


@triton.jit
def _bonus(Logits, M, Z, Cut, CutId, Argmax, U, ResGroups, Bonus, BonusCdf, b, t, row, children, m, z, cut, cut_id,
           V, NG, G: tl.constexpr, BLOCK: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr = False):
    """Request ``b``'s bonus token and its CDF interval from its residual's group masses, stored
    (``row``, ``children`` and the row's numbers as ``_residual_node`` gives them)."""
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
    pdl.launch_dependents(PDL)
    _store_bonus(Argmax, Bonus, BonusCdf, b, row, total, bonus, before, p)


@triton.jit
def _bonus_kernel(Logits, Temp, M, Z, Cut, CutId, Argmax, Tokens, Parents, Valid, Last, U, ResGroups, Bonus,
                  BonusCdf, Count, N, V, NG, G: tl.constexpr, BLOCK: tl.constexpr, BLOCK_G: tl.constexpr,
                  CANDS: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    t, row, children, m, z, cut, cut_id, count = _residual_node(Temp, M, Z, Cut, CutId, Count, Tokens, Parents,
                                                                Valid, Last, b, N, BLOCK, CANDS)
    if count < 0:  # else the residual kernel drew it from the row's candidates
        _bonus(Logits, M, Z, Cut, CutId, Argmax, U, ResGroups, Bonus, BonusCdf, b, t, row, children, m, z, cut,
               cut_id, V, NG, G, BLOCK, BLOCK_G, PDL)


def sampling_chunked(logits: torch.Tensor, temperature: torch.Tensor, top_k: int, top_p: float, tokens: torch.Tensor,
                     parents: torch.Tensor, depth: torch.Tensor, valid: torch.Tensor, mask: torch.Tensor,
                     coins: torch.Tensor, width: int, config: LaunchConfig) -> tuple[tuple, tuple]:
    """The whole sampling verify, every kernel of the module docstring. ``temperature`` is [B]
    float32. Returns ``(rows, decision)``: ``rows`` each node's distribution as ``(m, z, cut, cut_id,
    argmax)``, [B, N] each (float32 for the first three, int64); ``decision`` ``(status int8 [B, N],
    accept_path int64 [B, width], accept_length int64 [B], bonus int64 [B], bonus_cdf float32 [B, 2],
    child_probs float32 [B, N], coins float32 [B, N])`` as ``spectool.verify.verify_sampling``."""
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
    has_cut = has_k or has_p
    second = has_cut and config.second
    gmax2 = torch.empty(rows if second else 1, ng if second else 1, **f32)
    # Per request: how many of its row programs, then of its residual programs, have finished.
    arrived = torch.empty(max(bs, 1), 2, dtype=torch.int32, device=dev)
    on = pdl.use_pdl(logits)
    launch = dict(PDL=on, **pdl.launch_options(on))
    _stats_kernel[(rows, nc)](logits, temperature, vals, idx, sums, gmax, gmax2, arrived, n, vocab, nc, ng,
                              CHUNK=chunk, SUB=sub, GROUPS=has_cut, SECOND=second, FUSED=config.fused,
                              SUMS=not has_k, num_warps=warps,
                              **_regs(config.stats_regs), **launch)
    cap = config.candidates
    sort = min(config.sorted, cap) if vocab <= 1 << ID_BITS else 0
    sort_block = max(16, triton.next_power_of_2(sort))
    small_sort = min(sort_block, max(16, triton.next_power_of_2(config.small_sorted)))
    block_g = max(2, triton.next_power_of_2(ng))
    pre = min(max(2, triton.next_power_of_2(config.prefilter)), block_g) if config.prefilter > 0 else 0
    live = torch.empty(rows if has_cut else 1, ng, dtype=torch.int32, device=dev)
    count = torch.empty(rows, dtype=torch.int32, device=dev)
    cand_x = torch.empty(rows if has_cut else 1, cap, **f32)
    cand_id = torch.empty(rows if has_cut else 1, cap, dtype=torch.int32, device=dev)
    m, z, cut = (torch.empty(rows, **f32) for _ in range(3))
    cut_id, argmax = (torch.empty(rows, dtype=torch.int64, device=dev) for _ in range(2))

    status, path, length, bonus, bonus_cdf, child_probs, coins_out = decision_outputs(bs, n, width, dev)
    block = max(16, triton.next_power_of_2(max(n, width)))
    # The bonus's inverse CDF reads one group of G tokens: the cut rounds' tile size, less for wide trees.
    group = min(chunk, max(16, config.sub * 16 // block))
    res_ng = nc * (chunk // group)
    res_groups = torch.empty(bs, res_ng, dtype=torch.float64, device=dev)
    last = torch.empty(bs, dtype=torch.int64, device=dev)
    u = torch.empty(bs, dtype=torch.float64, device=dev)
    tree = (tokens.contiguous(), parents.contiguous(), depth.contiguous(), valid.contiguous().view(torch.uint8),
            mask.contiguous().view(torch.uint8), coins.float().contiguous())
    decide_warps = max(warps, 4 if block <= 64 else 8)
    p_warps = config.p_warps if has_p and not has_k else 0
    # Top-p alone's spread rounds: per round and row its search state (lo, hi, values at or above lo,
    # above hi, flat, active) and mass above hi, and per chunk its partial sums at each threshold.
    spread = config.spread_rounds if has_p and not has_k else 0
    state = torch.empty(max(spread, 1), rows, 6, dtype=torch.int64, device=dev)
    above = torch.empty(max(spread, 1), rows, **f32)
    spread_chunk = min(config.spread_chunk, triton.next_power_of_2(vocab))
    ncs = triton.cdiv(vocab, spread_chunk)
    block_cs = max(2, triton.next_power_of_2(ncs))
    pmass = torch.empty(max(spread, 1), rows if spread else 1, ncs, config.probes, **f32)
    pcnt = torch.empty(pmass.shape, dtype=torch.int32, device=dev)
    # With the spread copy: per chunk of a flat row its values at or above lo and above hi at the last
    # round, and per row how many the copy holds.
    gather = spread > 0 and config.spread_gather
    pedge = torch.empty(rows if gather else 1, ncs, 2, dtype=torch.int32, device=dev)
    gathered = torch.empty(rows if gather else 1, dtype=torch.int32, device=dev)
    spread_args = dict(CHUNK=spread_chunk, S=config.probes, T=min(spread_chunk, SEARCH_TILE), BLOCK_C=block_c,
                       BLOCK_CS=block_cs, num_warps=warps, **launch)
    for r in range(spread):
        _spread_kernel[(rows, ncs)](logits, temperature, vals, idx, sums, state, above, pmass, pcnt, pedge, r,
                                    spread - 1 if gather else -1, rows, n, vocab, nc, ncs, cap, float(top_p),
                                    EDGES=gather, **spread_args)
    if gather:
        _spread_gather_kernel[(rows, ncs)](logits, temperature, vals, idx, sums, state, above, pmass, pcnt, pedge,
                                           cand_x, cand_id, gathered, spread, rows, n, vocab, nc, ncs, cap,
                                           float(top_p), **spread_args)
    _cut_kernel[(rows,)](logits, temperature, vals, idx, sums, gmax, gmax2, live, cand_x, cand_id, count, m, z, cut,
                         cut_id, argmax, n, vocab, nc, ng, cap, cut_rounds(config.probes), top_k, float(top_p),
                         arrived, *tree, status, path, length, child_probs, coins_out, last, u, width, state, above,
                         pmass, pcnt, gathered, rows, ncs, HAS_K=has_k, HAS_P=has_p, SPREAD=spread, GATHER=gather,
                         SUB=sub,
                         GB=max(1, config.gather // sub), S=config.probes,
                         T=(has_k and config.cut_tile) or SEARCH_TILE * max(1, p_warps // 8), GT=GATHER_TILE,
                         BLOCK_C=block_c, BLOCK_CS=block_cs, BLOCK_G=block_g, SORTED=sort, SORT_BLOCK=sort_block,
                         SMALL_SORT=small_sort, PRE=pre, ID_BITS=ID_BITS, SECOND=second, FUSED=config.fused,
                         BLOCK=block,
                         num_warps=(has_k and config.cut_warps) or p_warps or max(warps, 8, decide_warps),
                         **_regs(has_k and config.cut_regs), **launch)
    if bs:
        if not config.fused:
            _decide_kernel[(bs,)](logits, temperature, m, z, cut, cut_id, *tree, status, path, length, child_probs,
                                  coins_out, last, u, n, vocab, width, BLOCK=block, num_warps=decide_warps, **launch)
        block_res = max(2, triton.next_power_of_2(res_ng))
        _residual_kernel[(bs, nc)](logits, temperature, m, z, cut, cut_id, tree[0], tree[1], tree[3], last, res_groups,
                                   n, vocab, res_ng, arrived, argmax, u, bonus, bonus_cdf, nc, cand_x, cand_id, count,
                                   cap, CHUNK=chunk, G=group, BLOCK=block, BLOCK_G=block_res, FUSED=config.fused,
                                   CANDS=has_k, T=SEARCH_TILE, num_warps=decide_warps, **launch)
        if not config.fused:
            _bonus_kernel[(bs,)](logits, temperature, m, z, cut, cut_id, argmax, tree[0], tree[1], tree[3], last, u,
                                 res_groups, bonus, bonus_cdf, count, n, vocab, res_ng, G=group, BLOCK=block,
                                 BLOCK_G=block_res, CANDS=has_k, num_warps=decide_warps, **launch)
    rows_out = tuple(a.view(bs, n) for a in (m, z, cut, cut_id, argmax))
    return rows_out, (status, path, length, bonus, bonus_cdf, child_probs, coins_out)
