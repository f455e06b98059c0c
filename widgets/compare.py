"""CompareView: two traces of the same prompts, aligned by position in the output, stepped in the browser.

Iteration k of one run and iteration k of another cover different tokens as soon
as their accept lengths differ, so the view aligns output positions instead: for
output token t of a request, the iteration of each run that produced it. The plot
shows, per output position, the accept length of the iteration that covered it in
each run; the first position where the outputs differ (if any) is marked and one
click away; the player (slider, Play, ← / → keys, request picker) shows both runs'
trees for the iterations covering a position.

The page runs widgets/static/viewer.js (`mountCompare`): each side is that module's tree view
of its trace, fed by the TraceViewer's data path (`PageData`: a header, chunks of per-node
arrays as binary buffers, asked for when first needed), and every step is rendered from data
already in the page. The page reports its position back once stepping pauses, so
`to_figure()` and `static_html()` show where the user left it.
"""

from __future__ import annotations

import dataclasses
import html
import json
from typing import Any

import anywidget
import numpy as np
import plotly.graph_objects as go
import pyarrow.compute as pc
import traitlets

from spectool.trace.figures import COLORS, HIGHLIGHT, TEMPLATE
from spectool.trace.viewdata import output_spans

from .common import message_html, open_trace
from .saved import StaticOutput, iteration_picture
from .viewer import PRELOAD_RECORDS, STATIC, PageData, plotly_reply

SIDE_COLORS = ("#1f77b4", "#d62728")


def _draft_settings(trace: Any) -> tuple[str, dict]:
    info = trace.run_info or {}
    draft = info.get("draft") or {}
    method = draft.get("method") or info.get("method", "?")
    return str(method), {k: v for k, v in draft.items()
                         if k not in ("method", "path") and not isinstance(v, (dict, list))}


def _method_defaults(method: str) -> dict:
    """The settings a draft method's config takes when not given: what a run info that leaves one
    out (an older or a hand-made trace) ran with."""
    from spectool import config

    for cls in (config.NgramConfig, config.EagleConfig, config.Eagle3Config, config.DraftModelConfig,
                config.MultiLayerEagleConfig):
        if cls.method == method:
            return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    return {}


def side_label(trace: Any, other: Any = None) -> str:
    """A run named by its draft method and settings, e.g. 'ngram (num_draft_tokens=12, match=bfs)'.

    Against `other`, a run of the same method, only the settings that differ are named (a setting
    the other run's info leaves out counts as the method's default).
    """
    method, settings = _draft_settings(trace)
    if other is not None:
        other_method, theirs = _draft_settings(other)
        if other_method == method:
            theirs = {**_method_defaults(method), **theirs}
            settings = {k: v for k, v in settings.items() if k not in theirs or theirs[k] != v}
    listed = ", ".join(f"{k}={v}" for k, v in settings.items())
    name = f"{method} ({listed})" if listed else method
    return f"predicted {name}" if (trace.run_info or {}).get("predicted") else name


def aligned(trace: Any, request: int) -> dict[str, np.ndarray]:
    """Per output position of `request`: the iteration that produced it, that iteration's accept length
    and its position among the request's iterations (`step`, what the trace's player indexes).

    Position 0 comes from prefill (iteration -1, accept length -1, step -1).
    """
    rows = trace.steps.select(["iteration", "request_id", "accept_length"])
    rows = rows.filter(pc.equal(rows["request_id"], request)).sort_by("iteration")
    its = rows["iteration"].to_numpy()
    acc = rows["accept_length"].fill_null(0).to_numpy().astype(np.int64)
    try:
        output = np.asarray(trace.request(request).get("output_tokens") or [], dtype=np.int64)
    except KeyError:
        output = np.zeros(0, np.int64)
    start, count = output_spans(acc, len(output))
    iteration = np.full(len(output), -1, np.int64)
    accept = np.full(len(output), -1, np.int64)
    step = np.full(len(output), -1, np.int64)
    for k in range(len(its)):
        iteration[start[k]:start[k] + count[k]] = its[k]
        accept[start[k]:start[k] + count[k]] = acc[k]
        step[start[k]:start[k] + count[k]] = k
    return {"tokens": output, "iteration": iteration, "accept_length": accept, "step": step}


def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    """The first output position where two token sequences differ (a length difference counts), or None."""
    n = min(len(a), len(b))
    diff = np.nonzero(a[:n] != b[:n])[0]
    if len(diff):
        return int(diff[0])
    return n if len(a) != len(b) else None


