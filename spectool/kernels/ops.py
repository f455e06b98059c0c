"""The per-layer operations of the decoder, as plain torch functions.

The model calls only these, so a faster variant (Triton, CUDA) can be dispatched from
here without touching model code. Shapes follow the model: activations are
[B, T, ...]; q/k/v are [B, T, heads, head_dim]; one layer's cache is
[max_batch, kv_heads, max_seq_len, head_dim]. Nothing here syncs with the host
unless the caller passes a host ``kv_len``, so every op is CUDA-graph safe.

On CUDA tensors each op dispatches to its fused Triton kernel (kernels/fused.py,
kernels/attention_triton.py, the embedding's row gather in kernels/gather.py; imported on
first use so CPU runs never load Triton).
The projections (``linear``, ``rms_norm_linear``, ``silu_mul_linear``) take the fused
GEMVs of kernels/gemv.py for one row, with the norm or SiLU·mul before them in the same
launch, and for the 2 to 16 tokens of one sequence where that measured faster (small
weights, no SiLU·mul: ``FEW_ROWS_MAX_WEIGHT``); the rest goes to cuBLAS after the separate
glue kernels.

Inside ``with deterministic():`` (the model's ``deterministic=True`` forwards) the projections
and the attention take the batch-invariant kernels of kernels/batch_invariant.py instead, for
any number of rows (docs/INTERNALS.md, "Deterministic mode"); on the CPU nothing changes.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F

# Tree verify holds at most this many new tokens per row; longer (prefill) uses the torch path.
TRITON_ATTENTION_MAX_T = 64

_DETERMINISTIC = contextvars.ContextVar("spectool_deterministic", default=False)


@contextlib.contextmanager
def deterministic(enabled: bool = True) -> Iterator[None]:
    """Run the ops inside with batch-invariant kernels on CUDA (``enabled=False``: the default ones).

    Read while a forward runs, so a CUDA graph captured inside replays the kernels chosen here.
    """
    token = _DETERMINISTIC.set(enabled)
    try:
        yield
    finally:
        _DETERMINISTIC.reset(token)


def _triton(x: torch.Tensor) -> bool:
    # The Triton kernels have no backward: training (grad enabled) takes the torch path.
    return x.is_cuda and x.stride(-1) == 1 and not torch.is_grad_enabled()


def _invariant(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """Deterministic mode is on and x (and the weight) can take its Triton kernels."""
    return _DETERMINISTIC.get() and _triton(x) and (weight is None or weight.stride(-1) == 1)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight[ids]``: the token embedding, ``ids.shape + (H,)``.

    On CUDA one Triton row gather (kernels/gather.py; torch's small-index gather is several
    times slower for a few tokens), which clamps ids outside [0, V) instead of raising (a
    check would sync; the engine checks prompt ids on the host, and every later id comes from
    an argmax or a sample over the vocabulary). It also serves a frozen table under autograd
    (the draft trainer embeds through the target's), as no gradient flows to it.
    """
    if (weight.is_cuda and ids.is_cuda and weight.stride(-1) == 1
            and not (torch.is_grad_enabled() and weight.requires_grad)):
        from spectool.kernels.gather import embedding_triton
        return embedding_triton(ids, weight)
    return F.embedding(ids, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, scaled by ``weight``."""
    if _triton(x):
        from spectool.kernels.fused import add_rms_norm_triton
        return add_rms_norm_triton(x, None, weight, eps)[0]
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rms_norm_pair(a: torch.Tensor, weight_a: torch.Tensor, b: torch.Tensor, weight_b: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """``cat([rms_norm(a), rms_norm(b)], -1)``; on CUDA the two norms write into one buffer."""
    if _triton(a) and _triton(b) and a.shape == b.shape:
        from spectool.kernels.fused import add_rms_norm_triton
        out = torch.empty(*a.shape[:-1], 2 * a.shape[-1], device=a.device, dtype=a.dtype)
        add_rms_norm_triton(a, None, weight_a, eps, out=out[..., :a.shape[-1]])
        add_rms_norm_triton(b, None, weight_b, eps, out=out[..., a.shape[-1]:])
        return out
    return torch.cat([rms_norm(a, weight_a, eps), rms_norm(b, weight_b, eps)], dim=-1)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual``; returns ``(rms_norm(s), s)`` (the fusion point of the residual add)."""
    if _triton(x) and residual.stride(-1) == 1:
        from spectool.kernels.fused import add_rms_norm_triton
        return add_rms_norm_triton(x, residual, weight, eps)
    s = x + residual
    return rms_norm(s, weight, eps), s


# benchmarks/decode.py --no-fused-gemv turns this off to time the unfused path in the same run.
FUSED_GEMV = True


# Above one row the fused GEMV only wins where the weight is small: on the H200 at 16 rows
# (benchmarks/gemv.py --rows 16, docs/BENCHMARKS.md) it beat norm + cuBLAS at the 107M model's
# qkv, o, gate_up and lm_head (up to 4096 x 768) but lost at its SiLU-fused down projection and
# at every 8B projection, where each program's repeated prologue over a wide input costs more
# than the launch it saves.
FEW_ROWS_MAX_WEIGHT = 4096 * 1024


def _fused(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False) -> bool:
    # One row (decode at batch 1) always; the 2 to gemv.MAX_ROWS tokens of one sequence (a batch-1
    # tree verify, an EAGLE draft step) where measured faster (above). Several sequences go to cuBLAS
    # however few their rows: a CUDA graph pads the batch to its bucket, and the kernel must not
    # change with the padding, or graphed and eager decoding would round differently.
    # gemv.py is imported only once the tensor is on CUDA, so CPU runs never load Triton.
    if not (FUSED_GEMV and _triton(x) and weight.dtype == x.dtype and weight.stride(-1) == 1 and x.shape[-1]):
        return False
    rows = x.numel() // x.shape[-1]
    if rows == 1:
        return True
    from spectool.kernels.gemv import MAX_ROWS
    return (x.dim() == 3 and x.shape[0] == 1 and rows <= MAX_ROWS and not silu_mul
            and weight.numel() <= FEW_ROWS_MAX_WEIGHT)


# Several sequences' one-token projections through kernels/gemv_split.py (``_split``): the 8B decode
# step at batch 8 took 1270 tok/s against 1244 with cuBLAS, the same tokens (H100, 2026-12-06,
# ``benchmarks/decode.py --shapes 8B --batches 1,8 --no-hf --quick --no-split-gemv``), and the
# engine's GPU tests (graphed against eager tokens at every batch) pass with it. Only the weight shapes
# ``gemv_split.CONFIGS`` gives a config take it (the 8B's); others stay with cuBLAS. False: cuBLAS.
SPLIT_GEMV = True


def _split(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # One token of each of 2 to gemv.MAX_ROWS sequences (a decode step, a draft layer's step at one
    # position): the split-K kernel, whose rows round alike however many pad the batch, at the weight
    # shapes where it reads faster than cuBLAS. A CUDA graph pads only the batch, to a power of two,
    # so a batch of at most MAX_ROWS (a power of two) takes this kernel eager and graphed alike; with
    # more tokens per sequence the padded rows could cross MAX_ROWS where the eager ones do not.
    if not (SPLIT_GEMV and _triton(x) and x.dim() == 3 and x.shape[1] == 1 and x.shape[0] > 1
            and weight.dtype == x.dtype and weight.stride(-1) == 1):
        return False
    from spectool.kernels.gemv import MAX_ROWS
    from spectool.kernels.gemv_split import config_for
    return x.shape[0] <= MAX_ROWS and config_for(*weight.shape) is not None


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` or, for one token of each of a few sequences, the split-K kernel (``_split``)."""
    if _split(x, weight):
        from spectool.kernels.gemv_split import gemv_split
        return gemv_split(x, weight, bias)
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; on CUDA one row (and 2 to 16 tokens of one sequence, small weights) go to the Triton GEMV
    (kernels/gemv.py), which reads small weights faster than cuBLAS's split-K kernels; with ``SPLIT_GEMV``,
    one token of each of 2 to 16 sequences to the split-K kernel (kernels/gemv_split.py)."""
    if _invariant(x, weight):
        from spectool.kernels.batch_invariant import linear_invariant
        return linear_invariant(x, weight, bias)[0]
    if _fused(x, weight):
        from spectool.kernels.gemv import gemv_triton
        return gemv_triton(x, weight, bias)[0]
    return _linear(x, weight, bias)


def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None,
                    out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (``x`` when residual is None); returns ``(linear(rms_norm(s)), s)``,
    the first in ``out_dtype`` (default x's).

    One fused launch on CUDA for one row (and 2 to 16 tokens of one sequence; kernels/gemv.py),
    with the unfused path's roundings of the normalised input; only the order of the float32
    sums differs.
    """
    if _invariant(x, weight):
        from spectool.kernels.batch_invariant import linear_invariant
        if residual is not None and (residual.stride(-1) != 1 or residual.shape != x.shape):
            x, residual = x + residual, None  # the kernel's own sum: one add, one rounding
        y, s = linear_invariant(x, weight, bias, "rms_norm", residual, norm_weight, eps, out_dtype)
        return y, x if s is None else s
    if _fused(x, weight) and (residual is None or (residual.stride(-1) == 1 and residual.shape == x.shape)):
        from spectool.kernels.gemv import gemv_triton
        y, s = gemv_triton(x, weight, bias, "rms_norm", residual, norm_weight, eps, out_dtype)
        return y, x if s is None else s
    if residual is None:
        normed, s = rms_norm(x, norm_weight, eps), x
    else:
        normed, s = add_rms_norm(x, residual, norm_weight, eps)
    y = _linear(normed, weight, bias)
    return y if out_dtype is None else y.to(out_dtype), s


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B,T,Hq,D] and k [B,T,Hkv,D] by cos/sin [B,T,D/2] (half-split layout, as Llama)."""
    if _triton(q) and k.stride(-1) == 1:
        from spectool.kernels.fused import rope_triton
        return rope_triton(q, k, cos, sin)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    return rotate(q), rotate(k)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: ``silu(gate) * up`` where gate_up = [gate | up] on the last dimension."""
    if _triton(gate_up):
        from spectool.kernels.fused import silu_mul_triton
        return silu_mul_triton(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``linear(silu_mul(gate_up), weight)`` (the MLP's down projection); one launch on CUDA for
    one row, with the same roundings as the unfused path (more rows: slower fused, see ``_fused``)."""
    if _invariant(gate_up, weight):
        from spectool.kernels.batch_invariant import linear_invariant
        return linear_invariant(gate_up, weight, prologue="silu_mul")[0]
    if _fused(gate_up, weight, silu_mul=True):
        from spectool.kernels.gemv import gemv_triton
        return gemv_triton(gate_up, weight, prologue="silu_mul")[0]
    return _linear(silu_mul(gate_up), weight)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor, starts: torch.Tensor) -> None:
    """Write k, v [B,T,Hkv,D] into cache indices ``starts[b] .. starts[b]+T-1`` of slot ``slots[b]``."""
    T = k.shape[1]
    index = starts[:, None] + torch.arange(T, device=starts.device)  # [B, T]
    # Advanced indices around a slice put their dims first: the target view is [B, T, Hkv, D].
    k_cache[slots[:, None], :, index] = k
    v_cache[slots[:, None], :, index] = v


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  starts: torch.Tensor, k_rot: torch.Tensor | None = None) -> torch.Tensor:
    """``rope`` then ``write_kv`` of the rotated k and v; returns the rotated q (one launch on CUDA).
    ``k_rot`` (optional, [B, T, Hkv, D]) receives the rotated k as the cache holds it."""
    if _triton(q) and k.stride(-1) == 1 and v.stride(-1) == 1:
        from spectool.kernels.fused import rope_write_kv_triton
        # Deterministic mode: its T = 1, N and prompt-length variants must round alike (no FMA contraction).
        return rope_write_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slots, starts,
                                    fp_fusion=not _DETERMINISTIC.get(), k_rot=k_rot)
    q, k = rope(q, k, cos, sin)
    write_kv(k_cache, v_cache, k, v, slots, starts)
    if k_rot is not None:
        k_rot.copy_(k.to(k_cache.dtype))
    return q


# benchmarks/decode.py --no-rope-fusion turns this off to time RoPE's own kernel in the same run.
FUSED_ROPE_ATTENTION = True


def rope_cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                          starts: torch.Tensor, tree_mask: torch.Tensor | None, kv_len: int | None) -> torch.Tensor:
    """``rope_write_kv`` then ``cached_attention`` (same arguments, q/k/v before RoPE).

    On CUDA a decode step (one new token per row, no mask) rotates and writes the new token inside
    the attention's own kernels (kernels/attention_triton.py): one launch fewer per layer. The
    deterministic mode keeps its batch-invariant kernels, which round every T alike.
    """
    if (FUSED_ROPE_ATTENTION and q.shape[1] == 1 and tree_mask is None and _triton(q) and not _DETERMINISTIC.get()
            and k.stride(-1) == 1 and v.stride(-1) == 1):
        from spectool.kernels.attention_triton import rope_cached_attention_triton
        return rope_cached_attention_triton(q, k, v, cos, sin, k_cache, v_cache, slots, starts)
    if _flash_prefill(q, tree_mask, kv_len):
        # Its keys and values are the new tokens' own: the attention reads them as written, where
        # gathering them back from the cache cost a copy per layer (a tenth of a long prefill's GPU time).
        k_rot = torch.empty(k.shape, dtype=k_cache.dtype, device=k.device)
        q = rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots, starts, k_rot=k_rot)
        return sdpa(q.transpose(1, 2), k_rot.transpose(1, 2), v.to(v_cache.dtype).transpose(1, 2),
                    is_causal=True).transpose(1, 2)
    q = rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots, starts)
    return cached_attention(q, k_cache, v_cache, slots, starts, tree_mask, kv_len)


def _flash_prefill(q: torch.Tensor, tree_mask: torch.Tensor | None, kv_len: int | None) -> bool:
    """Whether ``cached_attention`` takes a prefill from cache index 0 to flash attention: on CUDA,
    no mask, ``kv_len`` = T (every start 0), past the Triton kernel's T and outside deterministic mode."""
    T = q.shape[1]
    return (q.is_cuda and tree_mask is None and kv_len == T and not _invariant(q)
            and not (_triton(q) and T <= TRITON_ATTENTION_MAX_T))


def cached_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, starts: torch.Tensor, tree_mask: torch.Tensor | None,
                     kv_len: int | None) -> torch.Tensor:
    """Attention of T new queries per row over that row's cache slot (new K/V already written).

    Query t of row b sees every cache index below ``starts[b]`` and new token k iff
    ``tree_mask[b, t, k]`` (causal when None); it always sees itself. A mask W > T wide covers
    the W - T cache indices before the new tokens as well (query t sees index
    ``starts[b] + T - W + j`` iff ``tree_mask[b, t, j]``, every index below those): a tree fed a
    few nodes at a time, its earlier nodes already in the cache. Wide masks take the torch path.

    Args:
        q: [B, T, Hq, D] rotated queries.
        k_cache, v_cache: [max_batch, Hkv, max_seq_len, D], one layer.
        slots, starts: [B] int64.
        tree_mask: [B, T, W] bool (W >= T) or None.
        kv_len: host int >= max(starts + T) to read only the live part of the cache;
            None reads all of it (no host sync; the mask hides what is not live).

    Returns:
        [B, T, Hq, D] in q's dtype.
    """
    B, T, Hq, D = q.shape
    W = T if tree_mask is None else tree_mask.shape[-1]
    if _invariant(q) and W == T:  # any T, prefill included: the same kernel in every forward
        from spectool.kernels.batch_invariant import attention_invariant
        return attention_invariant(q, k_cache, v_cache, slots, starts, tree_mask)
    if _triton(q) and T <= TRITON_ATTENTION_MAX_T and W == T:  # reads starts on device, only the live blocks
        from spectool.kernels.attention_triton import cached_attention_triton
        return cached_attention_triton(q, k_cache, v_cache, slots, starts, tree_mask)
    L = k_cache.shape[2] if kv_len is None else kv_len
    k = k_cache[:, :, :L].index_select(0, slots)  # [B, Hkv, L, D]; faster on CPU than k_cache[slots, :, :L]
    v = v_cache[:, :, :L].index_select(0, slots)
    if _flash_prefill(q, tree_mask, kv_len):
        # A prefill from cache index 0 (kv_len == T leaves every start at 0): plainly causal, so flash
        # attention takes it; with an explicit mask SDPA falls back to the memory-efficient kernel,
        # which on the H200 made attention most of a long prefill. (The CPU keeps the masked path:
        # its teacher-forced forwards must round as the engine's masked ones do.)
        return sdpa(q.transpose(1, 2), k, v, is_causal=True).transpose(1, 2)
    rel = torch.arange(L, device=q.device) - starts[:, None]  # [B, L]: key index relative to the new tokens
    t = torch.arange(T, device=q.device)[:, None]  # [T, 1]
    if tree_mask is None:
        see_new = rel[:, None, :] <= t
        in_mask = (rel >= 0) & (rel < T)
        before = rel < 0
    else:
        if tree_mask.shape[:2] != (B, T) or W < T:
            raise ValueError(f"tree_mask must be ({B}, {T}, W >= {T}), got {tuple(tree_mask.shape)}")
        col = rel + (W - T)  # key index relative to the mask's first column
        idx = col.clamp(0, W - 1)[:, None, :].expand(B, T, L)
        see_new = torch.gather(tree_mask, 2, idx) | (rel[:, None, :] == t)
        in_mask = (col >= 0) & (rel < T)
        before = col < 0
    visible = before[:, None, :] | (in_mask[:, None, :] & see_new)  # [B, T, L]
    return sdpa(q.transpose(1, 2), k, v, attn_mask=visible[:, None]).transpose(1, 2)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
         is_causal: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` over [B, H, T, D] (k and v may have fewer heads: GQA).

    On CUDA it never takes cuDNN's backend: that one builds an execution plan for every new
    shape, about 0.3 s per layer for each prompt length not seen before, which a user's first
    calls (and every replayed request) paid. Flash and memory-efficient attention have no
    per-shape set-up. Flash attention reads grouped key/value heads as they are (GQA); for the
    memory-efficient kernel (a mask, float32) they are repeated.
    """
    gqa = k.shape[1] != q.shape[1]
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=gqa)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if gqa and attn_mask is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in range(8, 257, 8):
        # Repeating the heads cost a copy of K and V per layer, a tenth of a long prefill's GPU time.
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    if gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
