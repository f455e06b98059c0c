"""The views in a real browser: the standalone report from file:// and the notebooks in JupyterLab,
both in headless Chromium (Debian's package, driven by Playwright).

Checked in the page: step latency (input event to the next paint, timed with
performance.now and requestAnimationFrame), no padding nodes, tree and mask side by
side with every panel inside the viewport at 1366 px with JupyterLab's file browser
open, the text panel's highlighting and click-to-jump, the timing and calibration
views, find, CompareView's first difference, hostile trace strings shown as text,
and a saved notebook reopened without a kernel (and its nbconvert HTML) showing a
static figure. Screenshots go to test-artifacts/.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import nbformat
import numpy as np
import pytest
from browser_pages import (
    CHROMIUM,
    CHROMIUM_ARGS,
    HOSTILE,
    Lab,
    box,
    hostile_trace,
    inside,
    long_trace,
    open_notebook,
    placeholder_room,
    settled_box_inside,
    shown_box,
    step_latencies,
)
from trace_factory import make_trace

from spectool.trace.report import write_report

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
# Whole-notebook budget: loading the model and recording a generate on 2 CPU cores.
RUN_TIMEOUT_MS = 180_000
# The bound is 50 ms a step; a step slower than this fails outright.
STEP_FAIL_MS = 100.0
VIEWPORT = {"width": 1366, "height": 900}
WIDE = {"width": 1600, "height": 1000}
# The long trace of the open-time and chunk checks.
LONG_ITERATIONS = 10_000

if not CHROMIUM.exists() and os.environ.get("CI") != "true":
    pytest.skip("headless Chromium not installed (/usr/bin/chromium); run .ci/install-browser-deps.sh",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")


@pytest.fixture(scope="module")
def browser():
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@contextlib.contextmanager
def closed_on_exit(page, failure_png: str, errors: list | None = None) -> Iterator[None]:
    """Closes ``page`` after the block; a failure inside it first saves a full-page screenshot as
    test-artifacts/``failure_png`` (and prints the page's errors) for the CI artifacts."""
    try:
        yield
    except Exception:
        page.screenshot(path=str(ARTIFACTS / failure_png), full_page=True)
        if errors is not None:
            print("page errors:", errors)
        raise
    finally:
        page.close()


def drawn(view) -> list[int]:
    """Oracle for the nodes a view must show: the root and valid nodes whose parents are shown."""
    keep = [0]
    for i in range(1, len(view.parents)):
        if view.valid[i] and view.parents[i] in keep:
            keep.append(i)
    return keep


def _label_iteration(page, root: str) -> int:
    return int(page.locator(f"{root} .sv-label").first.inner_text().split()[1])


def _check_viewer(page, root: str, trace, request: int, name: str) -> dict:
    """The checks shared by the report and the notebook widget; returns the measured figures."""
    its = trace.iterations(request)
    # Tree, mask and text panel side by side / together, all inside the viewport.
    page.evaluate(f"() => document.querySelector('{root}').scrollIntoView({{block: 'start'}})")
    view = {"x": 0, "y": 0, **VIEWPORT}
    tree, mask = shown_box(page, f"{root} .spectool-tree"), shown_box(page, f"{root} .spectool-mask")
    assert mask["x"] >= tree["x"] + tree["width"] - 2 and abs(mask["y"] - tree["y"]) < 4, (tree, mask)
    for part in (".spectool-player", ".spectool-tree h4", ".spectool-mask h4", ".sv-tree-area svg",
                 ".spectool-mask svg", ".spectool-text"):
        b = shown_box(page, f"{root} {part}")
        assert b is not None and inside(b, view), f"{part} is not inside the {VIEWPORT} viewport: {b}"
    _check_placeholder(page, root)
    page.screenshot(path=str(ARTIFACTS / f"{name}_layout.png"))

    # Every position: the drawn nodes, mask rows and picker rows are the non-padding nodes.
    for k in range(min(len(its), 6)):
        page.evaluate(f"""() => {{ const s = document.querySelector('{root} .sv-slider');
                          s.value = '{k}'; s.dispatchEvent(new Event('input')); }}""")
        v = trace.iteration(its[k], request)
        want = drawn(v)
        got = page.evaluate(f"""() => [...document.querySelectorAll('{root} .sv-tree-area circle.sv-node')]
                                 .map(c => +c.dataset.node).sort((a, b) => a - b)""")
        assert got == want, (k, got, want)
        rows = page.locator(f"{root} .spectool-mask svg").get_attribute("data-nodes")
        options = page.locator(f"{root} .sv-row option").count()
        assert [int(r) for r in rows.split(",")] == want and options == len(want) + 1
        title = page.locator(f"{root} .spectool-tree h4").inner_text()
        if len(want) == 1:
            assert "only the root" in title
        padding = len(v.parents) - len(want)
        assert (f"{padding} padding not shown" in title) == (padding > 0), title
        # The text panel lights this iteration's accepted drafts and its bonus token.
        acc = page.locator(f"{root} .spectool-text .sv-acc").count()
        bonus = page.locator(f"{root} .spectool-text .sv-bonus").count()
        assert (acc, bonus) in ((v.accept_length, 1), (acc, 0)) and acc <= v.accept_length, (acc, bonus)

    # Clicking a token of the output jumps to the iteration that produced it.
    last = page.locator(f"{root} .spectool-text .sv-out").last
    last.click()
    assert _label_iteration(page, root) == its[-1]
    page.locator(f"{root} .spectool-text .sv-out").nth(1).click()
    assert _label_iteration(page, root) == its[0]

    # ← / → on the focused viewer step once.
    page.locator(f"{root} .sv-label").click()
    page.keyboard.press("ArrowRight")
    assert _label_iteration(page, root) == its[1]
    page.keyboard.press("ArrowLeft")
    assert _label_iteration(page, root) == its[0]

    # Timing (stacked phases) and calibration (one line per depth) are drawn.
    assert page.locator(f"{root} .spectool-timing .barlayer .point, {root} .spectool-timing .scatterlayer .trace"
                        ).count() > 0
    assert page.locator(f"{root} .spectool-calibration .scatterlayer .trace").count() >= 2

    # Find: the next iteration with accept length 0.
    accepts = [trace.iteration(i, request).accept_length for i in its]
    if 0 in accepts[1:]:
        page.select_option(f"{root} .sv-find-kind", "zero")
        page.locator(f"{root} .sv-find-next").click()
        assert _label_iteration(page, root) == its[1 + accepts[1:].index(0)]

    # Play at its fastest speed visits every iteration once, in order, then stops.
    seen = page.evaluate(f"""() => new Promise((done) => {{
      const root = document.querySelector('{root}');
      const label = root.querySelector('.sv-label'), play = root.querySelector('.sv-play');
      const seen = [];
      const watch = new MutationObserver(() => {{
        seen.push(+label.textContent.split(' ')[1]);
        if (play.textContent.includes('play')) {{ watch.disconnect(); done(seen); }}
      }});
      root.querySelector('.sv-speed').value = '20';
      const slider = root.querySelector('.sv-slider');
      slider.value = '0'; slider.dispatchEvent(new Event('input'));
      watch.observe(label, {{childList: true, characterData: true, subtree: true}});
      new MutationObserver(() => {{ if (play.textContent.includes('play')) {{ watch.disconnect(); done(seen); }} }})
        .observe(play, {{childList: true, characterData: true, subtree: true}});
      play.click();
    }})""")
    assert seen == its[1:len(seen) + 1] and seen[-1] == its[-1], seen

    # The page tells the kernel its position a second after stepping stops; let that settle first.
    page.wait_for_timeout(2500)
    ms = step_latencies(page, root, 14)[2:]  # the first two warm the page up
    page.screenshot(path=str(ARTIFACTS / f"{name}_stepped.png"))
    return {"median_ms": statistics.median(ms), "max_ms": max(ms), "steps_ms": [round(m, 1) for m in ms]}


def _check_placeholder(page, root: str) -> None:
    """The request search box shows its whole placeholder."""
    text, room = placeholder_room(page, f"{root} .sv-request-search")
    assert text <= room, f"the search box's placeholder needs {text:.0f} px and has {room:.0f} px"


def _check_latency(figures: dict) -> None:
    assert figures["median_ms"] <= STEP_FAIL_MS, f"step latency {figures['steps_ms']} ms"


def test_report_steps_in_the_page_without_network(browser, tmp_path):
    trace = make_trace("ngram", num_requests=2, batch_size=2, num_draft_tokens=64, max_new_tokens=60, seed=4)
    out = write_report(trace, tmp_path / "report.html")
    page = browser.new_page(viewport=VIEWPORT)
    outside = []
    page.on("request", lambda r: outside.append(r.url) if not r.url.startswith(("file:", "data:", "blob:")) else None)
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(out.as_uri())
        page.wait_for_selector(".spectool-tree svg circle")
        request = trace.request_ids[0]
        sizes = [len(drawn(trace.iteration(i, request))) for i in trace.iterations(request)]
        assert max(sizes) >= 48  # wide trees: the latency below is for trees of this size
        figures = _check_viewer(page, "#app", trace, request, "report")
        print(f"report step latency: {figures}")
        _check_latency(figures)
        page.select_option(".sv-request", "1")
        assert _label_iteration(page, "#app") == trace.iterations(trace.request_ids[1])[0]
    finally:
        page.close()
    assert outside == [] and errors == []


def _check_hostile(page, scope: str) -> None:
    """No script ran, and the hostile strings are on the page as literal text."""
    assert page.evaluate("() => window.__pwned") is None
    assert "pwned" not in page.title()
    text = page.locator(f"{scope} .spectool-text").first.inner_text()
    assert any(h[:12] in text for h in HOSTILE), text  # the prompt's tokens, literally
    labels = page.evaluate(f"() => [...document.querySelectorAll('{scope} svg text')].map(t => t.textContent)")
    assert any("</scr" in t or "<img" in t or "<a h" in t for t in labels)
    assert any("␣" in t for t in labels) and any("⏎" in t for t in labels)  # whitespace tokens are visible


def test_hostile_trace_strings_stay_text_in_the_report(browser, tmp_path):
    trace = hostile_trace(tmp_path / "hostile.sptrace")
    out = write_report(tmp_path / "hostile.sptrace", tmp_path / "hostile.html")
    page = browser.new_page(viewport=VIEWPORT)
    dialogs = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    try:
        page.goto(out.as_uri())
        page.wait_for_selector(".spectool-tree svg circle")
        _check_hostile(page, "#app")
        assert HOSTILE[0] in page.evaluate("() => document.querySelector('.sv-facts').textContent")
        # Hover a node: the tooltip is text too.
        page.locator(".sv-tree-area circle.sv-node").first.hover()
        assert page.locator(".sv-tip").is_visible()
        page.screenshot(path=str(ARTIFACTS / "report_hostile.png"))
    finally:
        page.close()
    assert dialogs == [] and trace is not None


@pytest.fixture(scope="module")
def lab(tmp_path_factory, demo_model_dir):
    """JupyterLab rooted at copies of notebook 02 and a notebook of synthetic traces (views.ipynb)."""
    work = tmp_path_factory.mktemp("lab")
    root = work / "root"
    root.mkdir()
    shutil.copy(ROOT / "notebooks" / "02_trees_and_masks.ipynb", root)
    make_trace("eagle", path=root / "wide.sptrace", num_requests=2, batch_size=2, num_draft_tokens=64,
               max_new_tokens=60, seed=4)
    make_trace("ngram", path=root / "a.sptrace", num_requests=2, batch_size=2, num_draft_tokens=8, seed=7)
    # Same prompts, sampled instead of greedy: the outputs part somewhere.
    make_trace("eagle", path=root / "b.sptrace", num_requests=2, batch_size=2, num_draft_tokens=8, seed=7,
               temperature=1.0)
    # The wide run again, sampled: 64-node trees on both sides, outputs that part somewhere.
    make_trace("ngram", path=root / "wide_sampled.sptrace", num_requests=2, batch_size=2, num_draft_tokens=64,
               max_new_tokens=60, seed=4, temperature=1.0)
    hostile_trace(root / "hostile.sptrace")
    long_trace(LONG_ITERATIONS, 64).save(root / "long.sptrace")
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in (
        "from spectool.widgets import TraceViewer", "TraceViewer('long.sptrace')")]), root / "long.ipynb")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in (
        "from spectool.widgets import CompareView, TraceViewer\nTraceViewer('wide.sptrace')",
        "TraceViewer('hostile.sptrace')",
        "CompareView('a.sptrace', 'b.sptrace')")]
    nbformat.write(nb, root / "views.ipynb")
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in (
        "from spectool.widgets import MaskView, TraceViewer, TreeView\nTreeView('wide.sptrace')",
        "MaskView('wide.sptrace')", "TraceViewer('wide.sptrace')")]),
        root / "standalone.ipynb")
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in (
        "from spectool.widgets import CompareView\nCompareView('wide.sptrace', 'wide_sampled.sptrace')",
        "import spectool as st\nfrom spectool.trace.reader import Trace\na = Trace.load('a.sptrace')\n"
        "CompareView(a, st.tune(a, grid=[st.NgramConfig(num_draft_tokens=2)], progress=False).predictions[0])")]),
        root / "compare.ipynb")
    server = Lab(root, work, {"SPECTOOL_MODEL_DIR": str(demo_model_dir), "SPECTOOL_MAX_NEW_TOKENS": "16",
                              "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    yield server, root
    server.stop()


def test_views_in_jupyterlab_then_reopened_without_a_kernel(browser, lab, tmp_path):
    server, root = lab
    page = browser.new_page(viewport=VIEWPORT)
    dialogs = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    with closed_on_exit(page, "lab_failure.png"):
        open_notebook(page, server, "views.ipynb")
        page.wait_for_selector(".spectool-compare .sv-tree-area circle", timeout=RUN_TIMEOUT_MS)
        page.wait_for_function("() => document.querySelectorAll('.spectool-viewer .sv-tree-area circle').length > 8",
                               timeout=60_000)
        assert page.locator(".jp-FileBrowser").first.is_visible()
        from spectool.trace.reader import Trace

        wide = Trace.load(root / "wide.sptrace")
        first = ".jp-Cell:nth-child(1) .spectool-viewer"
        figures = _check_viewer(page, first, wide, wide.request_ids[0], "lab_viewer")
        print(f"JupyterLab step latency: {figures}")

        _check_hostile(page, ".jp-Cell:nth-child(2) .spectool-viewer")

        # CompareView: the first output position where the runs differ, one click away.
        a, b = Trace.load(root / "a.sptrace"), Trace.load(root / "b.sptrace")
        r = sorted(set(a.request_ids) & set(b.request_ids))[0]
        ta, tb = (np.asarray(t.request(r)["output_tokens"]) for t in (a, b))
        n = min(len(ta), len(tb))
        diff = np.nonzero(ta[:n] != tb[:n])[0]
        compare = page.locator(".spectool-compare").first
        compare.scroll_into_view_if_needed()
        page.wait_for_function("() => (document.querySelector('.spectool-compare-summary') || {}).innerText",
                               timeout=30_000)
        summary = compare.locator(".spectool-compare-summary").inner_text()
        if len(diff):
            assert f"first difference at output token {int(diff[0])}" in summary
            compare.locator(".spectool-compare-jump").click()
            assert compare.locator(".sv-label").inner_text().startswith(f"output token {int(diff[0])} ")
        else:
            assert "identical" in summary
        page.screenshot(path=str(ARTIFACTS / "lab_compare.png"))

        # Save the notebook (JupyterLab keeps the widget state in it) once the page has told the kernel
        # where the viewer stands.
        page.locator(f"{first} .sv-next").click()
        saved_label = page.locator(f"{first} .sv-label").inner_text()
        page.wait_for_timeout(2500)
        # The toolbar's save button: a Ctrl+S pressed with the focus in an output may never reach the command.
        page.locator(".jp-NotebookPanel-toolbar [data-command='docmanager:save']").first.click()
        page.wait_for_function("() => !document.querySelector('.jp-mod-current.jp-mod-dirty')", timeout=30_000)
    assert dialogs == []

    # Reopen it the next day: a fresh JupyterLab whose fresh kernel has run nothing. Every view shows its
    # last state (the viewer from its saved state, still stepping in the page), no "model not found".
    server.shutdown_kernels()
    reopened = Lab(root, tmp_path, {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    page = browser.new_page(viewport=VIEWPORT)
    try:
        with closed_on_exit(page, "lab_reopened_failure.png"):
            page.goto(f"{reopened.url}/lab/tree/views.ipynb?token={reopened.token}")
            page.wait_for_function("() => document.querySelectorAll("
                                   "'.spectool-viewer .sv-tree-area svg, img.spectool-snapshot').length >= 2",
                                   timeout=90_000)
            page.wait_for_timeout(1500)
            assert page.get_by_text("model not found").count() == 0
            assert page.locator(".jp-Cell:nth-child(1) .jp-InputPrompt").first.inner_text().strip() == "[1]:"
            if page.locator(f"{first} .sv-label").count():  # live again: at the saved position
                assert page.locator(f"{first} .sv-label").inner_text() == saved_label
            page.screenshot(path=str(ARTIFACTS / "lab_reopened.png"))
    finally:
        reopened.stop()

    # The same notebook as static HTML, saved as JupyterLab saves it by default (no widget state, which
    # nbconvert would hand to the widget manager it loads from the network): the snapshot is an image.
    nb = nbformat.read(root / "views.ipynb", as_version=4)
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, tmp_path / "plain.ipynb")
    html_out = tmp_path / "views.html"
    subprocess.run([sys.executable, "-m", "nbconvert", "--to", "html", "--output", str(html_out),
                    str(tmp_path / "plain.ipynb")], check=True, capture_output=True)
    page = browser.new_page(viewport=VIEWPORT)
    try:
        page.route("http*://**", lambda route: route.abort())  # no network here, as for a reader offline
        page.goto(html_out.as_uri())
        assert page.locator("img.spectool-snapshot").count() >= 2
        assert page.evaluate("() => [...document.querySelectorAll('img.spectool-snapshot')]"
                             ".every(i => i.complete && i.naturalWidth > 100)")
        page.screenshot(path=str(ARTIFACTS / "nbconvert.png"), full_page=True)
    finally:
        page.close()
    _check_latency(figures)


def test_notebook_02_in_jupyterlab(browser, lab):
    server, _ = lab
    page = browser.new_page(viewport=VIEWPORT)
    try:
        open_notebook(page, server, "02_trees_and_masks.ipynb")
        page.wait_for_selector(".spectool-viewer .sv-tree-area circle", timeout=RUN_TIMEOUT_MS)
        assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
                            ).filter(has_text="Traceback").count() == 0, "a cell raised"
        root = ".spectool-viewer"
        page.evaluate(f"() => document.querySelector('{root}').scrollIntoView({{block: 'start'}})")
        tree, mask = shown_box(page, f"{root} .spectool-tree"), shown_box(page, f"{root} .spectool-mask")
        assert mask["x"] >= tree["x"] + tree["width"] - 2
        for part in (".spectool-player", ".sv-tree-area svg", ".spectool-mask svg", ".spectool-text"):
            b = shown_box(page, f"{root} {part}")
            assert b is not None and inside(b, {"x": 0, "y": 0, **VIEWPORT}), f"{part}: {b}"
        before = page.locator(f"{root} .sv-label").inner_text()
        page.locator(f"{root} .sv-next").click()
        assert page.locator(f"{root} .sv-label").inner_text() != before
        page.screenshot(path=str(ARTIFACTS / "02_viewer.png"))
    finally:
        page.close()


def _picture_count(nb) -> int:
    return sum(o.get("data", {}).get("text/html", "").count('class="spectool-snapshot"')
               for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_stored_notebooks_show_their_pictures_with_no_kernel_and_as_static_html(browser, tmp_path):
    """The shipped notebooks, trusted (as a user's own saved notebook is), in a JupyterLab that can start no
    kernel at all: every view is its static picture. A control copy whose outputs still hold the live widget
    beside the picture (as JupyterLab saves a view by default) shows "Loading widget..." instead: for a trusted
    notebook JupyterLab always prefers the widget. Then the same notebooks through nbconvert, from file://."""
    from spectool.widgets.saved import WIDGET_VIEW

    root = tmp_path / "root"
    root.mkdir()
    names = ["02_trees_and_masks.ipynb", "04_ngram_vs_eagle.ipynb"]
    for name in [*names, "01_live_decoding.ipynb"]:
        shutil.copy(ROOT / "notebooks" / name, root)
    control = nbformat.read(root / names[0], as_version=4)
    views = [o for c in control.cells if c.cell_type == "code" for o in c.outputs if "spectool-snapshot" in
             o.get("data", {}).get("text/html", "")]
    for out in views:
        out.data[WIDGET_VIEW] = {"model_id": "f" * 32, "version_major": 2, "version_minor": 0}
    nbformat.write(control, root / "as_saved.ipynb")
    env = {"JUPYTER_DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "jupyter", "trust", *map(str, sorted(root.glob("*.ipynb")))],
                   env={**os.environ, **env}, check=True, capture_output=True)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "jupyter_server_config.json").write_text(
        json.dumps({"KernelSpecManager": {"allowed_kernelspecs": ["none"]}}))  # no kernel can start
    server = Lab(root, tmp_path, env)
    page = browser.new_page(viewport=VIEWPORT)
    try:
        with closed_on_exit(page, "lab_no_kernel_failure.png"):
            for name in [*names, "as_saved.ipynb"]:
                page.goto(f"{server.url}/lab/tree/{name}?token={server.token}&reset")
                page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
                page.locator(".jp-Dialog", has_text="Select Kernel").wait_for(timeout=30_000)
                page.keyboard.press("Escape")  # keep "No Kernel"
                page.get_by_text("No Kernel").first.wait_for(timeout=10_000)
                if name == "as_saved.ipynb":
                    page.get_by_text("Loading widget...").first.wait_for(timeout=30_000)
                    assert page.locator("img.spectool-snapshot").count() == 0
                    page.get_by_text("Loading widget...").first.scroll_into_view_if_needed()
                    page.screenshot(path=str(ARTIFACTS / "lab_no_kernel_control.png"))
                    continue
                want = _picture_count(nbformat.read(root / name, as_version=4))
                assert want >= 1
                pictures = page.locator(".jp-OutputArea-output img.spectool-snapshot")
                for k in range(want):  # JupyterLab draws cells as they scroll into view
                    pictures.nth(k).scroll_into_view_if_needed(timeout=30_000)
                    page.wait_for_function("(k) => { const i = document.querySelectorAll("
                                           "'.jp-OutputArea-output img.spectool-snapshot')[k];"
                                           " return i && i.complete && i.naturalWidth > 300; }", arg=k, timeout=10_000)
                    assert pictures.nth(k).is_visible()
                assert page.get_by_text("Loading widget").count() == 0
                assert page.get_by_text("model not found").count() == 0
                pictures.first.scroll_into_view_if_needed()
                page.screenshot(path=str(ARTIFACTS / f"lab_no_kernel_{name[:2]}.png"))
    finally:
        server.stop()

    from nbconvert import HTMLExporter

    exporter = HTMLExporter()
    own = {exporter.require_js_url, exporter.mathjax_url}  # the template's head scripts, not the outputs'
    outside: list[str] = []
    for name in [*names, "01_live_decoding.ipynb"]:  # 01: LiveDecode's text and two plotly figures' PNGs
        html_out = tmp_path / f"{name[:2]}.html"
        subprocess.run([sys.executable, "-m", "nbconvert", "--to", "html", "--output", str(html_out),
                        str(root / name)], check=True, capture_output=True)
        page = browser.new_page(viewport=VIEWPORT)
        page.on("request", lambda r: outside.append(r.url) if not r.url.startswith(("file:", "data:")) else None)
        page.route("http*://**", lambda route: route.abort())  # a reader offline
        try:
            page.goto(html_out.as_uri())
            nb = nbformat.read(root / name, as_version=4)
            figures = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
            images = "img.spectool-snapshot, img[src^='data:image/png']"
            assert page.locator(images).count() == _picture_count(nb) + figures >= 1
            assert page.evaluate(f"() => [...document.querySelectorAll({images!r})]"
                                 ".every(i => i.complete && i.naturalWidth > 300)")
            if "01" in name:
                assert page.locator(".spectool-live-static").filter(has_text="accept length").count() == 2
            page.locator(images).first.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / f"nbconvert_{name[:2]}.png"))
        finally:
            page.close()
        assert set(outside) <= own, set(outside) - own


