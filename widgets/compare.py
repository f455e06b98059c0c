"""CompareView: two traces of the same prompts, aligned by position in the output.

Iteration k of one run and iteration k of another cover different tokens as soon
as their accept lengths differ, so the views align output positions instead: for
output token t of a request, the iteration of each run that produced it. The plot
shows, per output position, the accept length of the iteration that covered it in
each run; the first position where the outputs differ (if any) is marked and one
click away; the slider shows both runs' trees for the iterations covering a position.
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as widgets
import numpy as np
import plotly.graph_objects as go
import pyarrow.compute as pc

from spectool.trace.figures import COLORS, HIGHLIGHT, TEMPLATE
from spectool.trace.viewdata import output_spans

from .common import figure_copy, message_box, message_html, open_trace
from .saved import StaticOutput, iteration_picture
from .views import TreeView

SIDE_COLORS = ("#1f77b4", "#d62728")


def side_label(trace: Any) -> str:
    """A run named by its draft method and settings, e.g. 'ngram (num_draft_tokens=12, match=bfs)'."""
    info = trace.run_info or {}
    draft = info.get("draft") or {}
    method = draft.get("method") or info.get("method", "?")
    settings = ", ".join(f"{k}={v}" for k, v in draft.items()
                         if k not in ("method", "path") and not isinstance(v, (dict, list)))
    name = f"{method} ({settings})" if settings else str(method)
    return f"predicted {name}" if info.get("predicted") else name


def aligned(trace: Any, request: int) -> dict[str, np.ndarray]:
    """Per output position of `request`: the iteration that produced it and that iteration's accept length.

    Position 0 comes from prefill (iteration -1, accept length -1).
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
    for k in range(len(its)):
        iteration[start[k]:start[k] + count[k]] = its[k]
        accept[start[k]:start[k] + count[k]] = acc[k]
    return {"tokens": output, "iteration": iteration, "accept_length": accept}


def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    """The first output position where two token sequences differ (a length difference counts), or None."""
    n = min(len(a), len(b))
    diff = np.nonzero(a[:n] != b[:n])[0]
    if len(diff):
        return int(diff[0])
    return n if len(a) != len(b) else None


