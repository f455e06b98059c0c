"""Matrix-vector products for decoding (1 to 16 input rows) with the glue before them fused in.

At batch 1 every projection of a decoder layer is a GEMV over a weight read once
from memory, and the small kernels between them (residual add + RMSNorm, SiLU·mul)
cost more in launches than in bytes (docs/INTERNALS.md, "Why it is built this way"). The same holds
for a batch-1 tree verify (T = 16 rows) and an EAGLE draft step (4-16 rows): at 16
rows the product is still bound by reading the weight, and at small models every
kernel is launch latency. These kernels compute ``y = f(x) @ W.T`` where the
prologue ``f`` is applied to each chunk of the input rows as it is loaded, so those
launches disappear:

* ``silu_mul``: ``x = [gate | up]`` of length 2K; ``f(x) = silu(gate) * up``, rounded
  to the activation dtype as the unfused kernel rounds it;
* ``rms_norm``: ``f(x) = rms_norm(x + residual) * norm_weight``; the sum ``x +
  residual`` (the residual stream) is written by the first program. Every program
  first sums the squares of the (small, L2-resident) input rows, then rounds the
  normalised input exactly where the unfused kernels round it, so decoding and the
  verify see the same inputs: in bf16 a skipped rounding flips greedy near-ties
  between plain and speculative decoding. For one row, ``exact_norm=False`` instead
  accumulates the squares in the main pass and scales the output (``rstd * W @ (x *
  norm_weight)``): one pass over the input, one rounding fewer.

One row (M = 1, the bandwidth-bound decode step) has its own tuned kernel: one program
owns ``BLOCK_N`` output features and walks K in ``BLOCK_K`` chunks, keeping a
[BLOCK_N, BLOCK_K] float32 partial sum that is reduced once at the end. Its grid has a row
axis, so the same kernel also runs any number of rows each exactly as it runs one: the
batch-invariant linear of deterministic mode (kernels/batch_invariant.py). For 2 to
``MAX_ROWS`` rows a program also owns ``BLOCK_N`` features but multiplies each
[BLOCK_N, BLOCK_K] weight tile, loaded once, with all rows at once (``tl.dot`` of a
[16, BLOCK_K] input tile, rows past M zero, float32 accumulation), so the weight is
still read once whatever M is. Each program applies the prologue to all rows, though: on
the H200 at 16 rows (benchmarks/gemv.py --rows 16) that beats glue + cuBLAS at all the 107M
model's projections but the down one, and loses at the 8B ones, whose wide inputs make
the repeated prologue cost more than the launch it saves. More rows go to cuBLAS
(``ops.py`` dispatches): there the product starts to be bound by compute.
"""

from __future__ import annotations

import torch

from spectool.kernels import pdl
from spectool.kernels.triton_import import tl, triton

PROLOGUES = ("none", "silu_mul", "rms_norm")
_PROLOGUE_ID = {name: i for i, name in enumerate(PROLOGUES)}

# (BLOCK_N, BLOCK_K, num_warps, num_stages). benchmarks/gemv.py's sweep on the H200
# (docs/BENCHMARKS.md, "GEMV") found 8192-element tiles best throughout, long along K:
# 16 x 512 up to K = 4096, 8 x 1024 beyond (the down projection, with few output rows).
# Each is within 0.4 µs of the best of 36 configs at every 1B and 8B shape.
SHORT_K_CONFIG = (16, 512, 4, 3)
LONG_K_CONFIG = (8, 1024, 4, 3)


# The most input rows the fused kernels take; ops.py sends more to cuBLAS.
MAX_ROWS = 16
# tl.dot needs every dimension >= 16, so the row tile is 16 whatever M is (rows past M are
# masked to zero): 2 rows cost about what 16 do.
_BLOCK_M = 16
# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the few-row kernel. Every program applies the
# prologue to all rows of the input, so a wide BLOCK_N shares that work over more weight, but
# leaves SMs idle once N / BLOCK_N falls under a wave of programs. benchmarks/gemv.py --rows 16's
# sweep on the H200 (48 configs, 107M and 8B projections): 64 x 256 for outputs of 6144+
# features, 32 x 256 below: within 11 % of the best config at each, but 20 % at the 8B down.
ROWS_CONFIG = (32, 256, 4, 3)
ROWS_WIDE_N_CONFIG = (64, 256, 4, 3)


