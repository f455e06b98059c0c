"""What the in-browser views receive: a trace as one small JSON header plus one binary blob.

The notebook's TraceViewer and the standalone report run the same ES module
(widgets/static/viewer.js); both hand it `view_data(trace)`. Per request, the
per-node columns (tokens, parents, scores, status, target argmax...) go in the blob
as typed arrays with per-iteration offsets, so a 10,000-iteration trace is a few
MB and one step is a slice of arrays already in the page. Everything is computed
column-wise from `trace.steps` / `trace.requests` (no per-iteration Python objects).

Token texts travel raw, once per id (the page makes whitespace visible and sets all
text as text, never as HTML).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from spectool.trace.schema import ACCEPTED, PHASE_FIELDS, REJECTED, STEP_SCHEMA
from spectool.trace.suspicious import suspicious_numbers

# Per-node arrays: name in the page -> (steps column, numpy dtype).
NODE_COLUMNS = {
    "tokens": ("tokens", np.int32),
    "parents": ("parents", np.int32),
    "scores": ("scores", np.float32),
    "valid": ("valid", np.uint8),
    "status": ("status", np.uint8),
    "argmax": ("target_argmax", np.int32),
    "argmax_p": ("target_argmax_prob", np.float32),
}
# Prompt context shown before the output in the text panel.
PROMPT_TAIL_TOKENS = 48
# Score bins of the calibration view.
CALIBRATION_BINS = 10
# Iterations per chunk of per-node arrays: the page holds a few chunks and asks for the next ahead of time.
CHUNK = 256
# Above this many records a trace is "large": no whole-trace pass at open (facts from the index,
# calibration from a sample of CALIBRATION_SAMPLE records in CALIBRATION_BLOCKS runs).
LARGE_RECORDS = 200_000
CALIBRATION_SAMPLE = 32_768
CALIBRATION_BLOCKS = 16
# Buckets of the whole-run plot (Trace.aggregates).
AGGREGATE_POINTS = 1000
# The per-iteration columns a request's data reads; the per-node ones its chunks read.
SCALAR_COLUMNS = ["iteration", "request_id", "method", "seq_len", "accept_length", "bonus_token",
                  "ngram_match_len", "ngram_breadth", "iteration_us", *PHASE_FIELDS]
NODE_SOURCE_COLUMNS = ["tokens", "parents", "scores", "valid", "status", "target_argmax", "target_argmax_prob",
                       "target_topk_tokens", "target_topk_probs", "accept_path", "mask_packed"]


def _flat(rows: pa.Table, name: str, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (flat values, offsets per row), nulls as empty lists."""
    col = rows[name].combine_chunks() if rows.num_rows else pa.array([], rows.schema.field(name).type)
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    col = pc.if_else(pc.is_null(col), pa.scalar([], col.type), col) if col.null_count else col
    offsets = np.asarray(col.offsets.to_numpy(), dtype=np.int64)
    values = np.asarray(col.values.to_numpy(zero_copy_only=False), dtype=dtype)[offsets[0]:offsets[-1]]
    return values, offsets - offsets[0]


def _scalar(rows: pa.Table, name: str, fill: float, dtype: Any = np.float64) -> np.ndarray:
    if name not in rows.column_names:
        return np.full(rows.num_rows, fill, dtype=dtype)
    return np.asarray(rows[name].fill_null(fill).to_numpy(), dtype=dtype)


def derived_masks_match(parents: np.ndarray, offsets: np.ndarray, packed: list) -> np.ndarray:
    """Per row: True when the recorded mask equals the ancestors of `parents` (the page derives it then).

    Vectorised per tree size: the ancestor sets grow by one parent hop per round.
    """
    sizes = np.diff(offsets)
    same = np.zeros(len(sizes), dtype=bool)
    for n in np.unique(sizes):
        rows = np.nonzero(sizes == n)[0]
        if n == 0:
            same[rows] = [not packed[r] for r in rows]
            continue
        par = np.stack([parents[offsets[r]:offsets[r] + n] for r in rows]).astype(np.int64)
        par = np.where((par >= 0) & (par < np.arange(n)), par, -1)  # a bad parent ends the walk
        mask = np.zeros((len(rows), n, n), dtype=bool)
        cur = np.broadcast_to(np.arange(n), (len(rows), n)).copy()
        ri, qi = np.indices(cur.shape)
        while (cur >= 0).any():
            ok = cur >= 0
            mask[ri[ok], qi[ok], cur[ok]] = True
            cur = np.where(ok, np.take_along_axis(par, np.maximum(cur, 0), axis=1), -1)
        derived = np.packbits(mask.reshape(len(rows), -1), axis=1)
        for j, r in enumerate(rows):
            same[r] = (packed[r] or b"") == derived[j].tobytes()
    return same