# Re-running a cell: the time from now until a new viewer (not `old`) has drawn its first tree.
OPEN_WATCH_JS = """(sel) => {
  const old = document.querySelector(sel);
  window.__openMs = undefined;
  const t0 = performance.now();
  const watch = new MutationObserver(() => {
    const v = document.querySelector(sel);
    if (v && v !== old && v.querySelector('.sv-tree-area circle')) {
      window.__openMs = performance.now() - t0;
      watch.disconnect();
    }
  });
  watch.observe(document.body, {childList: true, subtree: true});
}"""

# Steps from position `first` to `last` one at a time: per step the time to the next paint and whether
# the tree was there (not waiting for its chunk).
STEP_RANGE_JS = """async ([sel, first, last]) => {
  const root = document.querySelector(sel);
  const slider = root.querySelector('.sv-slider'), label = root.querySelector('.sv-label');
  const frame = () => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
  const out = [];
  for (let k = first; k <= last; k++) {
    const t0 = performance.now();
    slider.value = String(k);
    slider.dispatchEvent(new Event('input', {bubbles: true}));
    await frame();
    out.push([performance.now() - t0, label.textContent.includes('loading')]);
  }
  return out;
}"""


def test_a_long_trace_opens_and_steps_across_chunks_in_jupyterlab(browser, lab):
    """10,000 iterations: the open time (measured in the page, reported, not a pass mark), stepping over
    the edge of the chunks the page holds, and a jump far away (its chunk asked from the kernel)."""
    server, root = lab
    page = browser.new_page(viewport=WIDE)
    viewer = ".jp-Cell:nth-child(2) .spectool-viewer"
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    server.shutdown_kernels()  # the notebooks before: Run All waits for this notebook's kernel alone
    with closed_on_exit(page, "lab_long_failure.png", errors):
        open_notebook(page, server, "long.ipynb")
        page.wait_for_selector(f"{viewer} .sv-tree-area circle", timeout=RUN_TIMEOUT_MS)
        # Open time of the viewer alone: its cell again, spectool imported and plotly.js on the page.
        page.evaluate(OPEN_WATCH_JS, viewer)
        page.locator(".jp-Cell:nth-child(2) .jp-InputArea-editor").click()
        page.keyboard.press("Control+Enter")
        page.wait_for_function("() => window.__openMs !== undefined", timeout=120_000)
        open_ms = page.evaluate("() => window.__openMs")
        print(f"JupyterLab: TraceViewer of {LONG_ITERATIONS} iterations, cell run to first tree: {open_ms:.0f} ms")
        (ARTIFACTS / "long_trace_open.txt").write_text(f"{LONG_ITERATIONS} iterations: {open_ms:.0f} ms\n")
        page.wait_for_timeout(500)
        page.screenshot(path=str(ARTIFACTS / "lab_long_1600.png"))

        from spectool.trace.reader import Trace

        trace = Trace.load(root / "long.sptrace")
        # Near the end of the first chunk the page asks for the next one ahead: stepping over the edge
        # never waits for the kernel.
        page.evaluate(STEP_RANGE_JS, [viewer, 200, 200])
        page.wait_for_timeout(3000)
        steps = page.evaluate(STEP_RANGE_JS, [viewer, 240, 272])
        ms = [t for t, _ in steps[2:]]
        print(f"step latency over the chunk edge: median {statistics.median(ms):.1f} ms, max {max(ms):.1f} ms")
        assert not any(loading for _, loading in steps), steps
        assert _label_iteration(page, viewer) == 272
        # A jump far away: shown as loading, then drawn when its chunk arrives.
        far = 7_003
        page.evaluate(STEP_RANGE_JS, [viewer, far, far])
        page.wait_for_function(f"""() => {{ const l = document.querySelector('{viewer} .sv-label').textContent;
                                   return l.startsWith('iteration {far} ') && !l.includes('loading'); }}""",
                               timeout=30_000)
        got = page.evaluate(f"""() => [...document.querySelectorAll('{viewer} .sv-tree-area circle.sv-node')]
                                 .map(c => +c.dataset.node).sort((a, b) => a - b)""")
        assert got == drawn(trace.iteration(far, 0))
        page.screenshot(path=str(ARTIFACTS / "lab_long_far.png"))
    assert statistics.median(ms) <= STEP_FAIL_MS, f"step latency {ms} ms"


