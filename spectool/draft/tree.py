"""Draft trees for a batch: the DraftTree, parents <-> mask, validation, EAGLE-2 building.

A draft tree has N nodes per request in topological order (a parent before its
children); node 0 is the root (the last verified token, not yet in the cache).
Padding nodes (``valid=False``) fill a request's tree up to N: they hang off the
root after all valid nodes and are never accepted.

Everything here is batched torch on one device and, except for validation (which
reads the tree on the host to name the fault), free of host syncs, so drafters can
call it on the GPU inside the draft loop.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spectool.kernels.topk import row_topk
from spectool.kernels.tree_indices import (
    mask_to_parents,
    next_token_and_sibling,
    reconstruct_indices_from_tree_mask,
)

__all__ = [
    "DraftTree",
    "MaskTree",
    "TREE_TENSORS",
    "TreeError",
    "build_eagle_tree",
    "chain_tree",
    "eagle_tree_from_candidates",
    "mask_to_parents",
    "parents_to_mask",
    "validate_tree",
]


class TreeError(ValueError):
    """An invalid draft tree; the message names the first faulty node ("node 3: ...")."""


def parents_to_mask(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """Tree masks [B, N, N] bool from parents [B, N] (-1 for the root):
    mask[b, q, k] = node k is q itself or an ancestor of q.

    Expects a valid tree (see :func:`validate_tree`); out-of-range parents are ignored.
    ``max_depth`` (a bound on every node's depth; default N-1) sets how many matmuls run.
    Ancestry is the transitive closure of the parent relation: entry (q, k) of
    (I + P)^L counts the ways to climb from q to k in L steps, so it is positive exactly
    when k is q or an ancestor at most L levels up. Squaring ceil(log2 depth) times gives
    a fixed number of batched matmuls and no per-node loop.
    """
    if parents.dim() != 2:
        raise ValueError(f"parents must be [B, N], got shape {tuple(parents.shape)}")
    n = parents.shape[1]
    idx, eye = _index_constants(n, parents.device)
    reach = eye + (parents[:, :, None] == idx)  # I + P, float32
    bound = n - 1 if max_depth is None else min(max_depth, n - 1)
    for i in range(math.ceil(math.log2(bound)) if bound > 1 else 0):
        reach = torch.bmm(reach, reach)
        # Counts up to C(32, 16) ~ 6e8 stay far inside float32 (and only their sign matters, so
        # rounding, TF32 included, does no harm); deeper trees go back to 0/1 every squaring.
        if i >= 4:
            reach = (reach > 0).float()
    return reach > 0


_INDEX_CONSTANTS: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _index_constants(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(arange(n), float32 identity [n, n]) on ``device``, made once: inside a drafter's CUDA
    graph every constant built per call would be one more kernel."""
    key = (n, device)
    if key not in _INDEX_CONSTANTS:
        _INDEX_CONSTANTS[key] = (torch.arange(n, device=device), torch.eye(n, device=device))
    return _INDEX_CONSTANTS[key]


def _fault(bad: torch.Tensor, order: int, message) -> tuple[int, int, int, str] | None:
    """The first (row, node) where ``bad`` [B, N] holds, with its message, or None."""
    hits = bad.nonzero()
    if hits.numel() == 0:
        return None
    b, i = (int(x) for x in hits[0])
    return b, i, order, message(b, i)


def validate_tree(
    parents: torch.Tensor | None = None,
    *,
    mask: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
) -> None:
    """Raise :class:`TreeError` naming the first fault of a batch of trees, else return.

    Give either ``parents`` [B, N] or ``mask`` [B, N, N] (an unbatched [N] / [N, N] is
    accepted too). Faults, checked for every node: a missing or second root, a parent
    that is not an earlier node (not topological), a mask row that does not see itself
    or the root, sees a later node, or is not its parent's row plus itself (a node with
    two parents / a mask not closed under ancestors); with ``valid``, a padding root, a
    padding node before a valid one or not hanging off the root; with ``scores``, a NaN
    score on a valid node. The first fault is the one with the smallest (batch row,
    node). Reads the tensors on the host (one sync).
    """
    if (parents is None) == (mask is None):
        raise TreeError("give exactly one of parents or mask")
    if parents is not None:
        parents = parents.detach().cpu()
        if parents.dim() == 1:
            parents = parents[None]
        if parents.dim() != 2 or parents.shape[1] == 0:
            raise TreeError(f"parents must be [B, N] with N >= 1, got shape {tuple(parents.shape)}")
        if parents.dtype.is_floating_point or parents.dtype == torch.bool:
            raise TreeError(f"parents must be integers, got {parents.dtype}")
        parents = parents.long()
        bs, n = parents.shape
    else:
        mask = mask.detach().cpu()
        if mask.dim() == 2:
            mask = mask[None]
        if mask.dim() != 3 or mask.shape[1] != mask.shape[2] or mask.shape[1] == 0:
            raise TreeError(f"mask must be [B, N, N] with N >= 1, got shape {tuple(mask.shape)}")
        if mask.dtype != torch.bool:
            raise TreeError(f"mask must be torch.bool, got {mask.dtype}")
        bs, n = mask.shape[:2]
    suffix = (lambda b: f" (batch row {b})") if bs > 1 else (lambda b: "")
    idx = torch.arange(n)
    faults = []
    if parents is not None:
        faults += [
            _fault((idx == 0) & (parents != -1), 0,
                   lambda b, i: f"node 0: the root must have parent -1, got {int(parents[b, 0])} "
                                f"(missing root){suffix(b)}"),
            _fault((idx > 0) & (parents == -1), 0,
                   lambda b, i: f"node {i}: parent -1 makes it a second root; only node 0 is the "
                                f"root{suffix(b)}"),
            _fault((idx > 0) & ((parents >= idx) | (parents < -1)), 0,
                   lambda b, i: f"node {i}: parent {int(parents[b, i])} is not an earlier node "
                                f"(not topological){suffix(b)}"),
        ]
    else:
        diag = mask.diagonal(dim1=1, dim2=2)
        later = (mask & (idx[None, :] > idx[:, None])).any(-1)
        parents = mask_to_parents(mask)
        # Expected row i = row of its parent plus i itself (the root's row is just itself).
        expect = mask[torch.arange(bs)[:, None], parents.clamp(min=0)] & (parents[..., None] >= 0)
        expect = expect | torch.eye(n, dtype=torch.bool)
        extra = (mask & ~expect).any(-1)
        missing = (expect & ~mask).any(-1)

        def first_col(b: int, i: int, bad: torch.Tensor) -> int:
            return int(bad[b, i].nonzero()[0])

        faults += [
            _fault(~diag, 0, lambda b, i: f"node {i}: mask[{i}][{i}] is False; a node must see "
                                          f"itself{suffix(b)}"),
            _fault(later, 0, lambda b, i: f"node {i}: sees later node {first_col(b, i, mask & (idx > i))} "
                                          f"(not topological){suffix(b)}"),
            _fault((idx > 0) & ~mask[:, :, 0], 1,
                   lambda b, i: f"node {i}: does not see the root (missing root){suffix(b)}"),
            _fault((idx > 0) & extra, 2,
                   lambda b, i: f"node {i}: sees node {first_col(b, i, mask & ~expect)}, which is not "
                                f"an ancestor of its parent {int(parents[b, i])} (a node with two "
                                f"parents){suffix(b)}"),
            _fault((idx > 0) & missing, 2,
                   lambda b, i: f"node {i}: does not see node {first_col(b, i, expect & ~mask)}, an "
                                f"ancestor of its parent {int(parents[b, i])} (mask not closed under "
                                f"ancestors){suffix(b)}"),
        ]
    if valid is not None:
        valid = valid.detach().cpu().reshape(bs, -1) if valid.numel() == bs * n else valid
        if valid.shape != (bs, n) or valid.dtype != torch.bool:
            raise TreeError(f"valid must be bool [B, N] = [{bs}, {n}], got {valid.dtype} "
                            f"{tuple(valid.shape)}")
        # A padding node followed (anywhere later) by a valid node.
        valid_after = valid.flip(-1).cummax(-1).values.flip(-1).roll(-1, -1)
        valid_after[:, -1] = False
        faults += [
            _fault((idx == 0) & ~valid, 3, lambda b, i: f"node 0: the root cannot be padding{suffix(b)}"),
            _fault((idx > 0) & ~valid & valid_after, 3,
                   lambda b, i: f"node {i}: padding node in the middle; valid nodes come after "
                                f"it{suffix(b)}"),
            _fault((idx > 0) & ~valid & (parents != 0), 3,
                   lambda b, i: f"node {i}: padding node must hang off the root, its parent is "
                                f"{int(parents[b, i])}{suffix(b)}"),
        ]
    if scores is not None:
        scores = scores.detach().cpu()
        if scores.numel() == bs * n:
            scores = scores.reshape(bs, n)
        if scores.shape != (bs, n):
            raise TreeError(f"scores must be [B, N] = [{bs}, {n}], got shape {tuple(scores.shape)}")
        live = valid if valid is not None else torch.ones(bs, n, dtype=torch.bool)
        faults.append(_fault(live & scores.isnan(), 4, lambda b, i: f"node {i}: NaN score{suffix(b)}"))
    faults = [f for f in faults if f is not None]
    if faults:
        raise TreeError(min(faults)[3])


@dataclass
class DraftTree:
    """A batch of draft trees, all [B, N] (mask [B, N, N]) torch tensors on one device.

    ``tokens`` int64 (node 0 = root), ``parents`` int64 (-1 for the root), ``depth``
    int64, ``scores`` float32 (the drafter's score; see the drafter), ``valid`` bool
    (False for padding), ``mask`` bool, ``positions`` int64 = seq_len + depth,
    ``retrieve_index`` = b*N + i, ``retrieve_next_token`` = smallest child or -1,
    ``retrieve_next_sibling`` = next child of the parent or -1 (padding nodes included:
    they are the root's last children), ``seq_lens`` [B] int64, and ``max_depth``, a
    host int >= every node's depth that sizes the verifier's accept path.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    scores: torch.Tensor
    valid: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    retrieve_index: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor
    seq_lens: torch.Tensor
    max_depth: int

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor field, in ``TREE_TENSORS`` order (what a graphed step returns)."""
        return tuple(getattr(self, name) for name in TREE_TENSORS)

    def as_inputs(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name (the engine's greedy step takes them as keyword inputs)."""
        return dict(zip(TREE_TENSORS, self.tensors()))

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor], max_depth: int) -> DraftTree:
        """The tree of :meth:`tensors`' output (e.g. a graph's static outputs)."""
        return cls(**dict(zip(TREE_TENSORS, tensors)), max_depth=max_depth)

    @classmethod
    def from_parents(
        cls,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        scores: torch.Tensor,
        seq_lens: torch.Tensor,
        valid: torch.Tensor | None = None,
        *,
        max_depth: int | None = None,
        check: bool = True,
    ) -> DraftTree:
        """Build from parents [B, N]. ``check`` validates the tree (one host sync; drafters
        that build valid trees by construction pass False); ``max_depth`` None reads the
        deepest node on the host (one sync)."""
        valid = _common_checks(tokens, scores, seq_lens, valid, parents.shape)
        if check:
            validate_tree(parents, valid=valid, scores=scores)
        parents = parents.long()
        mask = parents_to_mask(parents)
        depth = mask.sum(-1) - 1
        seq_lens = seq_lens.long()
        bs, n = tokens.shape
        next_token, next_sibling = next_token_and_sibling(parents)
        return cls(
            tokens=tokens.long(), parents=parents, depth=depth, scores=scores.float(), valid=valid,
            mask=mask, positions=seq_lens[:, None] + depth,
            retrieve_index=torch.arange(bs * n, device=tokens.device).view(bs, n),
            retrieve_next_token=next_token, retrieve_next_sibling=next_sibling, seq_lens=seq_lens,
            max_depth=int(depth.max()) if max_depth is None else max_depth,
        )

    @classmethod
    def from_mask(
        cls,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        scores: torch.Tensor,
        seq_lens: torch.Tensor,
        valid: torch.Tensor | None = None,
        *,
        max_depth: int | None = None,
        check: bool = True,
    ) -> DraftTree:
        """Build from tree masks [B, N, N] (e.g. the n-gram corpus); the index arrays come
        from :func:`reconstruct_indices_from_tree_mask`. Options as in :meth:`from_parents`."""
        if mask.dim() != 3:
            raise ValueError(f"mask must be [B, N, N], got shape {tuple(mask.shape)}")
        valid = _common_checks(tokens, scores, seq_lens, valid, mask.shape[:2])
        if check:
            validate_tree(mask=mask, valid=valid, scores=scores)
        seq_lens = seq_lens.long()
        positions, retrieve_index, next_token, next_sibling, parents = reconstruct_indices_from_tree_mask(
            mask, seq_lens, with_parents=True)
        depth = positions - seq_lens[:, None]
        return cls(
            tokens=tokens.long(), parents=parents, depth=depth, scores=scores.float(),
            valid=valid, mask=mask, positions=positions, retrieve_index=retrieve_index,
            retrieve_next_token=next_token, retrieve_next_sibling=next_sibling, seq_lens=seq_lens,
            max_depth=int(depth.max()) if max_depth is None else max_depth,
        )


# The tensor fields of a DraftTree (every field but max_depth), in declaration order.
TREE_TENSORS = tuple(f.name for f in dataclasses.fields(DraftTree) if f.name != "max_depth")


@dataclass
class MaskTree:
    """A draft tree known by its tokens and mask alone (the n-gram trie's output), valid by
    construction; :meth:`build` completes it with :meth:`DraftTree.from_mask`.

    The engine builds it inside its greedy verify step, so on CUDA the index kernel and the
    few ops around it are part of that step's graph: eagerly their launches cost the host
    more than the whole GPU work of a small target's step.
    """

    tokens: torch.Tensor    # [B, N]
    scores: torch.Tensor    # [B, N]
    mask: torch.Tensor      # [B, N, N] bool
    valid: torch.Tensor     # [B, N] bool
    seq_lens: torch.Tensor  # [B]
    max_depth: int

    def as_inputs(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name (the greedy step's inputs)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "max_depth"}

    def build(self) -> DraftTree:
        return DraftTree.from_mask(self.tokens, self.mask, self.scores, self.seq_lens, self.valid,
                                   max_depth=self.max_depth, check=False)


_CHAIN_SHAPES: dict[tuple[int, int, torch.device], dict[str, torch.Tensor]] = {}


def chain_tree(tokens: torch.Tensor, scores: torch.Tensor, seq_lens: torch.Tensor) -> DraftTree:
    """A batch of chains (node i's parent is i - 1): plain decoding's one-node tree and
    multi-layer EAGLE's draft. Only tokens, scores and positions change between
    iterations, so the structure's arrays are made once per shape and device: building
    them every iteration cost a few dozen small launches of host time."""
    b, n = tokens.shape
    key = (b, n, tokens.device)
    if key not in _CHAIN_SHAPES:
        dev = tokens.device
        parents = torch.arange(-1, n - 1, device=dev).expand(b, n).contiguous()
        next_token = torch.where(parents + 2 < n, parents + 2, -1)
        _CHAIN_SHAPES[key] = dict(
            parents=parents, depth=torch.arange(n, device=dev).expand(b, n).contiguous(),
            valid=_all_valid(b, n, dev), mask=parents_to_mask(parents),
            retrieve_index=torch.arange(b * n, device=dev).view(b, n), retrieve_next_token=next_token,
            retrieve_next_sibling=torch.full((b, n), -1, dtype=torch.long, device=dev))
    shapes = _CHAIN_SHAPES[key]
    seq_lens = seq_lens.long()
    return DraftTree(tokens=tokens.long(), scores=scores.float(), positions=seq_lens[:, None] + shapes["depth"],
                     seq_lens=seq_lens, max_depth=n - 1, **shapes)


_ALL_VALID: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _all_valid(b: int, n: int, device: torch.device) -> torch.Tensor:
    """A shared all-True ``valid`` [b, n] (drafters' trees without padding; never written to)."""
    key = (b, n, device)
    if key not in _ALL_VALID:
        _ALL_VALID[key] = torch.ones(b, n, dtype=torch.bool, device=device)
    return _ALL_VALID[key]


def _common_checks(tokens, scores, seq_lens, valid, shape) -> torch.Tensor:
    """Shape/device checks shared by the constructors; returns ``valid`` (all True if None)."""
    shape = tuple(shape)
    if len(shape) != 2 or shape[1] == 0:
        raise ValueError(f"trees must be [B, N] with N >= 1, got shape {shape}")
    for name, t in (("tokens", tokens), ("scores", scores)):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if tuple(seq_lens.shape) != shape[:1]:
        raise ValueError(f"seq_lens must have shape {shape[:1]}, got {tuple(seq_lens.shape)}")
    if valid is None:
        valid = torch.ones(shape, dtype=torch.bool, device=tokens.device)
    elif tuple(valid.shape) != shape or valid.dtype != torch.bool:
        raise ValueError(f"valid must be bool of shape {shape}, got {valid.dtype} {tuple(valid.shape)}")
    devices = {t.device for t in (tokens, scores, seq_lens, valid)}
    if len(devices) > 1:
        raise ValueError(f"tree tensors must be on one device, got {sorted(map(str, devices))}")
    return valid


def build_eagle_tree(
    root_tokens: torch.Tensor,
    step_tokens: Sequence[torch.Tensor],
    step_scores: Sequence[torch.Tensor],
    step_parents: Sequence[torch.Tensor | None],
    num_nodes: int,
    seq_lens: torch.Tensor,
) -> DraftTree:
    """EAGLE-2 dynamic tree: the best ``num_nodes - 1`` drafted candidates under the root.

    Args:
        root_tokens: [B] the root (last verified) token of each request.
        step_tokens: per draft step s, [B, C_s] candidate tokens. Step 0 expands the root
            into its top-k; step s > 0 expands the frontier (chosen by the drafter among
            step s-1's candidates) into the top-k of each frontier node.
        step_scores: per step, [B, C_s] path scores (product of draft probabilities along
            the path from the root). NaN counts as -inf.
        step_parents: per step, [B, C_s] int index of each candidate's parent among the
            previous step's C_{s-1} candidates; entry 0 is ignored (parent = root, may
            be None).
        num_nodes: N, nodes per tree including the root.
        seq_lens: [B] tokens in the cache before the tree.

    Selection: each candidate's effective score is min(its score, its parent's effective
    score), so scores never increase down a path even if the inputs do; candidates are
    ranked by effective score, ties toward the earlier candidate (earlier step, then
    lower index). A parent therefore always ranks before its children and the best N-1
    are closed under ancestors. They are laid out by (step, index), which is
    topological. If there are fewer than N-1 candidates, padding nodes (token 0, score
    0, ``valid=False``) fill the tree. ``scores`` of the tree hold the effective scores
    (root 1.0); ``max_depth`` = number of steps. Fully vectorised, no host sync.
    """
    steps = len(step_tokens)
    if steps == 0 or len(step_scores) != steps or len(step_parents) != steps:
        raise ValueError("step_tokens, step_scores and step_parents need one entry per step (>= 1 step)")
    if root_tokens.dim() != 1:
        raise ValueError(f"root_tokens must be [B], got shape {tuple(root_tokens.shape)}")
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    bs = root_tokens.shape[0]
    dev = root_tokens.device
    for s in range(steps):
        for name, t in (("step_tokens", step_tokens[s]), ("step_scores", step_scores[s]),
                        ("step_parents", step_parents[s] if s else step_tokens[s])):
            if t.dim() != 2 or t.shape[0] != bs or t.shape[1] != step_tokens[s].shape[1] or t.device != dev:
                raise ValueError(f"{name}[{s}] must be [B={bs}, C] on {dev} matching step_tokens[{s}], "
                                 f"got {tuple(t.shape)} on {t.device}")

    # Flatten: the root, then every step's candidates; parent = index in the flat list.
    scores, parents, offset = [], [], 1
    for s in range(steps):
        score = torch.nan_to_num(step_scores[s].float(), nan=-math.inf, posinf=math.inf, neginf=-math.inf)
        if s == 0:
            parent = torch.zeros_like(step_tokens[0], dtype=torch.long)
        else:
            local = step_parents[s].long()
            score = torch.minimum(score, scores[-1].gather(1, local))
            parent = local + (offset - step_tokens[s - 1].shape[1])
        scores.append(score)
        parents.append(parent)
        offset += step_tokens[s].shape[1]
    root_score = torch.zeros(bs, 1, device=dev)  # ignored: the root always comes first
    return eagle_tree_from_candidates(
        torch.cat([root_tokens.long()[:, None], *(t.long() for t in step_tokens)], 1),
        torch.cat([root_score, *scores], 1),
        torch.cat([torch.full((bs, 1), -1, dtype=torch.long, device=dev), *parents], 1),
        num_nodes, seq_lens, max_depth=steps)


def eagle_tree_from_candidates(
    tokens: torch.Tensor,
    scores: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: int,
    seq_lens: torch.Tensor,
    max_depth: int,
) -> DraftTree:
    """The EAGLE-2 selection of :func:`build_eagle_tree` over candidates already flattened.

    Args:
        tokens, scores, parents: [B, 1 + C]; index 0 is the root (its score and parent are
            ignored), then the candidates in topological order, ``parents`` as indices into
            this flat list. Scores must not increase down a path (path-probability products
            do not); NaN counts as -inf.
        num_nodes, seq_lens: as in :func:`build_eagle_tree`.
        max_depth: a bound on the depth of every candidate (the number of draft steps).

    A drafter fills these buffers step by step inside its CUDA graph; the selection is
    then a fixed, small number of kernels (the index arrays come from the mask through
    the tree-index kernel).
    """
    node_tokens, node_parents, node_scores, valid = eagle_select(tokens, scores, parents, num_nodes)
    mask = parents_to_mask(node_parents, max_depth)
    return DraftTree.from_mask(node_tokens, mask, node_scores, seq_lens, valid, max_depth=max_depth,
                               check=False)


def eagle_select(tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, num_nodes: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The nodes :func:`eagle_tree_from_candidates` keeps, without the mask and index arrays:
    (tokens, parents, scores, valid) [B, num_nodes] in topological order, padding last."""
    bs, total = tokens.shape
    keep = min(num_nodes, total)  # root included
    key = scores.float().clone()
    key[:, 0] = math.inf  # the root comes first
    # Best first, equal scores in candidate order (parents before children; NaN counts as -inf),
    # so the best are closed under ancestors; sorted back by index they are topological.
    best_scores, best = row_topk(key, keep)
    chosen, order = torch.sort(best, dim=1)
    node_tokens = tokens.gather(1, chosen)
    node_scores = best_scores.gather(1, order)
    node_scores[:, 0] = 1.0
    # A parent's node number is its rank among the chosen indices (the root's -1 ranks before all).
    node_parents = torch.searchsorted(chosen, parents.gather(1, chosen), right=True) - 1
    valid = _all_valid(bs, num_nodes, tokens.device)
    pad = num_nodes - keep
    if pad:
        dev = tokens.device
        zeros = torch.zeros(bs, pad, dtype=torch.long, device=dev)
        node_tokens = torch.cat([node_tokens, zeros], 1)
        node_parents = torch.cat([node_parents, zeros], 1)
        node_scores = torch.cat([node_scores, torch.zeros(bs, pad, device=dev)], 1)
        valid = torch.ones(bs, num_nodes, dtype=torch.bool, device=dev)
        valid[:, keep:] = False
    return node_tokens, node_parents, node_scores, valid
