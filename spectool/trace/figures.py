"""Plain plotly figures of a trace: the draft tree, the tree mask and acceptance.

Each figure is built from a fixed list of traces (`tree_traces`, `mask_traces`,
`acceptance_traces`) so the widgets can build a figure once and later restyle the
same traces in place for another iteration or request; `spectool report` embeds
the same styling. A view object here is what `Trace.iteration(i, request)`
returns (an IterationView: numpy fields tokens, parents, depth, scores, valid,
mask, status, accept_path, bonus_token, target_* and token_texts).
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
import pyarrow as pa
import pyarrow.compute as pc
from plotly.subplots import make_subplots

from spectool.trace.layout import ancestors, layout_tree
from spectool.trace.schema import ACCEPTED, NOT_VISITED, PHASE_FIELDS, REJECTED
from spectool.trace.stats import summarize

TokenText = Callable[[Sequence[int]], list[str]]

# Node colours by decision; "bonus" is the token the target adds after the accepted path.
COLORS = {"accepted": "#2ca02c", "rejected": "#d62728", "not visited": "#b8b8b8", "bonus": "#1f77b4"}
STATUS_NAMES = {NOT_VISITED: "not visited", ACCEPTED: "accepted", REJECTED: "rejected"}
HIGHLIGHT = "#ff7f0e"
# plotly.js defaults, no template: plotly deep-copies its default template into every
# figure, which makes a FigureWidget ~20x slower to build and every restyle slower.
TEMPLATE = "none"
# Mask cell codes and their colours: hidden, visible, cached prefix, visible in the selected row.
MASK_HIDDEN, MASK_VISIBLE, MASK_PREFIX, MASK_SELECTED = 0, 1, 2, 3
MASK_COLORS = ["#ffffff", "#9ecae1", "#d9d9d9", HIGHLIGHT]


_GLYPHS = {" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍", "\x7f": "␡"}


def visible(text: str) -> str:
    """A token's text with whitespace and control characters as glyphs (␣ ⏎ ⇥, control pictures).

    The same rule as the in-browser views (widgets/static/viewer.js), so a token
    reads the same in every figure, tooltip and picker; the empty string is ∅.
    """
    out = []
    for ch in str(text):
        c = ord(ch)
        if ch in _GLYPHS:
            out.append(_GLYPHS[ch])
        elif c < 32:
            out.append(chr(0x2400 + c))
        elif 0x80 <= c < 0xA0 or c in (0x200B, 0xFEFF):
            out.append(f"\\u{c:04x}")
        else:
            out.append(ch)
    return "".join(out) or "∅"


def _quote(text: str) -> str:
    """A token's text as plotly shows it: whitespace visible, tag characters escaped.

    plotly interprets a few HTML tags inside text, so trace strings go in escaped.
    """
    return html.escape(visible(text), quote=False)


def _texts(ids: Sequence[int], token_text: TokenText | None) -> list[str]:
    ids = [int(t) for t in ids]
    return token_text(ids) if token_text is not None else [f"#{t}" for t in ids]


def node_hover(view: Any, token_text: TokenText | None = None) -> list[str]:
    """Hover text per node: token, score, depth, decision and the target's top-k."""
    topk_tokens = np.asarray(view.target_topk_tokens).reshape(len(view.tokens), -1)
    topk_probs = np.asarray(view.target_topk_probs).reshape(len(view.tokens), -1)
    flat = _texts(topk_tokens.ravel(), token_text) if topk_tokens.size else []
    k = topk_tokens.shape[1]
    argmax_text = _texts(view.target_argmax, token_text)
    out = []
    for i, tok in enumerate(view.tokens):
        lines = [
            f"node {i} · {_quote(view.token_texts[i])} (id {int(tok)})",
            f"depth {int(view.depth[i])} · score {float(view.scores[i]):.4g}",
            f"{STATUS_NAMES.get(int(view.status[i]), '?')}",
            f"target argmax {_quote(argmax_text[i])} p={float(view.target_argmax_prob[i]):.3f}",
        ]
        if k:
            pairs = ", ".join(f"{_quote(flat[i * k + j])} {float(topk_probs[i, j]):.3f}" for j in range(k))
            lines.append(f"target top-{k}: {pairs}")
        out.append("<br>".join(lines))
    return out


