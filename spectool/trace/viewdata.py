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

from spectool.trace.schema import ACCEPTED, PHASE_FIELDS, REJECTED
from spectool.trace.stats import summarize
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


class _Blob:
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


def _request_rows(steps: pa.Table, request: int) -> pa.Table:
    wanted = [c for c in steps.column_names if c not in ("positions", "retrieve_index", "retrieve_next_token",
                                                        "retrieve_next_sibling", "coins")]
    # combine_chunks first: it compacts sliced list buffers, which makes filter and sort ~10x faster.
    rows = steps.select(wanted).combine_chunks()
    if pc.any(pc.not_equal(rows["request_id"], request)).as_py():
        rows = rows.filter(pc.equal(rows["request_id"], request))
    its = rows["iteration"].to_numpy()
    return rows if bool(np.all(its[1:] >= its[:-1])) else rows.sort_by("iteration")


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


def request_data(trace: Any, request: int, blob: _Blob, texts: set[int]) -> dict:
    """One request as per-iteration JSON lists and per-node typed arrays in `blob`."""
    rows = _request_rows(trace.steps, request)
    nodes: dict[str, Any] = {}
    offsets = np.zeros(1, np.int64)
    flat: dict[str, np.ndarray] = {}
    for name, (column, dtype) in NODE_COLUMNS.items():
        values, offsets = _flat(rows, column, dtype)
        flat[name] = values
        nodes[name] = blob.add(values, dtype)
    n_iter = rows.num_rows
    sizes = np.diff(offsets)
    topk, topk_offsets = _flat(rows, "target_topk_tokens", np.int32)
    topk_p, _ = _flat(rows, "target_topk_probs", np.float32)
    path, path_offsets = _flat(rows, "accept_path", np.int64)
    k_per_row = np.where(sizes > 0, np.diff(topk_offsets) // np.maximum(sizes, 1), 0)
    # The target's top-k is kept for accepted nodes: it is what their children were judged against.
    keep, kstart, kcount = [], np.zeros(n_iter + 1, np.int64), np.zeros(n_iter, np.int64)
    path_lists = []
    for k in range(n_iter):
        n = int(sizes[k])
        p = [int(i) for i in path[path_offsets[k]:path_offsets[k + 1]] if 0 <= i < n]
        path_lists.append(p)
        width = int(k_per_row[k])
        for i in p:
            a = topk_offsets[k] + i * width
            keep.append(np.arange(a, a + width))
        kcount[k] = width
        kstart[k + 1] = kstart[k] + len(p) * width
    kept = np.concatenate(keep) if keep else np.zeros(0, np.int64)
    nodes["topk"] = blob.add(topk[kept], np.int32)
    nodes["topk_p"] = blob.add(topk_p[kept], np.float32)

    status, scores, valid = flat["status"], flat["scores"], flat["valid"].astype(bool)
    depth = _depths(flat["parents"], offsets)
    row_of = np.repeat(np.arange(n_iter), sizes)
    rejected = (status == REJECTED) & valid
    first_reject = np.full(n_iter, -1, np.int64)
    confident = np.full(n_iter, -1.0)
    if rejected.any():
        r = row_of[rejected]
        dmin = np.full(n_iter, np.iinfo(np.int64).max)
        np.minimum.at(dmin, r, depth[rejected])
        first_reject = np.where(dmin == np.iinfo(np.int64).max, -1, dmin)
        np.maximum.at(confident, r, np.nan_to_num(scores[rejected].astype(np.float64), nan=-1.0))

    bonus = _scalar(rows, "bonus_token", -1, np.int64)
    texts.update(flat["tokens"][valid].tolist(), flat["argmax"][valid].tolist(), topk[kept].tolist(),
                 bonus[bonus >= 0].tolist())
    try:
        req = trace.request(request)
    except KeyError:
        req = {}
    output = [int(t) for t in (req.get("output_tokens") or [])]
    prompt = [int(t) for t in (req.get("prompt_tokens") or [])]
    texts.update(output, prompt[-PROMPT_TAIL_TOKENS:])
    accept = _scalar(rows, "accept_length", 0, np.int64)
    start, count = output_spans(accept, len(output))
    summary = summarize(rows) if n_iter else {"mean_accept_length": 0.0}
    method = rows["method"][0].as_py() if n_iter else "none"
    phases = {p: _scalar(rows, p, np.nan).round(1).tolist() for p in PHASE_FIELDS if p in rows.column_names}
    return {
        "id": int(request),
        "label": f"request {request} · {n_iter} iterations · mean accept length "
                 f"{summary['mean_accept_length']:.2f}",
        "method": method,
        "iteration": _scalar(rows, "iteration", -1, np.int64).tolist(),
        "seq_len": _scalar(rows, "seq_len", -1, np.int64).tolist(),
        "accept_length": accept.tolist(),
        "bonus": bonus.tolist(),
        "match_len": _scalar(rows, "ngram_match_len", -1, np.int64).tolist(),
        "breadth": _scalar(rows, "ngram_breadth", -1, np.int64).tolist(),
        "iteration_us": [None if v != v else v for v in _scalar(rows, "iteration_us", np.nan).round(1).tolist()],
        "phases": {p: [None if v != v else v for v in vals] for p, vals in phases.items()},
        "first_reject_depth": first_reject.tolist(),
        "max_rejected_score": np.round(confident, 4).tolist(),
        "offsets": offsets.tolist(),
        "path": path_lists,
        "topk_k": kcount.tolist(),
        "topk_start": kstart.tolist(),
        "masks": _masks(rows, flat["parents"], offsets),
        "nodes": nodes,
        "prompt_tail": prompt[-PROMPT_TAIL_TOKENS:],
        "prompt_len": len(prompt),
        "output": output,
        "out_start": start.tolist(),
        "out_count": count.tolist(),
        "finish_reason": req.get("finish_reason"),
    }


def _depths(parents: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Depth of every node of every row (parents come before children; bad parents count as roots)."""
    depth = np.zeros(len(parents), np.int64)
    sizes = np.diff(offsets)
    starts = offsets[:-1]
    for i in range(1, int(sizes.max()) if len(sizes) else 0):
        rows = np.nonzero(sizes > i)[0]
        idx = starts[rows] + i
        par = parents[idx]
        ok = (par >= 0) & (par < i)
        depth[idx[ok]] = depth[starts[rows][ok] + par[ok]] + 1
    return depth


def _masks(rows: pa.Table, parents: np.ndarray, offsets: np.ndarray) -> list[str]:
    """Per iteration: '' when the mask is the ancestors of parents, else the recorded bits (base64)."""
    packed = rows["mask_packed"].to_pylist() if rows.num_rows else []
    same = derived_masks_match(parents, offsets, packed)
    return ["" if s else base64.b64encode(p or b"").decode() for s, p in zip(same, packed)]


def calibration(trace: Any) -> dict:
    """Draft score against acceptance over the whole trace, by depth (by layer for multi-layer EAGLE).

    Only nodes the verifier judged count (accepted or rejected, not padding, not
    unvisited). Scores are binned over [0, 1] when they are probabilities, else
    over their observed range.
    """
    steps = trace.steps.select(["method", "parents", "scores", "status", "valid"]).combine_chunks()
    parents, offsets = _flat(steps, "parents", np.int64)
    scores, _ = _flat(steps, "scores", np.float64)
    status, _ = _flat(steps, "status", np.int64)
    valid, _ = _flat(steps, "valid", bool)
    depth = _depths(parents, offsets)
    judged = valid & ((status == ACCEPTED) | (status == REJECTED)) & (depth > 0) & np.isfinite(scores)
    methods = set(steps["method"].to_pylist()) if steps.num_rows else set()
    unit = "layer" if methods == {"multi_layer_eagle"} else "depth"
    out: dict[str, Any] = {"unit": unit, "groups": [], "probability": True}
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
    summary = trace.summary()
    info = trace.run_info or {}
    model = info.get("model", {})
    draft = info.get("draft") or {}
    settings = ", ".join(f"{k}={v}" for k, v in draft.items() if k != "method" and not isinstance(v, dict))
    tps = summary.get("tokens_per_s")
    return [
        ["method", str(getattr(trace, "method", info.get("method", "?")))],
        ["draft settings", settings or "–"],
        ["model", str(model.get("name", "") if isinstance(model, dict) else model)],
        ["device", str(info.get("device", "?"))],
        ["requests", str(len(trace.request_ids))],
        ["iterations", str(summary.get("iterations", 0))],
        ["mean accept length", f"{summary.get('mean_accept_length', 0.0):.3f}"],
        ["tokens/s", "–" if tps is None else f"{tps:.1f}"],
        ["tokenizer", "yes" if getattr(trace, "tokenizer_json", None) else "none (tokens shown as ids)"],
        ["warnings", " · ".join(suspicious_numbers(trace)) or "none"],
    ]


def view_data(trace: Any) -> tuple[dict, bytes]:
    """(header, blob) for viewer.js: every request with draft iterations, run facts, calibration, texts."""
    blob = _Blob()
    texts: set[int] = set()
    with_steps = set(pc.unique(trace.steps["request_id"]).to_pylist()) if trace.steps.num_rows else set()
    requests = [request_data(trace, r, blob, texts) for r in trace.request_ids if r in with_steps]
    ids = sorted(i for i in texts if i >= 0)
    info = trace.run_info or {}
    header = {
        "title": f"spectool trace · {getattr(trace, 'method', info.get('method', '?'))}",
        "facts": _facts(trace),
        "texts": dict(zip(map(str, ids), trace.token_text(ids))),
        "has_tokenizer": bool(getattr(trace, "tokenizer_json", None)),
        "requests": requests,
        "calibration": calibration(trace),
        "phases": list(PHASE_FIELDS),
    }
    return header, blob.bytes()
