"""Matrix-vector products for one-token decoding with the glue before them fused in.

At batch 1 every projection of a decoder layer is a GEMV over a weight read once
from memory, and the small kernels between them (residual add + RMSNorm, SiLU·mul)
cost more in launches than in bytes (DESIGN.md "Performance notes"). These kernels
compute ``y = W @ f(x)`` where the prologue ``f`` is applied to each chunk of the
input as it is loaded, so those launches disappear:

* ``silu_mul``: ``x = [gate | up]`` of length 2K; ``f(x) = silu(gate) * up``, rounded
  to the activation dtype as the unfused kernel rounds it;
* ``rms_norm``: ``f(x) = rms_norm(x + residual) * norm_weight``; the sum ``x +
  residual`` (the residual stream) is written by the first program. Every program
  first sums the squares of the (small, L2-resident) input row, then rounds the
  normalised input exactly where the unfused kernels round it, so batch-1 decoding
  and the N-token verify (unfused) see the same inputs: in bf16 a skipped rounding
  flips greedy near-ties between plain and speculative decoding. ``exact_norm=False``
  instead accumulates the squares in the main pass and scales the output
  (``rstd * W @ (x * norm_weight)``): one pass over the input, one rounding fewer.

One program owns ``BLOCK_N`` output rows and walks K in ``BLOCK_K`` chunks, keeping
a [BLOCK_N, BLOCK_K] float32 partial sum that is reduced once at the end. Only one
input row (M = 1) is supported: that is the bandwidth-bound case; larger M goes to
cuBLAS (``ops.py`` dispatches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PROLOGUES = ("none", "silu_mul", "rms_norm")
_PROLOGUE_ID = {name: i for i, name in enumerate(PROLOGUES)}

# (BLOCK_N, BLOCK_K, num_warps, num_stages). benchmarks/gemv.py's sweep on the H200
# (docs/BENCHMARKS.md, "GEMV") found 8192-element tiles best throughout, long along K:
# 16 x 512 up to K = 4096, 8 x 1024 beyond (the down projection, with few output rows).
# Each is within 0.4 µs of the best of 36 configs at every 1B and 8B shape.
SHORT_K_CONFIG = (16, 512, 4, 3)
LONG_K_CONFIG = (8, 1024, 4, 3)


def default_config(k: int) -> tuple[int, int, int, int]:
    """The kernel config for a weight with K input features."""
    return SHORT_K_CONFIG if k <= 4096 else LONG_K_CONFIG


@triton.jit
def _gemv_kernel(X, R, NW, W, B, Y, S, N, K, stride_wn, eps,
                 PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                 EXACT_NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = W + rows.to(tl.int64)[:, None] * stride_wn
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
    y = tl.sum(acc, axis=1)
    if PROLOGUE == 2 and not EXACT_NORM:
        y = y * tl.math.rsqrt(tl.sum(sumsq, axis=0) / K + eps)
    if HAS_BIAS:
        y += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                prologue: str = "none", residual: torch.Tensor | None = None,
                norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                out_dtype: torch.dtype | None = None, config: tuple[int, int, int, int] | None = None,
                exact_norm: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``y = weight @ f(x) (+ bias)`` for a single input row, ``f`` the prologue.

    Args:
        x: one row, shape [..., K] with a single row in all (2K wide for ``silu_mul``).
        weight: [N, K], contiguous along K (an ``nn.Linear`` weight).
        bias: [N] or None.
        prologue: ``"none"``, ``"silu_mul"`` or ``"rms_norm"`` (module docstring).
        residual: for ``rms_norm``, added to x before the norm; None = no add.
        norm_weight: [K], the RMSNorm weight (``rms_norm`` only).
        eps: the RMSNorm epsilon.
        out_dtype: dtype of y (default x's).
        config: (BLOCK_N, BLOCK_K, num_warps, num_stages); default ``default_config(K)``.
        exact_norm: ``rms_norm`` with the unfused path's roundings (two passes over the
            input row); False: one pass, one rounding fewer (module docstring).

    Returns:
        ``(y, s)``: y [..., N]; s = x + residual (shape of x) for ``rms_norm`` with a
        residual, else None.
    """
    if prologue not in _PROLOGUE_ID:
        raise ValueError(f"prologue must be one of {PROLOGUES}, got {prologue!r}")
    N, K = weight.shape
    width = 2 * K if prologue == "silu_mul" else K
    if x.shape[-1] != width or x.numel() != width:
        raise ValueError(f"x must be one row of {width} values for weight {tuple(weight.shape)} "
                         f"and prologue {prologue!r}, got shape {tuple(x.shape)}")
    if weight.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("weight and x must be contiguous along K")
    if prologue == "rms_norm" and (norm_weight is None or norm_weight.shape != (K,)):
        raise ValueError(f"rms_norm needs norm_weight of shape ({K},)")
    if residual is not None and (prologue != "rms_norm" or residual.shape != x.shape):
        raise ValueError("residual is only for rms_norm and must have x's shape")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")
    block_n, block_k, warps, stages = config or default_config(K)
    y = torch.empty(*x.shape[:-1], N, device=x.device, dtype=out_dtype or x.dtype)
    s = torch.empty_like(x) if residual is not None else None
    x1 = x.reshape(-1)
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x1, x1 if residual is None else residual.reshape(-1), x1 if norm_weight is None else norm_weight,
        weight, y if bias is None else bias, y, y if s is None else s, N, K, weight.stride(0), eps,
        PROLOGUE=_PROLOGUE_ID[prologue], HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        EXACT_NORM=exact_norm, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, num_warps=warps)
    return y, s


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