def _edges(parents: np.ndarray, x: np.ndarray, y: np.ndarray, nodes: Sequence[int]
           ) -> tuple[np.ndarray, np.ndarray]:
    """Line segments parent -> node for the given (drawn) nodes, NaN-separated for one scatter trace."""
    nodes = np.asarray(nodes, dtype=np.int64)
    nodes = nodes[parents[nodes] >= 0]
    out = []
    for coord in (x, y):
        seg = np.full((len(nodes), 3), np.nan)
        seg[:, 0] = coord[parents[nodes]]
        seg[:, 1] = coord[nodes]
        out.append(seg.ravel())
    return out[0], out[1]


def tree_traces(view: Any, highlight: int | None = None, token_text: TokenText | None = None,
                layout: tuple[np.ndarray, np.ndarray] | None = None) -> list[dict]:
    """The tree figure's traces as plain dicts, always in the same order:

    edges, highlighted path edges, highlighted path rings, one marker trace per
    status (not visited, accepted, rejected), the bonus token (with its edge). `highlight` is
    a node whose ancestors (root .. node, the nodes its mask row sees) are marked.
    Every marker trace carries node indices in customdata (-1 for the bonus token).
    """
    parents = np.asarray(view.parents)
    status = np.asarray(view.status)
    if layout is None:
        layout = _layout_with_bonus(view)
    x, y = layout[0][:len(parents)], layout[1][:len(parents)]
    bonus_xy = (layout[0][len(parents)], layout[1][len(parents)]) if len(layout[0]) > len(parents) else None
    shown = np.nonzero(~np.isnan(x))[0]
    # Numpy arrays throughout: plotly validates and sends them as typed buffers, far
    # faster than nested lists (this is what keeps a widget step under 100 ms).
    hover = np.array(node_hover(view, token_text), dtype=str)
    labels = np.array([_quote(t if len(t) <= 8 else t[:7] + "…") for t in map(visible, view.token_texts)],
                      dtype=str)

    traces: list[dict] = []
    ex, ey = _edges(parents, x, y, shown)
    traces.append(dict(type="scatter", name="edges", x=ex, y=ey, mode="lines", hoverinfo="skip",
                       line=dict(color="#999999", width=1), showlegend=False))
    path = ancestors(parents, highlight) if highlight is not None else []
    px, py = _edges(parents, x, y, path)
    traces.append(dict(type="scatter", name="selected path", x=px, y=py, mode="lines", hoverinfo="skip",
                       line=dict(color=HIGHLIGHT, width=4), showlegend=False))
    # The rings go under the markers and their labels, so a label is never hidden by one.
    ring = np.asarray(path, dtype=np.int64)
    traces.append(dict(type="scatter", name="selected", x=x[ring], y=y[ring],
                       mode="markers", customdata=ring, hoverinfo="skip", showlegend=False,
                       marker=dict(color="rgba(0,0,0,0)", size=22, line=dict(color=HIGHLIGHT, width=3))))
    for code in (NOT_VISITED, ACCEPTED, REJECTED):
        idx = shown[status[shown] == code]
        name = STATUS_NAMES[code]
        traces.append(dict(
            type="scatter", name=name, x=x[idx], y=y[idx], mode="markers+text",
            customdata=idx, hovertext=hover[idx], hoverinfo="text",
            text=labels[idx], textposition="bottom center", cliponaxis=False,
            marker=dict(color=COLORS[name], size=14, line=dict(color="#333333", width=1))))
    traces.append(_bonus_trace(view, x, y, bonus_xy, token_text))
    return traces


def _layout_with_bonus(view: Any) -> tuple[np.ndarray, np.ndarray]:
    """Tidy layout with the bonus token as the last child of the deepest accepted node (entry N)."""
    parents = np.asarray(view.parents)
    path = [int(a) for a in np.asarray(view.accept_path) if 0 <= a < len(parents)]
    if not path or int(view.bonus_token) < 0:
        return layout_tree(parents, view.scores, view.valid)
    scores = np.append(np.asarray(view.scores, dtype=np.float64), -np.inf)
    return layout_tree(np.append(parents, path[-1]), scores, np.append(np.asarray(view.valid, dtype=bool), True))


