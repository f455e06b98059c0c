"""A static SVG picture of one iteration (tree, mask, accept length), with no JavaScript.

Notebook outputs keep it beside the live widget, so a notebook reopened without a
kernel, or converted to HTML, still shows the view's last state. Every trace
string is XML-escaped.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from typing import Any
from xml.sax.saxutils import escape

import numpy as np

from spectool.trace.figures import COLORS, HIGHLIGHT, visible
from spectool.trace.layout import layout_tree

STATUS_COLORS = [COLORS["not visited"], COLORS["accepted"], COLORS["rejected"]]


def _text(x: float, y: float, s: str, size: int = 11, anchor: str = "middle", extra: str = "") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" {extra}>'
            f"{escape(s)}</text>")


def iteration_svg(view: Any, token_text: Callable[[Sequence[int]], list[str]], accept_lengths: Sequence[int],
                  position: int, title: str) -> str:
    """SVG of an iteration's tree and mask (padding dropped) and the request's accept lengths."""
    parents = np.asarray(view.parents)
    x, _ = layout_tree(parents, view.scores, view.valid)
    shown = np.nonzero(~np.isnan(x))[0]
    depth = np.asarray(view.depth)
    status = np.asarray(view.status)
    labels = [visible(t) for t in view.token_texts]
    leaves = max(1.0, float(np.nanmax(x)) + 1 if len(shown) else 1.0)
    max_depth = int(depth[shown].max()) if len(shown) else 0
    tree_w, level_h = 560.0, 56.0
    sx = (tree_w - 40) / leaves
    px = {int(i): 20 + sx * (x[i] + 0.5) for i in shown}
    py = {int(i): 50 + level_h * depth[i] for i in shown}
    parts = []
    for i in shown[1:]:
        p = int(parents[i])
        parts.append(f'<line x1="{px[p]:.1f}" y1="{py[p]:.1f}" x2="{px[i]:.1f}" y2="{py[i]:.1f}" stroke="#999"/>')
    path = [int(a) for a in np.asarray(view.accept_path) if 0 <= a < len(parents)]
    if path and int(view.bonus_token) >= 0:  # the bonus token under the deepest accepted node
        last = path[-1]
        bx, by = px[last] + sx * 0.45, py[last] + level_h
        parts.append(f'<line x1="{px[last]:.1f}" y1="{py[last]:.1f}" x2="{bx:.1f}" y2="{by:.1f}" '
                     f'stroke="{COLORS["bonus"]}" stroke-dasharray="3,3"/>')
        parts.append(f'<rect x="{bx - 6:.1f}" y="{by - 6:.1f}" width="12" height="12" fill="{COLORS["bonus"]}"/>')
        parts.append(_text(bx, by + 20, visible(view.bonus_text or str(int(view.bonus_token)))[:8], 10))
        max_depth = max(max_depth, int(depth[last]) + 1)
    chars = max(1, min(8, int(sx / 6.5)))
    for i in shown:
        ring = f' stroke="{HIGHLIGHT}" stroke-width="3"' if int(i) in path else ' stroke="#333"'
        parts.append(f'<circle cx="{px[i]:.1f}" cy="{py[i]:.1f}" r="7" fill="{STATUS_COLORS[int(status[i]) % 3]}"'
                     f"{ring}/>")
        parts.append(_text(px[i], py[i] + 20, labels[i][:chars], 10))
    tree_h = 70 + level_h * (max_depth + 1)

    m = len(shown)
    cell = max(8, min(22, int(380 / max(m, 1))))
    ox, oy = tree_w + 100, 50
    mask = np.asarray(view.mask, dtype=bool)
    sel = path[-1] if path else 0
    for r, q in enumerate(shown):
        parts.append(_text(ox - 4, oy + cell * (r + 0.7), f"{q} {labels[q][:8]}", 9, "end"))
        for c, k in enumerate(shown):
            fill = (HIGHLIGHT if q == sel else "#9ecae1") if mask[q, k] else "#ffffff"
            parts.append(f'<rect x="{ox + c * cell:.1f}" y="{oy + r * cell:.1f}" width="{cell - 1}" '
                         f'height="{cell - 1}" fill="{fill}" stroke="#eee"/>')
    mask_h = oy + cell * m + 20

    acc = np.asarray(accept_lengths, dtype=float)
    chart_y = max(tree_h, mask_h) + 30
    chart_w, chart_h = tree_w + 100 + cell * m, 90.0
    top = max(1.0, float(acc.max()) if len(acc) else 1.0)
    bw = chart_w / max(len(acc), 1)
    for k, a in enumerate(acc):
        hgt = chart_h * a / top
        color = HIGHLIGHT if k == position else COLORS["accepted"]
        parts.append(f'<rect x="{20 + k * bw:.1f}" y="{chart_y + chart_h - hgt:.1f}" width="{max(bw - 1, 0.5):.1f}" '
                     f'height="{hgt:.1f}" fill="{color}"/>')
    parts.append(_text(20, chart_y - 6, "accept length per iteration (current in orange)", 11, "start"))
    width, height = chart_w + 40, chart_y + chart_h + 20
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif">'
            f'<rect width="100%" height="100%" fill="white"/>'
            + _text(10, 20, title, 13, "start", 'font-weight="bold"')
            + _text(20, 40, "draft tree (green accepted, red rejected, grey not visited, blue bonus)", 11, "start")
            + _text(ox, 40, "tree mask", 11, "start"))
    return head + "".join(parts) + "</svg>"


def snapshot_html(svg: str) -> str:
    """The SVG as an <img> with a data URI: no script, so JupyterLab's sanitizer and nbconvert keep it."""
    data = base64.b64encode(svg.encode("utf-8")).decode()
    return (f'<img class="spectool-snapshot" alt="static snapshot of the trace viewer" style="max-width:100%" '
            f'src="data:image/svg+xml;base64,{data}">')