# Counts what the page sends its kernel (every comm message goes over the kernel's websocket).
COUNT_SENDS_JS = """() => { window.__spectoolSent = 0; const send = WebSocket.prototype.send;
  WebSocket.prototype.send = function (data) { window.__spectoolSent++; return send.call(this, data); }; }"""


def test_standalone_tree_and_mask_step_in_the_page_in_jupyterlab(browser, lab):
    """TreeView and MaskView step from data in the page: each step draws that iteration's nodes and sends
    the kernel nothing (the page reports its position once, after stepping pauses)."""
    from spectool.trace.reader import Trace

    server, root = lab
    wide = Trace.load(root / "wide.sptrace")
    request = wide.request_ids[0]
    its = wide.iterations(request)
    page = browser.new_page(viewport=VIEWPORT)
    page.add_init_script(f"({COUNT_SENDS_JS})()")
    try:
        open_notebook(page, server, "standalone.ipynb")
        tree, mask = (f".jp-Cell:nth-child({k}) .spectool-viewer" for k in (1, 2))
        page.wait_for_function(f"() => document.querySelectorAll('{tree} .sv-tree-area circle').length > 8",
                               timeout=RUN_TIMEOUT_MS)
        page.wait_for_selector(f"{mask} .spectool-mask svg", timeout=60_000)
        assert page.locator(f"{tree} .spectool-mask, {mask} .spectool-tree, {tree} .spectool-timing").count() == 0
        page.wait_for_timeout(2500)  # the kernel's replies to opening settle
        steps = min(len(its), 6)
        got = page.evaluate(f"""() => {{
          const before = window.__spectoolSent, out = [];
          for (const sel of ['{tree}', '{mask}']) {{
            const s = document.querySelector(sel + ' .sv-slider');
            for (let k = 0; k < {steps}; k++) {{
              s.value = String(k); s.dispatchEvent(new Event('input'));
              out.push(sel === '{tree}'
                ? [...document.querySelectorAll(sel + ' .sv-tree-area circle.sv-node')].map(c => [+c.dataset.node,
                    ['sv-unvisited', 'sv-accepted', 'sv-rejected'].findIndex(k => c.classList.contains(k))])
                    .sort((a, b) => a[0] - b[0])
                : [document.querySelector(sel + ' .spectool-mask svg').dataset.nodes.split(',').map(Number),
                   document.querySelector(sel + ' .spectool-mask h4').textContent.split(' · ')[2]]);
            }}
          }}
          return {{drawn: out, sent: window.__spectoolSent - before}};
        }}""")
        views = [wide.iteration(its[k], request) for k in range(steps)]
        # Oracle: the shown nodes with their recorded status; the mask's rows and its accepted path's last node.
        trees = [[[i, int(v.status[i])] for i in drawn(v)] for v in views]
        masks = [[drawn(v), f"row {max(int(a) for a in v.accept_path)}"] for v in views]
        assert got["drawn"][:steps] == trees and len({str(t) for t in trees}) > 1
        assert [[m[0], " ".join(m[1].split(" ")[:2])] for m in got["drawn"][steps:]] == masks
        assert got["sent"] == 0, f"{got['sent']} kernel messages for {2 * steps} steps"
        page.wait_for_timeout(2500)
        assert page.evaluate("() => window.__spectoolSent") > 0  # the position report, once stepping paused
        ms = step_latencies(page, tree, 14)[2:]
        print(f"standalone TreeView step latency: median {statistics.median(ms):.1f} ms, max {max(ms):.1f} ms")
        whole = step_latencies(page, ".jp-Cell:nth-child(3) .spectool-viewer", 14)[2:]
        print(f"TraceViewer step latency, same page: median {statistics.median(whole):.1f} ms, max {max(whole):.1f} ms")
        viewer = ".jp-Cell:nth-child(3) .spectool-viewer"
        _check_placeholder(page, viewer)
        page.set_viewport_size(WIDE)
        page.evaluate(f"() => document.querySelector('{viewer}').scrollIntoView({{block: 'start'}})")
        page.wait_for_timeout(500)
        _check_placeholder(page, viewer)
        page.screenshot(path=str(ARTIFACTS / "lab_viewer_1600.png"))
        page.set_viewport_size(VIEWPORT)
        page.evaluate(f"() => document.querySelector('{tree}').scrollIntoView({{block: 'start'}})")
        page.wait_for_timeout(500)
        page.screenshot(path=str(ARTIFACTS / "lab_standalone_views.png"))
        page.locator(mask).screenshot(path=str(ARTIFACTS / "lab_standalone_mask.png"))
    finally:
        page.close()
    assert statistics.median(ms) <= STEP_FAIL_MS, f"step latency {ms} ms"