def _bonus_trace(view: Any, x: np.ndarray, y: np.ndarray, bonus_xy: tuple[float, float] | None,
                 token_text: TokenText | None) -> dict:
    """The bonus token under the deepest accepted node, with an edge to it (its first point is that node)."""
    path = [int(a) for a in np.asarray(view.accept_path) if 0 <= a < len(x)]
    bonus = int(view.bonus_token)
    bx: list = []
    by: list = []
    hover: list = []
    text: list = []
    if path and bonus >= 0 and bonus_xy is not None and not np.isnan(bonus_xy[0]):
        last = path[-1]
        bx, by = [float(x[last]), float(bonus_xy[0])], [float(y[last]), float(bonus_xy[1])]
        label = _texts([bonus], token_text)[0]
        hover = ["", f"bonus token {_quote(label)} (id {bonus})<br>the target's own token after node {last}"]
        text = ["", _quote(visible(label)[:8])]
    return dict(type="scatter", name="bonus", x=bx, y=by, mode="lines+markers+text", customdata=[-1] * len(bx),
                hovertext=hover, hoverinfo="text", text=text, textposition="bottom center",
                line=dict(color=COLORS["bonus"], width=1.5, dash="dot"),
                marker=dict(color=COLORS["bonus"], size=[0, 15] if bx else 15, symbol="star",
                            line=dict(color="#333333", width=1)))


def tree_figure(view: Any, highlight: int | None = None, token_text: TokenText | None = None,
                title: str | None = None) -> go.Figure:
    """The draft tree of one iteration: tidy layout, nodes coloured by decision, hover details."""
    fig = go.Figure([go.Scatter(t) for t in tree_traces(view, highlight, token_text)])
    fig.update_layout(
        title=title or iteration_title(view), height=420, margin=dict(l=20, r=20, t=50, b=20),
        plot_bgcolor="white", template=TEMPLATE, legend=dict(orientation="h", y=-0.02),
        xaxis=dict(visible=False), yaxis=DEPTH_AXIS)
    return fig


# Nodes sit at y = -depth (root on top); label the axis with the depth itself.
DEPTH_AXIS = dict(title="depth", zeroline=False, showgrid=False, tickvals=[-d for d in range(65)],
                  ticktext=[str(d) for d in range(65)])


def iteration_title(view: Any) -> str:
    """One line about an iteration: method, seq_len, accept length, n-gram match."""
    parts = [f"iteration {int(view.iteration)}", f"request {int(view.request_id)}", f"{view.method}",
             f"seq_len {int(view.seq_len)}", f"accept length {int(view.accept_length)}"]
    if int(getattr(view, "ngram_match_len", -1)) >= 0:
        parts.append(f"match {int(view.ngram_match_len)}, breadth {int(view.ngram_breadth)}")
    return " · ".join(parts)


def mask_cells(view: Any, selected: int | None = None, prefix: int = 0) -> np.ndarray:
    """Cell codes [N, prefix + N]: MASK_HIDDEN / VISIBLE / PREFIX, and MASK_SELECTED for
    the selected row's visible tree cells."""
    mask = np.asarray(view.mask, dtype=bool)
    n = len(mask)
    if selected is not None and not 0 <= selected < n:
        raise ValueError(f"row {selected} is outside a mask of {n} rows")
    if prefix < 0:
        raise ValueError(f"prefix must be >= 0, got {prefix}")
    prefix = min(prefix, int(view.seq_len))
    z = np.empty((n, prefix + n), dtype=np.int8)
    z[:, :prefix] = MASK_PREFIX
    z[:, prefix:] = np.where(mask, MASK_VISIBLE, MASK_HIDDEN)
    if selected is not None:
        z[selected, prefix:][mask[selected]] = MASK_SELECTED
    return z


def drawn_nodes(view: Any) -> np.ndarray:
    """Node indices the views show: the root and every valid node whose ancestors are valid (no padding)."""
    x, _ = layout_tree(np.asarray(view.parents), view.scores, view.valid)
    return np.nonzero(~np.isnan(x))[0]


