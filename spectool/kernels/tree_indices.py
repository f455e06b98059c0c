"""Tree index arrays rebuilt from a tree mask: a Triton kernel and its torch reference.

Given the N x N tree mask of each request (mask[q][k] = node k is q or an ancestor
of q, nodes in topological order) and the cache length ``seq_lens``, compute

* ``positions[b, i]``             = seq_lens[b] + depth(i), depth(i) = popcount(row i) - 1;
* ``retrieve_index[b, i]``        = b * N + i;
* ``retrieve_next_token[b, i]``   = smallest child index of i, or -1;
* ``retrieve_next_sibling[b, i]`` = smallest j > i with the same parent as i, or -1.

In topological order the parent of i is its ancestor with the largest index (every
other ancestor is an ancestor of the parent, so it comes earlier). Both versions use
that; neither checks the mask (``spectool.draft.tree.validate_tree`` does). The depth
is not returned separately: it is ``positions - seq_lens[:, None]``.

The Triton kernel runs one program per request with the whole mask tile in
registers (N <= 128 in practice): one coalesced load of the tile gives every node's
parent, and with the parent vector broadcast along both tile axes children and
siblings fall out of one compare-and-min each. All outputs are int64.
"""

from __future__ import annotations

import os

import torch

from spectool.kernels.triton_import import tl, triton

IndexArrays = tuple[torch.Tensor, ...]  # the four index arrays (and parents when asked)


def _check(mask: torch.Tensor, seq_lens: torch.Tensor) -> None:
    if mask.dim() != 3 or mask.shape[1] != mask.shape[2] or mask.shape[1] == 0:
        raise ValueError(f"mask must be [B, N, N] with N >= 1, got shape {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be torch.bool, got {mask.dtype}")
    if seq_lens.shape != (mask.shape[0],):
        raise ValueError(f"seq_lens must be [B] = [{mask.shape[0]}], got shape {tuple(seq_lens.shape)}")
    if seq_lens.dtype.is_floating_point or seq_lens.dtype == torch.bool:
        raise ValueError(f"seq_lens must be an integer tensor, got {seq_lens.dtype}")
    if seq_lens.device != mask.device:
        raise ValueError(f"seq_lens is on {seq_lens.device} but mask is on {mask.device}")


def mask_to_parents(mask: torch.Tensor) -> torch.Tensor:
    """Parents [B, N] int64 (-1 for the root) of topologically ordered trees given by their
    masks [B, N, N]: the parent of a node is its ancestor with the largest index."""
    n = mask.shape[-1]
    idx = torch.arange(n, device=mask.device)
    strict = mask & (idx[None, :] < idx[:, None])
    return torch.where(strict, idx, -1).amax(-1)


