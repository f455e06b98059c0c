"""A saved notebook keeps every view as a static picture: in the output bundle beside the live
widget, and alone once saved through `keep_static` (what the shipped notebooks and the pre-save
hook store); nbconvert's HTML of it shows the pictures and loads no widget manager.

The browser half (JupyterLab with no kernel, the HTML from file://) is in test_browser.py.
"""

from __future__ import annotations

import base64
import re

import nbformat
import pytest
from nbclient import NotebookClient
from trace_factory import make_trace

from spectool.widgets import CompareView, LiveDecode, TraceViewer, TreeView
from spectool.widgets.saved import WIDGET_STATE, WIDGET_VIEW, pre_save_hook

IMG = re.compile(r'<img[^>]* class="spectool-snapshot"[^>]* src="data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)"')


def bundle(view) -> dict:
    """The data of a view's output bundle (ipywidgets returns data alone, anywidget (data, metadata))."""
    b = view._repr_mimebundle_()
    return b[0] if isinstance(b, tuple) else b


def pictures(html: str) -> list[str]:
    """The SVG documents of the pictures in `html`."""
    return [base64.b64decode(m).decode() for m in IMG.findall(html)]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    make_trace("eagle", path=root / "a.sptrace", num_requests=2, batch_size=2, num_draft_tokens=8, seed=7)
    make_trace("eagle", path=root / "b.sptrace", num_requests=2, batch_size=2, num_draft_tokens=8, seed=7,
               temperature=1.0)
    return root


def test_each_view_bundle_holds_a_picture_of_what_it_shows(traces):
    from spectool.trace.reader import Trace

    a = Trace.load(traces / "a.sptrace")
    tree = TreeView(a, request=1)
    data = bundle(tree)
    assert WIDGET_VIEW in data
    (svg,) = pictures(data["text/html"])
    shown = a.iteration(a.iterations(1)[0], 1)
    assert f"iteration {shown.iteration} · request 1" in svg
    drawn = [0]  # the root and the valid nodes whose parents are drawn: no padding
    for i in range(1, len(shown.parents)):
        if shown.valid[i] and shown.parents[i] in drawn:
            drawn.append(i)
    assert svg.count("<circle") == len(drawn)

    compare = CompareView(traces / "a.sptrace", traces / "b.sptrace")
    html = bundle(compare)["text/html"]
    assert len(pictures(html)) == 2 and "tokens per iteration" in html

    viewer = TraceViewer(a)
    viewer.go_to(2)  # the picture follows the step
    (svg,) = pictures(bundle(viewer)["text/html"])
    assert f"iteration {a.iterations(viewer.request)[2]} ·" in svg


def test_a_view_that_cannot_draw_says_why_in_its_picture(tmp_path):
    html = bundle(TreeView(tmp_path / "missing.sptrace"))["text/html"]
    assert "no trace file at" in html and not pictures(html)

    class NoEngine:
        pass

    live = LiveDecode(NoEngine(), ["x"])
    assert "spectool-live-static" in bundle(live)["text/html"]


def test_an_executed_notebook_saved_with_keep_static_shows_pictures_in_nbconvert(traces):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in (
        "from spectool.widgets import CompareView, TraceViewer\nv = TraceViewer('a.sptrace')\nv",
        "CompareView('a.sptrace', 'b.sptrace')",
        "v.go_to(3)")]
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(traces)}}).execute()
    assert WIDGET_STATE in nb.metadata["widgets"]  # nbclient, like JupyterLab's "save widget state", keeps it
    outputs = [o for c in nb.cells for o in c.outputs if "data" in o]
    assert all(WIDGET_VIEW in o.data and "text/html" in o.data for o in outputs)
    model = {"type": "notebook", "content": nb}
    pre_save_hook(model=model, path="x.ipynb", contents_manager=None)
    assert "widgets" not in nb.metadata
    assert [WIDGET_VIEW in o.data for o in outputs] == [False, False]
    # The viewer's picture is of the step its model stood at when saved (3), not the one it was shown at.
    from spectool.trace.reader import Trace
    from spectool.widgets.views import first_request

    a = Trace.load(traces / "a.sptrace")
    assert f"iteration {a.iterations(first_request(a))[3]} ·" in pictures(outputs[0].data["text/html"])[0]

    from nbconvert import HTMLExporter

    page, _ = HTMLExporter().from_notebook_node(nbformat.from_dict(nb))
    assert len(pictures(page)) == 3  # the viewer's and both sides of the comparison
    assert "embed-amd" not in page and WIDGET_VIEW not in page  # no widget manager from a CDN


def test_jupyter_server_saves_through_the_hook_as_configured(traces, tmp_path):
    """What JupyterLab's save does (a PUT of the notebook to the contents API), with the documented setting."""
    import json
    import urllib.request

    from browser_pages import Lab

    nb = nbformat.v4.new_notebook()
    view = nbformat.v4.new_output("display_data", data={
        "text/plain": "CompareView(...)", "text/html": '<img class="spectool-snapshot" src="data:,">',
        WIDGET_VIEW: {"model_id": "f" * 32, "version_major": 2, "version_minor": 0}})
    bar = nbformat.v4.new_output("display_data", data={"text/plain": "0%", WIDGET_VIEW: {"model_id": "e" * 32}})
    nb.cells = [nbformat.v4.new_code_cell("CompareView(a, b)", outputs=[view]),
                nbformat.v4.new_code_cell("progress()", outputs=[bar])]
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "jupyter_server_config.json").write_text(
        json.dumps({"ContentsManager": {"pre_save_hook": "spectool.widgets.saved.pre_save_hook"}}))
    root = tmp_path / "root"
    root.mkdir()
    server = Lab(root, tmp_path, {})
    try:
        body = json.dumps({"type": "notebook", "format": "json", "content": nb}).encode()
        put = urllib.request.Request(server.api("contents/n.ipynb"), data=body, method="PUT",
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(put, timeout=30)
    finally:
        server.stop()
    saved = nbformat.read(root / "n.ipynb", as_version=4)
    assert sorted(saved.cells[0].outputs[0].data) == ["text/html", "text/plain"]
    assert WIDGET_VIEW in saved.cells[1].outputs[0].data  # a widget with no picture is left as it was
