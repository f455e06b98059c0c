"""``spectool report TRACE``: one standalone HTML report of a trace."""

from __future__ import annotations

from pathlib import Path

from spectool.cli.args import BadInput, fail, open_trace, parser


def main(argv: list[str] | None = None) -> int:
    """`spectool report TRACE [-o report.html]`: exit 0, or 2 with one line when TRACE is unreadable."""
    p = parser("report", "Write one standalone HTML report of a trace: the tree, mask and acceptance views with a "
                         "step player, for every request. It needs no server or network to open.")
    p.add_argument("trace", help="a .sptrace file")
    p.add_argument("-o", "--out", help="output HTML file (default: TRACE with .html)")
    args = p.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.trace).with_suffix(".html")
    try:
        trace = open_trace("report", args.trace)
        from spectool.trace.report import write_report

        write_report(trace, out)
    except BadInput as e:
        return fail("report", e)
    except (ValueError, OSError) as e:
        return fail("report", f"{args.trace}: {e}")
    print(f"wrote {out}")
    return 0
