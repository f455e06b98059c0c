"""``spectool summary TRACE``: accept length, per-depth acceptance, tokens/s and phase times."""

from __future__ import annotations

import argparse
import json
import sys

from spectool.trace.format import TraceFormatError
from spectool.trace.reader import Trace
from spectool.trace.summary import summary_table


def main(argv: list[str] | None = None) -> int:
    """Command line: print the summary table (or JSON); exit 2 when the trace cannot be read."""
    parser = argparse.ArgumentParser(prog="spectool summary", description="Summarise a trace.")
    parser.add_argument("trace", help="a .sptrace file")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        trace = Trace.load(args.trace)
    except (TraceFormatError, OSError) as e:
        print(f"spectool summary: cannot read {args.trace}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(trace.summary(), indent=2))
        return 0
    from rich.console import Console

    Console().print(summary_table(trace))
    return 0