def mask_traces(view: Any, selected: int | None = None, prefix: int = 0) -> list[dict]:
    """The mask figure's single heatmap trace (rows = drawn queries, columns = prefix then drawn keys).

    Padding nodes have neither a row nor a column; row r of the heatmap is node
    `drawn_nodes(view)[r]` (its customdata).
    """
    z = mask_cells(view, selected, prefix)
    n = len(view.tokens)
    p = z.shape[1] - n
    kept = drawn_nodes(view)
    z = z[kept][:, np.concatenate([np.arange(p), p + kept])]
    rows = [f"{i} {_quote(view.token_texts[i])}" for i in kept]
    keys = [f"pos {int(view.seq_len) - p + j}" for j in range(p)] + rows
    seen = {MASK_HIDDEN: "does not see", MASK_VISIBLE: "sees", MASK_PREFIX: "sees", MASK_SELECTED: "sees"}
    hover = np.array([[f"{r} {seen[c]} {k}" for c, k in zip(zr, keys)] for r, zr in zip(rows, z.tolist())],
                     dtype=str)
    # Discrete colours: each code owns an equal band of the colour axis.
    bands = len(MASK_COLORS)
    scale = []
    for code, color in enumerate(MASK_COLORS):
        scale += [[code / bands, color], [(code + 1) / bands, color]]
    return [dict(type="heatmap", name="mask", z=z, zmin=-0.5, zmax=bands - 0.5,
                 colorscale=scale, showscale=False, xgap=1, ygap=1, customdata=np.repeat(kept[:, None], z.shape[1], 1),
                 hovertext=hover, hoverinfo="text")]


def mask_figure(view: Any, selected: int | None = None, prefix: int = 0, title: str | None = None
                ) -> go.Figure:
    """The tree mask as the verifier used it: row q sees column k when k is q or its ancestor.

    `selected` marks one row's visible cells; `prefix` adds that many cached-prefix
    columns (always visible, at most seq_len) before the tree columns. Cells are square.
    """
    traces = mask_traces(view, selected, prefix)
    fig = go.Figure([go.Heatmap(t) for t in traces])
    fig.update_layout(margin=dict(l=20, r=20, t=60, b=20), plot_bgcolor="white", template=TEMPLATE,
                      yaxis=dict(autorange="reversed", title="query node", automargin=True, scaleanchor="x",
                                 constrain="domain"),
                      xaxis=dict(tickangle=-60, automargin=True, title="key node", constrain="domain"))
    fig.update_layout(mask_layout(view, traces[0]["z"].shape[1] - len(traces[0]["z"])))
    if title:
        fig.update_layout(title_text=title)
    return fig


def mask_layout(view: Any, prefix: int = 0) -> dict:
    """The parts of the mask figure's layout that change per iteration: title, height, tick labels."""
    kept = drawn_nodes(view)
    m = len(kept)
    ticks = [f"{i} {_quote(view.token_texts[i])}" for i in kept]
    extra = f", {prefix} prefix columns" if prefix else ""
    padding = len(view.tokens) - m
    hidden = f" ({padding} padding not shown)" if padding else ""
    what = f"{m} nodes{hidden}" if m > 1 else "only the root: nothing was drafted"
    title = f"tree mask · iteration {int(view.iteration)} · request {int(view.request_id)} · {what}{extra}"
    return {"title_text": title, "height": max(300, 18 * (m + prefix) + 160),
            "yaxis_tickvals": list(range(m)), "yaxis_ticktext": ticks,
            "xaxis_tickvals": list(range(prefix, prefix + m)), "xaxis_ticktext": ticks}


def request_columns(steps: pa.Table, request: int) -> dict[str, Any]:
    """Per-iteration columns of one request, computed column-wise (no per-row Python).

    Returns numpy arrays iteration, seq_len and accept_length ordered by iteration,
    the request's draft method, and its `summarize` statistics (the same formulas
    as `spectool summary`).
    """
    # Only the scalar columns and depth: filtering the node arrays too costs seconds on big traces.
    wanted = ["iteration", "request_id", "method", "seq_len", "accept_length", "depth", "iteration_us",
              *PHASE_FIELDS]
    # combine_chunks compacts sliced list buffers, which makes filter and sort ~10x faster.
    steps = steps.select([c for c in wanted if c in steps.column_names]).combine_chunks()
    rows = steps.filter(pc.equal(steps["request_id"], request)).sort_by("iteration")
    return {
        "iteration": rows["iteration"].to_numpy(),
        "seq_len": rows["seq_len"].to_numpy(),
        "accept_length": rows["accept_length"].to_numpy().astype(np.int64),
        "method": rows["method"][0].as_py() if rows.num_rows else "none",
        "summary": summarize(rows),
    }


