"""Static figures: node/edge counts, colours from status, hover, mask cells, acceptance rates."""

from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from spectool.trace.figures import (
    COLORS,
    MASK_HIDDEN,
    MASK_PREFIX,
    MASK_SELECTED,
    MASK_VISIBLE,
    acceptance_figure,
    mask_figure,
    tree_figure,
)
from spectool.trace.schema import STEP_SCHEMA

STATUS_OF = {"not visited": 0, "accepted": 1, "rejected": 2}


def greedy_view(parents, scores, tokens, argmax, valid=None, seq_len=10, k=3, seed=0):
    """An IterationView-like record with the mask and greedy decision computed from scratch."""
    parents = np.asarray(parents)
    n = len(parents)
    valid = np.ones(n, bool) if valid is None else np.asarray(valid, bool)
    mask = np.zeros((n, n), bool)
    depth = np.zeros(n, int)
    for q in range(n):
        a = q
        while a >= 0:
            mask[q, a] = True
            a = parents[a]
        depth[q] = mask[q].sum() - 1
    status = np.zeros(n, np.int8)
    path, node = [0], 0
    status[0] = 1
    while True:  # greedy walk: take the child whose token is the target argmax at this node
        kids = [c for c in range(n) if parents[c] == node and valid[c]]
        for c in kids:
            status[c] = 2
        hit = [c for c in kids if tokens[c] == argmax[node]]
        if not hit:
            break
        node = hit[0]
        status[node] = 1
        path.append(node)
    rng = np.random.default_rng(seed)
    topk_tokens = rng.integers(0, 50, (n, k))
    topk_tokens[:, 0] = argmax
    return SimpleNamespace(
        iteration=0, request_id=0, method="eagle", seq_len=seq_len, num_nodes=n,
        tokens=np.asarray(tokens), parents=parents, depth=depth, scores=np.asarray(scores, float),
        valid=valid, mask=mask, status=status, accept_path=np.asarray(path), accept_length=len(path) - 1,
        bonus_token=int(argmax[node]), target_argmax=np.asarray(argmax),
        target_argmax_prob=np.full(n, 0.5), target_topk_tokens=topk_tokens,
        target_topk_probs=np.tile(np.linspace(0.5, 0.1, k), (n, 1)),
        token_texts=[f"t{t}" for t in tokens], bonus_text=f"t{argmax[node]}",
        ngram_match_len=-1, ngram_breadth=-1)


def design_example():
    # The worked example of docs/INTERNALS.md: r, A, B, C, D; target argmax per node [A, D, ., ., Z].
    r, A, B, C, D, Z = 100, 1, 2, 3, 4, 9
    return greedy_view([-1, 0, 0, 1, 1], [1, .6, .25, .30, .24], [r, A, B, C, D], [A, D, 0, 0, Z])


def node_traces(fig):
    return {t.name: t for t in fig.data if t.name in (*STATUS_OF, "bonus")}


def test_worked_example_tree_colours_and_bonus():
    view = design_example()
    np.testing.assert_array_equal(view.status, [1, 1, 2, 2, 1])  # the worked example's outcome
    traces = node_traces(tree_figure(view))
    assert sorted(traces["accepted"].customdata) == [0, 1, 4]
    assert sorted(traces["rejected"].customdata) == [2, 3]
    assert list(traces["not visited"].customdata) == []
    # The bonus token hangs under the deepest accepted node (D, depth 2), with an edge from it.
    bonus = traces["bonus"]
    assert list(bonus.y) == [-2.0, -3.0] and bonus.x[0] == node_x(traces, 4) and "#9" in bonus.hovertext[1]
    for name, t in traces.items():
        assert t.marker.color == COLORS[name]


def node_x(traces, node):
    for t in traces.values():
        if node in list(t.customdata):
            return t.x[list(t.customdata).index(node)]


def random_view(seed, n=30):
    rng = np.random.default_rng(seed)
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    tokens = rng.integers(0, 6, n)
    valid = rng.random(n) > 0.1
    valid[0] = True
    # Padding nodes hang off the root and have no children, like the engine's.
    parents = [p if valid[i] and valid[p] else 0 for i, p in enumerate(parents)]
    return greedy_view(parents, rng.random(n), tokens, rng.integers(0, 6, n), valid=valid, seed=seed)


@pytest.mark.parametrize("seed", range(5))
def test_tree_counts_and_colours_match_status(seed):
    view = random_view(seed)
    fig = tree_figure(view)
    traces = node_traces(fig)
    shown = np.nonzero(view.valid)[0]
    drawn = sorted(i for name in STATUS_OF for i in traces[name].customdata)
    assert drawn == shown.tolist()
    for name, code in STATUS_OF.items():
        assert all(view.status[i] == code for i in traces[name].customdata)
    edges = next(t for t in fig.data if t.name == "edges")
    assert len(edges.x) == 3 * (len(shown) - 1)  # one None-separated segment per non-root node


