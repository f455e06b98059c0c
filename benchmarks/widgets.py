"""Responsiveness of the trace views, measured in the kernel process (no frontend).

    python benchmarks/widgets.py [--iterations 10000] [--nodes 64]

Prints a table and, when $OUT is set, writes $OUT/widgets.json. Measures:
- import: first `import spectool.widgets` + first FigureWidget (plotly's one-time cost);
- open: TraceViewer(trace) on a trace of --iterations iterations (goal <= 2 s);
- step: one slider step of a --nodes-node tree, tree + mask + acceptance (goal <= 100 ms);
- row: selecting a mask row (mask + linked tree);
- report: write_report on the same trace, and the file's size.

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    t0 = time.perf_counter()
    import plotly.graph_objects as go

    from spectool.widgets import TraceViewer
    go.FigureWidget()
    import_s = time.perf_counter() - t0

    trace = big_trace(args.iterations, args.nodes)
    opens = [timed(lambda: TraceViewer(trace)) for _ in range(3)]
    viewer = TraceViewer(trace)
    steps = [timed(lambda i=i: setattr(viewer.slider, "value", i)) for i in range(1, args.steps + 1)]
    rows = [timed(lambda r=r: viewer.mask.select_row(r % args.nodes)) for r in range(1, args.steps + 1)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.html"
        from spectool.trace.report import write_report

        report_s = timed(lambda: write_report(trace, out))
        report_mb = out.stat().st_size / 1e6

    result = {
        "iterations": args.iterations, "nodes": args.nodes,
        "import_s": import_s,
        "open_s_median": statistics.median(opens),
        "step_ms_median": 1e3 * statistics.median(steps), "step_ms_max": 1e3 * max(steps),
        "row_ms_median": 1e3 * statistics.median(rows),
        "report_s": report_s, "report_mb": report_mb,
    }
    print(f"{'measure':<34}{'value':>12}  goal")
    print(f"{'first import + FigureWidget (s)':<34}{import_s:>12.2f}")
    print(f"{f'open {args.iterations} iterations (s)':<34}{result['open_s_median']:>12.3f}  <= 2 s")
    print(f"{f'step, {args.nodes}-node tree (ms, median)':<34}{result['step_ms_median']:>12.1f}  <= 100 ms")
    print(f"{'step (ms, max)':<34}{result['step_ms_max']:>12.1f}")
    print(f"{'mask row select (ms, median)':<34}{result['row_ms_median']:>12.1f}")
    print(f"{'write_report (s)':<34}{report_s:>12.2f}")
    print(f"{'report size (MB)':<34}{report_mb:>12.2f}")
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "widgets.json"
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
