"""Trace views driven programmatically: slider, request picker, row selection, bad input."""

import json

import numpy as np
import pyarrow as pa
import pytest
from trace_factory import make_trace

import spectool.trace.format as trace_format
from spectool.trace.reader import Trace
from spectool.trace.schema import REQUEST_SCHEMA, STEP_SCHEMA
from spectool.widgets import AcceptanceView, CompareView, LiveDecode, MaskView, TraceViewer, TreeView


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


def test_viewer_sends_the_trace_once_and_follows_the_page(ngram_trace):
    viewer = TraceViewer(ngram_trace)
    assert "spectool-viewer" in viewer._dom_classes and viewer.error is None
    assert [r["id"] for r in viewer.header["requests"]] == ngram_trace.request_ids
    assert len(viewer.blob) > 0
    request = viewer.request
    its = ngram_trace.iterations(request)
    snapshots = set()
    for pos in range(len(its)):
        viewer.go_to(pos)  # what the page reports after a step
        assert viewer.iteration == its[pos]
        snapshots.add(viewer.snapshot)
        fig = viewer.to_figure()
        view = ngram_trace.iteration(its[pos], request)
        drawn = sorted(int(i) for t in fig.data if t.name in ("not visited", "accepted", "rejected")
                       for i in t.customdata)
        assert drawn == oracle_drawn(view)
    assert len(snapshots) == len(its)  # the snapshot is the last state, not the first
    bundle, _ = viewer._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/html"].startswith('<img class="spectool-snapshot"') and "<script" not in bundle["text/html"]
    viewer.show_request(ngram_trace.request_ids[-1])
    assert viewer.position == 0 and viewer.iteration == ngram_trace.iterations(ngram_trace.request_ids[-1])[0]


def test_viewer_answers_the_page_with_plotly(ngram_trace, monkeypatch):
    viewer = TraceViewer(ngram_trace)
    sent = []
    monkeypatch.setattr(viewer, "send", lambda content, buffers=None: sent.append((content, buffers)))
    viewer._message(viewer, {"kind": "plotly"}, [])
    viewer._message(viewer, {"kind": "something else"}, [])
    assert len(sent) == 1 and sent[0][0] == {"kind": "plotly"} and b"plotly" in sent[0][1][0][:5000].lower()


def oracle_drawn(view):
    keep = [0]
    for i in range(1, len(view.parents)):
        if view.valid[i] and view.parents[i] in keep:
            keep.append(i)
    return keep


def test_mask_hides_padding_and_a_choice_resets_on_the_next_step(ngram_trace):
    r, padded = next((r, i) for r in ngram_trace.request_ids for i in ngram_trace.iterations(r)
                     if not ngram_trace.iteration(i, r).valid.all())
    its = ngram_trace.iterations(r)
    view = ngram_trace.iteration(padded, r)
    tree = TreeView(view)
    mask = MaskView(view, tree=tree)
    keep = oracle_drawn(view)
    z = np.asarray(mask.fig.data[0].z)
    assert z.shape == (len(keep), len(keep))
    np.testing.assert_array_equal(z > 0, view.mask[np.ix_(keep, keep)])
    assert [v for _, v in mask.rows.options][1:] == keep and "padding not shown" in mask.fig.layout.title.text
    node = keep[-1]
    mask.select_row(node)
    assert sorted(trace_named(tree.fig, "selected").customdata) == oracle_ancestors(view.parents, node)
    assert np.nonzero(np.asarray(mask.fig.data[0].z)[len(keep) - 1] == 3)[0].tolist() == [
        keep.index(a) for a in oracle_ancestors(view.parents, node)]
    other = ngram_trace.iteration(next(i for i in its if i != padded), r)
    mask.show_view(other)  # another iteration: back to its accepted path
    assert mask.chosen is None and mask.selected == max(int(a) for a in other.accept_path)


def test_views_accept_an_iteration_view_and_a_path(ngram_trace, tmp_path):
    view = ngram_trace.iteration(ngram_trace.iterations(0)[1], 0)
    assert drawn_nodes(TreeView(view)) == np.nonzero(view.valid)[0].tolist()
    assert MaskView(view).selected == max(int(a) for a in view.accept_path)
    path = tmp_path / "run.sptrace"
    ngram_trace.save(path)
    tree = TreeView(str(path), request=1)
    assert tree.request == 1 and tree.message.value == ""


