"""Summary statistics of a run: the one place their formulas live.

`Trace.summary()`, `spectool summary` and the engine's live stats all call
`summarize`, so they agree by construction. Definitions (a *record* is one row:
one request in one iteration):

- tokens: tokens verified, sum over records of accept_length + 1 (accepted + bonus). It
  can exceed the tokens a run emits: tokens accepted past max_new_tokens or a stop token
  in a request's last iteration are verified, then dropped (`spectool summary` shows both);
- mean_accept_length: mean accept_length over records;
- accept_length_histogram[a]: records with accept_length == a;
- accept_rate_by_depth[d-1]: among records whose draft tree reaches depth d, the
  fraction with accept_length >= d (for a multi-layer EAGLE chain, depth d is layer d);
- tokens_per_s: verified tokens / (sum of iteration_us over iterations) * 1e6, None when
  iteration_us was not recorded (excludes prefill);
- phase_us: mean µs per iteration of each recorded phase (timings are per batch,
  so each iteration counts once).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from spectool.trace.schema import PHASE_FIELDS


def _column(steps: pa.Table, name: str) -> np.ndarray | None:
    if name not in steps.column_names:
        return None
    col = steps.column(name)
    if col.null_count == len(col):
        return None
    return np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64)


def _max_depth(steps: pa.Table) -> np.ndarray | None:
    """Deepest node of each record's tree (0 for a root-only tree), or the ``max_depth`` column."""
    if "max_depth" in steps.column_names:
        return np.asarray(steps.column("max_depth").to_numpy(), dtype=np.int64)
    if "depth" not in steps.column_names:
        return None
    out = []
    for chunk in steps.column("depth").chunks:
        values = chunk.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
        offsets = chunk.offsets.to_numpy()
        lengths = np.diff(offsets)
        starts = offsets[:-1] - offsets[0]
        best = np.zeros(len(chunk), dtype=np.int64)
        nonempty = lengths > 0
        if nonempty.any():
            best[nonempty] = np.maximum.reduceat(values, starts[nonempty])
        out.append(best)
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def summary_columns(steps: pa.Table) -> pa.Table:
    """The columns `summarize` reads, with ``depth`` reduced to ``max_depth``: a stream of batches
    reduced this way and concatenated summarises the same as the whole table, in far less memory."""
    names = [n for n in steps.column_names if n not in ("depth", "max_depth")]
    out = steps.select(names)
    depth = _max_depth(steps)
    if depth is not None:
        out = out.append_column("max_depth", pa.array(depth, pa.int32()))
    return out


def summarize(steps: pa.Table | dict) -> dict:
    """Summary of a steps table (or a dict of columns).

    Needs the columns ``iteration`` and ``accept_length``; uses ``depth`` (or ``max_depth``),
    ``iteration_us`` and the phase timing columns when present.
    """
    if isinstance(steps, dict):
        steps = pa.table(steps)
    for name in ("iteration", "accept_length"):
        if name not in steps.column_names:
            raise ValueError(f"summarize needs a {name!r} column")
    if steps.num_rows == 0:  # a call that ran no iteration (one new token: the prefill's); its columns are untyped
        return {"records": 0, "iterations": 0, "tokens": 0, "mean_accept_length": 0.0, "accept_length_histogram": [],
                "accept_rate_by_depth": [], "tokens_per_s": None, "phase_us": {}}
    accept = np.asarray(steps.column("accept_length").fill_null(0).to_numpy(), dtype=np.int64)
    iteration = np.asarray(steps.column("iteration").to_numpy(zero_copy_only=False))
    _, first_row = np.unique(iteration, return_index=True)  # one row per iteration for batch-wide timings

    histogram = np.bincount(accept).tolist() if accept.size else []
    rate_by_depth = []
    max_depth = _max_depth(steps)
    if max_depth is not None and max_depth.size:
        for d in range(1, int(max_depth.max()) + 1):
            reaches = max_depth >= d
            rate_by_depth.append(float((accept[reaches] >= d).mean()))

    tokens = int((accept + 1).sum())
    iteration_us = _column(steps, "iteration_us")
    tokens_per_s = None
    if iteration_us is not None:
        total_us = np.nansum(iteration_us[first_row])
        tokens_per_s = float(tokens / total_us * 1e6) if total_us > 0 else None
    phase_us = {}
    for name in PHASE_FIELDS:
        values = _column(steps, name)
        if values is not None:
            phase_us[name] = float(np.nanmean(values[first_row]))
    return {
        "records": int(steps.num_rows),
        "iterations": int(first_row.size),
        "tokens": tokens,
        "mean_accept_length": float(accept.mean()) if accept.size else 0.0,
        "accept_length_histogram": histogram,
        "accept_rate_by_depth": rate_by_depth,
        "tokens_per_s": tokens_per_s,
        "phase_us": phase_us,
    }