def test_hover_shows_text_score_depth_and_topk():
    view = design_example()
    names = {1: "alpha", 4: "delta"}
    fig = tree_figure(view, token_text=lambda ids: [names.get(i, f"tok{i}") for i in ids])
    t = node_traces(fig)["accepted"]
    hover = dict(zip(t.customdata, t.hovertext))[1]  # node A; the target's argmax there is D
    assert "t1" in hover and "depth 1" in hover and "score 0.6" in hover and "accepted" in hover
    assert "target top-3: delta 0.500" in hover


def test_labels_show_whitespace_and_escape_tags():
    view = design_example()
    view.token_texts = [" \n", "<b>x</b>", "\t", "", "\x01"]  # one per node
    fig = tree_figure(view)
    labels = [str(x) for t in node_traces(fig).values() for x in (() if t.text is None else t.text)]
    assert "␣⏎" in labels and "⇥" in labels and "∅" in labels and "␁" in labels
    assert "&lt;b&gt;x&lt;/b&gt;" in labels and not any("<b>" in x for x in labels)


@pytest.mark.parametrize("seed", range(4))
def test_highlight_marks_exactly_the_mask_row(seed):
    view = random_view(seed)
    node = int(np.nonzero(view.valid)[0][-1])
    fig = tree_figure(view, highlight=node)
    selected = next(t for t in fig.data if t.name == "selected")
    # Oracle: the nodes row `node` of the tree mask sees.
    assert sorted(selected.customdata) == np.nonzero(view.mask[node])[0].tolist()
    path = next(t for t in fig.data if t.name == "selected path")
    assert len(path.x) == 3 * (len(selected.customdata) - 1)


def test_mask_figure_cells_and_selection():
    view = random_view(1, n=12)
    z = np.array(mask_figure(view).data[0].z)
    np.testing.assert_array_equal(z == MASK_VISIBLE, view.mask)
    z = np.array(mask_figure(view, selected=7, prefix=4).data[0].z)
    assert z.shape == (12, 16)
    assert np.all(z[:, :4] == MASK_PREFIX)
    np.testing.assert_array_equal(z[7, 4:] == MASK_SELECTED, view.mask[7])
    np.testing.assert_array_equal(np.delete(z, 7, axis=0)[:, 4:] == MASK_HIDDEN, ~np.delete(view.mask, 7, 0))
    # Prefix columns never exceed what is in the cache.
    assert np.array(mask_figure(view, prefix=1000).data[0].z).shape == (12, 12 + view.seq_len)
    with pytest.raises(ValueError, match="row 12"):
        mask_figure(view, selected=12)


def steps_table(rows):
    """A STEP_SCHEMA table from (iteration, request, method, parents, accept_length) rows."""
    cols = {f.name: [] for f in STEP_SCHEMA}
    for it, req, method, parents, acc in rows:
        n = len(parents)
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
        row = dict(iteration=it, request_id=req, method=method, seq_len=10 + it, num_nodes=n,
                   parents=parents, depth=depth, accept_length=acc)
        for name in cols:
            cols[name].append(row.get(name))
    return pa.table(cols, schema=STEP_SCHEMA)


def test_acceptance_figure_per_request():
    chain = [-1, 0, 1, 2]
    rows = [(0, 0, "multi_layer_eagle", chain, 3), (0, 1, "multi_layer_eagle", chain, 0),
            (1, 0, "multi_layer_eagle", chain, 1), (2, 0, "multi_layer_eagle", chain, 2)]
    trace = SimpleNamespace(steps=steps_table(rows), request_ids=[0, 1])
    fig = acceptance_figure(trace, 0, current=1)
    per_it = next(t for t in fig.data if t.name == "accept length")
    assert list(per_it.x) == [0, 1, 2] and list(per_it.y) == [3, 1, 2]
    by_layer = next(t for t in fig.data if t.name.startswith("acceptance by"))
    assert list(by_layer.x) == ["layer 0", "layer 1", "layer 2"]
    # Of the request's 3 chains (all reach layer 2): accept lengths 3, 1, 2.
    assert list(by_layer.y) == pytest.approx([1.0, 2 / 3, 1 / 3])
    hist = next(t for t in fig.data if t.name == "accept length histogram")
    assert list(hist.y) == [0, 1, 1, 1]
    assert list(next(t for t in fig.data if t.name == "current").x) == [1]
    with pytest.raises(ValueError, match="request 5"):
        acceptance_figure(trace, 5)
