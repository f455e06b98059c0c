"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a static KV cache.

One forward serves every use:
- ``cache=None``: plain causal (or tree-masked) forward over the T tokens, for training
  and as the reference;
- with a cache: prefill (T = prompt length, rows padded on the right), decode (T = 1)
  and tree verify (T = N with a tree mask). New K/V are written to cache indices
  ``starts[b] .. starts[b]+T-1`` of slot ``slots[b]`` and attention reads the prefix
  below ``starts[b]`` plus the new tokens.

The forward returns the hidden state before the final norm (draft layers consume
it); ``logits()`` applies the final norm and the head. q/k/v and gate/up are fused
into one matmul each (the loader concatenates the checkpoint's tensors).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from spectool.kernels import ops
from spectool.kernels.topk import row_topk
from spectool.model.config import ModelConfig
from spectool.model.kv_cache import KVCache
from spectool.model.parallel import TensorParallel, shard_config
from spectool.model.rope import RotaryEmbedding

LayerCache = tuple[torch.Tensor, torch.Tensor] | None  # one layer's (k, v) cache views, or no cache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class Embedding(nn.Embedding):
    """``nn.Embedding`` (same parameter, same state-dict key) whose lookup goes through
    ``ops.embedding``: one Triton row gather on CUDA. Under tensor parallelism the table is this
    rank's vocabulary slice: ids outside it embed as zeros and an all-reduce sums the ranks."""

    tp: TensorParallel | None = None

    def reset_parameters(self) -> None:
        # A table on the meta device (the loader builds there, then assigns the checkpoint's) needs no
        # values, and torch's normal_ on meta imports torch._dynamo: seconds of every load on a small CPU.
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.max_norm is not None:  # renormalises rows in place: torch's path only
            return super().forward(ids)
        if self.tp is None:
            return ops.embedding(ids, self.weight)
        n = self.weight.shape[0]
        local = ids - self.tp.rank * n
        own = (local >= 0) & (local < n)
        out = ops.embedding(local.clamp(0, n - 1), self.weight) * own[..., None].to(self.weight.dtype)
        return self.tp.all_reduce(out)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp  # row-parallel o_proj: the partial outputs are summed over the ranks
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        # Qwen3 normalises each head of q and k before RoPE.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()

    def forward(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerCache,
                slots: torch.Tensor | None, starts: torch.Tensor | None,
                tree_mask: torch.Tensor | None, kv_len: int | None) -> torch.Tensor:
        """Attention from the fused q/k/v projection ``qkv`` [B, T, ...] (the Block computes it,
        fused with the norm before it) to the output projection."""
        B, T, _ = qkv.shape
        q, k, v = qkv.split(self.split, dim=-1)
        q = self.q_norm(q.view(B, T, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(B, T, self.num_kv_heads, self.head_dim))
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        if kv is None:
            q, k = ops.rope(q, k, cos, sin)
            out = ops.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           attn_mask=None if tree_mask is None else tree_mask[:, None],
                           is_causal=tree_mask is None).transpose(1, 2)
        else:
            out = ops.rope_cached_attention(q, k, v, cos, sin, kv[0], kv[1], slots, starts, tree_mask, kv_len)
        out = ops.linear(out.reshape(B, T, -1), self.o_proj.weight)
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp  # row-parallel down_proj
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Down projection of SiLU(gate) * up, from the gate_up projection (the Block computes it,
        fused with the norm before it)."""
        out = ops.silu_mul_linear(gate_up, self.down_proj.weight)
        return out if self.tp is None else self.tp.all_reduce(out)


class Block(nn.Module):
    """One pre-norm decoder layer: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerCache,
                slots: torch.Tensor | None = None, starts: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, kv_len: int | None = None) -> torch.Tensor:
        mlp_out, h = self.forward_residual(x, None, cos, sin, kv, slots, starts, tree_mask, kv_len)
        return h + mlp_out

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                         sin: torch.Tensor, kv: LayerCache, slots: torch.Tensor | None,
                         starts: torch.Tensor | None, tree_mask: torch.Tensor | None,
                         kv_len: int | None, at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block with its residual stream kept apart: the input is ``x + residual`` (``x``
        when residual is None) and the output the pair ``(mlp_out, h)`` whose sum is the
        block's output. The next block adds the pair inside its first norm (one fused
        launch), which saves the separate residual add of every layer.

        ``at`` [B]: the one position of each row whose output is wanted ([B, 1, H] outputs); the
        other positions only write their keys and values to ``kv``, and skip the MLP."""
        qkv, x = _norm_linear(self.input_layernorm, x, residual, self.self_attn.qkv_proj)
        attn = self.self_attn(qkv, cos, sin, kv, slots, starts, tree_mask, kv_len)
        if at is not None:
            attn, x = positions_at(attn, at), positions_at(x, at)
        gate_up, h = _norm_linear(self.post_attention_layernorm, attn, x, self.mlp.gate_up_proj)
        return self.mlp(gate_up), h


def positions_at(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """[B, 1, H]: each row's position ``at[b]`` of ``x`` [B, T, H]."""
    return x.gather(1, at[:, None, None].expand(-1, 1, x.shape[-1]))


def _norm_linear(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
                 linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(norm(s)), s)`` with ``s = x + residual``: one launch at batch 1 on CUDA. A draft
    layer's block may have no input norm (an Identity)."""
    if isinstance(norm, RMSNorm):
        return ops.rms_norm_linear(x, residual, norm.weight, norm.eps, linear.weight, linear.bias)
    s = x if residual is None else x + residual
    return linear(s), s