def covering(trace, request: int) -> list[int]:
    """Oracle: per output position of `request`, the iteration that produced it, walking the iterations (each
    adds its accepted drafts and a bonus token); position 0 comes from prefill (-1)."""
    out = [-1]
    for it in trace.iterations(request):
        out += [it] * (trace.iteration(it, request).accept_length + 1)
    return out[:len(trace.request(request)["output_tokens"])]


# Every output position in turn: the label, per side the drawn tree nodes (None: that side shows no tree) and
# the side notes; and how many messages the page sent its kernel meanwhile.
COMPARE_STEPS_JS = """([sel, n]) => {
  const root = document.querySelector(sel), slider = root.querySelector('.sv-slider');
  const before = window.__spectoolSent, out = [];
  for (let t = 0; t < n; t++) {
    slider.value = String(t);
    slider.dispatchEvent(new Event('input'));
    out.push([root.querySelector('.sv-label').textContent,
      [...root.querySelectorAll('.sv-compare-side')].map((side) => (side.classList.contains('sv-compare-idle')
        ? null : [...side.querySelectorAll('.sv-tree-area circle.sv-node')].map((c) => +c.dataset.node)
          .sort((a, b) => a - b))),
      [...root.querySelectorAll('.sv-compare-note')].map((note) => note.textContent)]);
  }
  return {steps: out, sent: window.__spectoolSent - before};
}"""

