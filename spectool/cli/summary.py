"""``spectool summary TRACE``: accept length, per-depth acceptance, tokens/s and phase times."""

from __future__ import annotations

import json

from spectool.cli.args import BadInput, fail, open_trace, parser


def main(argv: list[str] | None = None) -> int:
    """Command line: print the summary table (or JSON); exit 2 when the trace cannot be read."""
    p = parser("summary", "Summarise a trace: tokens, mean accept length, its histogram, acceptance by depth, "
                          "decode tokens/s and the mean time of each phase per iteration.")
    p.add_argument("trace", help="a .sptrace file")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    args = p.parse_args(argv)
    try:
        trace = open_trace("summary", args.trace)
    except BadInput as e:
        return fail("summary", e)
    if args.json:
        from spectool.trace.suspicious import suspicious_numbers

        print(json.dumps({**trace.summary(), "warnings": suspicious_numbers(trace)}, indent=2))
        return 0
    from rich.console import Console

    from spectool.trace.summary import summary_table

    Console().print(summary_table(trace))
    return 0
