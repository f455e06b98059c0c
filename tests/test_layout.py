"""Tidy-tree layout: checked against properties computed straight from the parents array."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spectool.trace.layout import ancestors, layout_tree, tree_graph


@st.composite
def random_trees(draw, max_nodes=40):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    # Few distinct score values so ties happen too.
    scores = [draw(st.sampled_from([0.1, 0.2, 0.5, 0.9, 1.0])) for _ in range(n)]
    return np.array(parents), np.array(scores)


def children_oracle(parents, scores):
    """Children per node, best score first, ties by node index."""
    kids = {i: [] for i in range(len(parents))}
    for i in range(1, len(parents)):
        kids[parents[i]].append(i)
    return {p: sorted(c, key=lambda i: (-scores[i], i)) for p, c in kids.items()}


def depth_oracle(parents):
    return np.array([len(ancestors(parents, i)) - 1 for i in range(len(parents))])


@settings(max_examples=150, deadline=None)
@given(random_trees())
def test_tidy_layout_properties(tree):
    parents, scores = tree
    x, y = layout_tree(parents, scores)
    kids = children_oracle(parents, scores)
    depth = depth_oracle(parents)

    np.testing.assert_array_equal(y, -depth)
    for p, c in kids.items():
        if c:
            # Parent centred over its children; children left to right by descending score.
            assert x[p] == pytest.approx((x[c[0]] + x[c[-1]]) / 2)
            assert all(x[a] < x[b] for a, b in zip(c, c[1:]))
    # No two nodes share a position (no overlaps), at least one unit apart on a level.
    for d in set(depth.tolist()):
        row = np.sort(x[depth == d])
        assert np.all(np.diff(row) >= 1.0 - 1e-9)
    # The top-scored path (first child at every level) is the leftmost node of its depth.
    node = 0
    while kids[node]:
        node = kids[node][0]
        assert x[node] == x[depth == depth[node]].min()


def test_worked_example_from_the_internals():
    # The worked example (docs/INTERNALS.md): parents [-1, 0, 0, 1, 1], scores A .6 B .25 C .30 D .24.
    x, y = layout_tree([-1, 0, 0, 1, 1], [1.0, 0.6, 0.25, 0.30, 0.24])
    assert x[1] < x[2] and x[3] < x[4]
    assert x[1] == (x[3] + x[4]) / 2 and x[0] == (x[1] + x[2]) / 2
    np.testing.assert_array_equal(y, [0, -1, -1, -2, -2])


def test_padding_nodes_are_left_out():
    x, _ = layout_tree([-1, 0, 0, 0], [1.0, 0.5, 0.4, 0.0], valid=[True, True, True, False])
    assert np.isnan(x[3]) and not np.isnan(x[:3]).any()
    assert set(tree_graph([-1, 0, 0, 0], [1, .5, .4, 0], [True, True, True, False]).nodes) == {0, 1, 2}


def test_deep_chain_does_not_recurse():
    n = 5000
    x, y = layout_tree(np.arange(-1, n - 1), np.ones(n))
    assert y[-1] == -(n - 1) and np.all(x == 0)


@pytest.mark.parametrize("parents, scores, match", [
    ([], [], "root"),
    ([0, 0], [1, 1], "root"),
    ([-1, 2, 0], [1, 1, 1], "node 1"),
    ([-1, 0], [1.0], "scores"),
])
def test_bad_trees_raise_value_error(parents, scores, match):
    with pytest.raises(ValueError, match=match):
        layout_tree(parents, scores)


def test_ancestors():
    assert ancestors([-1, 0, 0, 1, 1], 4) == [0, 1, 4]
    assert ancestors([-1, 0, 0, 1, 1], 0) == [0]
    with pytest.raises(ValueError):
        ancestors([-1, 0], 5)