def test_compare_labels_name_only_the_settings_that_differ(ngram_trace):
    # The synthetic trace's run info names only num_draft_tokens; a prediction's names every
    # setting. Against it only the prediction's own choices are named: the rest are the defaults.
    from spectool.config import NgramConfig
    from spectool.tune.recommend import tune

    predicted = tune(ngram_trace, grid=[NgramConfig(num_draft_tokens=2, max_bfs_breadth=4)],
                     progress=False).predictions[0]
    cmp = CompareView(ngram_trace, predicted)
    n = ngram_trace.run_info["draft"]["num_draft_tokens"]
    assert cmp.labels == (f"A: ngram (num_draft_tokens={n})",
                          "B: predicted ngram (max_bfs_breadth=4, num_draft_tokens=2)"), cmp.labels


def test_compare_view_aligns_by_output_position(ngram_trace):
    sampled = make_trace("eagle", num_requests=3, batch_size=2, num_draft_tokens=10, seed=1, temperature=1.0)
    same = CompareView(ngram_trace, ngram_trace)
    assert same.first is None and "identical" in same.summary
    cmp = CompareView(ngram_trace, sampled, request=1)
    assert cmp.labels[0].startswith("A: ngram") and cmp.labels[1].startswith("B: eagle")
    out = [np.asarray(t.request(1)["output_tokens"]) for t in (ngram_trace, sampled)]
    n = min(map(len, out))
    first = int(np.nonzero(out[0][:n] != out[1][:n])[0][0])
    assert cmp.first == first and f"first difference at output token {first}" in cmp.summary
    assert cmp.position == first  # shown first
    for side, trace in zip(cmp.sides, (ngram_trace, sampled)):
        # Oracle: walk the iterations, each producing its accepted drafts and a bonus token.
        covering = [-1]
        for it in trace.iterations(1):
            covering += [it] * (trace.iteration(it, 1).accept_length + 1)
        assert side["iteration"].tolist() == covering[:len(side["tokens"])]
    cmp.go_to(0)
    assert cmp.iterations == [-1, -1]  # output token 0 comes from prefill in both runs
    cmp.go_to(first)
    assert cmp.iterations == [int(s["iteration"][first]) for s in cmp.sides]
    # What the page steps from: per side and output position, the position among the request's iterations.
    sides = json.loads(cmp.compare_json)["aligned"]["1"]["sides"]
    for side, trace in zip(sides, (ngram_trace, sampled)):
        its = trace.iterations(1)
        assert [its[k] if k >= 0 else -1 for k in side["step"]] == side["iteration"]


def test_compare_view_of_large_traces_sends_the_rest_when_the_page_asks(ngram_trace, monkeypatch):
    """Traces over the preload size: the page gets the first request's alignment and its first chunks; another
    request's alignment and a side's chunk come as answers to the page's questions, each side from its trace."""
    import spectool.widgets.compare
    import spectool.widgets.viewer

    monkeypatch.setattr(spectool.widgets.viewer, "PRELOAD_RECORDS", 1)
    monkeypatch.setattr(spectool.widgets.compare, "PRELOAD_RECORDS", 1)
    sampled = make_trace("eagle", num_requests=3, batch_size=2, num_draft_tokens=10, seed=1, temperature=1.0)
    cmp = CompareView(ngram_trace, sampled, request=0)
    page = json.loads(cmp.compare_json)
    assert list(page["aligned"]) == ["0"] and [r["id"] for r in page["requests"]] == [0, 1, 2]
    sent = []
    monkeypatch.setattr(cmp, "send", lambda content, buffers=None: sent.append((content, buffers)))
    cmp._message(cmp, {"kind": "compare", "request": 2}, [])
    (reply, _), = sent
    for side, trace in zip(reply["data"]["sides"], (ngram_trace, sampled)):
        its = trace.iterations(2)
        covering = [-1]
        for k, it in enumerate(its):
            covering += [k] * (trace.iteration(it, 2).accept_length + 1)
        assert side["step"] == covering[:len(trace.request(2)["output_tokens"])]
    sent.clear()
    cmp._message(cmp, {"kind": "chunk", "side": 1, "request": 2, "chunk": 0}, [])
    (reply, buffers), = sent
    assert reply["side"] == 1 and reply["request"] == 2 and len(buffers) == 1
    assert len(reply["data"]["offsets"]) == len(sampled.iterations(2)) + 1  # every iteration of B's request 2
    sent.clear()
    cmp._message(cmp, {"kind": "compare", "request": 99}, [])  # not a shared request: no answer
    assert sent == []


