"""``spectool check TRACE``: is a trace consistent? Exit 0 consistent, 1 a fault, 2 unreadable."""

from __future__ import annotations

import argparse
import sys

from spectool.trace.check import check_trace, replay
from spectool.trace.format import TraceFormatError
from spectool.trace.reader import Trace


def main(argv: list[str] | None = None) -> int:
    """Command line: exit 0 consistent, 1 first fault, 2 unreadable trace."""
    parser = argparse.ArgumentParser(prog="spectool check", description="Verify a trace's consistency.")
    parser.add_argument("trace", help="a .sptrace file")
    parser.add_argument("--replay", metavar="MODEL_DIR",
                        help="re-run the target greedily and compare outputs")
    parser.add_argument("--device", default=None, help="device for --replay (default: the recorded one)")
    args = parser.parse_args(argv)
    try:
        trace = Trace.load(args.trace)
    except (TraceFormatError, OSError) as e:
        print(f"spectool check: cannot read {args.trace}: {e}", file=sys.stderr)
        return 2
    try:
        fault = check_trace(trace)
        if fault is None and args.replay:
            fault = replay(trace, args.replay, args.device)
    except Exception as e:  # malformed content the checks did not foresee: still one line
        print(f"spectool check: cannot check {args.trace}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if fault is not None:
        print(f"FAULT {args.trace}: {fault}")
        return 1
    note = ""
    if trace.truncated:
        note = " (the file ends in an incomplete batch; its complete batches were checked)"
    print(f"ok {args.trace}: {trace.steps.num_rows} records, {trace.requests.num_rows} requests "
          f"consistent{' and replayed' if args.replay else ''}{note}")
    return 0
