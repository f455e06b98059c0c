"""Tree verification (greedy and lossless sampling) and the KV commit that follows it.

Both verifiers are batched torch with a fixed number of kernels whatever the tree
depth and no host sync, so they run inside the decode step (and its CUDA graph).
Neither walks the tree node by node: each works out, for every node at once,
whether it is the child its parent would take ("good"), then accepts the deepest
node whose whole root path is good. In topological order that is the walk "from
the root, take the chosen child, stop when there is none", done in parallel.

Node status: 1 accepted (the accepted path, root included); 2 rejected (a valid
child of an accepted node that the target looked at and turned down: every child
before the one taken, or all of them when none was taken); 0 not visited.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spectool.draft.tree import DraftTree
from spectool.kernels.gather import commit_kv_torch, commit_kv_triton
from spectool.kernels.tree_indices import triton_on_cpu
from spectool.kernels.verify_sampling_chunked import LaunchConfig
from spectool.model.parallel import argmax_of_parts

NOT_VISITED, ACCEPTED, REJECTED = 0, 1, 2


@dataclass
class VerifyResult:
    """What the verifier decided for a batch of trees.

    ``status`` [B, N] int8 (0 not visited, 1 accepted, 2 rejected); ``accept_path``
    [B, max_depth+1] int64 node indices, root first, -1 padded; ``accept_length`` [B]
    int64 (accepted drafts, excluding the root); ``bonus`` [B] int64, the token the
    target adds after the path; ``coins`` [B, N] float32, the uniform coin of each
    visited node (NaN elsewhere, and everywhere when greedy); ``target_argmax`` [B, N]
    int64; ``target_probs`` [B, N, V] float32, the target distribution after
    temperature / top-k / top-p (sampling only; None when greedy). Sampling also gives what
    its trace row needs to re-derive the decision: ``child_probs`` [B, N], p(token | parent)
    of every node (NaN at the root), and ``bonus_cdf`` [B, 2], the residual mass before the
    bonus token and the bonus token's residual probability. ``target_rows`` (the chunked sampling
    verify, which makes no ``target_probs``): each node's distribution as five [B, N] tensors
    (``spectool.kernels.verify_sampling_chunked``), what :func:`target_probs_at` reads.
    """

    status: torch.Tensor
    accept_path: torch.Tensor
    accept_length: torch.Tensor
    bonus: torch.Tensor
    coins: torch.Tensor
    target_argmax: torch.Tensor
    target_probs: torch.Tensor | None = None
    child_probs: torch.Tensor | None = None
    bonus_cdf: torch.Tensor | None = None
    target_rows: tuple[torch.Tensor, ...] | None = None


def _check_logits(tree: DraftTree, logits: torch.Tensor) -> None:
    if logits.dim() != 3 or logits.shape[:2] != tree.tokens.shape:
        raise ValueError(f"logits must be [B, N, V] with [B, N] = {tuple(tree.tokens.shape)}, "
                         f"got {tuple(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if logits.device != tree.device:
        raise ValueError(f"logits are on {logits.device} but the tree is on {tree.device}")


def _accept(tree: DraftTree, good: torch.Tensor):
    """Accept the deepest node whose root path is all ``good`` (ties: lowest index).

    Returns (accepted [B,N] bool, status, accept_path, accept_length, last [B]).
    """
    bs, n = tree.tokens.shape
    idx = torch.arange(n, device=tree.device)
    # A CUDA graph's padding rows hold an all-zero mask, whose nodes have depth -1: read them as 0,
    # so the gathers below stay in range (those rows' results are never used).
    depth = tree.depth.clamp(min=0)
    ok = good | (idx == 0)
    agree = ~(tree.mask & ~ok[:, None, :]).any(-1)
    key = torch.where(agree, depth * n + (n - 1 - idx), -1)
    last = key.argmax(-1)
    accepted = tree.mask[torch.arange(bs, device=tree.device), last]
    accept_length = depth.gather(1, last[:, None])[:, 0]

    width = tree.max_depth + 1
    path = torch.full((bs, width + 1), -1, dtype=torch.long, device=tree.device)
    path.scatter_(1, torch.where(accepted, depth.clamp(max=width - 1), width), idx.expand(bs, n))
    # Child taken at each node's parent: the path entry one level below the parent (-1: none -> n).
    taken = path.gather(1, depth.clamp(max=width))
    taken = torch.where(taken < 0, n, taken)
    parent_accepted = accepted.gather(1, tree.parents.clamp(min=0)) & (idx > 0)
    rejected = tree.valid & parent_accepted & ~accepted & (idx < taken)
    status = (accepted.to(torch.int8) * ACCEPTED) + (rejected.to(torch.int8) * REJECTED)
    return accepted, status, path[:, :width], accept_length, last


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
    """Greedy verify: accept the longest root path whose every token is the target's
    argmax at its parent (with duplicate sibling tokens, the deepest such path, ties to
    the lower node index); the bonus is the argmax at the last accepted node.

    Args:
        tree: the batch of draft trees.
        logits: [B, N, V] target logits at every node.

    On CUDA (and on CPU with ``TRITON_INTERPRET=1``) two Triton launches
    (``spectool.kernels.verify_triton``); elsewhere :func:`verify_greedy_torch`. Both give
    identical results, argmax ties going to the lowest token id.
    """
    if not (logits.is_cuda or triton_on_cpu()):
        return verify_greedy_torch(tree, logits)
    from spectool.kernels.verify_triton import verify_greedy_triton

    _check_logits(tree, logits)
    status, path, length, bonus, argmax = verify_greedy_triton(
        tree.tokens, tree.parents, tree.depth, tree.valid, tree.mask, logits, tree.max_depth + 1)
    coins = torch.full(tree.tokens.shape, math.nan, dtype=torch.float32, device=tree.device)
    return VerifyResult(status=status, accept_path=path, accept_length=length, bonus=bonus, coins=coins,
                        target_argmax=argmax)


def verify_greedy_torch(tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
    """Plain-torch reference of :func:`verify_greedy` (what the CPU runs)."""
    _check_logits(tree, logits)
    return _greedy_from_argmax(tree, logits.argmax(-1))


def verify_greedy_parts(tree: DraftTree, vals: torch.Tensor, ids: torch.Tensor) -> VerifyResult:
    """:func:`verify_greedy` from each node's per-part maxima instead of its logits: ``vals``
    float32 [B, N, P] the largest logit of each part of the vocabulary and ``ids`` int64
    [B, N, P] its token id (``TensorParallel.argmax_parts``: one part per rank of a target split
    by vocabulary). A node's argmax is the id of its largest value, the lowest among equal ones:
    what one argmax over the joined logits gives, without joining them."""
    if vals.shape != ids.shape or vals.dim() != 3 or vals.shape[:2] != tree.tokens.shape:
        raise ValueError(f"vals and ids must both be [B, N, P] with [B, N] = {tuple(tree.tokens.shape)}, "
                         f"got {tuple(vals.shape)} and {tuple(ids.shape)}")
    if vals.is_cuda or triton_on_cpu():
        from spectool.kernels.verify_triton import verify_greedy_parts_triton

        status, path, length, bonus, argmax = verify_greedy_parts_triton(
            tree.tokens, tree.parents, tree.depth, tree.valid, tree.mask, vals, ids, tree.max_depth + 1)
        coins = torch.full(tree.tokens.shape, math.nan, dtype=torch.float32, device=tree.device)
        return VerifyResult(status=status, accept_path=path, accept_length=length, bonus=bonus, coins=coins,
                            target_argmax=argmax)
    return _greedy_from_argmax(tree, argmax_of_parts(vals, ids))


def _greedy_from_argmax(tree: DraftTree, argmax: torch.Tensor) -> VerifyResult:
    """The greedy decision given the target argmax [B, N] at every node."""
    idx = torch.arange(tree.num_nodes, device=tree.device)
    good = tree.valid & (idx > 0) & (tree.tokens == argmax.gather(1, tree.parents.clamp(min=0)))
    _, status, path, length, last = _accept(tree, good)
    coins = torch.full(tree.tokens.shape, math.nan, dtype=torch.float32, device=tree.device)
    return VerifyResult(status=status, accept_path=path, accept_length=length,
                        bonus=argmax.gather(1, last[:, None])[:, 0], coins=coins, target_argmax=argmax)


def _check_sampling(logits: torch.Tensor, temperature: float | torch.Tensor, top_k: int, top_p: float) -> None:
    if isinstance(temperature, torch.Tensor):
        if temperature.shape != logits.shape[:1]:
            raise ValueError(f"a temperature tensor must be [B] = [{logits.shape[0]}], got {tuple(temperature.shape)}")
    elif not (isinstance(temperature, int | float) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0 (use verify_greedy for 0), "
                         f"got {temperature!r}")
    if not (isinstance(top_k, int) and top_k >= 0):
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if not (isinstance(top_p, int | float) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def target_probs(logits: torch.Tensor, temperature: float | torch.Tensor = 1.0, top_k: int = 0,
                 top_p: float = 1.0) -> torch.Tensor:
    """The target distribution sampling draws from: softmax(logits / temperature) cut to
    the ``top_k`` most likely tokens (0 = all; ties at the k-th value are kept) and then
    to the smallest most-likely set whose mass reaches ``top_p``, renormalised (equal values
    ranked by token id, so a tie at that cut keeps its lowest ids). float32.
    ``temperature`` may be a [B] tensor, one per row of logits (the engine's graphed step
    takes it as an input, so one graph serves every temperature; its values are not checked)."""
    _check_sampling(logits, temperature, top_k, top_p)
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.float().view(-1, *([1] * (logits.dim() - 1)))
    x = logits.float() / temperature
    if 0 < top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    probs = torch.softmax(x, dim=-1)
    if top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        # Drop a token when the mass before it already reaches top_p.
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _check_coins(coins: torch.Tensor, bs: int, n: int) -> None:
    if coins.shape != (bs, n):
        raise ValueError(f"coins must be [B, N] = [{bs}, {n}], got {tuple(coins.shape)}")


def _sampled_decision(tree: DraftTree, flat: torch.Tensor, coins: torch.Tensor):
    """The tree decision of :func:`verify_sampling` from ``flat`` [B, N], p(token | parent) of every
    node: (accepted, status, accept_path, accept_length, last, child_of_last [B, N] bool, u [B] float64,
    the coin left for the residual's inverse CDF at the last accepted node)."""
    n = tree.num_nodes
    idx = torch.arange(n, device=tree.device)
    parents = tree.parents
    live = tree.valid & (idx > 0)
    same_parent = (parents[:, :, None] == parents[:, None, :]) & live[:, :, None] & live[:, None, :]
    before = idx[None, :] < idx[:, None]  # [j, k]: k is before j
    duplicate = (same_parent & before & (tree.tokens[:, :, None] == tree.tokens[:, None, :])).any(-1)
    # q[j] = p(token_j | parent_j) for the first occurrence of each child token, else 0.
    q = torch.where(live & ~duplicate, flat, 0.0)
    upto = same_parent & (before | (idx[None, :] == idx[:, None]))
    cum = (upto * q[:, None, :]).sum(-1)
    coin_at_parent = coins.gather(1, parents.clamp(min=0))
    hit = (q > 0) & (coin_at_parent < cum)
    good = hit & ~(same_parent & before & hit[:, None, :]).any(-1)
    accepted, status, path, length, last = _accept(tree, good)

    child_of_last = live & (parents == last[:, None])
    child_mass = torch.where(child_of_last, q, 0.0).sum(-1)
    u = (coins.gather(1, last[:, None])[:, 0] - child_mass).clamp(min=0).double()
    return accepted, status, path, length, last, child_of_last, u


def verify_sampling(
    tree: DraftTree,
    logits: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    coins: torch.Tensor | None = None,
) -> VerifyResult:
    """Target-only tree sampling, exactly lossless (docs/INTERNALS.md, "Definitions").

    Every visited node x draws one coin u ~ U[0, 1). Its valid drafted children, in node
    order and with repeated tokens counted once (first occurrence), partition [0, 1)
    by their target probabilities p(c | x): the child whose interval holds u is
    accepted. When u falls past them all (u >= S, their total mass), the bonus token is
    the inverse CDF of the residual (p with the children's tokens zeroed, in vocabulary
    order) at u - S. So each token t is emitted with probability exactly p(t | x),
    whatever was drafted, and the recorded coins replay the whole decision.

    Args:
        tree: the batch of draft trees.
        logits: [B, N, V] target logits at every node.
        temperature, top_k, top_p: applied to the target distribution first
            (:func:`target_probs`).
        generator: torch.Generator on the logits' device for the coins (None = default).
        coins: [B, N] float32 uniform coins to use instead of drawing them (the engine's graphed
            step makes them with ``spectool.kernels.sampling.sampling_coins``).
    """
    _check_logits(tree, logits)
    probs = target_probs(logits, temperature, top_k, top_p)
    bs, n, vocab = probs.shape
    dev = tree.device
    idx = torch.arange(n, device=dev)
    if coins is None:
        coins = torch.rand(bs, n, generator=generator, device=dev, dtype=torch.float32)
    _check_coins(coins, bs, n)
    flat = probs.view(bs, n * vocab).gather(1, tree.parents.clamp(min=0) * vocab + tree.tokens)

    accepted, status, path, length, last, child_of_last, u = _sampled_decision(tree, flat, coins)

    # Bonus: inverse CDF of the residual at the last accepted node.
    rows = torch.arange(bs, device=dev)
    p_last = probs[rows, last]
    residual = torch.cat([p_last, p_last.new_zeros(bs, 1)], 1)
    residual.scatter_(1, torch.where(child_of_last, tree.tokens, vocab), 0.0)
    residual = residual[:, :vocab]
    cdf = residual.double().cumsum(-1)
    bonus = (cdf <= u[:, None]).sum(-1)
    # Rounding can put u past the residual's total: take its last token; an all-zero residual
    # (children hold all the mass, u landed past it by rounding) falls back to the argmax.
    last_nonzero = vocab - 1 - (residual > 0).flip(-1).int().argmax(-1)
    bonus = torch.where(bonus >= vocab, last_nonzero, bonus)
    bonus = torch.where(residual.sum(-1) > 0, bonus, p_last.argmax(-1))

    bonus_p = residual.gather(1, bonus[:, None])[:, 0].double()
    bonus_cdf = torch.stack([cdf.gather(1, bonus[:, None])[:, 0] - bonus_p, bonus_p], 1).float()
    return VerifyResult(status=status, accept_path=path, accept_length=length, bonus=bonus,
                        coins=torch.where(accepted, coins, math.nan), target_argmax=probs.argmax(-1),
                        target_probs=probs, child_probs=torch.where(idx > 0, flat, math.nan),
                        bonus_cdf=bonus_cdf)


def _kernel_sampling_inputs(tree: DraftTree, logits: torch.Tensor, temperature: float | torch.Tensor, top_k: int,
                            top_p: float, coins: torch.Tensor) -> torch.Tensor:
    """The sampling kernels' inputs checked, and the temperature as the [B] float32 tensor they read."""
    _check_logits(tree, logits)
    _check_sampling(logits, temperature, top_k, top_p)
    bs, n, _ = logits.shape
    _check_coins(coins, bs, n)
    if isinstance(temperature, torch.Tensor):
        return temperature
    return torch.full((bs,), float(temperature), dtype=torch.float32, device=tree.device)


def verify_sampling_fused(
    tree: DraftTree,
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    top_k: int,
    top_p: float,
    coins: torch.Tensor,
) -> VerifyResult:
    """:func:`verify_sampling` without the [B, N, V] probabilities: the same decision from each
    node's maximum, cut and normaliser (``spectool.kernels.verify_sampling_triton``: two or three
    launches; CUDA, or CPU with ``TRITON_INTERPRET=1``), one program per node for the cuts and per request
    for the bonus (the engine runs :func:`verify_sampling_chunked`; benchmarks/tree_kernels.py times both). Its result's
    ``target_probs`` is None; the rest is as :func:`verify_sampling`'s for the same coins (up to
    float32 rounding of the probabilities, and ties at the top-p cut, which it keeps)."""
    from spectool.kernels.verify_sampling_triton import sampling_decide_triton, sampling_rows_triton

    temperature = _kernel_sampling_inputs(tree, logits, temperature, top_k, top_p, coins)
    rows = sampling_rows_triton(logits, temperature, top_k, top_p)
    status, path, length, bonus, bonus_cdf, child_probs, coins_out = sampling_decide_triton(
        logits, temperature, rows, tree.tokens, tree.parents, tree.depth, tree.valid, tree.mask, coins,
        tree.max_depth + 1)
    return VerifyResult(status=status, accept_path=path, accept_length=length, bonus=bonus, coins=coins_out,
                        target_argmax=rows[3], child_probs=child_probs, bonus_cdf=bonus_cdf)

def verify_sampling_chunked(
    tree: DraftTree,
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    top_k: int,
    top_p: float,
    coins: torch.Tensor,
    config: str | LaunchConfig | None = None,
) -> VerifyResult:
    """:func:`verify_sampling` without the [B, N, V] probabilities, every vocabulary pass split over
    (row, chunk) programs (``spectool.kernels.verify_sampling_chunked``; CUDA, or CPU with
    ``TRITON_INTERPRET=1``). The same decision for the same coins, ties at the top-k and top-p cuts
    included (up to float32 rounding of the probabilities); ``target_probs`` is None and
    ``target_rows`` holds each node's distribution instead (:func:`target_probs_at`).
    ``config``: the launch shape, one of ``CONFIGS`` there by name or a ``LaunchConfig`` (None: the
    one ``default_config`` picks for the batch's rows)."""
    from spectool.kernels.verify_sampling_chunked import CONFIGS, default_config, sampling_chunked

    temperature = _kernel_sampling_inputs(tree, logits, temperature, top_k, top_p, coins)
    if isinstance(config, str) and config not in CONFIGS:
        raise ValueError(f"unknown launch config {config!r}; one of {sorted(CONFIGS)}")
    if not isinstance(config, LaunchConfig):
        config = CONFIGS[config or default_config(logits.shape[0] * logits.shape[1])]
    rows, (status, path, length, bonus, bonus_cdf, child_probs, coins_out) = sampling_chunked(
        logits, temperature, top_k, top_p, tree.tokens, tree.parents, tree.depth, tree.valid, tree.mask, coins,
        tree.max_depth + 1, config)
    return VerifyResult(status=status, accept_path=path, accept_length=length, bonus=bonus, coins=coins_out,
                        target_argmax=rows[4], child_probs=child_probs, bonus_cdf=bonus_cdf, target_rows=rows)


def target_probs_at(logits: torch.Tensor, temperature: float | torch.Tensor, rows: tuple[torch.Tensor, ...],
                    ids: torch.Tensor) -> torch.Tensor:
    """:func:`target_probs` gathered at ``ids`` [B, N, K] from a chunked verify's ``target_rows``
    (what a sampling trace records, without the [B, N, V] probabilities). float32."""
    m, z, cut, cut_id, _ = rows
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.float().view(-1, 1, 1)
    x = logits.gather(-1, ids).float() / temperature
    kept = (x > cut[..., None]) | ((x == cut[..., None]) & (ids <= cut_id[..., None]))
    return torch.where(kept, torch.exp(x - m[..., None]) / z[..., None], 0.0)


def commit_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    accept_path: torch.Tensor,
    accept_length: torch.Tensor,
    rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Move the accepted nodes' cache entries to contiguous positions, in place.

    k, v: [L, max_batch, kv_heads, max_seq_len, head_dim] (a target cache, or a draft
    layer's). For request b in cache slot ``slots[b]``, the tree was written at cache
    indices seq_len .. seq_len+N-1 in node order; entry ``seq_len + accept_path[b, j]``
    moves to ``seq_len + j`` for j = 0 .. accept_length[b]. Call it for each cache
    (target, draft layers); the caller then advances seq_len by accept_length + 1.
    No host sync: on CUDA (and on CPU with ``TRITON_INTERPRET=1``) one Triton launch for k
    and v (``spectool.kernels.gather.commit_kv_triton``), elsewhere the torch reference
    (``commit_kv_torch``: one gather and one scatter per cache).

    With ``rows`` it returns what it moved, for the trace: ``(src, dst)`` [B, W] int32, the
    cache indices copied from and to, -1 past each row's accept length (graph safe, no sync).
    """
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 5:
            raise ValueError(f"{name} must be [L, max_batch, kv_heads, max_seq_len, head_dim], "
                             f"got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    bs = slots.shape[0]
    if slots.dim() != 1 or seq_lens.shape != (bs,) or accept_length.shape != (bs,) \
            or accept_path.dim() != 2 or accept_path.shape[0] != bs:
        raise ValueError(f"expected slots [B], seq_lens [B], accept_path [B, D+1], accept_length [B]; "
                         f"got {tuple(slots.shape)}, {tuple(seq_lens.shape)}, "
                         f"{tuple(accept_path.shape)}, {tuple(accept_length.shape)}")
    if (k.is_cuda or triton_on_cpu()) and k.stride(-1) == 1 and v.stride(-1) == 1:
        commit_kv_triton(k, v, slots, seq_lens, accept_path, accept_length)
    else:
        commit_kv_torch(k, v, slots, seq_lens, accept_path, accept_length)
    if rows:
        j = torch.arange(accept_path.shape[1], device=accept_path.device)
        moved = j <= accept_length[:, None]
        base = seq_lens[:, None]
        return (torch.where(moved, base + accept_path, -1).int(), torch.where(moved, base + j, -1).int())
    return None
