"""Every notebook in notebooks/ runs end to end on the CPU with the bundled demo model, and is stored
with its outputs: each view as its static picture, small, and made from the cells as they are now.

Each runs in a fresh kernel from a scratch copy, with SPECTOOL_MODEL_DIR pointing at the model
directory; a cell that raises fails the test with the cell's traceback. The stored outputs are
written by the same run:

    SPECTOOL_STORE_NOTEBOOKS=1 PYTHONPATH=$PWD python -m pytest -q tests/test_notebooks.py -k runs

which executes each notebook and saves it through `spectool.widgets.saved.keep_static` (the live
widget references dropped, the pictures kept), with a digest of its code cells in its metadata.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from spectool.widgets.saved import WIDGET_STATE, WIDGET_VIEW, keep_static

PLOTLY = "application/vnd.plotly.v1+json"

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Per-cell limit; every notebook is meant to finish in under two minutes on 2 CPU cores.
CELL_TIMEOUT_S = 120
# The tokens per prompt of a stored run (the notebooks' own default is 64; CPU runs stay short).
STORED_MAX_NEW_TOKENS = "12"
# A stored notebook with its pictures stays below this (the largest is about a third of it).
MAX_STORED_BYTES = 400_000
STORE = os.environ.get("SPECTOOL_STORE_NOTEBOOKS") == "1"
# The views whose outputs must be pictures; their text/plain repr names them.
VIEW_REPR = re.compile(r"^(<spectool\.widgets\.\w+\.)?"
                       r"(TraceViewer|CompareView|LiveDecode|TuningPanel|TreeView|MaskView)\b")


def code_digest(nb) -> str:
    """What the stored outputs were made from: the code cells' sources, in order."""
    text = "\n\0".join(c.source for c in nb.cells if c.cell_type == "code")
    return hashlib.sha256(text.encode()).hexdigest()


def view_outputs(nb) -> list[dict]:
    """The outputs of the spectool views in `nb` (an execute_result or display_data of a view)."""
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            data = out.get("data", {})
            if WIDGET_VIEW in data or VIEW_REPR.match(data.get("text/plain", "")):
                found.append(data)
    return found


def stored_form(nb) -> None:
    """`nb` as the repository keeps it: each view as its picture (keep_static), and no output that
    only a live kernel could show (a progress bar's widget would read "0%" forever)."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs
                            if WIDGET_VIEW not in o.get("data", {}) or VIEW_REPR.match(o.data.get("text/plain", ""))]
            for out in cell.outputs:  # paths inside the checkout are printed relative to it
                if out.output_type == "stream":
                    out.text = out.text.replace(f"{ROOT}/", "")
                elif "text/plain" in out.get("data", {}):
                    out.data["text/plain"] = out.data["text/plain"].replace(f"{ROOT}/", "")
    keep_static(nb)


def draw_plotly_figures(nb) -> None:
    """Give each plotly figure output a PNG of itself, drawn by headless Chromium from plotly's own bundled
    plotly.js (no network), for readers without plotly's JupyterLab extension: nbconvert's HTML, repository
    viewers."""
    figures = [o.data for c in nb.cells if c.cell_type == "code" for o in c.outputs if PLOTLY in o.get("data", {})]
    if not figures:
        return
    from playwright.sync_api import sync_playwright
    from plotly.offline import get_plotlyjs

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=["--no-sandbox"])
        page = browser.new_page()
        page.set_content(f"<script>{get_plotlyjs()}</script>")
        for data in figures:
            url = page.evaluate("""(fig) => Plotly.toImage({data: fig.data, layout: fig.layout || {}},
                {format: 'png', width: 1000, height: (fig.layout || {}).height || 450})""", data[PLOTLY])
            data["image/png"] = url.split(",", 1)[1]
        browser.close()


def output_kinds(nb) -> list[list[list[str]]]:
    """Per code cell, each output's mimetypes (a figure's PNG, added when stored, left out)."""
    return [[sorted(k for k in o.get("data", {o.output_type: 0}) if not (k == "image/png" and PLOTLY in o.data))
             for o in c.outputs] for c in nb.cells if c.cell_type == "code"]


def test_all_five_notebooks_are_there():
    assert [p.name[:3] for p in NOTEBOOKS] == ["01_", "02_", "03_", "04_", "05_"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_with_its_pictures(path):
    size = path.stat().st_size
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert nb.metadata.get("spectool", {}).get("code_digest") == code_digest(nb), (
        f"{path.name}: its outputs were made from other cells; store them again (see this file's docstring)")
    assert all(c.execution_count for c in code), f"{path.name}: a code cell was not run"
    assert not any(o.output_type == "error" for c in code for o in c.outputs)
    assert size <= MAX_STORED_BYTES, f"{path.name} is {size} bytes"
    assert WIDGET_STATE not in nb.metadata.get("widgets", {})
    views = view_outputs(nb)
    assert views, f"{path.name} shows no view"
    for data in views:
        assert WIDGET_VIEW not in data  # no reopened notebook can show a live model
        assert re.search(r'<img[^>]* class="spectool-snapshot"[^>]* src="data:image/svg\+xml;base64,|'
                         r'class="spectool-(live|tuning)-static"', data.get("text/html", "")), data.get("text/plain")
    for out in (o for c in code for o in c.outputs if PLOTLY in o.get("data", {})):
        assert out.data.get("image/png", "").startswith("iVBOR")  # a PNG beside the figure
    # Nothing in the outputs reaches for the network: the pictures are inline.
    outputs = json.dumps([c.outputs for c in code])
    assert not re.search(r"""(src|href)=\\?["']?(https?:)?//""", outputs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, demo_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTOOL_MODEL_DIR", str(demo_model_dir))
    monkeypatch.setenv("SPECTOOL_MAX_NEW_TOKENS", STORED_MAX_NEW_TOKENS)
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    nb = nbformat.read(copy, as_version=4)
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    stored_form(nb)
    # What the run shows is what is stored: the same cells with outputs of the same kinds.
    if STORE:
        draw_plotly_figures(nb)
        nb.metadata["spectool"] = {"code_digest": code_digest(nb), "max_new_tokens": int(STORED_MAX_NEW_TOKENS)}
        nbformat.write(nb, path)
    stored = nbformat.read(path, as_version=4)
    assert output_kinds(nb) == output_kinds(stored), f"{path.name}: store its outputs again"