class CompareView(StaticOutput, widgets.VBox):
    """Two traces of the same prompts aligned by output position, the first difference marked.

        CompareView(trace_a, trace_b)                          # Traces or paths; sides named by method
        CompareView(trace_a, trace_b, labels=("ngram", "eagle"))
        CompareView(trace, result.prediction(config))          # the recorded run against a predicted one

    A side may be a ``spectool.tune`` Prediction made from the other side's trace: it is shown as the
    run that configuration would have recorded (``Prediction.to_trace``).
    """

    def __init__(self, trace_a: Any, trace_b: Any, labels: tuple[str, str] | None = None,
                 request: int | None = None):
        super().__init__()
        self.add_class("spectool-compare")
        self.message = message_box()
        self.fig = go.FigureWidget(layout=dict(template=TEMPLATE))
        self.traces: list[Any] = []
        errors = []
        sources = [trace_a, trace_b]
        for i in (0, 1):  # a Prediction becomes a trace of the other side's requests
            if hasattr(sources[i], "to_trace") and hasattr(sources[1 - i], "steps"):
                sources[i] = sources[i].to_trace(sources[1 - i])
        for side, source in zip("AB", sources):
            trace, error = open_trace(source)
            self.traces.append(trace)
            if error:
                errors.append(f"{side}: {error}")
        self.request: int | None = None
        self.sides: list[dict] = []
        self.first: int | None = None
        if errors:
            self.message.value = message_html("; ".join(errors))
            self.children = [self.message]
            return
        self.labels = labels or tuple(f"{s}: {side_label(t)}" for s, t in zip("AB", self.traces))
        both = sorted(set(self.traces[0].request_ids) & set(self.traces[1].request_ids))
        if not both:
            self.message.value = message_html("the two traces share no request ids")
            self.children = [self.message]
            return
        self.picker = widgets.Dropdown(description="request", options=both)
        self.slider = widgets.IntSlider(min=0, max=0, description="output pos")
        self.slider.add_class("spectool-player")
        self.jump = widgets.Button(description="go to first difference", icon="crosshairs")
        self.jump.add_class("spectool-compare-jump")
        self.jump.on_click(lambda _: self.go_to(self.first) if self.first is not None else None)
        self.summary = widgets.HTML()
        self.summary.add_class("spectool-compare-summary")
        self.trees = [TreeView(t, request=both[0], stepper=False) for t in self.traces]
        self.headers = [widgets.HTML() for _ in self.trees]
        side_by_side = [widgets.VBox([head, tree], layout=widgets.Layout(flex="1 1 0", min_width="0"))
                        for head, tree in zip(self.headers, self.trees)]
        self.children = [self.message, widgets.HBox([self.picker, self.slider, self.jump]), self.summary, self.fig,
                         widgets.HBox(side_by_side, layout=widgets.Layout(width="100%"))]
        self.picker.observe(lambda change: self.show_request(change["new"]), names="value")
        self.slider.observe(lambda change: self.go_to(change["new"]), names="value")
        self.show_request(request if request in both else both[0])

    def show_request(self, request: int) -> None:
        """Compare one request, output position by output position."""
        self.request = request
        if self.picker.value != request:
            self.picker.value = request  # its observer comes back here
            return
        self.sides = [aligned(t, request) for t in self.traces]
        self.first = first_difference(self.sides[0]["tokens"], self.sides[1]["tokens"])
        longest = max(len(s["tokens"]) for s in self.sides)
        fig = self._figure()
        with self.hold_sync():
            with self.fig.batch_update():
                self.fig.data = []
                self.fig.add_traces(fig.data)
                self.fig.layout = fig.layout
            self.slider.max = max(longest - 1, 0)
            self.jump.disabled = self.first is None
            self.summary.value = self._summary()
            start = self.first if self.first is not None else min(1, self.slider.max)
            if self.slider.value != start:
                self.slider.value = start
            else:
                self.go_to(start)

    def go_to(self, position: int) -> None:
        """Show both runs' trees for the iterations that produced output token `position`."""
        if self.slider.value != position:
            self.slider.value = position  # its observer comes back here
            return
        with self.hold_sync():
            for tree, head, side, label in zip(self.trees, self.headers, self.sides, self.labels):
                it = int(side["iteration"][position]) if position < len(side["iteration"]) else None
                if it is None:
                    text = f"{label}: no output token {position}"
                elif it < 0:
                    text = f"{label}: output token {position} came from prefill"
                else:
                    tree.show(it, self.request)
                    text = f"{label}: output token {position} from iteration {it}"
                head.value = message_html(text, "note").replace("#6b6b6b", "#222")
            with self.fig.batch_update():
                self.fig.layout.shapes = self._shapes(position)

    def _shapes(self, position: int) -> list[dict]:
        shapes = [dict(type="line", xref="x", yref="paper", x0=position, x1=position, y0=0, y1=1,
                       line=dict(color=HIGHLIGHT, width=2))]
        if self.first is not None:
            shapes.append(dict(type="line", xref="x", yref="paper", x0=self.first, x1=self.first, y0=0, y1=1,
                               line=dict(color=COLORS["rejected"], width=2, dash="dash")))
        return shapes

    def _figure(self) -> go.Figure:
        fig = go.Figure()
        for label, side, color in zip(self.labels, self.sides, SIDE_COLORS):
            pos = np.arange(len(side["tokens"]))[1:]  # position 0 is the prefill token
            fig.add_trace(go.Scatter(
                name=label, x=pos, y=side["accept_length"][1:], mode="lines", line=dict(color=color, shape="hv"),
                customdata=side["iteration"][1:],
                hovertemplate="output token %{x}: iteration %{customdata}, accept length %{y}<extra></extra>"))
        if self.first is not None:
            fig.add_annotation(x=self.first, y=1, yref="paper", text=f"outputs differ from token {self.first}",
                               showarrow=False, yanchor="bottom", font=dict(color=COLORS["rejected"]))
        fig.update_layout(height=340, plot_bgcolor="white", template=TEMPLATE, margin=dict(l=60, r=20, t=40, b=80),
                          legend=dict(orientation="h", y=-0.22, x=0), shapes=self._shapes(0),
                          xaxis_title="output position (token index)", yaxis_title="accept length (tokens)")
        return fig

    def _summary(self) -> str:
        a, b = (s["accept_length"] for s in self.sides)
        n = min(len(a), len(b))
        a, b = a[1:n], b[1:n]
        more_a, more_b = a > b, b > a
        parts = []
        for label, side in zip(self.labels, self.sides):
            its = len(set(side["iteration"][side["iteration"] >= 0].tolist()))
            parts.append(f"<b>{html.escape(label)}</b>: {len(side['tokens'])} tokens in {its} iterations "
                         f"({len(side['tokens']) / max(its, 1):.2f} tokens per iteration)")
        for label, more, diff in ((self.labels[0], more_a, a - b), (self.labels[1], more_b, b - a)):
            if more.any():
                parts.append(f"{html.escape(label)} accepted more at {int(more.sum())} of {len(a)} positions, "
                             f"by {diff[more].mean():.2f} tokens on average")
        if self.first is None:
            parts.append(f"the outputs are identical ({n} tokens)")
        else:
            parts.append(f'<span class="spectool-compare-first">first difference at output token {self.first}'
                         "</span>")
        return "<br>".join(parts)

    def static_html(self) -> str:
        """The summary and both sides' trees at the current output position, as a static picture."""
        if not self.sides:
            return self.message.value
        parts = [f'<div class="spectool-compare-summary">{self.summary.value}</div>']
        for head, tree in zip(self.headers, self.trees):
            parts.append(head.value)
            if tree.view is not None:
                parts.append(iteration_picture(tree.trace, tree.view))
        return "".join(parts)

    def to_figure(self) -> go.Figure:
        """The comparison plot as a plain plotly Figure."""
        return figure_copy(self.fig)
