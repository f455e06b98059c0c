"""Every notebook in notebooks/ runs end to end on the CPU with the bundled demo model.

Each runs in a fresh kernel from a scratch copy, with SPECTOOL_MODEL_DIR pointing at the
model directory; a cell that raises fails the test with the cell's traceback. Saved
notebooks must carry no outputs (the repository stays small).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
# Per-cell limit; every notebook is meant to finish in under two minutes on 2 CPU cores.
CELL_TIMEOUT_S = 120



def test_all_five_notebooks_are_there():
    assert [p.name[:3] for p in NOTEBOOKS] == ["01_", "02_", "03_", "04_", "05_"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_saved_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name} has saved outputs"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, demo_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTOOL_MODEL_DIR", str(demo_model_dir))
    monkeypatch.setenv("SPECTOOL_MAX_NEW_TOKENS", "12")
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    nb = nbformat.read(copy, as_version=4)
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
