"""What the browser tests drive: JupyterLab in headless Chromium, the viewer's page, hostile traces.

Kept apart from tests/test_browser.py so the checks read as a list of what a user sees.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from trace_factory import VOCAB, make_trace

from spectool.trace.reader import Trace

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
# A script that would run if any trace string reached the page as HTML.
PWN = "document.title='pwned';window.__pwned=1"
HOSTILE = [f"</script><script>{PWN}</script>", f'<img src=x onerror="{PWN}">',
           f'<a href="javascript:{PWN}">click</a>']


def hostile_tokenizer_json() -> str:
    """A word-level tokenizer whose tokens include script, img-onerror and javascript: strings and whitespace."""
    from tokenizers import Tokenizer, models

    words = []
    for i, w in enumerate(VOCAB):
        if i < 2:
            words.append(w)
        elif i % 6 == 2:
            words.append(HOSTILE[(i // 6) % 3] + str(i))
        elif i % 6 == 3:
            words.append(" " * (i // 6 + 1))  # whitespace-only tokens, unique by length
        elif i % 6 == 4:
            words.append("\n" + "\t" * (i // 6 + 1))
        else:
            words.append(w)
    return Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>")).to_str()


def hostile_trace(path: Path) -> Trace:
    """A recorded synthetic run re-labelled with the hostile tokenizer, prompt text and model name."""
    base = make_trace("ngram", num_requests=2, batch_size=2, num_draft_tokens=10, seed=3)
    info = dict(base.run_info, model={"name": HOSTILE[0], "hash": HOSTILE[1]})
    requests = base.requests.set_column(base.requests.schema.get_field_index("prompt_text"), "prompt_text",
                                        [[" ".join(HOSTILE)] * base.requests.num_rows])
    trace = Trace(base.steps, requests, info, hostile_tokenizer_json())
    trace.save(path)
    return Trace.load(path)


def long_trace(iterations: int, nodes: int) -> Trace:
    """A one-request trace of `iterations` iterations with `nodes`-node EAGLE-like trees: a synthetic
    recording's rows repeated and renumbered (what a view costs depends on row count and tree size)."""
    small = make_trace("eagle", num_requests=1, batch_size=1, num_draft_tokens=nodes, max_new_tokens=80, seed=0)
    steps = small.steps.filter(pc.equal(small.steps["request_id"], 0))
    reps = -(-iterations // steps.num_rows)
    steps = pa.concat_tables([steps] * reps).slice(0, iterations)
    steps = steps.set_column(steps.schema.get_field_index("iteration"), "iteration",
                             pa.array(np.arange(iterations, dtype=np.int32)))
    return Trace.from_tables(steps, small.requests, small.run_info, small.tokenizer_json)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lab_settings(settings_dir: Path) -> None:
    """No news or update checks (no network), the kernel starts without a dialog, widget state is saved
    with the notebook (JupyterLab's "Save Widget State Automatically")."""
    settings = {
        "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
        "@jupyterlab/notebook-extension/tracker": {"autoStartDefaultKernel": True},
        "@jupyter-widgets/jupyterlab-manager/plugin": {"saveState": True},
    }
    for name, values in settings.items():
        path = settings_dir / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


class Lab:
    """A JupyterLab server on a free localhost port with token auth, rooted at `root`."""

    def __init__(self, root: Path, workdir: Path, env: dict):
        settings = workdir / "settings"
        lab_settings(settings)
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, **env, "JUPYTERLAB_SETTINGS_DIR": str(settings),
               "JUPYTER_CONFIG_DIR": str(workdir / "config"), "JUPYTER_RUNTIME_DIR": str(workdir / "runtime")}
        self.log_path = workdir / "lab.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115  (closed in stop())
        self.server = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={self.port}",
             "--ip=127.0.0.1", f"--ServerApp.root_dir={root}", f"--IdentityProvider.token={self.token}",
             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=root)
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(self.api("status"), timeout=2)
                break
            except OSError:
                if self.server.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("JupyterLab did not start:\n" + self.log_path.read_text()) from None
                time.sleep(0.5)

    def api(self, what: str) -> str:
        return f"{self.url}/api/{what}?token={self.token}"

    def sessions(self) -> list:
        with urllib.request.urlopen(self.api("sessions"), timeout=5) as reply:
            return json.load(reply)

    def wait_idle(self, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            sessions = self.sessions()
            if sessions and all(s["kernel"]["execution_state"] == "idle" for s in sessions):
                return
            time.sleep(0.5)
        raise TimeoutError(f"the notebook's kernel did not start within {timeout_s} s")

    def shutdown_kernels(self) -> None:
        for s in self.sessions():
            req = urllib.request.Request(self.api(f"sessions/{s['id']}"), method="DELETE")
            urllib.request.urlopen(req, timeout=10)

    def stop(self) -> None:
        self.server.terminate()
        try:
            self.server.wait(10)
        except subprocess.TimeoutExpired:
            self.server.kill()
        self.log.close()


def open_notebook(page, lab: Lab, name: str, run: bool = True) -> None:
    """Open a notebook alone, with the file browser shown, and (optionally) Run All once its kernel is idle."""
    page.goto(f"{lab.url}/lab/tree/{name}?token={lab.token}&reset")  # reset: no tabs left from a test before
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    if not page.locator(".jp-FileBrowser").first.is_visible():
        page.locator(".jp-SideBar.jp-mod-left [data-id='filebrowser']").first.click()
    page.wait_for_selector(".jp-FileBrowser", state="visible", timeout=10_000)
    if not run:
        return
    # Run All before the kernel is up is dropped, and the page shows 'idle' before it connects.
    lab.wait_idle()
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=30_000)
    started = ("() => [...document.querySelectorAll('.jp-Notebook .jp-InputArea-prompt')]"
               ".some(p => /\\[(\\*|\\d+)\\]/.test(p.textContent))")
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for attempt in range(3):  # now and then Run All is dropped with the kernel idle: no cell starts
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-item:visible", has_text="Run All Cells").first.click()
        try:
            page.wait_for_function(started, timeout=20_000)
            return
        except PlaywrightTimeout:
            if attempt == 2:
                raise


