"""CompareView: two traces side by side, aligned by request and iteration.

Iterations are aligned by their position within the request (the k-th draft of
request r in run A against the k-th in run B), which is what changes when a
setting changes. The plot shows both accept lengths per position and marks the
positions whose draft trees differ (tokens or shape); a slider shows both trees
of one position next to each other.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets
import numpy as np
import plotly.graph_objects as go
import pyarrow.compute as pc

from spectool.trace.figures import COLORS, HIGHLIGHT, TEMPLATE, request_columns

from .common import figure_copy, message_box, message_html, open_trace, restyle
from .views import TreeView

SIDE_COLORS = ("#1f77b4", "#d62728")


def trees_differ(steps_a: Any, steps_b: Any, request: int) -> np.ndarray:
    """Per aligned position (up to the shorter run): True where tokens or parents differ."""
    lists = []
    for steps in (steps_a, steps_b):
        rows = steps.filter(pc.equal(steps["request_id"], request)).sort_by("iteration")
        lists.append((rows["tokens"].to_pylist(), rows["parents"].to_pylist()))
    (tok_a, par_a), (tok_b, par_b) = lists
    n = min(len(tok_a), len(tok_b))
    return np.array([tok_a[k] != tok_b[k] or par_a[k] != par_b[k] for k in range(n)], dtype=bool)


class CompareView(widgets.VBox):
    """Two traces aligned by request and iteration, differences marked.

        CompareView(trace_a, trace_b, labels=("ngram", "eagle"))    # Traces or paths
    """

    def __init__(self, trace_a: Any, trace_b: Any, labels: tuple[str, str] = ("A", "B"),
                 request: int | None = None):
        super().__init__()
        self.add_class("spectool-compare")
        self.labels = labels
        self.message = message_box()
        self.fig = go.FigureWidget(layout=dict(template=TEMPLATE))
        self.traces: list[Any] = []
        errors = []
        for label, source in zip(labels, (trace_a, trace_b)):
            trace, error = open_trace(source)
            self.traces.append(trace)
            if error:
                errors.append(f"{label}: {error}")
        self.request: int | None = None
        self.columns: list[dict] = []
        self.differ = np.zeros(0, bool)
        if errors:
            self.message.value = message_html("; ".join(errors))
            self.children = [self.message]
            return
        both = sorted(set(self.traces[0].request_ids) & set(self.traces[1].request_ids))
        if not both:
            self.message.value = message_html("the two traces share no request ids")
            self.children = [self.message]
            return
        self.picker = widgets.Dropdown(description="request", options=both)
        self.slider = widgets.IntSlider(min=0, max=0, description="step")
        self.slider.add_class("spectool-player")
        self.summary = widgets.HTML()
        self.trees = [TreeView(t, request=both[0]) for t in self.traces]
        side_by_side = []
        for label, tree in zip(labels, self.trees):
            side_by_side.append(widgets.VBox([widgets.HTML(f"<b>{label}</b>"), tree]))
        self.children = [self.message, widgets.HBox([self.picker, self.slider]), self.summary, self.fig,
                         widgets.HBox(side_by_side)]
        self.picker.observe(lambda change: self.show_request(change["new"]), names="value")
        self.slider.observe(lambda change: self.go_to(change["new"]), names="value")
        self.show_request(request if request in both else both[0])

    def show_request(self, request: int) -> None:
        """Compare one request's iterations."""
        self.request = request
        if self.picker.value != request:
            self.picker.value = request  # its observer comes back here
            return
        self.columns = [request_columns(t.steps, request) for t in self.traces]
        self.differ = trees_differ(self.traces[0].steps, self.traces[1].steps, request)
        longest = max(len(c["iteration"]) for c in self.columns)
        fig = self._figure(0)
        with self.hold_sync():
            if len(self.fig.data) != len(fig.data):
                with self.fig.batch_update():
                    self.fig.data = []
                    self.fig.add_traces(fig.data)
                    self.fig.layout = fig.layout
            else:
                restyle(self.fig, [t.to_plotly_json() for t in fig.data])
                self.fig.layout.title.text = fig.layout.title.text
            self.slider.max = max(longest - 1, 0)
            self.summary.value = self._summary()
            if self.slider.value != 0:
                self.slider.value = 0
            else:
                self.go_to(0)

    def go_to(self, position: int) -> None:
        """Show both trees of the `position`-th iteration of the request."""
        with self.hold_sync():
            for tree, cols, label in zip(self.trees, self.columns, self.labels):
                its = cols["iteration"]
                if position < len(its):
                    tree.show(int(its[position]), self.request)
                else:
                    tree.message.value = message_html(
                        f"{label} finished request {self.request} after {len(its)} iterations", "note")
            restyle(self.fig, [{}, {}, {}, self._current(position)])

    def _current(self, position: int) -> dict:
        ys = [int(c["accept_length"][position]) for c in self.columns if position < len(c["accept_length"])]
        return dict(x=[position] * len(ys), y=ys)

    def _figure(self, position: int) -> go.Figure:
        fig = go.Figure()
        for label, cols, color in zip(self.labels, self.columns, SIDE_COLORS):
            acc = cols["accept_length"]
            fig.add_trace(go.Scatter(
                name=f"{label} accept length", x=np.arange(len(acc)), y=acc, mode="lines+markers",
                line=dict(color=color, width=1), marker=dict(size=4), customdata=cols["iteration"],
                hovertemplate=f"{label}: step %{{x}} (iteration %{{customdata}}), accept length %{{y}}"
                              "<extra></extra>"))
        where = np.nonzero(self.differ)[0]
        top = [max(int(c["accept_length"][k]) for c in self.columns) + 0.4 for k in where]
        fig.add_trace(go.Scatter(name="trees differ", x=where, y=top, mode="markers",
                                 marker=dict(symbol="x", color=COLORS["rejected"], size=7),
                                 hovertemplate="step %{x}: the draft trees differ<extra></extra>"))
        fig.add_trace(go.Scatter(name="current", mode="markers", hoverinfo="skip", showlegend=False,
                                 marker=dict(symbol="diamond-open", color=HIGHLIGHT, size=14),
                                 **self._current(position)))
        fig.update_layout(title=f"request {self.request}: accept length per iteration, aligned by step",
                          height=360, plot_bgcolor="white", template=TEMPLATE,
                          margin=dict(l=40, r=20, t=50, b=40),
                          xaxis_title="step (iteration within the request)", yaxis_title="accept length")
        return fig

    def _summary(self) -> str:
        parts = []
        for label, cols in zip(self.labels, self.columns):
            acc = cols["accept_length"]
            mean = f"{acc.mean():.2f}" if len(acc) else "–"
            parts.append(f"<b>{label}</b>: {len(acc)} iterations, mean accept length {mean}")
        parts.append(f"trees differ at {int(self.differ.sum())} of {len(self.differ)} aligned steps")
        return " · ".join(parts)

    def to_figure(self) -> go.Figure:
        """The comparison plot as a plain plotly Figure."""
        return figure_copy(self.fig)
