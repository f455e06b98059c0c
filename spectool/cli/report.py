"""``spectool report TRACE``: one standalone HTML report of a trace."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spectool.trace.report import write_report


def main(argv: list[str] | None = None) -> int:
    """`spectool report TRACE [-o report.html]`: exit 0, or 2 with one line when TRACE is unreadable."""
    parser = argparse.ArgumentParser(prog="spectool report", description=write_report.__doc__)
    parser.add_argument("trace", help="a .sptrace file")
    parser.add_argument("-o", "--out", help="output HTML file (default: TRACE with .html)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.trace).with_suffix(".html")
    try:
        write_report(args.trace, out)
    except (ValueError, OSError) as e:  # TraceFormatError is a ValueError
        print(f"spectool report: {args.trace}: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
