"""``spectool report TRACE``: one standalone HTML report of a trace (or of some of its requests/iterations)."""

from __future__ import annotations

import sys
from pathlib import Path

from spectool.cli.args import BadInput, fail, open_trace, parser

# Above this many records a report without --requests / --iterations shows the first requests only:
# the page holds every node of what it shows.
REPORT_MAX_RECORDS = 20_000


def _ids(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        out += list(range(int(first), int(last) + 1)) if last else [int(first)]
    return out


def _range(text: str) -> tuple[int, int]:
    first, sep, last = text.partition(":")
    if not sep:
        raise ValueError
    return int(first or 0), int(last) if last else 2**31 - 1


def main(argv: list[str] | None = None) -> int:
    """`spectool report TRACE [-o report.html] [--requests 0,3-5] [--iterations 100:200]`: exit 0, or 2 with
    one line when TRACE is unreadable."""
    p = parser("report", "Write one standalone HTML report of a trace: the tree, mask and acceptance views with a "
                         "step player, for every request (or those chosen). It needs no server or network to open.")
    p.add_argument("trace", help="a .sptrace file")
    p.add_argument("-o", "--out", help="output HTML file (default: TRACE with .html)")
    p.add_argument("--requests", help="only these request ids, e.g. 0,3-5")
    p.add_argument("--iterations", help="only iterations FIRST:LAST (LAST excluded; either may be left out)")
    args = p.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.trace).with_suffix(".html")
    try:
        requests = _ids(args.requests) if args.requests else None
        iterations = _range(args.iterations) if args.iterations else None
    except ValueError:
        return fail("report", "--requests takes ids like 0,3-5 and --iterations FIRST:LAST")
    try:
        trace = open_trace("report", args.trace)
        from spectool.trace.report import write_report

        if requests is None and iterations is None and len(trace) > REPORT_MAX_RECORDS:
            requests = first_requests(trace, REPORT_MAX_RECORDS)
            print(f"spectool report: {len(trace)} records; the report shows requests {requests[0]}-{requests[-1]} "
                  "(choose with --requests / --iterations)", file=sys.stderr)
        if requests is not None or iterations is not None:
            trace = trace.select(requests=requests, iterations=iterations)
        write_report(trace, out)
    except BadInput as e:
        return fail("report", e)
    except (ValueError, OSError) as e:
        return fail("report", f"{args.trace}: {e}")
    print(f"wrote {out}")
    return 0


def first_requests(trace, max_records: int) -> list[int]:
    """The lowest request ids whose records add up to at most ``max_records`` (at least one)."""
    import numpy as np

    ids, counts = np.unique(trace.keys()[1], return_counts=True)
    take = max(1, int(np.searchsorted(np.cumsum(counts), max_records, side="right")))
    return ids[:take].tolist()