def empty_steps():
    return pa.table({f.name: pa.array([], f.type) for f in STEP_SCHEMA}, schema=STEP_SCHEMA)


def test_empty_trace_shows_a_message():
    trace = Trace.from_tables(empty_steps(), None, {"method": "ngram"})
    for view in (TreeView(trace), MaskView(trace), AcceptanceView(trace)):
        assert "empty trace" in view.message.value
    assert "empty trace" in TraceViewer(trace).error
    assert "empty trace" in CompareView(trace, trace).error


def test_request_finished_at_prefill(ngram_trace):
    extra = pa.table({"request_id": [7], "prompt_tokens": [[2, 3]], "output_tokens": [[4]],
                      "finish_reason": ["prefill"], "prompt_text": ["def x"]}, schema=REQUEST_SCHEMA)
    trace = Trace.from_tables(ngram_trace.steps, pa.concat_tables([ngram_trace.requests, extra]),
                              ngram_trace.run_info, ngram_trace.tokenizer_json)
    assert "request 7 finished at prefill" in TraceViewer(trace, request=7).error
    assert "finished at prefill" in TreeView(trace, request=7).message.value
    assert 7 not in [r["id"] for r in TraceViewer(trace).header["requests"]]  # nothing to step through


def test_newer_format_version_and_bad_files(ngram_trace, tmp_path, monkeypatch):
    path = tmp_path / "run.sptrace"
    ngram_trace.save(path)
    junk = tmp_path / "junk.sptrace"
    junk.write_bytes(b"\x00not a trace at all" * 10)
    monkeypatch.setattr(trace_format, "FORMAT_VERSION", trace_format.FORMAT_VERSION - 1)
    for view in (TreeView(path), AcceptanceView(path)):
        assert "newer" in view.message.value
    assert "newer" in TraceViewer(path).error
    assert "cannot read" in TreeView(junk).message.value
    assert "no trace file" in MaskView(tmp_path / "missing.sptrace").message.value
    assert "expected a spectool Trace" in TraceViewer(42).error


def test_missing_tokenizer_falls_back_to_ids(ngram_trace):
    trace = Trace.from_tables(ngram_trace.steps, ngram_trace.requests, ngram_trace.run_info, None)
    tree = TreeView(trace)
    assert "no tokenizer" in tree.message.value
    view = tree.view
    accepted = trace_named(tree.fig, "accepted")
    hover = dict(zip(accepted.customdata, accepted.hovertext))
    assert str(int(view.tokens[0])) in hover[0]


def test_live_decode_legend_matches_the_checkpoint_and_colours_do_not_repeat():
    from spectool.widgets.live import depth_colour

    class Config:
        method, num_steps = "multi_layer_eagle", 4

    class Engine:
        draft_config = Config()

        def stream(self, *args, **kwargs):
            return iter(())

    live = LiveDecode(Engine(), ["x"])
    legend = live.children[2].value
    assert all(f"layer {k}" in legend for k in range(4)) and "layer 4" not in legend
    assert live.text.layout.max_height and live.text.layout.overflow == "auto"
    assert len({depth_colour(d) for d in range(1, 25)}) == 24