def acceptance_traces(cols: dict[str, Any], current: int | None = None) -> list[dict]:
    """Acceptance figure traces, in order: accept length per iteration, the current
    iteration's marker, acceptance by depth (by layer for multi_layer_eagle), histogram."""
    acc = cols["accept_length"]
    it = cols["iteration"]
    rate = cols["summary"]["accept_rate_by_depth"]
    hist = cols["summary"]["accept_length_histogram"]
    unit = "layer" if cols["method"] == "multi_layer_eagle" else "depth"
    # Multi-layer EAGLE: layer k drafts the token at depth k+1.
    labels = [f"layer {d - 1}" if unit == "layer" else f"depth {d}" for d in range(1, len(rate) + 1)]
    cur = current is not None and 0 <= current < len(it)
    return [
        dict(type="scatter", name="accept length", x=it, y=acc, mode="lines+markers",
             line=dict(color=COLORS["accepted"], width=1), marker=dict(size=4), xaxis="x", yaxis="y",
             hovertemplate="iteration %{x}: accept length %{y}<extra></extra>"),
        dict(type="scatter", name="current", x=it[current:current + 1] if cur else [],
             y=acc[current:current + 1] if cur else [], mode="markers", xaxis="x", yaxis="y",
             marker=dict(color=HIGHLIGHT, size=12, symbol="diamond"), hoverinfo="skip"),
        dict(type="bar", name=f"acceptance by {unit}", x=labels, y=rate,
             marker=dict(color=COLORS["accepted"]), xaxis="x2", yaxis="y2",
             hovertemplate="%{x}: %{y:.1%} of the trees reaching it<extra></extra>"),
        dict(type="bar", name="accept length histogram", x=list(range(len(hist))), y=hist,
             marker=dict(color=COLORS["bonus"]), xaxis="x3", yaxis="y3",
             hovertemplate="accept length %{x}: %{y} iterations<extra></extra>"),
    ]


def acceptance_figure(trace: Any, request: int, current: int | None = None) -> go.Figure:
    """Accept length per iteration, acceptance by depth (or layer) and a histogram for one request.

    `current` is a position in the request's iterations to mark (the player's step).
    """
    if request not in list(trace.request_ids):
        raise ValueError(f"request {request} is not in this trace (requests: {list(trace.request_ids)})")
    return acceptance_figure_from_columns(request_columns(trace.steps, request), request, current)


def acceptance_figure_from_columns(cols: dict[str, Any], request: int, current: int | None = None
                                   ) -> go.Figure:
    """`acceptance_figure` from precomputed `request_columns` (the widgets cache them per request)."""
    method = cols["method"]
    fig = make_subplots(rows=2, cols=2, specs=[[{"colspan": 2}, None], [{}, {}]], vertical_spacing=0.18,
                        subplot_titles=("accept length per iteration",
                                        "acceptance by layer" if method == "multi_layer_eagle"
                                        else "acceptance by depth (of trees reaching it)",
                                        "accept length histogram"))
    for t in acceptance_traces(cols, current):
        kind = go.Bar if t["type"] == "bar" else go.Scatter
        fig.add_trace(kind(t))
    acc = cols["accept_length"]
    mean = f"mean accept length {acc.mean():.2f} over {len(acc)} iterations" if len(acc) else "no iterations"
    fig.update_layout(title=f"request {request} · {method} · {mean}", height=520, showlegend=False,
                      margin=dict(l=40, r=20, t=70, b=40), plot_bgcolor="white", template=TEMPLATE)
    fig.update_yaxes(title_text="accept length (tokens)", row=1, col=1)
    fig.update_xaxes(title_text="iteration", tickformat="d", row=1, col=1)
    fig.update_yaxes(title_text="accepted (% reaching it)", tickformat=".0%", range=[0, 1], row=2, col=1)
    fig.update_xaxes(title_text="draft layer" if method == "multi_layer_eagle" else "depth", row=2, col=1)
    fig.update_yaxes(title_text="iterations", row=2, col=2)
    fig.update_xaxes(title_text="accept length (tokens)", tickformat="d", row=2, col=2)
    return fig