# One step: input event -> two animation frames (the next paint after the render), timed in the page.
STEP_LATENCY_JS = """async ([sel, steps]) => {
  const root = document.querySelector(sel);
  const slider = root.querySelector('.sv-slider');
  const frame = () => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
  const out = [];
  const last = Number(slider.max);
  for (let i = 0; i < steps; i++) {
    const target = (Number(slider.value) + 1) % (last + 1);
    const t0 = performance.now();
    slider.value = String(target);
    slider.dispatchEvent(new Event('input', {bubbles: true}));
    await frame();
    out.push(performance.now() - t0);
  }
  return out;
}"""


def step_latencies(page, selector: str, steps: int = 12) -> list[float]:
    return page.evaluate(STEP_LATENCY_JS, [selector, steps])


def box(page, selector: str) -> dict:
    return page.locator(selector).first.bounding_box()


SETTLED_BOX_JS = """async ([sel, ms]) => {
  const frame = () => new Promise(r => requestAnimationFrame(r));
  const end = performance.now() + ms;
  let last = null;
  while (performance.now() < end) {
    const r = document.querySelector(sel)?.getBoundingClientRect();
    const now = r && r.width > 0 && r.height > 0 ? {x: r.x, y: r.y, width: r.width, height: r.height} : null;
    if (now && JSON.stringify(now) === JSON.stringify(last)) return now;
    last = now;
    await frame();
  }
  return last;
}"""


def shown_box(page, selector: str, timeout_ms: int = 15_000) -> dict | None:
    """The box of the first match once it is drawn and holds still for a frame, measured in one step in
    the page. JupyterLab skips drawing cells out of view (content-visibility) and the views redraw their
    trees when resized, so right after a scroll or a resize an element may be undrawn or replaced."""
    return page.evaluate(SETTLED_BOX_JS, [selector, timeout_ms])


def inside(inner: dict, outer: dict) -> bool:
    return (inner["x"] >= outer["x"] - 1 and inner["y"] >= outer["y"] - 1 and
            inner["x"] + inner["width"] <= outer["x"] + outer["width"] + 1 and
            inner["y"] + inner["height"] <= outer["y"] + outer["height"] + 1)


def settled_box_inside(page, selector: str, outer: dict, timeout_s: float = 15.0) -> dict | None:
    """The first match's box once it lies inside ``outer``, else its last box after ``timeout_s``: after a
    resize JupyterLab lays a cell out again on its own schedule, later on a loaded machine, and a box
    measured before that still has the old width."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = shown_box(page, selector)
        if (found is not None and inside(found, outer)) or time.monotonic() > deadline:
            return found
        page.wait_for_timeout(200)


# A search box's placeholder against the room it has: (text width, content-box width) in CSS pixels,
# the text measured in the box's own font.
PLACEHOLDER_JS = """(sel) => {
  const box = document.querySelector(sel), cs = getComputedStyle(box);
  const ctx = document.createElement('canvas').getContext('2d');
  ctx.font = `${cs.fontStyle} ${cs.fontWeight} ${cs.fontSize} ${cs.fontFamily}`;
  return [ctx.measureText(box.placeholder).width,
          box.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight)];
}"""


def placeholder_room(page, selector: str) -> tuple[float, float]:
    text, room = page.evaluate(PLACEHOLDER_JS, selector)
    return text, room