# Play at its fastest from position 0: the positions the label shows, until it stops.
COMPARE_PLAY_JS = """(sel) => new Promise((done) => {
  const root = document.querySelector(sel);
  const label = root.querySelector('.sv-label'), play = root.querySelector('.sv-play');
  const slider = root.querySelector('.sv-slider');
  slider.value = '0'; slider.dispatchEvent(new Event('input'));
  root.querySelector('.sv-speed').value = '20';
  const seen = [];
  const watch = new MutationObserver(() => seen.push(+label.textContent.split(' ')[2]));
  watch.observe(label, {childList: true, characterData: true, subtree: true});
  new MutationObserver(() => { if (play.textContent.includes('play')) { watch.disconnect(); done(seen); } })
    .observe(play, {childList: true, characterData: true, subtree: true});
  play.click();
})"""


def _compare_label_position(page, root: str) -> int:
    return int(page.locator(f"{root} .sv-label").inner_text().split()[2])


def _check_compare_plot(page, root: str) -> None:
    """The plot is whole: its x-axis title sits above the trees, not under them."""
    title = shown_box(page, f"{root} .spectool-compare-plot .xtitle")
    side = shown_box(page, f"{root} .sv-compare-side-a")
    assert title["y"] + title["height"] <= side["y"], (title, side)


