"""``spectool query TRACE "select ..."``: SQL over a trace's records with DuckDB."""

from __future__ import annotations

import sys

from spectool.cli.args import BadInput, fail, open_trace, parser

_TABLES = """tables:
  steps     one row per record (iteration, request): the trace's columns by their schema names;
            list columns are DuckDB lists, 1-based (status[2] is node 1's status)
  requests  one row per request: request_id, prompt_tokens, output_tokens, finish_reason, prompt_text
  nodes     one row per draft-tree node: iteration, request_id, node (0 = root), token, parent, depth,
            score, status (0 not visited, 1 accepted, 2 rejected), target_argmax, target_argmax_prob

examples:
  spectool query run.sptrace "select request_id, avg(accept_length) from steps group by 1 order by 1"
  spectool query run.sptrace "select depth, avg((status = 1)::int) from nodes where depth > 0 group by 1"

DuckDB is optional: pip install duckdb"""


def main(argv: list[str] | None = None) -> int:
    """Command line: print the result (a table, CSV or JSON); exit 2 on an unreadable trace, bad SQL or no DuckDB."""
    import argparse

    p = parser("query", "Run SQL (DuckDB) over a trace's records, requests and draft-tree nodes. Only the columns "
                        "a query names are read from the file.")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = _TABLES
    p.add_argument("trace", help="a .sptrace file")
    p.add_argument("sql", help='the query, e.g. "select accept_length, count(*) from steps group by 1"')
    p.add_argument("--format", choices=("table", "csv", "json"), default="table", help="output format")
    p.add_argument("--max-rows", type=int, default=50, help="rows a table shows (csv and json print all)")
    args = p.parse_args(argv)
    try:
        trace = open_trace("query", args.trace)
        result = trace.sql(args.sql)
    except BadInput as e:
        return fail("query", e)
    except (ValueError, OSError, ImportError) as e:
        return fail("query", f"{args.trace}: {e}")
    if args.format == "csv":
        result.to_csv(sys.stdout, index=False)
    elif args.format == "json":
        print(result.to_json(orient="records"))
    else:
        print(result.to_string(index=False, max_rows=args.max_rows))
    from spectool.trace.select import kept_note

    note = kept_note(trace.run_info)
    if note["selection"]:
        print(f"note: the trace holds {100 * note['kept_fraction']:.1f} % of the run's records "
              f"({note['selection']})", file=sys.stderr)
    return 0
