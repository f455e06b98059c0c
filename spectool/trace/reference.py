"""The checker's reference: every tree and decision field re-derived the slow, obvious way.

Plain Python over lists, one node at a time, straight from the definitions in docs/INTERNALS.md ("Definitions")
(Vocabulary, part 5). Nothing here is imported from the engine's path (draft/, kernels/,
verify.py), so a bug there cannot agree with itself: `spectool check` compares what the
engine recorded with what these functions give.

    parents [-1, 0, 0, 1, 1], seq_len 10  ->  positions [10, 11, 11, 12, 12],
    next_token [1, 3, -1, -1, -1], next_sibling [-1, 2, -1, 4, -1]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

NOT_VISITED, ACCEPTED, REJECTED = 0, 1, 2

# Mantissa bits per dtype name: a value x is stored to within half of 2**(floor(log2|x|) - bits).
MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23, "float64": 52}
# A logit is the end of a chain of roundings (every layer's activations are stored in the dtype), so
# two kernels that sum in different orders can move it by a few units in the last place, not one.
NEAR_TIE_ULPS = 4


def depths(parents: list[int]) -> list[int]:
    """Depth of every node (root 0); parents must be topological (checked by the caller)."""
    out: list[int] = []
    for i, p in enumerate(parents):
        out.append(0 if i == 0 else out[p] + 1)
    return out


def ancestors(parents: list[int], node: int) -> list[int]:
    """node, its parent, ..., the root."""
    out = [node]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out


def mask_rows(parents: list[int]) -> list[list[bool]]:
    """mask[q][k] = node k is q itself or an ancestor of q."""
    n = len(parents)
    rows = []
    for q in range(n):
        row = [False] * n
        for k in ancestors(parents, q):
            row[k] = True
        rows.append(row)
    return rows


def parents_from_mask(mask: list[list[bool]]) -> list[int]:
    """Each node's parent read back from a mask: the ancestor (not itself) that has the most
    ancestors of its own; -1 for a row that sees nothing but itself."""
    out = []
    for q, row in enumerate(mask):
        best, best_count = -1, -1
        for k, seen in enumerate(row):
            if seen and k != q and sum(mask[k]) > best_count:
                best, best_count = k, sum(mask[k])
        out.append(best)
    return out


def tree_indices(parents: list[int], seq_len: int) -> dict[str, list[int]]:
    """positions, retrieve_index (relative: node i -> i), retrieve_next_token (first child) and
    retrieve_next_sibling (next child of the same parent) of one tree."""
    n = len(parents)
    d = depths(parents)
    first_child = [-1] * n
    next_sibling = [-1] * n
    for i in range(1, n):
        p = parents[i]
        if first_child[p] < 0:
            first_child[p] = i
        later = [j for j in range(i + 1, n) if parents[j] == p]
        if later:
            next_sibling[i] = later[0]
    return {"positions": [seq_len + x for x in d], "retrieve_index": list(range(n)),
            "retrieve_next_token": first_child, "retrieve_next_sibling": next_sibling}


def children(parents: list[int], valid: list[bool], node: int) -> list[int]:
    """Valid children of ``node`` in node order."""
    return [c for c in range(1, len(parents)) if parents[c] == node and valid[c]]


@dataclass
class Decision:
    """A verify decision: node status, accepted path (root first) and the bonus token
    (None when the reference cannot tell it: a sampled bonus is checked through its interval)."""

    status: list[int]
    path: list[int]
    bonus: int | None


def _status(parents: list[int], valid: list[bool], path: list[int]) -> list[int]:
    """Accepted on the path; rejected: a valid child of an accepted node that comes before the
    child taken there (all of them below the last node); the rest not visited."""
    n = len(parents)
    status = [NOT_VISITED] * n
    for node in path:
        status[node] = ACCEPTED
    for level, node in enumerate(path):
        taken = path[level + 1] if level + 1 < len(path) else n
        for c in children(parents, valid, node):
            if c < taken:
                status[c] = REJECTED
    return status


def greedy_decision(tokens: list[int], parents: list[int], valid: list[bool], argmax: list[int]) -> Decision:
    """Greedy verify: the longest root path whose every token is the target argmax at its parent
    (among duplicate siblings, the deepest such path, ties to the lower last node); the bonus is
    the argmax at its last node."""
    best = [0]

    def walk(path: list[int]) -> None:
        nonlocal best
        if len(path) > len(best) or (len(path) == len(best) and path[-1] < best[-1]):
            best = list(path)
        for c in children(parents, valid, path[-1]):
            if tokens[c] == argmax[path[-1]]:
                walk(path + [c])

    walk([0])
    return Decision(_status(parents, valid, best), best, argmax[best[-1]])


def sampled_children(tokens: list[int], parents: list[int], valid: list[bool], node: int,
                     child_probs: list[float]) -> list[tuple[int, float]]:
    """(child, its target probability) for the children that take part in the draw at ``node``:
    valid, in node order, a repeated token counted once (its first occurrence)."""
    seen: set[int] = set()
    out = []
    for c in children(parents, valid, node):
        if tokens[c] not in seen:
            seen.add(tokens[c])
            out.append((c, child_probs[c]))
    return out


@dataclass
class SampledDecision(Decision):
    """A sampled decision and the residual draw left for the bonus: ``residual_u`` = the last
    node's coin minus its children's mass (the bonus is the residual's inverse CDF there)."""

    residual_u: float = math.nan


def sampled_decision(tokens: list[int], parents: list[int], valid: list[bool], coins: list[float],
                     child_probs: list[float]) -> SampledDecision:
    """Target-only tree sampling (docs/INTERNALS.md, "Definitions"): at each visited node its coin falls into the
    interval of one child (accepted, the walk goes on) or past them all (the walk stops).

    ``child_probs[c]`` is p(tokens[c] | parent of c) after temperature / top-k / top-p.
    """
    path = [0]
    while True:
        node, u = path[-1], coins[path[-1]]
        total, taken = 0.0, None
        for c, p in sampled_children(tokens, parents, valid, node, child_probs):
            total += p
            if p > 0 and u < total:
                taken = c
                break
        if taken is None:
            break
        path.append(taken)
    return SampledDecision(_status(parents, valid, path), path, None, max(u - total, 0.0))


def ulp(value: float, dtype: str) -> float:
    """Spacing of ``dtype`` numbers at the magnitude of ``value`` (its rounding unit there)."""
    bits = MANTISSA_BITS.get(dtype, 23)
    mag = abs(value)
    if mag == 0 or not math.isfinite(mag):
        return 0.0
    return 2.0 ** (math.floor(math.log2(mag)) - bits)


def is_near_tie(gap: float, magnitude: float, dtype: str) -> bool:
    """A logit gap that the dtype's rounding at that magnitude can close (or open): at most
    ``NEAR_TIE_ULPS`` units in the last place of ``dtype`` at ``magnitude``."""
    return gap <= NEAR_TIE_ULPS * ulp(magnitude, dtype)
