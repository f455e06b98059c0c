"""Trace views driven programmatically: slider, request picker, row selection, bad input."""

import numpy as np
import pyarrow as pa
import pytest
from trace_factory import make_trace

import spectool.trace.format as trace_format
from spectool.trace.reader import Trace
from spectool.trace.schema import REQUEST_SCHEMA, STEP_SCHEMA
from spectool.widgets import AcceptanceView, CompareView, MaskView, TraceViewer, TreeView


@pytest.fixture(scope="module")
def ngram_trace():
    return make_trace("ngram", num_requests=3, batch_size=2, num_draft_tokens=10, seed=1)


@pytest.fixture(scope="module")
def eagle_trace():
    return make_trace("eagle", num_requests=3, batch_size=2, num_draft_tokens=10, seed=2)


def oracle_ancestors(parents, node):
    """Nodes from the root to `node`, by walking parents (independent of the view code)."""
    out = {node}
    while parents[node] >= 0:
        node = parents[node]
        out.add(int(node))
    return sorted(out)


def trace_named(fig, name):
    return next(t for t in fig.data if t.name == name)


def drawn_nodes(tree):
    return sorted(int(i) for name in ("not visited", "accepted", "rejected")
                  for i in trace_named(tree.fig, name).customdata)


def test_viewer_slider_steps_through_the_request(ngram_trace):
    viewer = TraceViewer(ngram_trace)
    request = viewer.request
    its = ngram_trace.iterations(request)
    assert viewer.slider.max == len(its) - 1 and viewer.play.max == len(its) - 1
    assert "spectool-player" in viewer.player._dom_classes
    assert "spectool-tree" in viewer.tree._dom_classes and "spectool-mask" in viewer.mask._dom_classes
    seen = set()
    for pos in range(len(its)):
        viewer.slider.value = pos
        view = ngram_trace.iteration(its[pos], request)
        assert viewer.tree.iteration == its[pos] == viewer.mask.iteration
        assert drawn_nodes(viewer.tree) == np.nonzero(view.valid)[0].tolist()
        np.testing.assert_array_equal(np.asarray(viewer.mask.fig.data[0].z)[:, :] > 0, view.mask)
        assert list(trace_named(viewer.acceptance.fig, "current").x) == [its[pos]]
        # Until a row is chosen, the highlighted path is the accepted path.
        path = [int(a) for a in view.accept_path if a >= 0]
        assert sorted(trace_named(viewer.tree.fig, "selected").customdata) == sorted(path)
        seen.add(tuple(np.round(trace_named(viewer.tree.fig, "edges").x[:30], 3).tolist()))
    assert len(seen) > 1  # the tree really changed between steps


def test_mask_row_selection_highlights_ancestors_in_tree(ngram_trace):
    viewer = TraceViewer(ngram_trace)
    viewer.slider.value = 1
    view = viewer.tree.view
    for node in np.nonzero(view.valid)[0][::2]:
        viewer.mask.select_row(int(node))
        expected = oracle_ancestors(view.parents, int(node))
        assert sorted(trace_named(viewer.tree.fig, "selected").customdata) == expected
        z = np.asarray(viewer.mask.fig.data[0].z)
        assert np.nonzero(z[node] == 3)[0].tolist() == expected  # the mask row lights the same nodes
    viewer.mask.rows.value = 2  # the row dropdown does the same
    assert sorted(trace_named(viewer.tree.fig, "selected").customdata) == oracle_ancestors(view.parents, 2)
    viewer.slider.value = 2  # the chosen row stays chosen on the next step
    assert viewer.mask.selected == 2
    assert sorted(trace_named(viewer.tree.fig, "selected").customdata) == oracle_ancestors(
        viewer.tree.view.parents, 2)
    viewer.tree._click_callbacks[0](3)  # a click on tree node 3 selects its mask row
    assert viewer.mask.selected == 3 and viewer.mask.rows.value == 3
    viewer.mask.select_row(99)
    assert "outside" in viewer.mask.message.value


def test_request_picker_switches_acceptance(ngram_trace):
    viewer = TraceViewer(ngram_trace)
    df = ngram_trace.to_pandas()
    for request in ngram_trace.request_ids:
        viewer.picker.value = request
        rows = df[df.request_id == request].sort_values("iteration")
        acc = trace_named(viewer.acceptance.fig, "accept length")
        assert list(acc.x) == rows.iteration.tolist() and list(acc.y) == rows.accept_length.tolist()
        assert viewer.tree.request == request and viewer.slider.value == 0
        assert viewer.tree.iteration == rows.iteration.iloc[0]
    viewer.acceptance._pick_callbacks[0](2)  # clicking a point jumps the player there
    assert viewer.slider.value == 2 and viewer.tree.iteration == ngram_trace.iterations(viewer.request)[2]


