"""``spectool export-perfetto TRACE``: phase timings as Chrome/Perfetto trace JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spectool.trace.format import TraceFormatError
from spectool.trace.perfetto import perfetto_events
from spectool.trace.reader import Trace


def main(argv: list[str] | None = None) -> int:
    """Command line: write the JSON next to the trace (or to -o); exit 2 when unreadable."""
    parser = argparse.ArgumentParser(prog="spectool export-perfetto",
                                     description="Export phase timings as Chrome/Perfetto trace JSON.")
    parser.add_argument("trace", help="a .sptrace file")
    parser.add_argument("-o", "--out", help="output JSON (default: TRACE with .perfetto.json)")
    args = parser.parse_args(argv)
    try:
        trace = Trace.load(args.trace)
    except (TraceFormatError, OSError) as e:
        print(f"spectool export-perfetto: cannot read {args.trace}: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(args.trace).with_suffix(".perfetto.json")
    data = perfetto_events(trace)
    out.write_text(json.dumps(data))
    print(f"wrote {out} ({len(data['traceEvents'])} events); open it in https://ui.perfetto.dev")
    return 0