def default_config(k: int, rows: int = 1, n: int = 0) -> tuple[int, int, int, int]:
    """The config of the kernel that runs ``rows`` input rows against an [n, k] weight."""
    if rows > 1:
        return ROWS_WIDE_N_CONFIG if n >= 6144 else ROWS_CONFIG
    return SHORT_K_CONFIG if k <= 4096 else LONG_K_CONFIG


@triton.jit
def _gemv_kernel(X, R, NW, W, B, Y, S, N, K, stride_xm, stride_rm, stride_wn, eps,
                 PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                 EXACT_NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
    # Axis 0 is the input row, so one row's programs never differ from another's: the
    # batch-invariant linear (kernels/batch_invariant.py) runs M rows in one launch, each exactly
    # as the one-row decode step runs it. Rows are the fastest axis so that the rows sharing a
    # weight slab run together and read it from L2.
    row = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    X += row * stride_xm
    R += row * stride_rm
    Y += row * N
    S += row * K
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = W + rows.to(tl.int64)[:, None] * stride_wn
    pdl.wait(PDL)  # nothing before reads or writes what another kernel of the step touches
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
    rstd = 1.0
    if PROLOGUE == 2 and EXACT_NORM:  # first pass: the row's sum of squares
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            x = tl.load(X + cols, mask=col_ok, other=0.0)
            if HAS_RESIDUAL:
                x = (x.to(tl.float32) + tl.load(R + cols, mask=col_ok, other=0.0).to(tl.float32)).to(x.dtype)
            sumsq += x.to(tl.float32) * x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(sumsq, axis=0) / K + eps)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        x = tl.load(X + cols, mask=col_ok, other=0.0)
        dtype = x.dtype
        if PROLOGUE == 1:  # silu(gate) * up, rounded like the unfused kernel's output
            g = x.to(tl.float32)
            u = tl.load(X + K + cols, mask=col_ok, other=0.0).to(tl.float32)
            xf = (g / (1.0 + tl.exp(-g)) * u).to(dtype).to(tl.float32)
        elif PROLOGUE == 2:
            if HAS_RESIDUAL:
                x = (x.to(tl.float32) + tl.load(R + cols, mask=col_ok, other=0.0).to(tl.float32)).to(dtype)
                if pid == 0:
                    tl.store(S + cols, x, mask=col_ok)
            xf = x.to(tl.float32)
            nw = tl.load(NW + cols, mask=col_ok, other=0.0).to(tl.float32)
            if EXACT_NORM:  # the unfused roundings: normalised, then times the weight
                xf = ((xf * rstd).to(dtype).to(tl.float32) * nw).to(dtype).to(tl.float32)
            else:
                sumsq += xf * xf
                xf = xf * nw
        else:
            xf = x.to(tl.float32)
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * xf[None, :]
    pdl.launch_dependents(PDL)
    y = tl.sum(acc, axis=1)
    if PROLOGUE == 2 and not EXACT_NORM:
        y = y * tl.math.rsqrt(tl.sum(sumsq, axis=0) / K + eps)
    if HAS_BIAS:
        y += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)


@triton.jit
def _load_rows(x_rows, r_rows, K, cols, mask, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """One [BLOCK_M, BLOCK_K] chunk of the input and its partner: ``up`` for silu_mul, the
    residual for rms_norm with one, else the chunk again."""
    x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0)
    if PROLOGUE == 1:
        other = tl.load(x_rows + K + cols[None, :], mask=mask, other=0.0)
    elif HAS_RESIDUAL:
        other = tl.load(r_rows + cols[None, :], mask=mask, other=0.0)
    else:
        other = x
    return x, other


@triton.jit
def dot_tile(acc, x, w_rows, cols, n_ok, col_ok, DOT_F32: tl.constexpr):
    """``acc + x @ W[n, cols].T`` for a [BLOCK_M, BLOCK_K] input tile ``x``: the weight tile loaded from
    ``w_rows`` (zero past N and K), float32 accumulation, and float32 operands where ``DOT_F32``."""
    w = tl.load(w_rows + cols[None, :], mask=n_ok[:, None] & col_ok[None, :], other=0.0)
    if DOT_F32:
        x = x.to(tl.float32)
        w = w.to(tl.float32)
    return tl.dot(x, tl.trans(w), acc, input_precision="ieee")


