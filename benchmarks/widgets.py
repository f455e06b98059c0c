"""Responsiveness of the trace views: the kernel's side and the page's (headless Chromium).

Figure: docs/BENCHMARKS.md "Views". Time: about 1 minute on the CPU.

    python benchmarks/widgets.py [--iterations 10000] [--nodes 64] [--trace BIG.sptrace]

Prints a table and, when $OUT is set, writes $OUT/widgets.json. Measures:
- import: first `import spectool.widgets`;
- viewer (kernel): TraceViewer(trace) on a trace of --iterations iterations of one request: the
  header and the first chunk of per-node arrays it sends at open;
- viewer (page): the same state (header and buffer) mounted by viewer.js in headless Chromium at
  1600x1000: the time mount() takes (up to the first tree drawn, timed in the page) and from
  navigation to the first tree (which adds parsing plotly.js: once per JupyterLab page); then one
  step of a --nodes-node tree from the input event to the next paint (goal <= 50 ms);
- report: write_report on the same trace (every chunk embedded), the file's size, its open time
  and step latency in the page;
- with --trace (e.g. the 1,000,000-record file of `benchmarks/trace_scale.py --keep FILE`):
  Trace.load + TraceViewer, the page's mount and step latency on that state, and what the page
  asks the kernel for later (a chunk, another request, a request's text the first time and again).
The open goals: <= 2 s for 10,000 iterations, <= 3 s for 1,000,000 records (kernel and page).

The 10,000-iteration trace is tests/browser_pages.long_trace: a synthetic recording whose rows are
repeated and renumbered up to --iterations: what is measured depends on row count
and tree size, not on what the trees hold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def page_figures(html: Path, steps: int) -> dict:
    """Open time, mount time and step latency of a viewer page in headless Chromium ({} without it)."""
    if not Path("/usr/bin/chromium").exists():
        return {}
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return {}
    from browser_pages import CHROMIUM_ARGS, step_latencies

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        t0 = time.perf_counter()
        page.goto(html.as_uri())
        page.wait_for_selector(".spectool-tree svg circle", timeout=120_000)
        open_s = time.perf_counter() - t0
        mount_ms = page.evaluate("() => performance.getEntriesByName('spectool-mounted')[0].duration")
        ms = step_latencies(page, "#app", steps)[2:]
        browser.close()
    return {"page_open_s": open_s, "mount_s": mount_ms / 1000, "step_ms_median": statistics.median(ms),
            "step_ms_max": max(ms)}


def viewer_page(viewer, path: Path) -> Path:
    """The state a TraceViewer sends at open, as a page that mounts viewer.js on it (no kernel)."""
    from spectool.trace.report import page_html

    path.write_text(page_html(viewer.header, viewer.blob), encoding="utf-8")
    return path


def big_file_figures(path: Path, steps: int, tmp: Path) -> dict:
    """TraceViewer on a large .sptrace file: open, page, and the kernel's answers to the page."""
    from spectool.trace.reader import Trace
    from spectool.widgets import TraceViewer

    t0 = time.perf_counter()
    trace = Trace.load(path)
    viewer = TraceViewer(trace)
    out = {"records": len(trace), "requests": len(viewer.header["requests"]), "open_s": time.perf_counter() - t0,
           "header_kb": len(json.dumps(viewer.header)) / 1e3, "blob_kb": len(viewer.blob) / 1e3}
    ask = viewer._message  # what the page sends; the replies go to no page here
    other = viewer.header["requests"][len(viewer.header["requests"]) // 2]["id"]
    for name, msg in (("chunk_s", {"kind": "chunk", "request": viewer.request, "chunk": 0}),
                      ("request_s", {"kind": "request", "request": other}),
                      ("text_first_s", {"kind": "text", "request": viewer.request}),
                      ("text_again_s", {"kind": "text", "request": other})):
        out[name] = timed(lambda msg=msg: ask(viewer, msg, []))
    out.update({f"page_{k}": v for k, v in page_figures(viewer_page(viewer, tmp / "big.html"), steps).items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--trace", type=Path, help="also measure TraceViewer on this (large) .sptrace file")
    args = parser.parse_args()

    t0 = time.perf_counter()
    from spectool.widgets import TraceViewer
    import_s = time.perf_counter() - t0

    from browser_pages import long_trace

    trace = long_trace(args.iterations, args.nodes)
    opens = [timed(lambda: TraceViewer(trace)) for _ in range(3)]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        viewer = page_figures(viewer_page(TraceViewer(trace), tmp / "viewer.html"), args.steps)
        out = tmp / "report.html"
        from spectool.trace.report import write_report

        report_s = timed(lambda: write_report(trace, out))
        report_mb = out.stat().st_size / 1e6
        page = page_figures(out, args.steps)
        big = big_file_figures(args.trace, args.steps, tmp) if args.trace else {}

    result = {
        "iterations": args.iterations, "nodes": args.nodes, "import_s": import_s,
        "open_s_median": statistics.median(opens), "viewer_page": viewer, "report_s": report_s,
        "report_mb": report_mb, "report_page": page, "big": big, "load_average": os.getloadavg(),
    }
    rows = [("first import (s)", import_s, ""),
            (f"viewer, kernel: open {args.iterations} iterations (s)", result["open_s_median"], "")]
    if viewer:
        rows += [("viewer, page: mount to first tree (s)", viewer["mount_s"], "kernel + page <= 2 s"),
                 ("viewer, page: navigation to first tree (s)", viewer["page_open_s"], "(+ parsing plotly.js)"),
                 (f"viewer, page: step, {args.nodes}-node tree (ms, median)", viewer["step_ms_median"], "<= 50 ms"),
                 ("viewer, page: step (ms, max)", viewer["step_ms_max"], "")]
    rows += [("report: write_report (s)", report_s, ""), ("report: size (MB)", report_mb, "")]
    if page:
        rows += [("report, page: navigation to first tree (s)", page["page_open_s"], ""),
                 ("report, page: step (ms, median)", page["step_ms_median"], "<= 50 ms")]
    if big:
        rows += [(f"{big['records']:,} records: Trace.load + TraceViewer (s)", big["open_s"], "kernel + page <= 3 s"),
                 ("  header sent at open (KB)", big["header_kb"], ""),
                 ("  buffer sent at open (KB)", big["blob_kb"], ""),
                 ("  kernel: a chunk (s)", big["chunk_s"], ""), ("  kernel: another request (s)", big["request_s"], ""),
                 ("  kernel: a request's text, first (s)", big["text_first_s"], ""),
                 ("  kernel: a request's text, again (s)", big["text_again_s"], "")]
        if "page_mount_s" in big:
            rows += [("  page: mount to first tree (s)", big["page_mount_s"], ""),
                     ("  page: step (ms, median)", big["page_step_ms_median"], "<= 50 ms"),
                     ("  page: step (ms, max)", big["page_step_ms_max"], "")]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'measure':<52}{'value':>10}  goal")
    for name, value, goal in rows:
        print(f"{name:<52}{value:>10.3f}  {goal}")
    from speculative import provenance  # after the timing: the first import is one of the figures

    result["meta"] = provenance("widgets", None, "cpu")
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "widgets.json"
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
