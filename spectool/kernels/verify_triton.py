"""Greedy tree verify in two Triton launches (the torch reference is ``spectool.verify``).

At a 128k vocabulary the torch version spends its time in the argmax over [B, N, V]
logits and in the twenty-odd small kernels of the tree decision. Here:

1. ``_argmax_chunks_kernel``: one program per (node, vocabulary chunk) finds the chunk's
   maximum and its first index, so the whole GPU reads the logits at once.
2. ``_greedy_decide_kernel``: one program per request combines the chunks into each
   node's argmax and makes the whole decision with the request's tree in registers,
   as [N, N] tiles: a node is "good" when its token is the argmax at its parent; the
   accepted node is the deepest whose ancestors are all good (ties: lowest index); its
   mask row is the accepted set; the accept path, statuses and bonus follow.

Gathers by index (the argmax at a node's parent, the path entry at a node's depth) are
one-hot reductions over a tile axis. NaN logits count as the largest value, as in
``torch.argmax``. No host sync: the engine captures both launches in its CUDA graph.
"""

from __future__ import annotations

import torch

from spectool.kernels.triton_import import tl, triton

CHUNK = 4096  # vocabulary entries per argmax program


@triton.jit
def _argmax_chunks_kernel(Logits, Vals, Idx, V, C, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(Logits + row * V + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    best, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(Vals + row * C + c, best)
    tl.store(Idx + row * C + c, (c * CHUNK + i).to(tl.int64))


@triton.jit
def _greedy_decide_kernel(
    Vals, Idx, Tokens, Parents, Depth, Valid, Mask,
    Status, Path, AcceptLength, Bonus, Argmax,
    N, C, W, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK)
    in_r = rows < N
    in_c = cols < N

    # Each node's argmax: the best chunk, ties to the lower chunk (= the lower token id).
    ch = tl.arange(0, BLOCK_C)
    live = in_r[:, None] & (ch[None, :] < C)
    part = (b * N + rows[:, None]) * C + ch[None, :]
    vals = tl.load(Vals + part, mask=live, other=-float("inf"))
    idx = tl.load(Idx + part, mask=live, other=0)
    best = tl.max(vals, axis=1)
    argmax = tl.min(tl.where(live & (vals == best[:, None]), idx, 1 << 62), axis=1)  # along rows
    tl.store(Argmax + b * N + rows, argmax, mask=in_r)

    node = b * N + cols
    tokens = tl.load(Tokens + node, mask=in_c, other=-1)
    parents = tl.load(Parents + node, mask=in_c, other=-1)
    depth_c = tl.load(Depth + node, mask=in_c, other=0)
    valid = tl.load(Valid + node, mask=in_c, other=0) != 0
    depth_r = tl.load(Depth + b * N + rows, mask=in_r, other=0)

    # is_parent[k, j]: node k (axis 0) is the parent of node j (axis 1).
    is_parent = rows[:, None] == parents[None, :]
    at_parent = tl.sum(tl.where(is_parent, argmax[:, None], 0), axis=0)
    good = valid & (cols > 0) & (tokens == at_parent)
    ok = good | (cols == 0)

    # m[j, k]: node k is j or an ancestor of j. Node j agrees when all of them are ok.
    tile = Mask + b * N * N
    m = tl.load(tile + rows[:, None] * N + cols[None, :], mask=in_r[:, None] & in_c[None, :], other=0) != 0
    agree = tl.sum((m & ~ok[None, :]).to(tl.int32), axis=1) == 0
    key = tl.where(agree & in_r, depth_r * N + (N - 1 - rows), -1)
    top = tl.max(key, axis=0)  # >= 0: the root always agrees
    last = N - 1 - top % N
    tl.store(AcceptLength + b, top // N)
    tl.store(Bonus + b, tl.sum(tl.where(rows == last, argmax, 0), axis=0))

    accepted_c = tl.load(tile + last * N + cols, mask=in_c, other=0) != 0
    accepted_r = tl.load(tile + last * N + rows, mask=in_r, other=0) != 0
    # path[d] (d along axis 0): the accepted node at depth d, or -1.
    path = tl.max(tl.where(accepted_c[None, :] & (depth_c[None, :] == rows[:, None]), cols[None, :], -1), axis=1)
    tl.store(Path + b * W + rows, path.to(tl.int64), mask=rows < W)

    # Rejected: a valid child of an accepted node, before the child taken there (all when none).
    taken = tl.max(tl.where(rows[:, None] == depth_c[None, :], path[:, None], -1), axis=0)
    taken = tl.where(taken < 0, N, taken)
    parent_accepted = tl.sum((is_parent & accepted_r[:, None]).to(tl.int32), axis=0) > 0
    rejected = valid & parent_accepted & ~accepted_c & (cols < taken) & (cols > 0)
    status = accepted_c.to(tl.int8) + 2 * rejected.to(tl.int8)
    tl.store(Status + node, status, mask=in_c)


def verify_greedy_triton(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, valid: torch.Tensor,
                         mask: torch.Tensor, logits: torch.Tensor, width: int):
    """Greedy verify of [B, N] trees against logits [B, N, V] (float; contiguous rows).

    Returns ``(status int8 [B, N], accept_path int64 [B, width], accept_length int64 [B],
    bonus int64 [B], target_argmax int64 [B, N])`` exactly as ``spectool.verify.verify_greedy``.
    """
    bs, n, vocab = logits.shape
    logits = logits.contiguous()
    chunk = min(CHUNK, triton.next_power_of_2(vocab))
    chunks = triton.cdiv(vocab, chunk)
    vals = torch.empty(bs, n, chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(bs, n, chunks, dtype=torch.int64, device=logits.device)
    if bs:
        _argmax_chunks_kernel[(bs * n, chunks)](logits, vals, idx, vocab, chunks, CHUNK=chunk)
    return verify_greedy_parts_triton(tokens, parents, depth, valid, mask, vals, idx, width)


def verify_greedy_parts_triton(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                               valid: torch.Tensor, mask: torch.Tensor, vals: torch.Tensor, idx: torch.Tensor,
                               width: int):
    """The decision launch alone, from each node's per-part maxima ``vals`` float32 [B, N, P] and
    their token ids ``idx`` int64 [B, N, P] (vocabulary chunks, or the ranks of a target split by
    vocabulary); the same outputs as :func:`verify_greedy_triton`."""
    bs, n, parts = vals.shape
    dev = vals.device
    status = torch.empty(bs, n, dtype=torch.int8, device=dev)
    path = torch.empty(bs, width, dtype=torch.int64, device=dev)
    length = torch.empty(bs, dtype=torch.int64, device=dev)
    bonus = torch.empty(bs, dtype=torch.int64, device=dev)
    argmax = torch.empty(bs, n, dtype=torch.int64, device=dev)
    if bs == 0:
        return status, path, length, bonus, argmax
    block = max(16, triton.next_power_of_2(n))
    _greedy_decide_kernel[(bs,)](
        vals.contiguous(), idx.contiguous(), tokens.contiguous(), parents.contiguous(), depth.contiguous(),
        valid.contiguous().view(torch.uint8), mask.contiguous().view(torch.uint8),
        status, path, length, bonus, argmax, n, parts, width,
        BLOCK=block, BLOCK_C=max(2, triton.next_power_of_2(parts)), num_warps=4 if block <= 64 else 8)
    return status, path, length, bonus, argmax