def test_compare_view_steps_in_the_page_in_jupyterlab(browser, lab):
    """CompareView of two 64-node-tree runs: each output position draws, on each side, the tree of the
    iteration that produced it, from data in the page (no kernel message); the first difference is marked
    and one click away; keys, Play and the request picker step it; the latency of a step is measured in the
    page. A recorded run against the tuner's prediction of a smaller tree shows the predicted trees."""
    from spectool.trace.reader import Trace

    server, root = lab
    a, b = Trace.load(root / "wide.sptrace"), Trace.load(root / "wide_sampled.sptrace")
    requests = sorted(set(a.request_ids) & set(b.request_ids))
    r = requests[0]
    want = [covering(t, r) for t in (a, b)]
    ta, tb = (np.asarray(t.request(r)["output_tokens"]) for t in (a, b))
    n = min(len(ta), len(tb))
    diff = np.nonzero(ta[:n] != tb[:n])[0]
    assert len(diff), "the sampled run should part from the greedy one"
    first = int(diff[0])
    page = browser.new_page(viewport=VIEWPORT)
    page.add_init_script(f"({COUNT_SENDS_JS})()")
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    cmp = ".jp-Cell:nth-child(1) .spectool-compare-page"
    with closed_on_exit(page, "lab_compare_failure.png", errors):
        open_notebook(page, server, "compare.ipynb")
        page.wait_for_function(f"() => [...document.querySelectorAll('{cmp} .sv-compare-tree')]"
                               ".filter(t => t.querySelectorAll('circle').length > 8).length === 2",
                               timeout=RUN_TIMEOUT_MS)
        page.wait_for_selector(f"{cmp} .spectool-compare-plot .scatterlayer .trace", timeout=60_000)
        assert page.locator(".jp-FileBrowser").first.is_visible()
        heads = page.locator(f"{cmp} .sv-compare-label").all_inner_texts()
        assert heads[0].startswith("A: eagle") and heads[1].startswith("B: ngram"), heads
        assert "num_draft_tokens=64" in heads[0] and "num_draft_tokens=64" in heads[1]
        summary = page.locator(f"{cmp} .spectool-compare-summary").inner_text()
        assert f"first difference at output token {first}" in summary and "accepted more at" in summary, summary
        assert _compare_label_position(page, cmp) == first  # it opens at the first difference

        # One screen at 1366 px with the file browser open: player, plot, summary and both trees side by side.
        page.evaluate(f"() => document.querySelector('{cmp}').scrollIntoView({{block: 'start'}})")
        view = box(page, ".jp-NotebookPanel .jp-WindowedPanel-outer")  # the notebook's visible area
        side_a, side_b = shown_box(page, f"{cmp} .sv-compare-side-a"), shown_box(page, f"{cmp} .sv-compare-side-b")
        assert side_b["x"] >= side_a["x"] + side_a["width"] - 2 and abs(side_b["y"] - side_a["y"]) < 4
        for part in (".spectool-player", ".spectool-compare-plot", ".spectool-compare-summary",
                     ".sv-compare-side-a .sv-tree-area svg", ".sv-compare-side-b .sv-tree-area svg"):
            b_ = settled_box_inside(page, f"{cmp} {part}", view)
            assert b_ is not None and inside(b_, view), f"{part} is not inside the notebook's area {view}: {b_}"
        _check_compare_plot(page, cmp)
        page.screenshot(path=str(ARTIFACTS / "lab_compare_1366.png"))

        # Every output position: each side draws the tree of the iteration that produced it (none for
        # prefill or past its output), and the page asks its kernel nothing.
        page.wait_for_timeout(2500)  # the page's position report after opening
        length = max(len(w) for w in want)
        got = page.evaluate(COMPARE_STEPS_JS, [cmp, length])
        assert got["sent"] == 0, f"{got['sent']} kernel messages for {length} steps"
        for t, (label, trees, notes) in enumerate(got["steps"]):
            assert label.startswith(f"output token {t} ({t + 1}/{length})"), label
            for trace, cover, nodes, note in zip((a, b), want, trees, notes):
                it = cover[t] if t < len(cover) else None
                if it is None or it < 0:
                    assert nodes is None, (t, note)
                else:
                    assert nodes == drawn(trace.iteration(it, r)), (t, it)
                    assert note.startswith(f"from iteration {it} "), note

        # The first difference, one click away; ← / → step one output token.
        page.locator(f"{cmp} .spectool-compare-jump").click()
        assert _compare_label_position(page, cmp) == first
        page.locator(f"{cmp} .sv-label").click()
        page.keyboard.press("ArrowRight")
        assert _compare_label_position(page, cmp) == first + 1
        page.keyboard.press("ArrowLeft")
        assert _compare_label_position(page, cmp) == first
        # A click on the plot's line picks that output position (plotly's click event, as a click on a point).
        page.evaluate(f"() => document.querySelector('{cmp} .spectool-compare-plot .sv-plot-area')"
                      ".emit('plotly_click', {points: [{x: 5}]})")
        assert _compare_label_position(page, cmp) == 5

        # Play at its fastest visits every output position once, in order, then stops.
        seen = page.evaluate(COMPARE_PLAY_JS, cmp)
        assert seen == list(range(1, length)), seen

        # Input to the next paint, in the page.
        page.wait_for_timeout(2500)
        ms = step_latencies(page, cmp, 14)[2:]  # the first two warm the page up
        print(f"JupyterLab CompareView step latency: median {statistics.median(ms):.1f} ms, max {max(ms):.1f} ms, "
              f"steps {[round(m, 1) for m in ms]}")

        # Another request from the picker: its own alignment, opened at its first difference (or token 1).
        other = requests[1]
        page.select_option(f"{cmp} .sv-request", "1")
        outs = [list(t.request(other)["output_tokens"]) for t in (a, b)]
        start = next((k for k, (x, y) in enumerate(zip(*outs)) if x != y), None)
        start = start if start is not None else (min(map(len, outs)) if len(outs[0]) != len(outs[1]) else 1)
        assert _compare_label_position(page, cmp) == start
        it = covering(a, other)[start]
        if it >= 0:
            side = f"{cmp} .sv-compare-side-a .sv-tree-area circle.sv-node"
            nodes = page.evaluate(f"() => [...document.querySelectorAll('{side}')].map(c => +c.dataset.node)"
                                  ".sort((a, b) => a - b)")
            assert nodes == drawn(a.iteration(it, other))

        # The recorded run against the tuner's prediction for two draft tokens: side B draws predicted trees.
        predicted = ".jp-Cell:nth-child(2) .spectool-compare-page"
        page.wait_for_selector(f"{predicted} .sv-compare-side-b .sv-tree-area circle", timeout=RUN_TIMEOUT_MS)
        heads = page.locator(f"{predicted} .sv-compare-label").all_inner_texts()
        assert heads[1].startswith("B: predicted ngram") and "num_draft_tokens=2" in heads[1], heads
        steps = page.evaluate(COMPARE_STEPS_JS, [predicted, 12])["steps"]
        sizes = [len(trees[1]) for _, trees, _ in steps if trees[1] is not None]
        assert sizes and max(sizes) <= 3, sizes  # the root and at most two drafted nodes
        page.evaluate(f"() => document.querySelector('{predicted}').scrollIntoView({{block: 'start'}})")
        page.screenshot(path=str(ARTIFACTS / "lab_compare_predicted.png"))

        page.set_viewport_size(WIDE)
        page.evaluate(f"() => document.querySelector('{cmp}').scrollIntoView({{block: 'start'}})")
        view = box(page, ".jp-NotebookPanel .jp-WindowedPanel-outer")
        for part in (".spectool-player", ".sv-compare-side-a .sv-tree-area svg",
                     ".sv-compare-side-b .sv-tree-area svg"):
            b_ = settled_box_inside(page, f"{cmp} {part}", view)
            assert b_ is not None and inside(b_, view), f"{part} is not inside the notebook's area {view}: {b_}"
        _check_compare_plot(page, cmp)
        page.screenshot(path=str(ARTIFACTS / "lab_compare_1600.png"))
    assert errors == []
    assert statistics.median(ms) <= STEP_FAIL_MS, f"step latency {ms} ms"
