"""``spectool export-perfetto TRACE``: phase timings as Chrome/Perfetto trace JSON."""

from __future__ import annotations

import json
from pathlib import Path

from spectool.cli.args import BadInput, fail, open_trace, parser


def main(argv: list[str] | None = None) -> int:
    """Command line: write the JSON next to the trace (or to -o); exit 2 when unreadable."""
    p = parser("export-perfetto", "Export a trace's phase timings (draft, index, verify, commit, trie) per "
                                  "iteration as Chrome/Perfetto trace JSON; open it in https://ui.perfetto.dev.")
    p.add_argument("trace", help="a .sptrace file")
    p.add_argument("-o", "--out", help="output JSON (default: TRACE with .perfetto.json)")
    args = p.parse_args(argv)
    try:
        trace = open_trace("export-perfetto", args.trace)
    except BadInput as e:
        return fail("export-perfetto", e)
    from spectool.trace.perfetto import perfetto_events

    out = Path(args.out) if args.out else Path(args.trace).with_suffix(".perfetto.json")
    data = perfetto_events(trace)
    try:
        out.write_text(json.dumps(data))
    except OSError as e:
        return fail("export-perfetto", f"cannot write {out}: {e}")
    print(f"wrote {out} ({len(data['traceEvents'])} events); open it in https://ui.perfetto.dev")
    return 0
