"""`spectool report`: one standalone HTML file with the tree, mask and acceptance of any iteration.

The file opens without a kernel or a network: plotly.js is inlined, and the trace
goes in once as compact columnar JSON (per request: flat node arrays with offsets,
the tidy-layout x of every node, the bit-packed masks, token texts once per id).
A small script in the page turns one iteration's slice of those columns into the
tree and mask figures (styled like `tree_figure` / `mask_figure`, whose output for
the first iteration seeds each plot) and re-renders them on every step of the
player, so a trace of thousands of iterations stays one light page rather than
thousands of figures.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from plotly.offline import get_plotlyjs

from spectool.trace.figures import (
    COLORS,
    HIGHLIGHT,
    MASK_HIDDEN,
    MASK_SELECTED,
    MASK_VISIBLE,
    acceptance_figure_from_columns,
    mask_figure,
    request_columns,
    tree_figure,
)
from spectool.trace.layout import layout_tree
from spectool.trace.suspicious import suspicious_numbers


def _flat(rows: pa.Table, name: str, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (flat values, offsets per row) with nulls as empty lists."""
    col = rows[name].combine_chunks() if rows.num_rows else pa.array([], rows.schema.field(name).type)
    col = pc.if_else(pc.is_null(col), pa.scalar([], col.type), col) if col.null_count else col
    offsets = np.asarray(col.offsets.to_numpy(), dtype=np.int64)
    values = np.asarray(col.values.to_numpy(zero_copy_only=False), dtype=dtype)[offsets[0]:offsets[-1]]
    return values, offsets - offsets[0]


def _sig3(values: np.ndarray) -> list:
    """Floats to 3 significant digits for the page (NaN -> None, which JSON can hold)."""
    return [None if v != v else float(f"{v:.3g}") for v in values.astype(np.float64).tolist()]


def _per_mille(values: np.ndarray) -> list:
    """Probabilities as integer thousandths (shorter JSON than floats; the page shows 3 decimals)."""
    return np.rint(np.nan_to_num(values.astype(np.float64)) * 1000).astype(np.int64).tolist()


def _ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """mask[q, k] = k is q or an ancestor of q (parents come before children)."""
    mask = np.eye(len(parents), dtype=bool)
    for i in range(1, len(parents)):
        if 0 <= parents[i] < i:
            mask[i] |= mask[parents[i]]
    return mask


