"""The views in a real browser: JupyterLab + headless Chromium (Debian's package) via Playwright.

Opens notebooks/02_trees_and_masks.ipynb, runs all cells from the Run menu, checks that
the tree, the mask and the player rendered (plotly nodes inside the elements the views
mark with spectool-tree / spectool-mask / spectool-player), moves the player's slider
with the keyboard and checks the highlighted tree changed. Screenshots go to
test-artifacts/. Needs /usr/bin/chromium (.ci/install-browser-deps.sh installs it).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
NOTEBOOK = ROOT / "notebooks" / "02_trees_and_masks.ipynb"
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
# Whole-notebook budget: loading the model and recording a generate on 2 CPU cores.
RUN_TIMEOUT_MS = 150_000

if not CHROMIUM.exists() and os.environ.get("CI") != "true":
    pytest.skip("headless Chromium not installed (/usr/bin/chromium); run .ci/install-browser-deps.sh",
                allow_module_level=True)



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quiet_lab_settings(settings_dir: Path) -> None:
    """No news or update checks (no network here), no toast and no kernel dialog covering the page."""
    settings = {
        "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
        "notebook-extension/tracker": {"autoStartDefaultKernel": True},
    }
    for name, values in settings.items():
        path = settings_dir / "@jupyterlab" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


@pytest.fixture
def jupyter_lab(tmp_path, demo_model_dir):
    """A JupyterLab server on a free localhost port, token auth, rooted at a copy of notebook 02."""
    root = tmp_path / "lab"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    settings = tmp_path / "settings"
    _quiet_lab_settings(settings)
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "SPECTOOL_MODEL_DIR": str(demo_model_dir), "SPECTOOL_MAX_NEW_TOKENS": "16",
           "JUPYTERLAB_SETTINGS_DIR": str(settings),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    log = open(tmp_path / "lab.log", "w")  # noqa: SIM115  (closed below, after the server stops)
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={port}",
         "--ip=127.0.0.1", f"--ServerApp.root_dir={root}", f"--IdentityProvider.token={token}",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    log_text = (tmp_path / "lab.log").read_text()
                    raise RuntimeError("JupyterLab did not start:\n" + log_text) from None
                time.sleep(0.5)
        yield url, token
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def _wait_for_idle_kernel(url: str, token: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{url}/api/sessions?token={token}", timeout=5) as reply:
            sessions = json.load(reply)
        if sessions and all(s["kernel"]["execution_state"] == "idle" for s in sessions):
            return
        time.sleep(0.5)
    raise TimeoutError(f"the notebook's kernel did not start within {timeout_s} s")


# What the tree draws: every marker's position and fill and every text label, as one string.
_TREE_SIGNATURE_JS = """[...document.querySelector('.spectool-tree')
        .querySelectorAll('.scatterlayer .point, .scatterlayer .textpoint')]
    .map(p => (p.getAttribute('transform') || '') + '|' + (p.style.fill || '') + '|' + (p.textContent || ''))
    .join(';')"""


def _tree_signature(page) -> str:
    return page.evaluate(f"() => {_TREE_SIGNATURE_JS}")


def test_notebook_02_renders_and_slider_moves_tree(jupyter_lab):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    url, token = jupyter_lab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1200})
        try:
            page.goto(f"{url}/lab/tree/{NOTEBOOK.name}?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            # Run All before the kernel is up is dropped, and the page shows 'idle' before it
            # connects: ask the server instead.
            _wait_for_idle_kernel(url, token)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=30_000)

            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-item:visible", has_text="Run All Cells").first.click()

            page.wait_for_selector(".spectool-tree .scatterlayer", timeout=RUN_TIMEOUT_MS)
            page.wait_for_selector(".spectool-mask .heatmaplayer", timeout=30_000)
            handle = page.wait_for_selector(".spectool-player .noUi-handle", timeout=30_000)
            page.wait_for_function(
                "() => document.querySelectorAll('.spectool-tree .scatterlayer .point').length > 1",
                timeout=30_000)
            assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
                                ).filter(has_text="Traceback").count() == 0, "a cell raised"
            page.locator(".spectool-tree").first.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "02_before_slider.png"), full_page=True)

            before = _tree_signature(page)
            handle.focus()
            page.keyboard.press("ArrowRight")
            page.wait_for_function(f"(before) => ({_TREE_SIGNATURE_JS}) !== before", arg=before,
                                   timeout=30_000)
            assert _tree_signature(page) != before
            page.screenshot(path=str(ARTIFACTS / "02_after_slider.png"), full_page=True)
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "02_failure.png"), full_page=True)
            raise
        finally:
            browser.close()