def test_viewer_sends_requests_and_chunks_on_demand(eagle_trace, monkeypatch):
    """A trace too big to send whole: the page gets the first chunk at open, then asks for more; each
    answer holds the same nodes as `Trace.iteration` (the independent record reader)."""
    import spectool.trace.viewdata as viewdata
    import spectool.widgets.viewer as viewer_module

    monkeypatch.setattr(viewer_module, "PRELOAD_RECORDS", 0)
    monkeypatch.setattr(viewdata, "CHUNK", 3)
    viewer = TraceViewer(eagle_trace)
    [first] = viewer.header["loaded"]
    assert first["id"] == viewer.request and list(first["loaded"]) == ["0"] and first["chunks"] > 1
    sent = []
    monkeypatch.setattr(viewer, "send", lambda content, buffers=None: sent.append((content, buffers)))
    other = next(r for r in eagle_trace.request_ids if r != viewer.request)
    its = eagle_trace.iterations(other)

    def same_nodes(meta, buffer, chunk):
        arrays = {name: np.frombuffer(buffer, dtype=np.dtype(dtype), count=n, offset=off)
                  for name, (dtype, off, n) in meta["nodes"].items()}
        for j, it in enumerate(its[chunk * 3:(chunk + 1) * 3]):
            view = eagle_trace.iteration(it, other)
            a, b = meta["offsets"][j], meta["offsets"][j + 1]
            np.testing.assert_array_equal(arrays["tokens"][a:b], view.tokens)
            np.testing.assert_array_equal(arrays["parents"][a:b], view.parents)
            assert meta["path"][j] == [int(i) for i in view.accept_path if i >= 0]

    # The page asks for a request at the position it will show: the answer brings that position's chunk.
    viewer._message(viewer, {"kind": "request", "request": other, "position": 4}, [])
    content, [buffer] = sent[-1]
    data = content["data"]
    assert data["id"] == other and data["iteration"] == its
    assert data["accept_length"] == [eagle_trace.iteration(i, other).accept_length for i in its]
    assert list(data["loaded"]) == ["1"]
    same_nodes(data["loaded"]["1"], buffer, 1)
    for chunk in range(data["chunks"]):
        viewer._message(viewer, {"kind": "chunk", "request": other, "chunk": chunk}, [])
        content, [buffer] = sent[-1]
        same_nodes(content["data"], buffer, chunk)
    viewer._message(viewer, {"kind": "text", "request": other}, [])
    assert sent[-1][0]["data"]["output"] == eagle_trace.request(other)["output_tokens"]
    viewer._message(viewer, {"kind": "chunk", "request": "x"}, [])  # malformed: no answer, no traceback
    assert sent[-1][0]["kind"] == "text"


def test_standalone_views_step_in_the_page_and_follow_its_reports(ngram_trace):
    """TreeView and MaskView of a trace are the page's player with their part on: the page steps,
    reports its position, and the figure kept in the kernel shows that step's tree."""
    r = ngram_trace.request_ids[1]
    its = ngram_trace.iterations(r)
    tree = TreeView(ngram_trace, request=r, iteration=its[2])
    mask = MaskView(ngram_trace, request=r)
    assert tree.player.parts == ["tree"] and mask.player.parts == ["mask"]
    assert tree.children[-1] is tree.player and (tree.player.request, tree.player.position) == (r, 2)
    assert len(tree.player.blob) > 0  # the steps are in the page already
    for k in (0, len(its) - 1, 1):
        tree.player.go_to(k)  # what the page reports after stepping
        assert tree.iteration == its[k] and drawn_nodes(tree) == oracle_drawn(ngram_trace.iteration(its[k], r))
    tree.show(its[-1])  # the kernel moves the page
    assert tree.player.position == len(its) - 1
    tree.highlight(2)
    assert tree.player.selected == 2
    mask.select_row(mask.rows.options[-1][1])
    assert mask.player.selected == mask.rows.options[-1][1]
    mask.player.go_to(1)  # another step: back to the accepted path
    assert mask.iteration == its[1] and mask.chosen is None and mask.player.selected == -1
    fixed = TreeView(ngram_trace, request=r, stepper=False)
    assert fixed.player is None and fixed.children[-1] is fixed.fig


def test_a_mask_with_prefix_columns_is_the_kernels_figure(ngram_trace):
    mask = MaskView(ngram_trace, prefix=4)  # the page draws no prefix columns
    assert mask.player is None and mask.children[-1] is mask.fig