def request_data(trace: Any, request: int, texts: set[int]) -> dict:
    """One request's iterations as compact columns for the page; adds every token id seen to `texts`.

    Per node: token, parent, depth, score, valid, status, layout x, target argmax and
    its probability. The target's top-k is kept for accepted nodes only (their
    top-k is what decided their children: "why was this rejected"), which keeps
    large traces small. The recorded mask is kept only where it differs from the
    ancestors of `parents` (the page derives it otherwise).
    """
    rows = trace.steps.filter(pc.equal(trace.steps["request_id"], request)).sort_by("iteration")
    tokens, offsets = _flat(rows, "tokens", np.int64)
    parents, _ = _flat(rows, "parents", np.int64)
    scores, _ = _flat(rows, "scores", np.float64)
    valid, _ = _flat(rows, "valid", bool)
    status, _ = _flat(rows, "status", np.int64)
    depth, _ = _flat(rows, "depth", np.int64)
    argmax, _ = _flat(rows, "target_argmax", np.int64)
    argmax_p, _ = _flat(rows, "target_argmax_prob", np.float64)
    topk, topk_offsets = _flat(rows, "target_topk_tokens", np.int64)
    topk_p, _ = _flat(rows, "target_topk_probs", np.float64)
    path, path_offsets = _flat(rows, "accept_path", np.int64)
    bonus = np.asarray(rows["bonus_token"].fill_null(-1).to_numpy(), dtype=np.int64)
    packed = rows["mask_packed"].to_pylist()

    x2 = np.full(len(tokens), -1, dtype=np.int64)  # tidy-layout x in half units (y is -depth)
    masks: list[str] = []
    path_k: list[list[int]] = []  # accepted path per iteration, padding dropped
    keep_topk: list[np.ndarray] = []
    for k in range(rows.num_rows):
        a, b = offsets[k], offsets[k + 1]
        n = b - a
        if n:
            x, _ = layout_tree(parents[a:b], scores[a:b], valid[a:b])
            x2[a:b] = np.where(np.isnan(x), -1, np.nan_to_num(x * 2)).astype(np.int64)
        recorded = packed[k] or b""
        derived = np.packbits(_ancestor_mask(parents[a:b]).ravel()).tobytes() if n else b""
        masks.append("" if recorded == derived else base64.b64encode(recorded).decode())
        nodes = [int(i) for i in path[path_offsets[k]:path_offsets[k + 1]] if 0 <= i < n]
        path_k.append(nodes)
        ta, tb = topk_offsets[k], topk_offsets[k + 1]
        width = (tb - ta) // n if n else 0
        keep_topk.extend(np.arange(ta + i * width, ta + (i + 1) * width) for i in nodes)
    kept = np.concatenate(keep_topk) if keep_topk else np.zeros(0, np.int64)
    texts.update(tokens.tolist(), argmax.tolist(), topk[kept].tolist(), bonus[bonus >= 0].tolist())
    cols = request_columns(trace.steps, request)
    acceptance = acceptance_figure_from_columns(cols, request)
    return {
        "id": int(request),
        "label": f"request {request} · {rows.num_rows} iterations · mean accept length "
                 f"{cols['summary']['mean_accept_length']:.2f}",
        "iteration": rows["iteration"].to_pylist(),
        "method": rows["method"].to_pylist(),
        "seq_len": rows["seq_len"].to_pylist(),
        "accept_length": rows["accept_length"].to_pylist(),
        "match_len": rows["ngram_match_len"].fill_null(-1).to_pylist(),
        "breadth": rows["ngram_breadth"].fill_null(-1).to_pylist(),
        "bonus": bonus.tolist(),
        "offsets": offsets.tolist(),
        "tokens": tokens.tolist(),
        "parents": parents.tolist(),
        "depth": depth.tolist(),
        "scores": _sig3(scores),
        "valid": valid.astype(np.int8).tolist(),
        "status": status.tolist(),
        "x2": x2.tolist(),
        "argmax": argmax.tolist(),
        "argmax_pm": _per_mille(argmax_p),
        "path": path_k,
        "topk_k": (np.diff(topk_offsets) // np.maximum(np.diff(offsets), 1)).tolist(),
        "topk": topk[kept].tolist(),  # per iteration: K per accepted node, in path order
        "topk_pm": _per_mille(topk_p[kept]),
        "mask": masks,
        "acceptance": json.loads(acceptance.to_json()),
    }


def report_data(trace: Any) -> dict:
    """Everything the page shows, as one JSON-able dict."""
    texts: set[int] = set()
    with_steps = set(trace.steps["request_id"].to_pylist())
    requests = [request_data(trace, r, texts) for r in trace.request_ids if r in with_steps]
    ids = sorted(i for i in texts if i >= 0)
    first = None
    if requests:
        first_request = requests[0]["id"]
        view = trace.iteration(trace.iterations(first_request)[0], first_request)
        first = {"tree": json.loads(tree_figure(view, token_text=trace.token_text).to_json()),
                 "mask": json.loads(mask_figure(view).to_json())}
    summary = trace.summary()
    info = trace.run_info
    model = info.get("model", {})
    return {
        "title": f"spectool trace · {trace.method} · "
                 f"{model.get('name', '') if isinstance(model, dict) else model}",
        "facts": {
            "method": trace.method, "device": info.get("device", "?"),
            "requests": len(trace.request_ids), "iterations": summary["iterations"],
            "mean accept length": round(summary["mean_accept_length"], 3),
            "tokens/s": None if summary["tokens_per_s"] is None else round(summary["tokens_per_s"], 1),
            "tokenizer": "yes" if getattr(trace, "tokenizer_json", None) else "none (tokens shown as ids)",
            "warnings": " · ".join(suspicious_numbers(trace)) or "none",
        },
        "texts": dict(zip(map(str, ids), trace.token_text(ids))),
        "requests": requests,
        "first": first,
        "style": {"colors": COLORS, "highlight": HIGHLIGHT,
                  "mask": {"hidden": MASK_HIDDEN, "visible": MASK_VISIBLE, "selected": MASK_SELECTED}},
    }


def write_report(trace_or_path: Any, out_html: str | Path) -> Path:
    """Write one standalone HTML report of a trace (a Trace or a `.sptrace` path); returns its path.

    Raises TraceFormatError (a ValueError) when the path is not a readable trace.
    """
    if isinstance(trace_or_path, (str, Path)):
        from spectool.trace.reader import Trace

        trace = Trace.load(trace_or_path)
    else:
        trace = trace_or_path
    data = report_data(trace)
    # "</" inside a script element would end it early (a token text can be anything).
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    page = _PAGE.format(title=html.escape(data["title"]), plotlyjs=get_plotlyjs(), data=payload,
                        script=_SCRIPT)
    out = Path(out_html)
    out.write_text(page, encoding="utf-8")
    return out



_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 16px; color: #222; }}
.controls {{ display: flex; gap: 10px; align-items: center; flex-wrap: wrap; margin: 8px 0; }}
.views {{ display: flex; gap: 8px; flex-wrap: wrap; }}
.views > div {{ flex: 1 1 560px; min-width: 420px; }}
table.facts td {{ padding: 0 12px 0 0; }}
#message {{ color: #a94442; }}
</style>
<script>{plotlyjs}</script>
</head><body>
<h2>{title}</h2>
<table class="facts" id="facts"></table>
<div id="message"></div>
<div class="controls spectool-player">
  <select id="request"></select>
  <button id="play">play</button>
  <button id="prev">&lt;</button><button id="next">&gt;</button>
  <input id="step" type="range" min="0" max="0" value="0" style="width: 320px">
  <span id="label"></span>
  <label>mask row <select id="row"></select></label>
</div>
<div class="views">
  <div id="tree" class="spectool-tree"></div><div id="mask" class="spectool-mask"></div>
</div>
<div id="acceptance" class="spectool-acceptance"></div>
<script type="application/json" id="spectool-data">{data}</script>
<script>{script}</script>
</body></html>
"""

# The player: slices one iteration out of the request's columns and re-renders the
# tree and mask with the same traces, order and styling as spectool.trace.figures.
_SCRIPT = r"""
const D = JSON.parse(document.getElementById('spectool-data').textContent);
const $ = (id) => document.getElementById(id);
const STATUS = ['not visited', 'accepted', 'rejected'];
let R = null, pos = 0, chosen = null, timer = null;

for (const [k, v] of Object.entries(D.facts)) {
  $('facts').insertAdjacentHTML('beforeend', `<tr><td>${k}</td><td>${v === null ? '–' : v}</td></tr>`);
}
const text = (id) => (D.texts[id] !== undefined ? D.texts[id] : '#' + id);
const quote = (s) => JSON.stringify(s);
const esc = (s) => s.replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;');

let topkStart = [];  // per iteration of R: where its accepted nodes' top-k begin

function slice(k) {
  const a = R.offsets[k], b = R.offsets[k + 1], n = b - a, sl = (arr) => arr.slice(a, b);
  const parents = sl(R.parents), mask = [];
  const bits = R.mask[k] ? atob(R.mask[k]) : null;  // recorded only where it differs from parents
  for (let q = 0; q < n; q++) {
    const row = new Array(n).fill(0);
    if (bits) {
      for (let c = 0; c < n; c++) {
        const i = q * n + c;
        row[c] = i >> 3 < bits.length ? (bits.charCodeAt(i >> 3) >> (7 - (i & 7))) & 1 : 0;
      }
    } else {
      for (let c = q; c >= 0; c = parents[c]) row[c] = 1;
    }
    mask.push(row);
  }
  const K = R.topk_k[k], topk = {};
  R.path[k].forEach((node, j) => {
    const s = topkStart[k] + j * K;
    topk[node] = R.topk.slice(s, s + K).map((t, m) => [t, R.topk_pm[s + m] / 1000]);
  });
  return {
    n, mask, topk, parents, iteration: R.iteration[k], method: R.method[k], seq_len: R.seq_len[k],
    accept_length: R.accept_length[k], match_len: R.match_len[k], breadth: R.breadth[k], bonus: R.bonus[k],
    tokens: sl(R.tokens), depth: sl(R.depth), scores: sl(R.scores), valid: sl(R.valid), status: sl(R.status),
    x: sl(R.x2).map((v) => (v < 0 ? null : v / 2)), argmax: sl(R.argmax),
    argmax_p: sl(R.argmax_pm).map((v) => v / 1000), path: R.path[k],
  };
}

function hover(v, i) {
  const lines = [
    `node ${i} · ${esc(quote(text(v.tokens[i])))} (id ${v.tokens[i]})`,
    `depth ${v.depth[i]} · score ${v.scores[i] === null ? 'nan' : +v.scores[i].toPrecision(4)}`,
    STATUS[v.status[i]] || '?',
    `target argmax ${esc(quote(text(v.argmax[i])))} p=${v.argmax_p[i].toFixed(3)}`,
  ];
  if (v.topk[i] && v.topk[i].length) {
    const pairs = v.topk[i].map(([t, p]) => `${esc(quote(text(t)))} ${p.toFixed(3)}`);
    lines.push(`target top-${pairs.length}: ${pairs.join(', ')}`);
  }
  return lines.join('<br>');
}

function ancestors(v, node) {
  const out = [node];
  while (v.parents[out[out.length - 1]] >= 0) out.push(v.parents[out[out.length - 1]]);
  return out.reverse();
}

function edges(v, nodes) {
  const ex = [], ey = [];
  for (const i of nodes) {
    const p = v.parents[i];
    if (p >= 0 && v.x[i] !== null) { ex.push(v.x[p], v.x[i], null); ey.push(-v.depth[p], -v.depth[i], null); }
  }
  return [ex, ey];
}

function selectedRow(v) {
  if (chosen !== null && chosen < v.n) return chosen;
  return v.path.length ? v.path[v.path.length - 1] : 0;
}

function treeUpdates(v, sel) {
  const shown = [...Array(v.n).keys()].filter((i) => v.x[i] !== null);
  const [ex, ey] = edges(v, shown);
  const path = ancestors(v, sel);
  const [px, py] = edges(v, path);
  const out = [{x: ex, y: ey}, {x: px, y: py}];
  for (let code = 0; code < 3; code++) {
    const idx = shown.filter((i) => v.status[i] === code);
    out.push({
      x: idx.map((i) => v.x[i]), y: idx.map((i) => -v.depth[i]), customdata: idx,
      hovertext: idx.map((i) => hover(v, i)),
      text: idx.map((i) => { const t = text(v.tokens[i]); return t.length <= 8 ? t : t.slice(0, 7) + '…'; }),
    });
  }
  let bonus = {x: [], y: [], customdata: [], hovertext: []};
  if (v.path.length && v.bonus >= 0) {
    const last = v.path[v.path.length - 1], level = -v.depth[last] - 1;
    const row = shown.filter((i) => -v.depth[i] === level).map((i) => v.x[i]);
    bonus = {x: [row.length ? Math.max(...row) + 1 : v.x[last]], y: [level], customdata: [-1],
             hovertext: [`bonus token ${esc(quote(text(v.bonus)))} (id ${v.bonus})<br>` +
                         `from the target after node ${last}`]};
  }
  out.push(bonus);
  out.push({x: path.map((i) => v.x[i]), y: path.map((i) => -v.depth[i]), customdata: path});
  return out;
}

function title(v) {
  const parts = [`iteration ${v.iteration}`, `request ${R.id}`, v.method, `seq_len ${v.seq_len}`,
                 `accept length ${v.accept_length}`];
  if (v.match_len >= 0) parts.push(`match ${v.match_len}, breadth ${v.breadth}`);
  return parts.join(' · ');
}

function render() {
  const v = slice(pos), sel = selectedRow(v);
  const tree = D.first.tree, mask = D.first.mask;
  const updates = treeUpdates(v, sel);
  const data = tree.data.map((t, i) => Object.assign({}, t, updates[i]));
  Plotly.react('tree', data, Object.assign({}, tree.layout, {title: {text: title(v)}}));

  const labels = v.tokens.map((t, i) => `${i} ${text(t)}`);
  const quoted = v.tokens.map((t, i) => `${i} ${esc(quote(text(t)))}`);
  const M = D.style.mask;
  const z = v.mask.map((row, q) => row.map((m) => (m ? (q === sel ? M.selected : M.visible) : M.hidden)));
  const hov = v.mask.map((row, q) => row.map((m, c) => `${quoted[q]} ${m ? 'sees' : 'hidden'} ${quoted[c]}`));
  const ticks = [...Array(v.n).keys()];
  const layout = Object.assign({}, mask.layout, {
    title: {text: `tree mask · iteration ${v.iteration} · request ${R.id} · ${v.n} nodes`},
    height: Math.max(300, 14 * v.n + 120),
    yaxis: Object.assign({}, mask.layout.yaxis, {tickvals: ticks, ticktext: labels}),
    xaxis: Object.assign({}, mask.layout.xaxis, {tickvals: ticks, ticktext: labels}),
  });
  Plotly.react('mask', [Object.assign({}, mask.data[0], {z, hovertext: hov})], layout);

  Plotly.restyle('acceptance', {x: [[v.iteration]], y: [[v.accept_length]]}, [1]);
  $('label').textContent =
    `iteration ${v.iteration} (${pos + 1}/${R.iteration.length}) · accept length ${v.accept_length}`;
  $('step').value = pos;
  const rowSel = $('row');
  rowSel.innerHTML = '<option value="-1">accepted path</option>' +
    labels.map((l, i) => `<option value="${i}">${esc(l)}</option>`).join('');
  rowSel.value = chosen !== null && chosen < v.n ? String(chosen) : '-1';
}

function showRequest(i) {
  R = D.requests[i];
  pos = 0;
  topkStart = [0];
  R.path.forEach((p, k) => topkStart.push(topkStart[k] + p.length * R.topk_k[k]));
  $('step').max = R.iteration.length - 1;
  Plotly.react('acceptance', R.acceptance.data, R.acceptance.layout);
  render();
}

function goTo(p) { pos = Math.max(0, Math.min(R.iteration.length - 1, p)); render(); }

if (!D.requests.length) {
  $('message').textContent = 'this trace has no draft iterations (empty trace)';
  document.querySelector('.controls').style.display = 'none';
} else {
  D.requests.forEach((r, i) =>
    $('request').insertAdjacentHTML('beforeend', `<option value="${i}">${esc(r.label)}</option>`));
  $('request').onchange = (e) => showRequest(+e.target.value);
  $('step').oninput = (e) => goTo(+e.target.value);
  $('prev').onclick = () => goTo(pos - 1);
  $('next').onclick = () => goTo(pos + 1);
  $('row').onchange = (e) => { chosen = +e.target.value < 0 ? null : +e.target.value; render(); };
  $('play').onclick = () => {
    if (timer) { clearInterval(timer); timer = null; $('play').textContent = 'play'; return; }
    $('play').textContent = 'pause';
    timer = setInterval(() => {
      if (pos >= R.iteration.length - 1) $('play').click(); else goTo(pos + 1);
    }, 600);
  };
  Plotly.newPlot('tree', D.first.tree.data, D.first.tree.layout);
  Plotly.newPlot('mask', D.first.mask.data, D.first.mask.layout);
  Plotly.newPlot('acceptance', [], {});
  $('tree').on('plotly_click', (e) => {
    const p = e.points[0];
    if (p.curveNumber >= 2 && p.curveNumber <= 4) { chosen = p.customdata; render(); }
  });
  $('mask').on('plotly_click', (e) => { chosen = e.points[0].y; render(); });
  $('acceptance').on('plotly_click', (e) => {
    if (e.points[0].curveNumber === 0) goTo(e.points[0].pointIndex);
  });
  showRequest(0);
}
"""
