"""`spectool export-perfetto TRACE [-o out.json]`: phase timings as Chrome trace-event JSON.

Opens in https://ui.perfetto.dev or chrome://tracing. Each iteration is one
complete event ("ph": "X") on the "iteration" track; inside it the phases run one
after another on the "phases" track in the engine's order (draft, index, verify,
commit); the n-gram corpus calls (trie_get, trie_put) go on their own track since
trie_put runs on the corpus worker thread. Times are µs. When iteration_us was
recorded, iterations are laid out by it (the gap after the phases is host overhead);
otherwise back to back.
"""

from __future__ import annotations

from spectool.trace.reader import Trace
from spectool.trace.schema import PHASE_FIELDS

_TRACKS = {"iteration": 1, "phases": 2, "trie": 3}
_SEQUENTIAL = ("draft_us", "index_us", "verify_us", "commit_us")


def perfetto_events(trace: Trace) -> dict:
    """The Chrome trace-event JSON object for ``trace``."""
    names = ["iteration", "request_id", "accept_length", "iteration_us", *PHASE_FIELDS]
    # Only these scalar columns are read (a lazily loaded trace decodes nothing else).
    steps = trace.columns(names).sort_by([("iteration", "ascending"), ("request_id", "ascending")])
    cols = {n: steps[n].to_pylist() for n in names}
    its = cols["iteration"]
    by_iteration: dict[int, list[int]] = {}
    for k, it in enumerate(its):
        by_iteration.setdefault(it, []).append(k)
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "spectool decode"}}]
    events += [{"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": name}}
               for name, tid in _TRACKS.items()]
    t = 0.0
    for it, rows in by_iteration.items():
        first = rows[0]  # phase timings are per batch: every row of an iteration holds the same
        phases = {p: cols[p][first] for p in PHASE_FIELDS if cols[p][first] is not None}
        busy = sum(phases.get(p, 0.0) for p in _SEQUENTIAL)
        length = cols["iteration_us"][first] if cols["iteration_us"][first] is not None else busy
        args = {"iteration": it, "batch": len(rows),
                "accept_lengths": {str(cols["request_id"][r]): cols["accept_length"][r] for r in rows}}
        events.append({"ph": "X", "pid": 1, "tid": _TRACKS["iteration"], "name": f"iteration {it}",
                       "ts": t, "dur": max(length, busy), "args": args})
        start = t
        for p in _SEQUENTIAL:
            if p in phases:
                events.append({"ph": "X", "pid": 1, "tid": _TRACKS["phases"], "name": p.removesuffix("_us"),
                               "ts": start, "dur": phases[p], "args": {"iteration": it}})
                start += phases[p]
        if "trie_get_us" in phases:  # the corpus lookup happens at the start of drafting
            events.append({"ph": "X", "pid": 1, "tid": _TRACKS["trie"], "name": "trie_get", "ts": t,
                           "dur": phases["trie_get_us"], "args": {"iteration": it}})
        if "trie_put_us" in phases:  # the insert follows the commit
            events.append({"ph": "X", "pid": 1, "tid": _TRACKS["trie"], "name": "trie_put", "ts": start,
                           "dur": phases["trie_put_us"], "args": {"iteration": it}})
        t += max(length, busy)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"run_info": {k: v for k, v in trace.run_info.items() if k != "tokenizer_json"}}}
