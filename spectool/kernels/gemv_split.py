"""The product of a few input rows (2 to 16) with a large weight, split along K: decode steps of
several sequences.

At 8 rows an 8B projection is still bound by reading its weight, but a kernel whose programs each
walk all of K for a slab of output features (``gemv._gemv_rows_kernel``) has too few programs for
the small projections (the 8B model's o projection: 4096 features, 128 slabs of 32) to keep every
SM reading, and cuBLAS's split-K kernels add a reduction launch. Here program (slab, s) multiplies
slab ``BLOCK_N`` of the weight over the s-th of ``split`` spans of K with every row (``tl.dot`` of
a [16, BLOCK_K] input tile, rows past M zero, float32 accumulation) and stores its float32 partial
sums; the last of a slab's programs to finish (a per-slab count, taken with release and acquire)
adds the partials in span order and writes the output. The order of every sum depends on (N, K)
and the dtype alone, never on M or on which program came last, so a row's output is the same bits whatever the
other rows are and however many pad the batch: a CUDA graph's padded bucket and an eager call
round alike, and repeated calls give the same bits.

The slab counts live in one zeroed int32 buffer per device, reset by each slab's last program, so
calls on one device must not overlap on two streams; it is made on the first call outside a CUDA
graph capture (the engine's graphs warm up eagerly first). The torch reference is
``gemv.gemv_reference`` (prologue ``none``).
"""

from __future__ import annotations

import torch

from spectool.kernels import pdl
from spectool.kernels.gemv import MAX_ROWS, check_gemv_args, dot_tile
from spectool.kernels.triton_import import tl, triton

_BLOCK_M = 16  # tl.dot needs every dimension >= 16; rows past M are masked to zero
# (BLOCK_N, BLOCK_K, split, num_warps, num_stages) by weight shape [N, K]; None where cuBLAS reads
# that weight faster. ``ops`` takes the kernel only at the shapes listed with a config: at the 1B
# shapes, untimed, DEFAULT_CONFIG made the 1B decode step at batch 8 0.924x cuBLAS's, 5452 against
# 5901 tok/s (H100, 2026-12-06, ``benchmarks/decode.py --shapes 8B,1B --batches 1,8 --no-hf --quick
# --no-split-gemv``). A direct call at another shape takes DEFAULT_CONFIG. The 8B shapes at
# 8 rows, each the best of 24 configs (H100, 2026-12-06, ``benchmarks/gemv.py --shapes 8B --rows 8
# --split --configs sweep --quick``; µs with the norm or SiLU·mul kernel before it, against that
# kernel + cuBLAS): qkv 23.3 against 24.2, o 15.3 against 17.5, down 44.7 against 46.9, lm_head
# 343.2 against 373.2, gate_up 83.5 against 82.8 (cuBLAS kept). DEFAULT_CONFIG had the least
# time summed over the five, relative to each one's best.
DEFAULT_CONFIG = (64, 512, 1, 4, 3)
CONFIGS: dict[tuple[int, int], tuple[int, int, int, int, int] | None] = {
    (6144, 4096): (64, 256, 1, 4, 3),
    (4096, 4096): (64, 512, 2, 4, 3),
    (28672, 4096): None,
    (4096, 14336): (64, 256, 2, 4, 3),
    (128256, 4096): (64, 256, 1, 4, 3),
}
SHARED_BYTES = 232448  # shared memory a Hopper program may take (227 KiB), which the pipelined tiles must fit
MAX_SLABS = 1 << 14  # slab counts per device: N / BLOCK_N of the widest weight (a 128k vocabulary at 16)

_counts: dict[torch.device, torch.Tensor] = {}


def config_for(n: int, k: int) -> tuple[int, int, int, int, int] | None:
    """The launch config for an [n, k] weight, a function of the shape alone (module docstring); None
    where cuBLAS is faster or the shape was never timed against it."""
    return CONFIGS.get((n, k))


def fit_config(config: tuple[int, int, int, int, int], element_size: int) -> tuple[int, int, int, int, int]:
    """``config`` (chosen for 2-byte weights) with BLOCK_K, then the stages, cut until the pipelined
    weight and input tiles fit ``SHARED_BYTES`` at ``element_size`` bytes a value (4 for float32)."""
    block_n, block_k, split, warps, stages = config

    def shared(block_k: int, stages: int) -> int:  # Triton's pipeliner keeps stages - 1 tiles in flight
        return max(stages - 1, 1) * (block_n + _BLOCK_M) * block_k * element_size

    while block_k > 64 and shared(block_k, stages) > SHARED_BYTES:
        block_k //= 2
    while stages > 1 and shared(block_k, stages) > SHARED_BYTES:
        stages -= 1
    return block_n, block_k, split, warps, stages


