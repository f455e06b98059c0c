"""Responsiveness of the trace views: the kernel's side and the page's (headless Chromium).

Figure: docs/BENCHMARKS.md "Views". Time: about 1 minute on the CPU.

    python benchmarks/widgets.py [--iterations 10000] [--nodes 64]

Prints a table and, when $OUT is set, writes $OUT/widgets.json. Measures:
- import: first `import spectool.widgets`;
- open (kernel): TraceViewer(trace) on a trace of --iterations iterations, i.e. building the data the
  page receives once;
- report: write_report on the same trace, and the file's size;
- with /usr/bin/chromium: the report opened from file:// until the first tree is drawn (goal with the
  kernel side <= 2 s), and one step of a --nodes-node tree from the input event to the next paint
  (goal <= 50 ms), both timed in the page.

The large trace is a synthetic recording (tests/trace_factory.py) whose rows are
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

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def big_trace(iterations: int, nodes: int):
    """A one-request trace of `iterations` rows with `nodes`-node EAGLE-like trees."""
    from trace_factory import make_trace

    from spectool.trace.reader import Trace

    small = make_trace("eagle", num_requests=1, batch_size=1, num_draft_tokens=nodes, max_new_tokens=80,
                       seed=0)
    steps = small.steps.filter(pc.equal(small.steps["request_id"], 0))
    reps = -(-iterations // steps.num_rows)
    steps = pa.concat_tables([steps] * reps).slice(0, iterations)
    steps = steps.set_column(steps.schema.get_field_index("iteration"), "iteration",
                             pa.array(np.arange(iterations, dtype=np.int32)))
    return Trace.from_tables(steps, small.requests, small.run_info, small.tokenizer_json)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def page_figures(report: Path, steps: int) -> dict:
    """Open time and step latency of the report in headless Chromium ({} without Chromium/Playwright)."""
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
        page.goto(report.as_uri())
        page.wait_for_selector(".spectool-tree svg circle", timeout=60_000)
        open_s = time.perf_counter() - t0
        ms = step_latencies(page, "#app", steps)[2:]
        browser.close()
    return {"page_open_s": open_s, "step_ms_median": statistics.median(ms), "step_ms_max": max(ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    t0 = time.perf_counter()
    from spectool.widgets import TraceViewer
    import_s = time.perf_counter() - t0

    trace = big_trace(args.iterations, args.nodes)
    opens = [timed(lambda: TraceViewer(trace)) for _ in range(3)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.html"
        from spectool.trace.report import write_report

        report_s = timed(lambda: write_report(trace, out))
        report_mb = out.stat().st_size / 1e6
        page = page_figures(out, args.steps)

    result = {
        "iterations": args.iterations, "nodes": args.nodes, "import_s": import_s,
        "open_s_median": statistics.median(opens), "report_s": report_s, "report_mb": report_mb, **page,
    }
    print(f"{'measure':<40}{'value':>12}  goal")
    print(f"{'first import (s)':<40}{import_s:>12.2f}")
    print(f"{f'kernel: data for {args.iterations} iterations (s)':<40}{result['open_s_median']:>12.3f}")
    print(f"{'write_report (s)':<40}{report_s:>12.2f}")
    print(f"{'report size (MB)':<40}{report_mb:>12.2f}")
    if page:
        print(f"{'page: open to first tree (s)':<40}{page['page_open_s']:>12.2f}  <= 2 s with the kernel's")
        print(f"{f'page: step, {args.nodes}-node tree (ms, median)':<40}{page['step_ms_median']:>12.1f}  <= 50 ms")
        print(f"{'page: step (ms, max)':<40}{page['step_ms_max']:>12.1f}")
    from speculative import provenance  # after the timing: the first import is one of the figures

    result["meta"] = provenance("widgets", None, "cpu")
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "widgets.json"
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
