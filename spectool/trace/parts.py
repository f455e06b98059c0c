"""Checking a trace of any size in parts, in bounded memory.

The checker works on whole tables. `check_in_parts` hands it parts of a large trace
instead: whole requests, grouped in the order they first appear, about
``rows_per_part`` records each (every check is per record or per request, so a part
holds everything its checks need), read with `Trace.take` so only the batches holding
a part's records are decoded. Fault rows are mapped back to positions in the whole
trace's (iteration, request) order, and the earliest fault over all parts wins, as in
one pass over the whole table.

A trace that keeps only some iterations (``Record(every=...)``, ``where``, ``slowest``
or a ``select`` of iterations) lacks the records that continuity and output checks
follow a request through; it is checked record by record (each record on its own).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from spectool.trace.schema import REQUEST_SCHEMA

ROWS_PER_PART = 4096


def holds_whole_requests(run_info: dict) -> bool:
    """False when the trace kept only some iterations of its requests."""
    record = run_info.get("record") or {}
    subset = run_info.get("subset") or {}
    return (record.get("every", 1) == 1 and record.get("where") is None and record.get("slowest") is None
            and subset.get("iterations") is None)


def _parts(trace, rank: np.ndarray, rows_per_part: int) -> Iterator[np.ndarray]:
    """Global row numbers of each part (whole requests), each sorted by rank."""
    reqs = trace.keys()[1]
    ids, inverse = np.unique(reqs, return_inverse=True)
    first = np.full(len(ids), len(rank))
    np.minimum.at(first, inverse, rank)
    by_request = np.argsort(inverse, kind="stable")
    starts = np.searchsorted(inverse[by_request], np.arange(len(ids) + 1))
    group, size = [], 0
    for r in np.argsort(first, kind="stable"):
        group.append(by_request[starts[r]:starts[r + 1]])
        size += starts[r + 1] - starts[r]
        if size >= rows_per_part:
            rows = np.concatenate(group)
            yield rows[np.argsort(rank[rows], kind="stable")]
            group, size = [], 0
    if group:
        rows = np.concatenate(group)
        yield rows[np.argsort(rank[rows], kind="stable")]


def check_in_parts(trace, check: Callable, rows_per_part: int = ROWS_PER_PART, progress: bool = True):
    """``check(part_trace) -> Fault | None`` over parts of ``trace``; the earliest fault, in whole-trace rows."""
    from spectool.trace.reader import Trace

    its, reqs = trace.keys()
    n = len(its)
    whole = holds_whole_requests(trace.run_info)
    if n <= rows_per_part and whole:
        return check(trace)
    order = np.lexsort((reqs, its))
    rank = np.empty(n, np.int64)
    rank[order] = np.arange(n)
    requests = trace.requests
    from tqdm import tqdm

    bar = tqdm(total=n, desc="checking", unit="record", disable=None if progress else True, leave=False)
    best = None
    try:
        if not whole:  # record by record, in trace order: the first part with a fault holds the earliest
            for start in range(0, n, rows_per_part):
                rows = order[start:start + rows_per_part]
                steps = trace.take(rows)
                alone = steps.set_column(steps.schema.get_field_index("request_id"), "request_id",
                                         pa.array(np.arange(len(rows)), pa.int32()))
                fault = check(Trace(alone, REQUEST_SCHEMA.empty_table(), trace.run_info, trace.tokenizer_json))
                bar.update(len(rows))
                if fault is not None:
                    local = min(fault.row, len(rows) - 1)
                    return dataclasses.replace(fault, row=start + fault.row, request_id=int(reqs[rows[local]]))
            return None
        seen: set[int] = set()
        for rows in _parts(trace, rank, rows_per_part):
            bar.update(len(rows))
            if best is not None and rank[rows[0]] > best.row:
                continue  # every record of this part comes after the fault already found
            ids = np.unique(reqs[rows])
            seen.update(ids.tolist())
            part_requests = requests.filter(pc.is_in(requests["request_id"], pa.array(ids, pa.int32())))
            fault = check(Trace(trace.take(rows), part_requests, trace.run_info, trace.tokenizer_json))
            if fault is not None:
                fault = dataclasses.replace(fault, row=int(rank[rows[fault.row]]) if fault.row < len(rows) else n)
                best = fault if best is None or fault < best else best
        # Requests without any step row (finished at prefill) still have their outputs checked.
        rest = requests.filter(pc.invert(pc.is_in(requests["request_id"], pa.array(sorted(seen), pa.int32()))))
        if rest.num_rows:
            fault = check(Trace(trace.take(np.zeros(0, np.int64)), rest, trace.run_info, trace.tokenizer_json))
            if fault is not None:
                fault = dataclasses.replace(fault, row=n)
                best = fault if best is None or fault < best else best
        return best
    finally:
        bar.close()
