"""TraceViewer: tree, mask and acceptance of a trace, linked, with a step player.

    viewer = TraceViewer("run.sptrace")     # or a Trace
    viewer                                   # Play / slider over iterations, request picker

The slider runs over positions in the chosen request's iterations (Play is
jslink'd to it, so playing needs no kernel round trip per frame beyond the
redraw). Each step loads the IterationView once and hands it to the tree and the
mask; selecting a mask row (click, dropdown) highlights that node's ancestors in
the tree; clicking a point of the accept-length plot jumps there.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from spectool.trace.figures import TEMPLATE

from .common import message_box, message_html, open_trace, tokenizer_note
from .views import AcceptanceView, MaskView, TreeView, first_request, no_iterations_message


class TraceViewer(widgets.VBox):
    """All three views of a trace, linked, with a Play button, an iteration slider and a request picker."""

    def __init__(self, source: Any, request: int | None = None, prefix: int = 0, interval_ms: int = 600):
        super().__init__()
        self.add_class("spectool-viewer")
        self.message = message_box()
        self.trace, error = open_trace(source)
        self.request: int | None = None
        self.positions: list[int] = []  # iteration numbers of the request, the slider's range
        self.play = widgets.Play(min=0, max=0, step=1, interval=interval_ms, description="play")
        self.slider = widgets.IntSlider(min=0, max=0, description="step", continuous_update=True)
        widgets.jslink((self.play, "value"), (self.slider, "value"))
        self.label = widgets.HTML()
        self.player = widgets.HBox([self.play, self.slider, self.label])
        self.player.add_class("spectool-player")
        requests = list(self.trace.request_ids) if self.trace is not None else []
        self.picker = widgets.Dropdown(description="request", options=requests)
        if error or not requests:
            self.message.value = message_html(error or "this trace has no requests")
            self.children = [self.message]
            return
        self.tree = TreeView(self.trace)
        self.mask = MaskView(self.trace, prefix=prefix, tree=self.tree)
        self.acceptance = AcceptanceView(self.trace)
        self.acceptance.on_pick(self.go_to)
        self.tree.on_node_click(self.mask.select_row)
        # Side by side, wrapping on narrow screens. Fixed figure widths: a FigureWidget in
        # a flex row does not shrink to its share, it overflows it.
        for view, width in ((self.tree, 620), (self.mask, 560)):
            view.fig.layout.width = width
            view.layout = widgets.Layout(flex="0 0 auto")
        self.children = [self.message, widgets.HBox([self.picker, self.player]),
                         widgets.HBox([self.tree, self.mask], layout=widgets.Layout(flex_flow="row wrap")),
                         self.acceptance]
        self.slider.observe(lambda change: self.go_to(change["new"]), names="value")
        self.picker.observe(lambda change: self.show_request(change["new"]), names="value")
        start = request if request is not None else first_request(self.trace)
        self.picker.value = start if start is not None else requests[0]
        if self.request is None:  # the picker already held that value, so no change fired
            self.show_request(self.picker.value)

    def show_request(self, request: int) -> None:
        """Switch to another request, at its first iteration."""
        self.request = request
        self.positions = self.trace.iterations(request)
        with self.hold_sync():
            self.acceptance.show(request)
            shown = "visible" if self.positions else "hidden"  # nothing to step through or draw
            for part in (self.player, self.tree, self.mask):
                part.layout.visibility = shown
            if not self.positions:
                self.message.value = message_html(no_iterations_message(self.trace, request))
                return
            self.message.value = message_html(tokenizer_note(self.trace), "note")
            last = len(self.positions) - 1
            self.play.max = self.slider.max = last
            if self.slider.value != 0:
                self.slider.value = 0  # its observer draws position 0
            else:
                self.go_to(0)

    def go_to(self, position: int) -> None:
        """Show the request's `position`-th iteration in every view."""
        if not 0 <= position < len(self.positions):
            return
        if self.slider.value != position:
            self.slider.value = position  # its observer comes back here
            return
        iteration = self.positions[position]
        try:
            view = self.trace.iteration(iteration, self.request)
        except (KeyError, ValueError) as e:
            self.message.value = message_html(str(e).strip("'\""))
            return
        with self.hold_sync():
            self.mask.show_view(view)  # redraws the linked tree too
            self.acceptance.set_current(position)
            self.label.value = (f"iteration {iteration} ({position + 1}/{len(self.positions)}) · "
                                f"accept length {int(view.accept_length)}")

    def to_figure(self) -> go.Figure:
        """Tree, mask and acceptance of the current step as one static plotly Figure."""
        parts = [self.tree.to_figure(), self.mask.to_figure(), self.acceptance.to_figure()]
        titles = ("draft tree", "tree mask", "accept length", parts[2].data[2].name)
        fig = make_subplots(rows=2, cols=2, subplot_titles=titles, vertical_spacing=0.12,
                            horizontal_spacing=0.08)
        for trace in parts[0].data:
            fig.add_trace(trace, row=1, col=1)
        for trace in parts[1].data:
            fig.add_trace(trace, row=1, col=2)
        for trace in parts[2].data[:2]:  # accept length per iteration and the current step
            fig.add_trace(trace, row=2, col=1)
        fig.add_trace(parts[2].data[2], row=2, col=2)  # acceptance by depth (or layer)
        mask = parts[1].layout
        fig.update_yaxes(autorange="reversed", tickvals=mask.yaxis.tickvals, ticktext=mask.yaxis.ticktext,
                         row=1, col=2)
        fig.update_xaxes(tickvals=mask.xaxis.tickvals, ticktext=mask.xaxis.ticktext, tickangle=-60,
                         row=1, col=2)
        fig.update_xaxes(visible=False, row=1, col=1)
        fig.update_layout(height=900, showlegend=False, plot_bgcolor="white", template=TEMPLATE,
                          title=parts[0].layout.title.text)
        return fig