@triton.jit
def _gemv_rows_kernel(X, R, NW, W, B, Y, S, M, N, K, stride_xm, stride_rm, stride_wn, eps,
                      PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                      DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    x_rows = X + m.to(tl.int64)[:, None] * stride_xm
    r_rows = R + m.to(tl.int64)[:, None] * stride_rm
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_rows = W + n.to(tl.int64)[:, None] * stride_wn
    pdl.wait(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PROLOGUE == 2:  # first pass: each row's own sum of squares, so each row's rstd is exact
        sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            cols = k0 + tl.arange(0, BLOCK_K)
            x, r = _load_rows(x_rows, r_rows, K, cols, m_ok[:, None] & (cols < K)[None, :], PROLOGUE, HAS_RESIDUAL)
            if HAS_RESIDUAL:
                x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            xf = x.to(tl.float32)
            sumsq += tl.sum(xf * xf, axis=1)
        rstd = tl.math.rsqrt(sumsq / K + eps)
    # The input chunk is loaded one iteration ahead. Besides hiding its latency, this keeps the
    # prologue in a layout spread over all warps: computed straight from a load, Triton moves it
    # into tl.dot's operand layout, where every warp holds (and computes) all BLOCK_M rows; on the
    # H200 that made the silu_mul prologue 3x slower.
    cols = tl.arange(0, BLOCK_K)
    next_x, next_other = _load_rows(x_rows, r_rows, K, cols, m_ok[:, None] & (cols < K)[None, :], PROLOGUE,
                                    HAS_RESIDUAL)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        mask = m_ok[:, None] & col_ok[None, :]
        x, other = next_x, next_other
        ahead = cols + BLOCK_K
        next_x, next_other = _load_rows(x_rows, r_rows, K, ahead, m_ok[:, None] & (ahead < K)[None, :], PROLOGUE,
                                        HAS_RESIDUAL)
        dtype = x.dtype
        if PROLOGUE == 1:  # silu(gate) * up, rounded like the unfused kernel's output
            g = x.to(tl.float32)
            x = (g / (1.0 + tl.exp(-g)) * other.to(tl.float32)).to(dtype)
        elif PROLOGUE == 2:
            if HAS_RESIDUAL:
                x = (x.to(tl.float32) + other.to(tl.float32)).to(dtype)
                if pid == 0:
                    tl.store(S + m[:, None] * K + cols[None, :], x, mask=mask)
            nw = tl.load(NW + cols, mask=col_ok, other=0.0).to(tl.float32)
            # The unfused roundings: normalised, then times the weight.
            x = ((x.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32) * nw[None, :]).to(dtype)
        acc = dot_tile(acc, x, w_rows, cols, n_ok, col_ok, DOT_F32)
    pdl.launch_dependents(PDL)
    if HAS_BIAS:
        acc += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + m[:, None] * N + n[None, :], acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                prologue: str = "none", residual: torch.Tensor | None = None,
                norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                out_dtype: torch.dtype | None = None, config: tuple[int, int, int, int] | None = None,
                exact_norm: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``y = f(x) @ weight.T (+ bias)`` for 1 to ``MAX_ROWS`` input rows, ``f`` the prologue.

    Args:
        x: [..., K] (2K wide for ``silu_mul``) with 1 to ``MAX_ROWS`` rows in all, contiguous
            along K; the rows may be strided (a slice), not copied when they have one stride.
        weight: [N, K], contiguous along K (an ``nn.Linear`` weight).
        bias: [N] or None.
        prologue: ``"none"``, ``"silu_mul"`` or ``"rms_norm"`` (module docstring).
        residual: for ``rms_norm``, added to x before the norm; None = no add.
        norm_weight: [K], the RMSNorm weight (``rms_norm`` only).
        eps: the RMSNorm epsilon.
        out_dtype: dtype of y (default x's).
        config: (BLOCK_N, BLOCK_K, num_warps, num_stages) of the kernel that runs; default
            ``default_config(K, rows, N)``.
        exact_norm: ``rms_norm`` with the unfused path's roundings (two passes over the
            input); False (one row only): one pass, one rounding fewer (module docstring).

    Returns:
        ``(y, s)``: y [..., N]; s = x + residual (shape of x, contiguous) for ``rms_norm``
        with a residual, else None.
    """
    check_gemv_args(x, weight, bias, prologue, residual, norm_weight)
    N, K = weight.shape
    width = 2 * K if prologue == "silu_mul" else K
    rows = x.numel() // width if x.shape[-1] == width else 0
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"x must be 1 to {MAX_ROWS} rows of {width} values for weight {tuple(weight.shape)} "
                         f"and prologue {prologue!r}, got shape {tuple(x.shape)}")
    if rows > 1 and not exact_norm:
        raise ValueError("exact_norm=False is implemented for one row only")
    y = torch.empty(*x.shape[:-1], N, device=x.device, dtype=out_dtype or x.dtype)
    s = torch.empty(x.shape, device=x.device, dtype=x.dtype) if residual is not None else None
    if rows == 1:
        x1 = x.reshape(-1)
        launch_row_gemv(x1, None if residual is None else residual.reshape(-1), weight, bias, prologue,
                        norm_weight, eps, y, s, 1, config, exact_norm)
        return y, s
    block_n, block_k, warps, stages = config or default_config(K, rows, N)
    # A view whenever the leading dims collapse to one row stride (e.g. hidden[:, -1:]), else a copy.
    x2 = x.reshape(rows, width)
    r2 = x2 if residual is None else residual.reshape(rows, width)
    on = pdl.use_pdl(x)
    _gemv_rows_kernel[(triton.cdiv(N, block_n),)](
        x2, r2, x2 if norm_weight is None else norm_weight, weight, y if bias is None else bias, y,
        y if s is None else s, rows, N, K, x2.stride(0), r2.stride(0), weight.stride(0), eps,
        PROLOGUE=_PROLOGUE_ID[prologue], HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        # The interpreter's tl.dot misreads bfloat16 (stored as raw bits); mixed dtypes cannot meet in
        # one tl.dot. float32 operands give the same exact products, with float32 accumulation.
        DOT_F32=not x.is_cuda or x.dtype != weight.dtype,
        BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, PDL=on,
        num_warps=warps, **pdl.launch_options(on))
    return y, s


def check_gemv_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prologue: str,
                    residual: torch.Tensor | None, norm_weight: torch.Tensor | None) -> None:
    """The checks every GEMV entry point makes beyond its row count (a clear ValueError)."""
    if prologue not in _PROLOGUE_ID:
        raise ValueError(f"prologue must be one of {PROLOGUES}, got {prologue!r}")
    N, K = weight.shape
    if weight.stride(-1) != 1 or x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("weight, x and residual must be contiguous along K")
    if prologue == "rms_norm" and (norm_weight is None or norm_weight.shape != (K,)):
        raise ValueError(f"rms_norm needs norm_weight of shape ({K},)")
    if residual is not None and (prologue != "rms_norm" or residual.shape != x.shape):
        raise ValueError("residual is only for rms_norm and must have x's shape")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")


def launch_row_gemv(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    bias: torch.Tensor | None, prologue: str, norm_weight: torch.Tensor | None, eps: float,
                    y: torch.Tensor, s: torch.Tensor | None, rows: int,
                    config: tuple[int, int, int, int] | None = None, exact_norm: bool = True) -> None:
    """Launch the one-row kernel over ``rows`` rows (one program set per row; arguments already checked).

    ``x``, ``residual``, ``y`` and ``s`` hold their rows back to back (contiguous); the kernel
    config depends on the weight's K alone, so every row runs the same program whatever
    ``rows`` is.
    """
    N, K = weight.shape
    block_n, block_k, warps, stages = config or default_config(K, 1)
    on = pdl.use_pdl(x)
    _gemv_kernel[(rows, triton.cdiv(N, block_n))](
        x, x if residual is None else residual, x if norm_weight is None else norm_weight,
        weight, y if bias is None else bias, y, y if s is None else s, N, K, x.numel() // rows, K,
        weight.stride(0), eps,
        PROLOGUE=_PROLOGUE_ID[prologue], HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        EXACT_NORM=exact_norm, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, PDL=on,
        num_warps=warps, **pdl.launch_options(on))


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   prologue: str = "none", residual: torch.Tensor | None = None,
                   norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                   out_dtype: torch.dtype | None = None,
                   exact_norm: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch reference of :func:`gemv_triton`, in float32 with the kernel's roundings."""
    s = None
    if prologue == "silu_mul":
        gate, up = x.float().chunk(2, dim=-1)
        xf = (torch.nn.functional.silu(gate) * up).to(x.dtype).float()
        scale = 1.0
    elif prologue == "rms_norm":
        if residual is not None:
            x = s = (x.float() + residual.float()).to(x.dtype)
        xf = x.float()
        scale = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if exact_norm:
            xf = ((xf * scale).to(x.dtype).float() * norm_weight.float()).to(x.dtype).float()
            scale = 1.0
        else:
            xf = xf * norm_weight.float()
    else:
        xf, scale = x.float(), 1.0
    y = (xf @ weight.float().t()) * scale
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype), s