@triton.jit
def _split_kernel(X, W, B, Y, P, Count, M, N, K, stride_xm, stride_wn, SPAN, HAS_BIAS: tl.constexpr,
                  DOT_F32: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
    slab = tl.program_id(0)
    s = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    n = slab * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    x_rows = X + m.to(tl.int64)[:, None] * stride_xm
    w_rows = W + n.to(tl.int64)[:, None] * stride_wn
    pdl.wait(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    lo = s * SPAN
    for k0 in tl.range(lo, lo + SPAN, BLOCK_K, num_stages=NUM_STAGES):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        x = tl.load(x_rows + cols[None, :], mask=m_ok[:, None] & col_ok[None, :], other=0.0)
        acc = dot_tile(acc, x, w_rows, cols, n_ok, col_ok, DOT_F32)
    pdl.launch_dependents(PDL)
    out = m_ok[:, None] & n_ok[None, :]
    last = True
    if SPLIT > 1:
        tile = m[:, None] * N + n[None, :]
        tl.store(P + s * BLOCK_M * N + tile, acc, mask=out)
        # Every thread's partial is stored before the count goes up (release); the last program
        # to count (acquire) sees them all.
        tl.debug_barrier()
        last = tl.atomic_add(Count + slab, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
        if last:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for j in range(SPLIT):  # in span order, whichever program came last
                acc += tl.load(P + j * BLOCK_M * N + tile, mask=out, other=0.0)
            tl.store(Count + slab, 0)
    if last:
        if HAS_BIAS:
            acc += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + m[:, None] * N + n[None, :], acc.to(Y.dtype.element_ty), mask=out)


def _slab_counts(device: torch.device) -> torch.Tensor:
    counts = _counts.get(device)
    if counts is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("gemv_split's first call on a device must run outside a CUDA graph capture "
                               "(it zeroes the slab counts): run the step once eagerly before capturing it")
        counts = _counts[device] = torch.zeros(MAX_SLABS, dtype=torch.int32, device=device)
    return counts


def gemv_split(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None,
               config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``y = x @ weight.T (+ bias)`` for 1 to ``gemv.MAX_ROWS`` input rows, split along K.

    Args:
        x: [..., K] with 1 to ``MAX_ROWS`` rows in all, contiguous along K.
        weight: [N, K], contiguous along K (an ``nn.Linear`` weight).
        bias: [N] or None.
        out_dtype: dtype of y (default x's).
        config: (BLOCK_N, BLOCK_K, split, num_warps, num_stages); default ``config_for(N, K)``; either
            fitted to shared memory by ``fit_config``.

    Returns:
        y [..., N]; each row's values the same bits whatever the other rows are (module docstring).
    """
    n, k = weight.shape
    rows = x.numel() // k if x.shape[-1] == k else 0
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"x must be 1 to {MAX_ROWS} rows of {k} values for weight {tuple(weight.shape)}, "
                         f"got shape {tuple(x.shape)}")
    check_gemv_args(x, weight, bias, "none", None, None)
    block_n, block_k, split, warps, stages = fit_config(config or config_for(n, k) or DEFAULT_CONFIG,
                                                        max(x.element_size(), weight.element_size()))
    slabs = triton.cdiv(n, block_n)
    if slabs > MAX_SLABS:
        raise ValueError(f"{slabs} slabs of {block_n} features exceed the {MAX_SLABS} counts: a wider BLOCK_N")
    # Whole BLOCK_K tiles per span, so a span's tiles are those of the unsplit loop.
    span = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, span)
    x2 = x.reshape(rows, k)
    y = torch.empty(*x.shape[:-1], n, device=x.device, dtype=out_dtype or x.dtype)
    # One span writes y directly: no partials, no counts (both arguments then go unread).
    partials = torch.empty(split, _BLOCK_M, n, device=x.device, dtype=torch.float32) if split > 1 else y
    counts = _slab_counts(x.device) if split > 1 else y
    on = pdl.use_pdl(x)
    _split_kernel[(slabs, split)](
        x2, weight, y if bias is None else bias, y, partials, counts, rows, n, k, x2.stride(0), weight.stride(0),
        span, HAS_BIAS=bias is not None,
        # As gemv.py: the interpreter's tl.dot misreads bfloat16, and mixed dtypes cannot meet in one tl.dot.
        DOT_F32=not x.is_cuda or x.dtype != weight.dtype,
        SPLIT=split, BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, PDL=on,
        num_warps=warps, **pdl.launch_options(on))
    return y
