"""Fused Triton kernels for the decode step, each with its plain-torch reference beside it.

At batch 1 a decoder layer's matmuls take ~100 µs on the H200 (8B shape) and every
other kernel launch costs 3-5 µs even inside a CUDA graph, so the glue between the
matmuls is fused into as few launches as possible (docs/INTERNALS.md, "Why it is built this way"):

* ``add_rms_norm``: residual add + RMSNorm in one pass (also plain RMSNorm);
* ``rope`` / ``rope_write_kv``: rotary embedding of q and k in one launch, optionally
  with the K/V cache write;
* ``silu_mul``: SiLU(gate) * up over the fused gate_up projection output;
* ``argmax``: greedy token over the vocabulary in two small passes (``torch.argmax``
  over 128k logits is one long single-block reduction per row).

Numerics follow Hugging Face Llama: RMSNorm normalises in float32, rounds to the
activation dtype, then multiplies by the weight; the residual sum is rounded to the
activation dtype before it is normalised and returned.
"""

from __future__ import annotations

import torch

from spectool.kernels import pdl
from spectool.kernels.triton_import import tl, triton

# ---------------------------------------------------------------------------------
# residual add + RMSNorm


@triton.jit
def _add_rms_norm_kernel(X, R, W, Out, ResOut, stride_x, stride_r, stride_o, stride_ro, N, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)  # all arithmetic in float32, rounded where torch rounds
    if HAS_RESIDUAL:
        xf = xf + tl.load(R + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        x = xf.to(dtype)
        tl.store(ResOut + row * stride_ro + cols, x, mask=ok)
        xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(W + cols, mask=ok, other=0.0)
    y = (xf * rstd).to(dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(Out + row * stride_o + cols, y.to(Out.dtype.element_ty), mask=ok)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                        eps: float, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x + residual`` (or of ``x`` when residual is None).

    Returns ``(normed, x + residual)``; the second is ``x`` itself when residual is None.
    Shapes ``[..., N]`` with a contiguous last dim; weight ``[N]``. ``out``: where to write
    the normed rows (x's shape; rows may be strided, e.g. one half of a wider buffer).
    """
    shape, n = x.shape, x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight {tuple(weight.shape)} does not fit hidden size {n}")
    x2 = x.reshape(-1, n)
    r2 = residual.reshape(-1, n) if residual is not None else x2
    if x2.stride(-1) != 1 or r2.stride(-1) != 1:
        raise ValueError("add_rms_norm needs a contiguous last dimension")
    if out is not None and (out.shape != shape or out.stride(-1) != 1):
        raise ValueError(f"out must have x's shape {tuple(shape)} and a contiguous last dimension")
    out = torch.empty_like(x2) if out is None else out.view(-1, n)
    res_out = torch.empty_like(x2) if residual is not None else x2
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0), n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out.view(shape), res_out.view(shape)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`add_rms_norm_triton`."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype), x


# ---------------------------------------------------------------------------------
# RoPE on q and k (+ K/V cache write)


@triton.jit
def rotate_half(x, partner, cos, signed_sin, FMA: tl.constexpr):
    """One half of RoPE's rotation in float32: ``x * cos + partner * signed_sin`` (``-sin`` for the
    first half, ``sin`` for the second). With FMA the first product is fused into the add (one
    rounding fewer), spelt out so that every kernel that rotates rounds alike whatever its compiler
    contracts; without it each operation rounds as written (deterministic mode, whose kernels launch
    without FMA contraction)."""
    if FMA:
        return tl.fma(x, cos, partner * signed_sin)
    return x * cos + partner * signed_sin


@triton.jit
def _rope_kernel(
    Q, K, V, Cos, Sin, Slots, Starts, QOut, KOut, VOut, KRot,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sc_b, sc_t, ss_b, ss_t,
    sqo_b, sqo_t, sqo_h, sko_b, sko_h, sko_n, svo_b, svo_h, svo_n, skr_b, skr_t, skr_h,
    T, MAX_SEQ_LEN,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, WRITE_KV: tl.constexpr, KEEP_K: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, FMA: tl.constexpr, PDL: tl.constexpr,
):
    pdl.wait(PDL)
    pid = tl.program_id(0)  # one program per (row, new token): all heads at once
    b = pid // T
    t = pid % T
    offs = tl.arange(0, BLOCK_HALF)
    c_ok = offs < HALF
    cos = tl.load(Cos + b * sc_b + t * sc_t + offs, mask=c_ok, other=0.0).to(tl.float32)
    sin = tl.load(Sin + b * ss_b + t * ss_t + offs, mask=c_ok, other=0.0).to(tl.float32)

    # q: rotate-half convention, x1 = x[:D/2], x2 = x[D/2:].
    hq = tl.arange(0, BLOCK_HQ)
    m = (hq < HQ)[:, None] & c_ok[None, :]
    qp = Q + b * sq_b + t * sq_t + hq[:, None] * sq_h + offs[None, :]
    q1 = tl.load(qp, mask=m, other=0.0).to(tl.float32)
    q2 = tl.load(qp + HALF, mask=m, other=0.0).to(tl.float32)
    pdl.launch_dependents(PDL)
    qo = QOut + b * sqo_b + t * sqo_t + hq[:, None] * sqo_h + offs[None, :]
    tl.store(qo, rotate_half(q1, q2, cos, -sin, FMA).to(QOut.dtype.element_ty), mask=m)
    tl.store(qo + HALF, rotate_half(q2, q1, cos, sin, FMA).to(QOut.dtype.element_ty), mask=m)

    # k rotated; with WRITE_KV, k and v go straight to the cache slot at starts[b] + t
    # (never past its end: padding rows), else k to a [B, Hkv, T, D] output.
    hk = tl.arange(0, BLOCK_HKV)
    m = (hk < HKV)[:, None] & c_ok[None, :]
    kp = K + b * sk_b + t * sk_t + hk[:, None] * sk_h + offs[None, :]
    k1 = tl.load(kp, mask=m, other=0.0).to(tl.float32)
    k2 = tl.load(kp + HALF, mask=m, other=0.0).to(tl.float32)
    k1r = rotate_half(k1, k2, cos, -sin, FMA).to(KOut.dtype.element_ty)
    k2r = rotate_half(k2, k1, cos, sin, FMA).to(KOut.dtype.element_ty)
    if KEEP_K:  # the rotated k as well in [B, T, Hkv, D], cast as the cache holds it
        kr = KRot + b * skr_b + t * skr_t + hk[:, None] * skr_h + offs[None, :]
        tl.store(kr, k1r, mask=m)
        tl.store(kr + HALF, k2r, mask=m)
    if WRITE_KV:
        row = tl.load(Slots + b).to(tl.int64)
        idx = tl.load(Starts + b).to(tl.int64) + t
        m = m & ((hk * 0 + idx) < MAX_SEQ_LEN)[:, None]
    else:
        row = b.to(tl.int64)
        idx = t
    ko = KOut + row * sko_b + hk[:, None] * sko_h + idx * sko_n + offs[None, :]
    tl.store(ko, k1r, mask=m)
    tl.store(ko + HALF, k2r, mask=m)
    if WRITE_KV:
        vp = V + b * sv_b + t * sv_t + hk[:, None] * sv_h + offs[None, :]
        vo = VOut + row * svo_b + hk[:, None] * svo_h + idx * svo_n + offs[None, :]
        tl.store(vo, tl.load(vp, mask=m, other=0.0).to(VOut.dtype.element_ty), mask=m)
        tl.store(vo + HALF, tl.load(vp + HALF, mask=m, other=0.0).to(VOut.dtype.element_ty), mask=m)


def _check_rope_args(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    B, T, _, D = q.shape
    if k.dim() != 4 or k.shape[:2] != (B, T) or k.shape[3] != D:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} do not fit together")
    if D % 2 or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("head_dim must be even and q, k contiguous in head_dim")
    if cos.shape != (B, T, D // 2) or sin.shape != cos.shape or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(f"cos/sin must be [{B}, {T}, {D // 2}], got {tuple(cos.shape)}, {tuple(sin.shape)}")


def _launch_rope(q, k, v, cos, sin, slots, starts, q_out, k_out, v_out, write_kv: bool,
                 fp_fusion: bool = True, k_rot: torch.Tensor | None = None) -> None:
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    on = pdl.use_pdl_one_row(q, B * T)
    keep = k_rot if k_rot is not None else q_out  # never written without KEEP_K
    _rope_kernel[(B * T,)](
        q, k, v, cos, sin, slots, starts, q_out, k_out, v_out, keep,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *cos.stride()[:2], *sin.stride()[:2],
        *q_out.stride()[:3], *k_out.stride()[:3], *v_out.stride()[:3], *keep.stride()[:3],
        T, k_out.shape[2],
        HQ=Hq, HKV=Hkv, HALF=D // 2, WRITE_KV=write_kv, KEEP_K=k_rot is not None, BLOCK_HQ=triton.next_power_of_2(Hq),
        BLOCK_HKV=triton.next_power_of_2(Hkv), BLOCK_HALF=triton.next_power_of_2(D // 2), FMA=fp_fusion, PDL=on,
        num_warps=4, enable_fp_fusion=fp_fusion, **pdl.launch_options(on))


def rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B,T,Hq,D] and k [B,T,Hkv,D] by cos/sin [B,T,D/2] (rotate-half layout).

    Same contract as ``ops.rope``; one launch for both. Returns contiguous outputs.
    """
    _check_rope_args(q, k, cos, sin)
    B, T, Hkv, D = k.shape
    q_out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    k_out = torch.empty(B, Hkv, T, D, device=k.device, dtype=k.dtype)
    _launch_rope(q, k, k, cos, sin, cos, cos, q_out, k_out, k_out, write_kv=False)
    return q_out, k_out.transpose(1, 2).contiguous()


def rope_write_kv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor, starts: torch.Tensor, fp_fusion: bool = True,
                         k_rot: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate q and k and write k, v to the cache in one launch (``ops.rope`` + ``ops.write_kv``).

    Args:
        q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] (views into a fused qkv output are fine).
        cos, sin: [B, T, D/2] for the tokens' positions.
        k_cache, v_cache: [max_batch, Hkv, max_seq_len, D]; token t of row b goes to
            ``[slots[b], :, starts[b] + t]`` (indices past max_seq_len are dropped).
        slots, starts: [B].
        fp_fusion: let the compiler fuse multiplies and adds (False: each rounded as written, so
            the kernel's variants for other T give the same bits; deterministic mode).
        k_rot: optional [B, T, Hkv, D] buffer (contiguous in head_dim) that also receives the
            rotated k, cast to the cache's dtype: what the cache now holds, without reading it back.

    Returns:
        rotated q, [B, T, Hq, D] contiguous.
    """
    _check_rope_args(q, k, cos, sin)
    B, T = q.shape[:2]
    if k_rot is not None and (k_rot.shape != k.shape or k_rot.stride(-1) != 1 or k_rot.dtype != k_cache.dtype):
        raise ValueError(f"k_rot must be {tuple(k.shape)} in the cache's dtype {k_cache.dtype}, contiguous in "
                         f"head_dim; got {tuple(k_rot.shape)} {k_rot.dtype}")
    if v.shape != k.shape or v.stride(-1) != 1:
        raise ValueError(f"v {tuple(v.shape)} must match k {tuple(k.shape)}, contiguous in head_dim")
    if k_cache.shape != v_cache.shape or k_cache.shape[1] != k.shape[2] or k_cache.shape[3] != k.shape[3]:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not fit k {tuple(k.shape)}")
    if slots.shape != (B,) or starts.shape != (B,):
        raise ValueError(f"slots and starts must be ({B},)")
    q_out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    # The kernel reads slots and starts at stride 1; a column of a [B, K] table is not.
    _launch_rope(q, k, v, cos, sin, slots.contiguous(), starts.contiguous(), q_out, k_cache, v_cache,
                 write_kv=True, fp_fusion=fp_fusion, k_rot=k_rot)
    return q_out


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`rope_triton` (float32 math, one rounding at the end)."""
    _check_rope_args(q, k, cos, sin)
    half = q.shape[-1] // 2
    c, s = cos.float().unsqueeze(2), sin.float().unsqueeze(2)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float()[..., :half], x.float()[..., half:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def rope_write_kv_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slots: torch.Tensor, starts: torch.Tensor,
                            k_rot: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`rope_write_kv_triton`."""
    q_rot, rotated = rope_reference(q, k, cos, sin)
    if k_rot is not None:
        k_rot.copy_(rotated.to(k_cache.dtype))
    for b in range(q.shape[0]):
        slot, start = int(slots[b]), int(starts[b])
        n = max(0, min(q.shape[1], k_cache.shape[2] - start))
        k_cache[slot, :, start:start + n] = rotated[b, :n].transpose(0, 1).to(k_cache.dtype)
        v_cache[slot, :, start:start + n] = v[b, :n].transpose(0, 1).to(v_cache.dtype)
    return q_rot


# ---------------------------------------------------------------------------------
# SiLU(gate) * up


@triton.jit
def _silu_mul_kernel(X, Out, stride_x, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    g = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + N + cols, mask=ok, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(Out + row * stride_o + cols, y.to(Out.dtype.element_ty), mask=ok)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up = cat([gate, up], -1)``: [..., 2I] -> [..., I]."""
    two_n = gate_up.shape[-1]
    if two_n % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up last dim must be even and contiguous, got shape {tuple(gate_up.shape)}")
    x = gate_up.reshape(-1, two_n)
    n = two_n // 2
    out = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
    block = 1024
    _silu_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n,
                                                         BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], n)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`silu_mul_triton`."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


# ---------------------------------------------------------------------------------
# argmax over the vocabulary (greedy decoding)


@triton.jit
def _argmax_partial_kernel(X, PartVal, PartIdx, stride_x, V, NUM_CHUNKS, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    # NaN never wins here (torch.argmax would pick it); logits are finite in practice.
    x = tl.where(x != x, float("-inf"), x)
    val, idx = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(PartVal + row * NUM_CHUNKS + chunk, val)
    tl.store(PartIdx + row * NUM_CHUNKS + chunk, chunk * BLOCK + idx)


@triton.jit
def _argmax_final_kernel(PartVal, PartIdx, Out, NUM_CHUNKS, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    ok = offs < NUM_CHUNKS
    val = tl.load(PartVal + row * NUM_CHUNKS + offs, mask=ok, other=float("-inf"))
    idx = tl.load(PartIdx + row * NUM_CHUNKS + offs, mask=ok, other=2**31 - 1)
    best = tl.max(val, 0)
    # Ties across chunks: the smallest index wins, as within a chunk.
    win = tl.min(tl.where(val == best, idx, 2**31 - 1), 0)
    tl.store(Out + row, win.to(tl.int64))


def argmax_triton(logits: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """Index of the largest logit per row (first one on ties): [..., V] -> [...] int64."""
    V = logits.shape[-1]
    if logits.stride(-1) != 1 or V == 0:
        raise ValueError(f"argmax needs a non-empty contiguous last dim, got shape {tuple(logits.shape)}")
    x = logits.reshape(-1, V)
    rows, chunks = x.shape[0], triton.cdiv(V, block)
    part_val = torch.empty(rows, chunks, device=x.device, dtype=torch.float32)
    part_idx = torch.empty(rows, chunks, device=x.device, dtype=torch.int32)
    out = torch.empty(rows, device=x.device, dtype=torch.int64)
    _argmax_partial_kernel[(rows, chunks)](x, part_val, part_idx, x.stride(0), V, chunks, BLOCK=block,
                                           num_warps=8)
    _argmax_final_kernel[(rows,)](part_val, part_idx, out, chunks, BLOCK_C=triton.next_power_of_2(chunks),
                                  num_warps=1)
    return out.view(logits.shape[:-1])


def argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`argmax_triton`."""
    return logits.argmax(-1)