def next_token_and_sibling(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(retrieve_next_token, retrieve_next_sibling)`` [B, N] int64 from parents [B, N]
    (-1 for the root): the smallest child of each node and the next child of its parent."""
    n = parents.shape[-1]
    idx = torch.arange(n, device=parents.device)
    # is_child[b, i, j]: j is a child of i.
    is_child = parents[:, None, :] == idx[None, :, None]
    next_token = torch.where(is_child, idx, n).amin(-1)
    # Same parent and after i; the root (parent -1) has no siblings.
    same_parent = (parents[:, None, :] == parents[:, :, None]) & (parents[:, :, None] >= 0)
    next_sibling = torch.where(same_parent & (idx[None, :] > idx[:, None]), idx, n).amin(-1)
    return torch.where(next_token == n, -1, next_token), torch.where(next_sibling == n, -1, next_sibling)


def reconstruct_indices_torch(mask: torch.Tensor, seq_lens: torch.Tensor,
                              with_parents: bool = False) -> IndexArrays:
    """Plain-torch reference of :func:`reconstruct_indices_from_tree_mask`."""
    _check(mask, seq_lens)
    bs, n, _ = mask.shape
    dev = mask.device
    depth = mask.sum(-1) - 1
    positions = seq_lens.to(torch.int64)[:, None] + depth
    retrieve_index = torch.arange(bs * n, device=dev).view(bs, n)

    parents = mask_to_parents(mask)
    next_token, next_sibling = next_token_and_sibling(parents)
    out = positions, retrieve_index, next_token, next_sibling
    return (*out, parents) if with_parents else out


@triton.jit
def _load_tile(Mask, b, N, rows, cols):
    """Request b's N x N mask as a [BLOCK, BLOCK] bool tile (False outside N x N)."""
    inside = (rows[:, None] < N) & (cols[None, :] < N)
    return tl.load(Mask + b * N * N + rows[:, None] * N + cols[None, :], mask=inside, other=0) != 0


@triton.jit
def _child_and_sibling(parent_row, rows, cols, N):
    """([i, j] = j is a child of i, [i, j] = j is a later sibling of i) from the parent vector,
    laid along both tile axes (Triton moves it between layouts), so the tile is never transposed."""
    is_child = (parent_row[None, :] == rows[:, None]) & (cols[None, :] < N)
    sib = (parent_row[None, :] == parent_row[:, None]) & (cols[None, :] > rows[:, None])
    sib = sib & (cols[None, :] < N) & (parent_row[:, None] >= 0)
    return is_child, sib


@triton.jit
def _store_indices(Out, SeqLens, STRIDE, b, N, rows, depth, parent_row, next_token, next_sibling, big):
    """Request b's five [N] rows of Out ([5, B, N], STRIDE = B * N); ``big`` marks no child / sibling."""
    out = rows < N
    seq_len = tl.load(SeqLens + b).to(tl.int64)
    offs = b * N + rows
    tl.store(Out + offs, seq_len + depth.to(tl.int64), mask=out)
    tl.store(Out + STRIDE + offs, offs, mask=out)
    tl.store(Out + 2 * STRIDE + offs, tl.where(next_token == big, -1, next_token).to(tl.int64), mask=out)
    tl.store(Out + 3 * STRIDE + offs, tl.where(next_sibling == big, -1, next_sibling).to(tl.int64), mask=out)
    tl.store(Out + 4 * STRIDE + offs, parent_row.to(tl.int64), mask=out)


@triton.jit
def _depth_and_parent(m, rows, cols):
    """Each node's depth (its ancestors, itself excluded) and parent (its largest strict ancestor,
    -1 for the root) from its row of the mask tile."""
    depth = tl.sum(m.to(tl.int32), axis=1) - 1
    parent_row = tl.max(tl.where(m & (cols[None, :] < rows[:, None]), cols[None, :], -1), axis=1)
    return depth, parent_row


@triton.jit
def _request_indices(Mask, SeqLens, Out, N, STRIDE, b, BLOCK: tl.constexpr):
    """Request b's index arrays, from its mask tile to its five rows of Out."""
    rows = tl.arange(0, BLOCK)  # node i along axis 0
    cols = tl.arange(0, BLOCK)  # node k / j along axis 1
    depth, parent_row = _depth_and_parent(_load_tile(Mask, b, N, rows, cols), rows, cols)

    big = BLOCK + N
    is_child, sib = _child_and_sibling(parent_row, rows, cols, N)
    next_token = tl.min(tl.where(is_child, cols[None, :], big), axis=1)
    next_sibling = tl.min(tl.where(sib, cols[None, :], big), axis=1)
    _store_indices(Out, SeqLens, STRIDE, b, N, rows, depth, parent_row, next_token, next_sibling, big)


@triton.jit
def _tree_indices_kernel(Mask, SeqLens, Out, N, STRIDE, BLOCK: tl.constexpr):
    # Out is [5, B, N]: positions, retrieve_index, next token, next sibling, parents (STRIDE = B * N).
    _request_indices(Mask, SeqLens, Out, N, STRIDE, tl.program_id(0).to(tl.int64), BLOCK)


def reconstruct_indices_triton(mask: torch.Tensor, seq_lens: torch.Tensor,
                               with_parents: bool = False) -> IndexArrays:
    """Triton version of :func:`reconstruct_indices_from_tree_mask` (CUDA, or CPU under
    ``TRITON_INTERPRET=1``). One launch, no host sync, so it can sit in a CUDA graph."""
    _check(mask, seq_lens)
    bs, n, _ = mask.shape
    # One output buffer and few arguments: at small sizes the launch's host cost is most of a call.
    out = torch.empty(5, bs, n, dtype=torch.int64, device=mask.device)
    if bs > 0:
        block = max(16, triton.next_power_of_2(n))
        _tree_indices_kernel[(bs,)](mask.contiguous(), seq_lens.contiguous(), out, n, bs * n, BLOCK=block,
                                    num_warps=4 if block <= 64 else 8)
    return tuple(out.unbind(0)) if with_parents else tuple(out[:4].unbind(0))


def triton_on_cpu() -> bool:
    """True when Triton kernels should run on CPU tensors (``TRITON_INTERPRET=1``)."""
    # Read per call: the interpreter only works when the variable was set before triton loaded,
    # but reading it late does no harm and lets one process opt in from its environment.
    return os.environ.get("TRITON_INTERPRET") == "1"


def reconstruct_indices_from_tree_mask(mask: torch.Tensor, seq_lens: torch.Tensor,
                                       with_parents: bool = False) -> IndexArrays:
    """Rebuild a batch's tree index arrays from its tree masks.

    Args:
        mask: [B, N, N] bool, mask[b, q, k] = node k is q or an ancestor of q; nodes in
            topological order (node 0 the root).
        seq_lens: [B] integer, tokens in the cache before the tree.

        with_parents: also return each node's parent (-1 for the root), the kernel finds
            it anyway.

    Returns:
        ``(positions, retrieve_index, retrieve_next_token, retrieve_next_sibling)``, each
        [B, N] int64 on the mask's device (see the module docstring for their meaning),
        then ``parents`` when asked.

    Triton on CUDA (and on CPU when ``TRITON_INTERPRET=1``), the torch reference on CPU
    otherwise; both give identical results on valid trees.
    """
    if mask.is_cuda or triton_on_cpu():
        return reconstruct_indices_triton(mask, seq_lens, with_parents)
    return reconstruct_indices_torch(mask, seq_lens, with_parents)
