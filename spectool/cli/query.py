"""``spectool query TRACE "select ..."``: SQL over a trace's records with DuckDB."""

from __future__ import annotations

import argparse
import sys

from spectool.trace.format import TraceFormatError
from spectool.trace.reader import Trace
from spectool.trace.select import kept_note


def main(argv: list[str] | None = None) -> int:
    """Command line: print the result (a table, CSV or JSON); exit 2 on an unreadable trace, bad SQL or no DuckDB."""
    from spectool.trace import sql

    parser = argparse.ArgumentParser(
        prog="spectool query", description="Run SQL over a trace (tables: steps, requests, nodes).",
        epilog=sql.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", help="a .sptrace file")
    parser.add_argument("sql", help='the query, e.g. "select accept_length, count(*) from steps group by 1"')
    parser.add_argument("--format", choices=("table", "csv", "json"), default="table", help="output format")
    parser.add_argument("--max-rows", type=int, default=50, help="rows a table shows (csv and json print all)")
    args = parser.parse_args(argv)
    try:
        trace = Trace.load(args.trace)
        result = trace.sql(args.sql)
    except (TraceFormatError, OSError, ValueError, ImportError) as e:
        print(f"spectool query: {args.trace}: {e}", file=sys.stderr)
        return 2
    if args.format == "csv":
        result.to_csv(sys.stdout, index=False)
    elif args.format == "json":
        print(result.to_json(orient="records"))
    else:
        import pandas as pd

        with pd.option_context("display.max_rows", args.max_rows, "display.width", 200):
            print(result.to_string(index=False, max_rows=args.max_rows))
    note = kept_note(trace.run_info)
    if note["selection"]:
        print(f"note: the trace holds {100 * note['kept_fraction']:.1f} % of the run's records "
              f"({note['selection']})", file=sys.stderr)
    return 0