def summary_lines(labels: tuple[str, str], sides: list[dict], first: int | None) -> list[dict]:
    """The comparison in words, one {label, text, first} per line: each run's tokens per iteration,
    where each accepted more than the other and by how much, and the first difference."""
    a, b = (s["accept_length"] for s in sides)
    n = min(len(a), len(b))
    a, b = a[1:n], b[1:n]
    lines = []
    for label, side in zip(labels, sides):
        its = len(set(side["iteration"][side["iteration"] >= 0].tolist()))
        size = len(side["tokens"])
        lines.append({"label": label, "text": f": {size} tokens in {its} iterations "
                                              f"({size / max(its, 1):.2f} tokens per iteration)"})
    for label, more, diff in ((labels[0], a > b, a - b), (labels[1], b > a, b - a)):
        if more.any():
            lines.append({"text": f"{label} accepted more at {int(more.sum())} of {len(a)} positions, "
                                  f"by {diff[more].mean():.2f} tokens on average"})
    if first is None:
        lines.append({"text": f"the outputs are identical ({n} tokens)"})
    else:
        lines.append({"text": f"first difference at output token {first}", "first": True})
    return lines


class CompareView(StaticOutput, anywidget.AnyWidget):
    """Two traces of the same prompts aligned by output position, the first difference marked.

        CompareView(trace_a, trace_b)                          # Traces or paths; sides named by method
        CompareView(trace_a, trace_b, labels=("ngram", "eagle"))
        CompareView(trace, result.prediction(config))          # the recorded run against a predicted one

    A side may be a ``spectool.tune`` Prediction made from the other side's trace: it is shown as the
    run that configuration would have recorded (``Prediction.to_trace``). `position` is the output
    position on show (the page's player moves it; `go_to` moves the page), `iterations` the iteration
    of each run that produced it.
    """

    _esm = STATIC / "viewer.js"
    # Labels, shared requests and their alignment by output position, as UTF-8 JSON bytes (as
    # TraceViewer's header); each side's header and first blob of per-node arrays (`PageData`).
    compare_json = traitlets.Bytes().tag(sync=True)
    sides_json = traitlets.Bytes().tag(sync=True)
    blob_a = traitlets.Bytes().tag(sync=True)
    blob_b = traitlets.Bytes().tag(sync=True)
    request = traitlets.Int(0).tag(sync=True)
    position = traitlets.Int(0).tag(sync=True)

    def __init__(self, trace_a: Any, trace_b: Any, labels: tuple[str, str] | None = None,
                 request: int | None = None):
        sources = [trace_a, trace_b]
        for i in (0, 1):  # a Prediction becomes a trace of the other side's requests
            if hasattr(sources[i], "to_trace") and hasattr(sources[1 - i], "steps"):
                sources[i] = sources[i].to_trace(sources[1 - i])
        self.traces: list[Any] = []
        errors = []
        for side, source in zip("AB", sources):
            trace, error = open_trace(source)
            self.traces.append(trace)
            if error:
                errors.append(f"{side}: {error}")
        self.error: str | None = "; ".join(errors) or None
        self.sides: list[dict] = []
        self.first: int | None = None
        self.labels: tuple[str, str] = ("A", "B")
        self._shared: list[int] = []
        if not errors:
            self.labels = labels or tuple(f"{s}: {side_label(t, o)}"
                                          for s, t, o in zip("AB", self.traces, self.traces[::-1]))
            self._shared = sorted(set(self.traces[0].request_ids) & set(self.traces[1].request_ids))
            if not self._shared:
                self.error = "the two traces share no request ids"
        start = request if request in self._shared else (self._shared[0] if self._shared else 0)
        self.pages = [PageData(t, self.error, start) for t in self.traces]
        compare: dict = {"labels": list(self.labels), "error": self.error, "requests": [], "aligned": {}}
        self._start = 0
        if not self.error:
            # Small traces go whole; of larger ones the page asks for a request's alignment when shown.
            whole = all(len(t) <= PRELOAD_RECORDS for t in self.traces)
            for r in self._shared:
                label = f"request {r}"
                if whole or r == start:
                    data = compare["aligned"][str(r)] = self._compare_data(r)
                    label += " · identical" if data["first"] is None else f" · differ at token {data['first']}"
                compare["requests"].append({"id": r, "label": label})
            self._start = compare["aligned"][str(start)]["start"]
        super().__init__(compare_json=self._json(compare),
                         sides_json=self._json([p.header for p in self.pages]),
                         blob_a=self.pages[0].blob, blob_b=self.pages[1].blob,
                         request=int(start), position=int(self._start))
        self.add_class("spectool-compare")
        self.observe(lambda change: self._align(change["new"]), names="request")
        self._align(self.request)
        self.on_msg(self._message)

    @staticmethod
    def _json(value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()

    def _compare_data(self, request: int) -> dict:
        """What the page needs of one request: per side and output position the player position
        (`step`, -1 for prefill), iteration and accept length; the first difference, the summary and
        the position shown first (the first difference, else the first drafted token)."""
        sides = [aligned(t, request) for t in self.traces]
        first = first_difference(sides[0]["tokens"], sides[1]["tokens"])
        longest = max(len(s["tokens"]) for s in sides)
        return {"id": request, "first": first, "start": first if first is not None else min(1, max(longest - 1, 0)),
                "length": longest, "summary": summary_lines(self.labels, sides, first),
                "sides": [{k: s[k].tolist() for k in ("step", "iteration", "accept_length")} for s in sides]}

    def _align(self, request: int) -> None:
        if self.error:
            return
        self.sides = [aligned(t, request) for t in self.traces]
        self.first = first_difference(self.sides[0]["tokens"], self.sides[1]["tokens"])

    def _message(self, _widget: Any, content: Any, _buffers: list) -> None:
        """The page's questions: plotly.js, a request's alignment, or a side's data (`PageData.answer`)."""
        reply = plotly_reply(content)
        if reply is None and isinstance(content, dict) and not self.error:
            if content.get("kind") == "compare" and content.get("request") in self._shared:
                reply = {"kind": "compare", "data": self._compare_data(content["request"])}, []
            elif content.get("side") in (0, 1):
                reply = self.pages[content["side"]].answer(content)
                if reply is not None:
                    reply[0]["side"] = content["side"]
        if reply is not None:
            self.send(*reply)

    @property
    def iterations(self) -> list[int | None]:
        """Per side, the iteration that produced output token `position` (-1: prefill; None: no such token)."""
        return [int(s["iteration"][self.position]) if self.position < len(s["iteration"]) else None
                for s in self.sides]

    @property
    def summary(self) -> str:
        """The comparison in words, as HTML (labels escaped)."""
        if self.error:
            return ""
        parts = []
        for line in summary_lines(self.labels, self.sides, self.first):
            text = (f"<b>{html.escape(line['label'])}</b>" if line.get("label") else "") + html.escape(line["text"])
            parts.append(f'<span class="spectool-compare-first">{text}</span>' if line.get("first") else text)
        return "<br>".join(parts)

    def show_request(self, request: int) -> None:
        """Compare one request, output position by output position (the page follows)."""
        if request not in self._shared:
            raise ValueError(f"request {request} is not in both traces (shared: {self._shared})")
        with self.hold_trait_notifications():
            self.request = request
            self.position = self._compare_data(request)["start"]

    def go_to(self, position: int) -> None:
        """Show both runs' trees for the iterations that produced output token `position` (the page follows)."""
        longest = max((len(s["tokens"]) for s in self.sides), default=1)
        self.position = max(0, min(int(position), longest - 1))

    def _side_notes(self) -> list[str]:
        notes = []
        for label, it in zip(self.labels, self.iterations):
            if it is None:
                notes.append(f"{label}: no output token {self.position}")
            elif it < 0:
                notes.append(f"{label}: output token {self.position} came from prefill")
            else:
                notes.append(f"{label}: output token {self.position} from iteration {it}")
        return notes

    def static_html(self) -> str:
        """The summary and both sides' trees at the current output position, as a static picture."""
        if self.error:
            return message_html(self.error)
        parts = [f'<div class="spectool-compare-summary">{self.summary}</div>']
        for trace, it, note in zip(self.traces, self.iterations, self._side_notes()):
            parts.append(message_html(note, "note").replace("#6b6b6b", "#222"))
            if it is not None and it >= 0:
                parts.append(iteration_picture(trace, trace.iteration(it, self.request)))
        return "".join(parts)

    def to_figure(self) -> go.Figure:
        """The comparison plot (accept length by output position, both runs) as a plain plotly Figure."""
        fig = go.Figure(layout=dict(template=TEMPLATE))
        if self.error:
            fig.update_layout(title=self.error)
            return fig
        for label, side, color in zip(self.labels, self.sides, SIDE_COLORS):
            pos = np.arange(len(side["tokens"]))[1:]  # position 0 is the prefill token
            fig.add_trace(go.Scatter(
                name=label, x=pos, y=side["accept_length"][1:], mode="lines", line=dict(color=color, shape="hv"),
                customdata=side["iteration"][1:],
                hovertemplate="output token %{x}: iteration %{customdata}, accept length %{y}<extra></extra>"))
        shapes = [dict(type="line", xref="x", yref="paper", x0=self.position, x1=self.position, y0=0, y1=1,
                       line=dict(color=HIGHLIGHT, width=2))]
        if self.first is not None:
            shapes.append(dict(type="line", xref="x", yref="paper", x0=self.first, x1=self.first, y0=0, y1=1,
                               line=dict(color=COLORS["rejected"], width=2, dash="dash")))
            fig.add_annotation(x=self.first, y=1, yref="paper", text=f"outputs differ from token {self.first}",
                               showarrow=False, yanchor="bottom", font=dict(color=COLORS["rejected"]))
        fig.update_layout(height=340, plot_bgcolor="white", margin=dict(l=60, r=20, t=40, b=80),
                          legend=dict(orientation="h", y=-0.22, x=0), shapes=shapes,
                          xaxis_title="output position (token index)", yaxis_title="accept length (tokens)")
        return fig
