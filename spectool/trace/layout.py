"""Tidy-tree layout for draft trees.

A draft tree arrives as a parents array (node 0 = root, parents before children).
`tree_graph` turns it into a networkx DiGraph whose successor lists are ordered by
descending draft score; `tidy_layout` places it so that

- every node sits at y = -depth (root on top),
- leaves take consecutive integer x in depth-first order, so subtrees never overlap,
- every parent is centred over its first and last child,
- children run left to right by descending score, so the top-scored path (the
  first child at every level) is the leftmost node of each depth it reaches.

Padding nodes (valid=False) are left out of the graph and get NaN coordinates.
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx
import numpy as np


def tree_graph(parents: Sequence[int], scores: Sequence[float], valid: Sequence[bool] | None = None
               ) -> nx.DiGraph:
    """The draft tree as a DiGraph: edges parent -> child, children inserted best score first.

    Node attributes: ``score`` and ``depth``. Raises ValueError for a parents array
    that is not a topologically ordered tree rooted at node 0.
    """
    parents = np.asarray(parents, dtype=np.int64)
    scores = np.asarray(scores, dtype=np.float64)
    n = len(parents)
    if n == 0 or parents[0] != -1:
        raise ValueError("a draft tree needs node 0 as its root (parents[0] == -1)")
    if len(scores) != n:
        raise ValueError(f"scores has {len(scores)} entries for {n} nodes")
    keep = np.ones(n, dtype=bool) if valid is None else np.asarray(valid, dtype=bool).copy()
    if len(keep) != n:
        raise ValueError(f"valid has {len(keep)} entries for {n} nodes")
    keep[0] = True
    bad = np.nonzero((parents[1:] < 0) | (parents[1:] >= np.arange(1, n)))[0]
    if len(bad):
        i = int(bad[0]) + 1
        raise ValueError(f"node {i}: parent {int(parents[i])} must come before it (0 <= parent < {i})")

    # Depth in one pass (parents come first); padding and its descendants drop out.
    depth = np.zeros(n, dtype=np.int64)
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
        keep[i] &= keep[parents[i]]
    graph = nx.DiGraph()
    graph.add_nodes_from((int(i), {"score": float(scores[i]), "depth": int(depth[i])})
                         for i in np.nonzero(keep)[0])
    # networkx keeps successors in insertion order: insert edges best score first
    # (a stable sort, so equal scores keep node order; NaN scores go last).
    order = np.argsort(-np.nan_to_num(scores, nan=-np.inf), kind="stable")
    graph.add_edges_from((int(parents[i]), int(i)) for i in order if i > 0 and keep[i])
    return graph


def tidy_layout(graph: nx.DiGraph, num_nodes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Coordinates (x, y) per node index; nodes missing from the graph get NaN.

    Children are placed in the graph's successor order (best score first, as
    `tree_graph` inserts them).
    """
    n = num_nodes if num_nodes is not None else (max(graph.nodes) + 1 if len(graph) else 0)
    x = np.full(n, np.nan)
    y = np.full(n, np.nan)
    if n == 0 or 0 not in graph:
        return x, y
    next_leaf = 0.0
    # Iterative post-order walk (deep chains must not hit the recursion limit).
    stack: list[tuple[int, bool]] = [(0, False)]
    while stack:
        node, children_done = stack.pop()
        kids = list(graph.successors(node))
        y[node] = -graph.nodes[node]["depth"]
        if not kids:
            x[node] = next_leaf
            next_leaf += 1.0
        elif children_done:
            x[node] = (x[kids[0]] + x[kids[-1]]) / 2.0
        else:
            stack.append((node, True))
            stack.extend((k, False) for k in reversed(kids))
    return x, y


def layout_tree(parents: Sequence[int], scores: Sequence[float], valid: Sequence[bool] | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """`tidy_layout(tree_graph(...))` for a parents array: (x, y) per node, NaN for padding."""
    return tidy_layout(tree_graph(parents, scores, valid), num_nodes=len(parents))


def ancestors(parents: Sequence[int], node: int) -> list[int]:
    """Node indices from the root down to `node` (inclusive): the nodes its mask row sees."""
    if not 0 <= node < len(parents):
        raise ValueError(f"node {node} is outside a tree of {len(parents)} nodes")
    path = [int(node)]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]