def check_forward_args(tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache | None,
                       slots: torch.Tensor | None, starts: torch.Tensor | None,
                       tree_mask: torch.Tensor | None, vocab_size: int, max_position: int) -> None:
    """Shape checks (free) and, off CUDA, range checks (cheap there; on CUDA they would sync)."""
    if tokens.dim() != 2 or positions.shape != tokens.shape:
        raise ValueError(f"tokens and positions must both be [B, T]; got {tuple(tokens.shape)} "
                         f"and {tuple(positions.shape)}")
    B, T = tokens.shape
    if tree_mask is not None and tree_mask.shape != (B, T, T):
        raise ValueError(f"tree_mask must be [{B}, {T}, {T}] bool, got {tuple(tree_mask.shape)}")
    if cache is not None and (slots is None or starts is None or slots.shape != (B,) or starts.shape != (B,)):
        raise ValueError(f"a cached forward needs slots and starts of shape [{B}]")
    if tokens.is_cuda:
        return
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}); "
                         f"got {int(tokens.min())}..{int(tokens.max())}")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= max_position):
        raise ValueError(f"positions must be in [0, {max_position}); got up to {int(positions.max())}")
    if cache is not None and B and int((starts + T).max()) > cache.max_seq_len:
        raise ValueError(f"starts + T = {int((starts + T).max())} exceeds the cache's max_seq_len "
                         f"{cache.max_seq_len}")


class Transformer(nn.Module):
    """Token embedding, ``num_layers`` Blocks, final norm and lm_head (tied or not).

    With ``tp`` the modules hold one rank's shard (``spectool.model.parallel``): ``config`` stays
    the whole model's, ``local_config`` is the shard's (its heads size the KV cache).
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.local_config = cfg if tp is None else shard_config(cfg, tp.size)
        local = self.local_config
        self.embed_tokens = Embedding(local.vocab_size, cfg.hidden_size)
        self.embed_tokens.tp = tp
        self.layers = nn.ModuleList(Block(local, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, local.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                slots: torch.Tensor | None = None, starts: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, kv_len: int | None = None,
                aux_layers: tuple[int, ...] | None = None,
                deterministic: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [B, T, H] before the final norm (see the module docstring and INTERNALS.md).

        Args:
            tokens, positions: [B, T] int64 token ids and RoPE positions.
            cache: the static KVCache, or None for a plain forward over the T tokens only.
            slots: [B] cache slot per row; starts: [B] cache length before these tokens.
            tree_mask: [B, T, T] bool, [b, q, k] = new token q sees new token k; None = causal.
            kv_len: host int >= max(starts + T) so attention reads only that much cache;
                None = no host value (attention masks the rest).
            aux_layers: also return the outputs of these layers (0-based), concatenated in the
                order given to [B, T, len * H] (what an EAGLE-3 draft reads): ``(hidden, aux)``.
            deterministic: on CUDA, batch-invariant kernels: a cached token's hidden state is the
                same bits in a prefill, a decode or a tree verify, whatever the batch
                (INTERNALS.md, "Deterministic mode"). No effect on the CPU.
        """
        check_forward_args(tokens, positions, cache, slots, starts, tree_mask,
                           self.config.vocab_size, self.rope.max_position)
        with ops.deterministic() if deterministic else contextlib.nullcontext():
            x, residual = self.embed_tokens(tokens), None
            cos, sin = self.rope(positions, x.dtype)
            aux = {}
            for i, layer in enumerate(self.layers):
                kv = None if cache is None else cache.layer(i)
                x, residual = layer.forward_residual(x, residual, cos, sin, kv, slots, starts, tree_mask, kv_len)
                if aux_layers is not None and i in aux_layers:
                    aux[i] = x + residual
            if aux_layers is None:
                return x + residual
            return x + residual, torch.cat([aux[i] for i in aux_layers], dim=-1)

    def logits(self, hidden: torch.Tensor, deterministic: bool = False, gather: bool = True) -> torch.Tensor:
        """Final norm + lm_head, as float32 [B, T, V] (one launch at batch 1 on CUDA);
        ``deterministic``: each row computed as it is alone, as in ``forward``. Under tensor
        parallelism every rank's vocabulary slice joined, or with ``gather=False`` this rank's
        slice [B, T, V / tp_size] (for ``TensorParallel.argmax_parts`` and ``topk``)."""
        with ops.deterministic() if deterministic else contextlib.nullcontext():
            out = ops.rms_norm_linear(hidden, None, self.norm.weight, self.norm.eps, self.lm_head.weight, None,
                                      torch.float32)[0]
        return out if self.tp is None or not gather else self.tp.gather_vocab(out)

    def head_topk(self, normed: torch.Tensor, k: int,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` most probable tokens of the lm_head over already-normed states (the draft
        layers' shared head): ``(probabilities, ids)`` as ``row_topk(..., softmax=True)``, into
        ``out`` when given. Under tensor parallelism from every rank's slice, without joining
        the logits."""
        logits = ops.linear(normed, self.lm_head.weight)
        if self.tp is None:
            return row_topk(logits, k, softmax=True, out=out)
        probs, ids = self.tp.topk(logits, k, softmax=True)
        if out is None:
            return probs, ids
        out[0].copy_(probs)
        out[1].copy_(ids)
        return out