class Blob:
    """Typed arrays appended to one buffer, 8-byte aligned, described by (dtype, offset, length)."""

    def __init__(self):
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, values: np.ndarray, dtype: Any) -> list:
        data = np.ascontiguousarray(values, dtype=dtype).tobytes()
        where = [np.dtype(dtype).name, self.size, len(values)]
        pad = (-len(data)) % 8
        self.parts.append(data + b"\0" * pad)
        self.size += len(data) + pad
        return where

    def bytes(self) -> bytes:
        return b"".join(self.parts)


def _request_rows(trace: Any, request: int, columns: list[str]) -> pa.Table:
    """The request's step rows by iteration, only ``columns`` (a lazily loaded trace decodes only its batches)."""
    return trace.request_steps(request, [c for c in columns if c in STEP_SCHEMA.names])


def output_spans(accept_length: np.ndarray, num_output: int) -> tuple[np.ndarray, np.ndarray]:
    """Per iteration, the first output position it produced and how many (accept length + bonus).

    Output token 0 comes from prefill; iteration k then adds accept_length[k] + 1
    tokens, clipped where the request stopped.
    """
    gained = np.maximum(accept_length.astype(np.int64), 0) + 1
    start = 1 + np.concatenate([[0], np.cumsum(gained)[:-1]]) if len(gained) else np.zeros(0, np.int64)
    start = np.minimum(start, num_output)
    count = np.clip(num_output - start, 0, gained)
    return start, count


def _texts(trace: Any, ids: Any) -> dict[str, str]:
    ids = np.unique(np.asarray(ids, np.int64))
    ids = ids[ids >= 0].tolist()
    return dict(zip(map(str, ids), trace.token_text(ids)))


def _nullable(values: np.ndarray) -> list:
    return [None if v != v else v for v in values.round(1).tolist()]


