"""``spectool check TRACE``: is a trace consistent? Exit 0 consistent, 1 a fault, 2 unreadable."""

from __future__ import annotations

import sys

from spectool.cli.args import BadInput, NoCompleteRecord, fail, open_trace, parser


def main(argv: list[str] | None = None) -> int:
    """Command line: exit 0 consistent, 1 first fault, 2 unreadable trace."""
    p = parser("check", "Verify a trace's internal consistency: every tree, mask, index array and acceptance "
                        "decision, and that the accepted tokens are the outputs. Prints the first fault "
                        "(iteration, request, node) and exits 1, or exits 0 when consistent; 2 when the file "
                        "cannot be read.")
    p.add_argument("trace", help="a .sptrace file")
    p.add_argument("--replay", metavar="MODEL_DIR",
                   help="also re-run the target (plain forwards) and the drafters from scratch and re-derive "
                        "every decision; a divergence gets its logit margin (near-tie or bug)")
    p.add_argument("--device", help="device for --replay (default: the one the trace was recorded on)")
    args = p.parse_args(argv)
    try:
        trace = open_trace("check", args.trace)
    except NoCompleteRecord as e:  # cut short before any record: nothing in it is consistent
        print(f"FAULT {e}")
        return 1
    except BadInput as e:
        return fail("check", e)
    from spectool.trace.check import check_trace

    try:
        fault = check_trace(trace)
        if fault is None and args.replay:
            from spectool.trace.replay import replay

            report = replay(trace, args.replay, args.device, progress=sys.stderr.isatty())
            for d in report.divergences:
                print(f"divergence {d}")
            for note in report.notes:
                print(f"note: {note}")
            fault = report.fault
    except Exception as e:  # malformed content the checks did not foresee: still one line
        return fail("check", f"cannot check {args.trace}: {type(e).__name__}: {e}")
    if fault is not None:
        print(f"FAULT {args.trace}: {fault}")
        return 1
    cut = f" (the complete records of a file cut short: {trace.damage})" if trace.truncated else ""
    print(f"ok {args.trace}: {len(trace)} records, {trace.requests.num_rows} requests "
          f"consistent{' and replayed' if args.replay else ''}{cut}")
    return 0