def test_to_figure_is_a_plain_figure(ngram_trace):
    viewer = TraceViewer(ngram_trace)
    viewer.slider.value = 1
    tree = viewer.tree.to_figure()
    assert type(tree).__name__ == "Figure" and len(tree.data) == len(viewer.tree.fig.data)
    assert list(trace_named(tree, "accepted").customdata) == list(
        trace_named(viewer.tree.fig, "accepted").customdata)
    assert len(viewer.to_figure().data) > 5 and len(viewer.acceptance.to_figure().data) == 4


def test_views_accept_an_iteration_view_and_a_path(ngram_trace, tmp_path):
    view = ngram_trace.iteration(ngram_trace.iterations(0)[1], 0)
    assert drawn_nodes(TreeView(view)) == np.nonzero(view.valid)[0].tolist()
    assert MaskView(view).selected == max(int(a) for a in view.accept_path)
    path = tmp_path / "run.sptrace"
    ngram_trace.save(path)
    tree = TreeView(str(path), request=1)
    assert tree.request == 1 and tree.message.value == ""


def test_compare_view_marks_differing_trees(ngram_trace, eagle_trace):
    same = CompareView(ngram_trace, ngram_trace)
    assert len(trace_named(same.fig, "trees differ").x) == 0
    cmp = CompareView(ngram_trace, eagle_trace, labels=("ngram", "eagle"), request=1)
    its = [t.iterations(1) for t in (ngram_trace, eagle_trace)]
    expected = []
    for k in range(min(map(len, its))):
        a, b = (t.iteration(i[k], 1) for t, i in zip((ngram_trace, eagle_trace), its))
        if not (np.array_equal(a.tokens, b.tokens) and np.array_equal(a.parents, b.parents)):
            expected.append(k)
    assert list(trace_named(cmp.fig, "trees differ").x) == expected
    for side, i in zip(("ngram accept length", "eagle accept length"), its):
        assert len(trace_named(cmp.fig, side).y) == len(i)
    cmp.slider.value = 1
    assert [t.iteration for t in cmp.trees] == [its[0][1], its[1][1]]
    assert "ngram" in cmp.summary.value and "eagle" in cmp.summary.value


def empty_steps():
    return pa.table({f.name: pa.array([], f.type) for f in STEP_SCHEMA}, schema=STEP_SCHEMA)


def test_empty_trace_shows_a_message():
    trace = Trace.from_tables(empty_steps(), None, {"method": "ngram"})
    for view in (TraceViewer(trace), TreeView(trace), MaskView(trace), AcceptanceView(trace)):
        assert "empty trace" in view.message.value or "no requests" in view.message.value
    assert "empty trace" in CompareView(trace, trace).message.value


def test_request_finished_at_prefill(ngram_trace):
    extra = pa.table({"request_id": [7], "prompt_tokens": [[2, 3]], "output_tokens": [[4]],
                      "finish_reason": ["prefill"], "prompt_text": ["def x"]}, schema=REQUEST_SCHEMA)
    trace = Trace.from_tables(ngram_trace.steps, pa.concat_tables([ngram_trace.requests, extra]),
                              ngram_trace.run_info, ngram_trace.tokenizer_json)
    viewer = TraceViewer(trace)
    viewer.picker.value = 7
    assert "request 7 finished at prefill" in viewer.message.value
    assert viewer.tree.layout.visibility == "hidden" == viewer.player.layout.visibility
    assert "finished at prefill" in TreeView(trace, request=7).message.value
    viewer.picker.value = 0  # and the viewer recovers
    assert viewer.message.value == "" and viewer.tree.request == 0
    assert viewer.tree.layout.visibility == "visible"


def test_newer_format_version_and_bad_files(ngram_trace, tmp_path, monkeypatch):
    path = tmp_path / "run.sptrace"
    ngram_trace.save(path)
    junk = tmp_path / "junk.sptrace"
    junk.write_bytes(b"\x00not a trace at all" * 10)
    monkeypatch.setattr(trace_format, "FORMAT_VERSION", trace_format.FORMAT_VERSION - 1)
    for view in (TraceViewer(path), TreeView(path), AcceptanceView(path)):
        assert "newer" in view.message.value
    assert "cannot read" in TreeView(junk).message.value
    assert "no trace file" in MaskView(tmp_path / "missing.sptrace").message.value
    assert "expected a spectool Trace" in TraceViewer(42).message.value


def test_missing_tokenizer_falls_back_to_ids(ngram_trace):
    trace = Trace.from_tables(ngram_trace.steps, ngram_trace.requests, ngram_trace.run_info, None)
    tree = TreeView(trace)
    assert "no tokenizer" in tree.message.value
    view = tree.view
    accepted = trace_named(tree.fig, "accepted")
    hover = dict(zip(accepted.customdata, accepted.hovertext))
    assert repr(str(int(view.tokens[0]))) in hover[0]