def request_data(trace: Any, request: int, with_text: bool = True) -> dict:
    """One request's per-iteration columns (what the player, the find bar and the plots need).

    The per-node arrays come separately, in chunks of CHUNK iterations (`chunk_data`).
    ``with_text=False`` leaves out the prompt and output (`text_data`), which a lazily loaded
    trace without a request index (`Trace.finds_requests_fast`) reads from every batch holding
    request rows the first time.
    """
    rows = _request_rows(trace, request, [*SCALAR_COLUMNS, "parents", "scores", "status", "valid"])
    n_iter = rows.num_rows
    parents, offsets = _flat(rows, "parents", np.int64)
    status, _ = _flat(rows, "status", np.uint8)
    scores, _ = _flat(rows, "scores", np.float64)
    valid, _ = _flat(rows, "valid", bool)
    depth, drawn = _depths(parents, offsets, valid)
    row_of = np.repeat(np.arange(n_iter), np.diff(offsets))
    rejected = (status == REJECTED) & valid
    first_reject = np.full(n_iter, -1, np.int64)
    confident = np.full(n_iter, -1.0)
    if rejected.any():
        r = row_of[rejected]
        dmin = np.full(n_iter, np.iinfo(np.int64).max)
        np.minimum.at(dmin, r, depth[rejected])
        first_reject = np.where(dmin == np.iinfo(np.int64).max, -1, dmin)
        np.maximum.at(confident, r, np.nan_to_num(scores[rejected], nan=-1.0))
    deepest = np.zeros(n_iter, np.int64)
    np.maximum.at(deepest, row_of[drawn], depth[drawn])
    shown = np.bincount(row_of[drawn], minlength=n_iter)
    accept = _scalar(rows, "accept_length", 0, np.int64)
    bonus = _scalar(rows, "bonus_token", -1, np.int64)
    phases = {p: _nullable(_scalar(rows, p, np.nan)) for p in PHASE_FIELDS if p in rows.column_names}
    out = {
        "id": int(request),
        "label": f"request {request} · {n_iter} iterations · mean accept length "
                 f"{accept.mean() if n_iter else 0.0:.2f}",
        "method": rows["method"][0].as_py() if n_iter else "none",
        "chunk": CHUNK,
        "chunks": -(-n_iter // CHUNK),
        "iteration": _scalar(rows, "iteration", -1, np.int64).tolist(),
        "seq_len": _scalar(rows, "seq_len", -1, np.int64).tolist(),
        "accept_length": accept.tolist(),
        "bonus": bonus.tolist(),
        "match_len": _scalar(rows, "ngram_match_len", -1, np.int64).tolist(),
        "breadth": _scalar(rows, "ngram_breadth", -1, np.int64).tolist(),
        "iteration_us": _nullable(_scalar(rows, "iteration_us", np.nan)),
        "phases": phases,
        "first_reject_depth": first_reject.tolist(),
        "max_rejected_score": np.round(confident, 4).tolist(),
        "deepest": deepest.tolist(),
        "shown": shown.tolist(),
        "texts": _texts(trace, bonus),
    }
    if with_text:
        out["text"] = text_data(trace, request, accept)
    return out


def text_data(trace: Any, request: int, accept_length: Any) -> dict:
    """The text panel's data: prompt tail, output, and the output span of every iteration."""
    try:
        req = trace.request(request)
    except KeyError:
        req = {}
    output = [int(t) for t in (req.get("output_tokens") or [])]
    prompt = [int(t) for t in (req.get("prompt_tokens") or [])]
    start, count = output_spans(np.asarray(accept_length, np.int64), len(output))
    return {"prompt_tail": prompt[-PROMPT_TAIL_TOKENS:], "prompt_len": len(prompt), "output": output,
            "out_start": start.tolist(), "out_count": count.tolist(), "finish_reason": req.get("finish_reason"),
            "texts": _texts(trace, output + prompt[-PROMPT_TAIL_TOKENS:])}


def chunk_data(rows: pa.Table, blob: Blob, trace: Any) -> dict:
    """Per-node typed arrays of some consecutive iterations (`rows`) appended to ``blob``, with their
    per-iteration offsets, accepted paths, kept top-k and masks that differ from the parents' ancestors."""
    nodes: dict[str, Any] = {}
    flat: dict[str, np.ndarray] = {}
    offsets = np.zeros(1, np.int64)
    for name, (column, dtype) in NODE_COLUMNS.items():
        flat[name], offsets = _flat(rows, column, dtype)
        nodes[name] = blob.add(flat[name], dtype)
    n_iter, sizes = rows.num_rows, np.diff(offsets)
    topk, topk_offsets = _flat(rows, "target_topk_tokens", np.int32)
    topk_p, _ = _flat(rows, "target_topk_probs", np.float32)
    path, path_offsets = _flat(rows, "accept_path", np.int64)
    width = np.where(sizes > 0, np.diff(topk_offsets) // np.maximum(sizes, 1), 0)
    # The target's top-k is kept for accepted nodes: it is what their children were judged against.
    path_row = np.repeat(np.arange(n_iter), np.diff(path_offsets))
    on_path = (path >= 0) & (path < sizes[path_row])
    path, path_row = path[on_path], path_row[on_path]
    counts = np.bincount(path_row, minlength=n_iter)
    starts = topk_offsets[path_row] + path * width[path_row]
    w = width[path_row]
    kept = (np.repeat(starts - np.cumsum(w) + w, w) + np.arange(int(w.sum()))) if len(w) else np.zeros(0, np.int64)
    kstart = np.concatenate([[0], np.cumsum(counts * width)])
    nodes["topk"] = blob.add(topk[kept], np.int32)
    nodes["topk_p"] = blob.add(topk_p[kept], np.float32)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    valid = flat["valid"].astype(bool)
    return {
        "offsets": offsets.tolist(),
        "path": [path[bounds[k]:bounds[k + 1]].tolist() for k in range(n_iter)],
        "topk_k": width.tolist(),
        "topk_start": kstart[:-1].tolist(),
        "masks": _masks(rows, flat["parents"], offsets),
        "nodes": nodes,
        "texts": _texts(trace, np.concatenate([flat["tokens"][valid], flat["argmax"][valid], topk[kept]])),
    }


def chunk_rows(trace: Any, request: int, chunk: int, rows: np.ndarray | None = None) -> pa.Table:
    """The step rows of the request's ``chunk``-th run of CHUNK iterations (``rows``: the request's row
    numbers by iteration, when already known)."""
    if rows is None:
        rows = request_row_numbers(trace, request)
    return trace.take(rows[chunk * CHUNK:(chunk + 1) * CHUNK], NODE_SOURCE_COLUMNS)


def request_row_numbers(trace: Any, request: int) -> np.ndarray:
    """Row numbers (see `Trace.keys`) of one request's records, by iteration."""
    its, reqs = trace.keys()
    rows = np.flatnonzero(reqs == request)
    return rows[np.argsort(its[rows], kind="stable")]


def _depths(parents: np.ndarray, offsets: np.ndarray, valid: np.ndarray | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
    """Depth of every node of every row, and whether it is drawn (the root, and valid nodes under drawn
    parents: what the page shows). Parents come before children; a bad parent counts as a root."""
    depth = np.zeros(len(parents), np.int64)
    drawn = np.zeros(len(parents), bool)
    sizes = np.diff(offsets)
    starts = offsets[:-1]
    drawn[starts[sizes > 0]] = True
    live = np.arange(len(sizes))
    for i in range(1, int(sizes.max()) if len(sizes) else 0):
        live = live[sizes[live] > i]  # the rows with a node at position i
        idx = starts[live] + i
        par = parents[idx]
        ok = (par >= 0) & (par < i)
        pidx = starts[live][ok] + par[ok]
        depth[idx[ok]] = depth[pidx] + 1
        drawn[idx[ok]] = drawn[pidx] if valid is None else drawn[pidx] & valid[idx[ok]]
    return depth, drawn


def _masks(rows: pa.Table, parents: np.ndarray, offsets: np.ndarray) -> list[str]:
    """Per iteration: '' when the mask is the ancestors of parents, else the recorded bits (base64)."""
    packed = rows["mask_packed"].to_pylist() if rows.num_rows else []
    same = derived_masks_match(parents, offsets, packed)
    return ["" if s else base64.b64encode(p or b"").decode() for s, p in zip(same, packed)]


def calibration(trace: Any) -> dict:
    """Draft score against acceptance over the whole trace, by depth (by layer for multi-layer EAGLE).

    Only nodes the verifier judged count (accepted or rejected, not padding, not
    unvisited). Scores are binned over [0, 1] when they are probabilities, else
    over their observed range. A trace of more than LARGE_RECORDS records is
    sampled: CALIBRATION_BLOCKS evenly spaced runs of consecutive records,
    CALIBRATION_SAMPLE in all (``sampled`` says how many of how many).
    """
    columns = ["method", "parents", "scores", "status", "valid"]
    total = len(trace)
    if total > LARGE_RECORDS:
        block = CALIBRATION_SAMPLE // CALIBRATION_BLOCKS
        starts = np.linspace(0, total - block, CALIBRATION_BLOCKS).astype(np.int64)
        steps = trace.take(np.unique((starts[:, None] + np.arange(block)).ravel()), columns)
    else:
        steps = trace.columns(columns) if hasattr(trace, "columns") else trace.steps.select(columns)
    steps = steps.combine_chunks()
    parents, offsets = _flat(steps, "parents", np.int64)
    scores, _ = _flat(steps, "scores", np.float64)
    status, _ = _flat(steps, "status", np.int64)
    valid, _ = _flat(steps, "valid", bool)
    depth, _ = _depths(parents, offsets)
    judged = valid & ((status == ACCEPTED) | (status == REJECTED)) & (depth > 0) & np.isfinite(scores)
    methods = set(steps["method"].unique().to_pylist()) if steps.num_rows else set()
    unit = "layer" if methods == {"multi_layer_eagle"} else "depth"
    out: dict[str, Any] = {"unit": unit, "groups": [], "probability": True,
                           "sampled": [steps.num_rows, total] if steps.num_rows < total else None}
    if not judged.any():
        return out
    s, d, acc = scores[judged], depth[judged], status[judged] == ACCEPTED
    lo, hi = (0.0, 1.0) if s.min() >= 0 and s.max() <= 1 else (float(s.min()), float(s.max()) or 1.0)
    out["probability"] = (lo, hi) == (0.0, 1.0)
    edges = np.linspace(lo, hi, CALIBRATION_BINS + 1)
    bins = np.clip(np.searchsorted(edges, s, side="right") - 1, 0, CALIBRATION_BINS - 1)
    out["edges"] = np.round(edges, 4).tolist()
    for g in np.unique(d):
        sel = d == g
        count = np.bincount(bins[sel], minlength=CALIBRATION_BINS)
        hits = np.bincount(bins[sel], weights=acc[sel], minlength=CALIBRATION_BINS)
        mean = np.bincount(bins[sel], weights=s[sel], minlength=CALIBRATION_BINS)
        nz = count > 0
        out["groups"].append({
            "depth": int(g), "label": f"layer {g - 1}" if unit == "layer" else f"depth {g}",
            "count": count[nz].tolist(), "accepted": hits[nz].astype(int).tolist(),
            "score": np.round(mean[nz] / count[nz], 4).tolist()})
    return out


def _facts(trace: Any) -> list[list]:
    info = trace.run_info or {}
    model = info.get("model", {})
    draft = info.get("draft") or {}
    settings = ", ".join(f"{k}={v}" for k, v in draft.items() if k != "method" and not isinstance(v, dict))
    if len(trace) > LARGE_RECORDS:  # from the columns read at open: a whole-trace pass takes many seconds
        cols = trace.scalars()
        acc, us = cols["accept_length"], cols["iteration_us"]
        _, first = np.unique(cols["iteration"], return_index=True)
        total_us = np.nansum(us[first]) if len(us) else 0.0
        iterations, tps = len(first), (float((np.maximum(acc, 0) + 1).sum() / total_us * 1e6) if total_us > 0
                                       else None)
        mean = float(np.maximum(acc, 0).mean()) if len(acc) else 0.0
        warnings = f"not computed at {len(trace):,} records (`spectool summary` lists them)"
    else:
        summary = trace.summary()
        iterations, tps, mean = summary.get("iterations", 0), summary.get("tokens_per_s"), \
            summary.get("mean_accept_length", 0.0)
        warnings = " · ".join(suspicious_numbers(trace)) or "none"
    return [
        ["method", str(getattr(trace, "method", info.get("method", "?")))],
        ["draft settings", settings or "–"],
        ["model", str(model.get("name", "") if isinstance(model, dict) else model)],
        ["device", str(info.get("device", "?"))],
        ["requests", str(len(step_requests(trace)))],
        ["records", f"{len(trace):,}"],
        ["iterations", str(iterations)],
        ["mean accept length", f"{mean:.3f}"],
        ["tokens/s", "–" if tps is None else f"{tps:.1f}"],
        ["tokenizer", "yes" if getattr(trace, "tokenizer_json", None) else "none (tokens shown as ids)"],
        ["warnings", warnings],
    ]


def step_requests(trace: Any) -> list[int]:
    """Request ids that have draft iterations, ascending (from the index alone)."""
    reqs = np.unique(trace.keys()[1])
    return reqs[reqs >= 0].tolist()


def header_data(trace: Any) -> dict:
    """What every page gets first: run facts, the request picker's list, whole-run series and calibration.

    ``requests`` lists every request with draft iterations as {id, label} (the page loads a
    request's data when it is shown); ``aggregate`` is `Trace.aggregates` (per-iteration means
    over all requests, downsampled to at most AGGREGATE_POINTS buckets, each keeping its min and max).
    """
    info = trace.run_info or {}
    agg = trace.aggregates(AGGREGATE_POINTS)
    table = agg.pop("requests")
    for series in ("accept_length", "batch", "iteration_us"):  # JSON has no NaN: a bucket without timings
        agg[series] = {k: [None if v != v else v for v in vals] for k, vals in agg[series].items()}
    requests = [{"id": int(r), "label": f"request {r} · {n} iterations · mean accept length {m:.2f}"}
                for r, n, m in zip(table["id"], table["records"], table["mean_accept_length"]) if r >= 0]
    return {
        "title": f"spectool trace · {getattr(trace, 'method', info.get('method', '?'))}",
        "facts": _facts(trace),
        "texts": {},
        "has_tokenizer": bool(getattr(trace, "tokenizer_json", None)),
        "requests": requests,
        "aggregate": agg,
        "calibration": calibration(trace),
        "phases": list(PHASE_FIELDS),
        "records": len(trace),
    }


def preload(header: dict, blob: Blob, trace: Any, request: int, chunks: Any = None) -> dict:
    """Put one request's data, and its ``chunks`` (default: all), in ``header["loaded"]`` and ``blob``."""
    # A large trace that reads every request row for the first text sends that text on its own.
    data = request_data(trace, request, with_text=len(trace) <= LARGE_RECORDS or trace.finds_requests_fast)
    rows = request_row_numbers(trace, request)
    if chunks is None:  # every chunk: one read, then zero-copy slices
        table = trace.take(rows, NODE_SOURCE_COLUMNS).combine_chunks()
        parts = {c: table.slice(c * CHUNK, CHUNK) for c in range(data["chunks"])}
    else:
        parts = {c: chunk_rows(trace, request, c, rows) for c in chunks if 0 <= c < data["chunks"]}
    data["loaded"] = {str(c): chunk_data(part, blob, trace) for c, part in parts.items()}
    header.setdefault("loaded", []).append(data)
    return data


def view_data(trace: Any) -> tuple[dict, bytes]:
    """(header, blob) with every request and every iteration loaded: what the standalone report embeds."""
    blob = Blob()
    header = header_data(trace)
    for r in header["requests"]:
        preload(header, blob, trace, r["id"])
    return header, blob.bytes()
