"""TreeView, MaskView and AcceptanceView: one trace figure each, live in a notebook.

Each view is an ipywidgets VBox holding a message line and its figure. TreeView and MaskView
of a trace show a player (slider, Play, ← / → keys, request picker) drawn by the TraceViewer's
page code with only their part on (`TraceViewer(parts=["tree"])`): a step is rendered in the
browser from data already sent, and the page tells the kernel where it is once stepping pauses.
`fig`, a plotly FigureWidget built from the trace lists in `spectool.trace.figures`, follows the
step on show (`show`, `highlight`, `select_row`, or the page's report) and gives `to_figure()`; it
is what the view shows of a lone IterationView, and of a TreeView made with `stepper=False`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ipywidgets as widgets
import numpy as np
import plotly.graph_objects as go

from spectool.trace.figures import (
    TEMPLATE,
    acceptance_figure_from_columns,
    acceptance_traces,
    drawn_nodes,
    iteration_title,
    mask_figure,
    mask_layout,
    mask_traces,
    request_columns,
    tree_figure,
    tree_traces,
    visible,
)

from .common import figure_copy, message_box, message_html, open_trace, restyle, tokenizer_note
from .saved import StaticOutput, iteration_picture


def first_request(trace: Any) -> int | None:
    """The first request that has draft iterations (None when none has)."""
    reqs = trace.keys()[1]  # the index: a lazily loaded trace decodes nothing
    reqs = reqs[reqs >= 0]
    return int(reqs.min()) if len(reqs) else None


def no_iterations_message(trace: Any, request: int) -> str:
    """Why request `request` has nothing to show."""
    if request not in trace.request_ids:
        return f"request {request} is not in this trace (requests: {list(trace.request_ids)})"
    try:
        reason = trace.request(request).get("finish_reason")
    except (KeyError, AttributeError):
        reason = None
    if reason == "prefill":
        return f"request {request} finished at prefill: it has no draft iterations"
    return f"request {request} has no draft iterations"


def last_accepted(view: Any) -> int:
    """The deepest accepted node of an iteration (the root when nothing was accepted)."""
    path = [int(a) for a in np.asarray(view.accept_path) if a >= 0]
    return path[-1] if path else 0


def is_iteration_view(source: Any) -> bool:
    """True for one iteration's record (an IterationView) rather than a trace or path."""
    return hasattr(source, "mask") and hasattr(source, "parents")


class _IterationFigure(StaticOutput, widgets.VBox):
    """Shared by TreeView and MaskView: a source, the iteration shown, a message and a figure.

    Subclasses give `_traces(view)` (the data to restyle), `_layout(view)` (the
    layout that changes with it) and `_figure(view)` (the full figure, built on the
    first draw), and `part`, what the player of a trace shows.
    """

    css_class = ""
    part = ""

    def __init__(self, source: Any, request: int | None = None, iteration: int | None = None,
                 stepper: bool = True):
        super().__init__()
        self.add_class(self.css_class)
        self.message = message_box()
        self.fig = go.FigureWidget(layout=dict(template=TEMPLATE))
        self.children = [self.message, self.fig]
        self.trace: Any = None
        self.view: Any = None  # the IterationView on show
        self.request: int | None = None
        self.iteration: int | None = None
        self.player: Any = None  # the page's player of a trace (None: `fig` is on show)
        if is_iteration_view(source):
            self.show_view(source)
            return
        self.trace, error = open_trace(source)
        if error:
            self.message.value = message_html(error)
            return
        self.show(iteration, request)
        if stepper and self.view is not None:
            self._add_player()

    def _add_player(self) -> None:
        from .viewer import TraceViewer  # viewer.py imports this module's helpers

        self.player = TraceViewer(self.trace, self.request, parts=[self.part])
        self._place_player()
        self.player.selected = self._marked()
        self.children = [self.message, self.player]
        self.player.observe(self._page_moved, names=["request", "position"])

    def _place_player(self) -> None:
        """Move the page's player to the step on show (the page follows)."""
        if self.player is not None and self.view is not None:
            position = self.trace.iterations(self.request).index(self.iteration)
            if (self.player.request, self.player.position) != (self.request, position):
                self.player.show_request(self.request, position)

    def _page_moved(self, _change: dict) -> None:
        """The page stepped: the figure and the attributes follow."""
        request, its = self.player.request, self.trace.iterations(self.player.request)
        iteration = its[min(self.player.position, len(its) - 1)] if its else None
        if iteration is not None and (request, iteration) != (self.request, self.iteration):
            self.show(iteration, request)

    def _marked(self) -> int:
        """The node the page marks (-1: the accepted path)."""
        return -1

    def token_text(self) -> Callable | None:
        """Token id -> text through the trace's tokenizer (None: show ids)."""
        return self.trace.token_text if self.trace is not None else None

    def show(self, iteration: int | None = None, request: int | None = None) -> None:
        """Show one iteration of one request (defaults: this request, its first iteration)."""
        if self.trace is None:
            return
        if request is None:
            request = self.request if self.request is not None else first_request(self.trace)
        if request is None:
            self.message.value = message_html("this trace has no draft iterations (empty trace)")
            return
        if iteration is None:
            its = self.trace.iterations(request)
            if not its:
                self.message.value = message_html(no_iterations_message(self.trace, request))
                return
            iteration = its[0]
        try:
            view = self.trace.iteration(iteration, request)
        except (KeyError, ValueError) as e:
            self.message.value = message_html(str(e).strip("'\""))
            return
        self.show_view(view)

    def show_view(self, view: Any) -> None:
        """Draw an IterationView (TraceViewer loads it once for all linked views)."""
        self.view, self.request, self.iteration = view, int(view.request_id), int(view.iteration)
        try:
            traces = self._traces(view)
            if len(self.fig.data) != len(traces):
                self._rebuild(self._figure(view))
            else:
                with self.fig.batch_update():
                    restyle(self.fig, traces)
                    self.fig.update_layout(self._layout(view))
            self._place_player()
            if self.player is not None:
                self.player.selected = self._marked()
        except ValueError as e:  # a malformed record: say which, keep the widget alive
            self.message.value = message_html(f"iteration {view.iteration}, request {view.request_id}: {e}")
            return
        self.message.value = message_html(tokenizer_note(self.trace), "note")

    def static_html(self) -> str:
        """The iteration on show as a static picture (its tree, mask and request's accept lengths)."""
        if self.view is None or self.trace is None:
            return self.message.value
        return iteration_picture(self.trace, self.view)

    def _rebuild(self, fig: go.Figure) -> None:
        with self.fig.batch_update():
            self.fig.data = []
            self.fig.add_traces(fig.data)
            self.fig.layout = fig.layout
        self._wire_clicks()

    def _traces(self, view: Any) -> list[dict]:
        raise NotImplementedError

    def _figure(self, view: Any) -> go.Figure:
        raise NotImplementedError

    def _layout(self, view: Any) -> dict:
        """Layout properties that change between iterations."""
        raise NotImplementedError

    def _wire_clicks(self) -> None:
        """Register FigureWidget click callbacks (called after the traces are built)."""

    def to_figure(self) -> go.Figure:
        """The view as a plain plotly Figure."""
        return figure_copy(self.fig)


class TreeView(_IterationFigure):
    """The draft tree of one iteration: tidy layout, coloured by decision, hover with target top-k.

        TreeView(trace, request=0, iteration=5, highlight=3)   # a Trace, a path, or an IterationView

    `highlight(node)` marks the node and its ancestors (what its mask row sees);
    `on_node_click(callback)` calls callback(node) when a node of `fig` is clicked. A trace's
    tree is stepped in the page (its `player`); `stepper=False` shows `fig`, stepped by `show`.
    """

    css_class = "spectool-tree"
    part = "tree"

    def __init__(self, source: Any, request: int | None = None, iteration: int | None = None,
                 highlight: int | None = None, stepper: bool = True):
        self.selected = highlight
        self._click_callbacks: list[Callable[[int], None]] = []
        super().__init__(source, request, iteration, stepper)

    def _node(self, view: Any) -> int | None:
        return self.selected if self.selected is not None and self.selected < len(view.tokens) else None

    def _traces(self, view: Any) -> list[dict]:
        return tree_traces(view, self._node(view), self.token_text())

    def _figure(self, view: Any) -> go.Figure:
        return tree_figure(view, self._node(view), self.token_text())

    def _layout(self, view: Any) -> dict:
        return {"title_text": iteration_title(view)}

    def highlight(self, node: int | None) -> None:
        """Mark `node` and its ancestors (None clears the mark)."""
        self.selected = node
        if self.view is not None:
            self.show_view(self.view)

    def _marked(self) -> int:
        return -1 if self.selected is None else int(self.selected)

    def on_node_click(self, callback: Callable[[int], None]) -> None:
        """Call `callback(node)` when a node marker is clicked."""
        self._click_callbacks.append(callback)

    def _wire_clicks(self) -> None:
        for trace in self.fig.data:
            if trace.name in ("not visited", "accepted", "rejected"):
                trace.on_click(self._clicked)

    def _clicked(self, trace: Any, points: Any, _state: Any) -> None:
        for i in points.point_inds:
            for cb in self._click_callbacks:
                cb(int(trace.customdata[i]))


class MaskView(_IterationFigure):
    """The tree mask as a heatmap with token labels; selecting a row marks what it sees.

        mask = MaskView(trace, request=0, iteration=5, prefix=8, tree=tree_view)
        mask.select_row(3)      # or click the heatmap, or use the row dropdown

    Until a row is chosen the row of the deepest accepted node is selected. A
    linked TreeView (`tree=`) highlights the selected row's ancestors. A trace's mask is
    stepped in the page (its `player`, with its own row picker); `stepper=False` or `prefix > 0`
    shows `fig`.
    """

    css_class = "spectool-mask"
    part = "mask"
    FOLLOW = -1  # dropdown value: follow the accepted path

    def __init__(self, source: Any, request: int | None = None, iteration: int | None = None,
                 prefix: int = 0, tree: TreeView | None = None, stepper: bool = True):
        self.prefix = prefix
        self.tree = tree
        self.chosen: int | None = None  # the user's row; None = the deepest accepted node
        self._syncing = False
        self.rows = widgets.Dropdown(description="row", options=[("accepted path", self.FOLLOW)],
                                     value=self.FOLLOW)
        self.rows.observe(self._row_picked, names="value")
        # The page draws no prefix columns: a mask with them is the kernel's figure, stepped by `show`.
        super().__init__(source, request, iteration, stepper and prefix <= 0)
        if self.player is None:  # the page's player has its own row picker
            self.children = [self.message, self.rows, self.fig]

    @property
    def selected(self) -> int | None:
        """The row on show (the chosen one, or the deepest accepted node)."""
        if self.view is None:
            return None
        if self.chosen is not None and self.chosen in drawn_nodes(self.view):
            return self.chosen
        return last_accepted(self.view)

    def _traces(self, view: Any) -> list[dict]:
        return mask_traces(view, self.selected, self.prefix)

    def _figure(self, view: Any) -> go.Figure:
        return mask_figure(view, self.selected, self.prefix)

    def _layout(self, view: Any) -> dict:
        return mask_layout(view, min(max(self.prefix, 0), int(view.seq_len)))

    def show_view(self, view: Any) -> None:
        """Draw an IterationView, refresh the row choices and highlight in the linked tree.

        A row chosen in one tree means nothing in another: a new iteration or request
        goes back to following the accepted path.
        """
        if self.view is not None and (self.view.iteration, self.view.request_id) != (view.iteration,
                                                                                       view.request_id):
            self.chosen = None
        self.view = view
        rows = [("accepted path", self.FOLLOW)] + [(f"{i} {visible(view.token_texts[i])}", int(i))
                                                   for i in drawn_nodes(view)]
        with self.hold_sync():
            self._syncing = True  # programmatic changes of the dropdown are not user picks
            try:
                if list(self.rows.options) != rows:
                    self.rows.options = rows
                self.rows.value = self.chosen if self.chosen in dict(rows).values() else self.FOLLOW
            finally:
                self._syncing = False
            super().show_view(view)
        if self.tree is not None:
            self.tree.selected = self.selected
            self.tree.show_view(view)

    def select_row(self, row: int | None) -> None:
        """Select a query row (None: follow the accepted path) and highlight its ancestors."""
        if row is not None and self.view is not None and not 0 <= row < len(self.view.tokens):
            n = len(self.view.tokens)
            self.message.value = message_html(f"row {row} is outside this mask of {n} rows")
            return
        self.chosen = row
        if self.view is not None:
            self.show_view(self.view)

    def _marked(self) -> int:
        return -1 if self.chosen is None else int(self.chosen)

    def _row_picked(self, change: dict) -> None:
        if not self._syncing:
            self.select_row(None if change["new"] == self.FOLLOW else change["new"])

    def _wire_clicks(self) -> None:
        self.fig.data[0].on_click(self._clicked)

    def _clicked(self, _trace: Any, points: Any, _state: Any) -> None:
        if points.ys:  # heatmap rows are drawn nodes only (no padding): map the row back to its node
            self.select_row(int(drawn_nodes(self.view)[int(points.ys[0])]))


class AcceptanceView(widgets.VBox):
    """Accept length per iteration, acceptance by depth (or layer) and a histogram, for one request.

        AcceptanceView(trace, request=0)
        view.set_current(position)    # mark the player's step (position in the request's iterations)

    `on_pick(callback)` calls callback(position) when a point of the per-iteration plot is clicked.
    """

    def __init__(self, source: Any, request: int | None = None, current: int | None = None):
        super().__init__()
        self.add_class("spectool-acceptance")
        self.message = message_box()
        self.fig = go.FigureWidget(layout=dict(template=TEMPLATE))
        self.children = [self.message, self.fig]
        self.request: int | None = None
        self.current = current
        self._columns: dict[int, dict] = {}
        self._pick_callbacks: list[Callable[[int], None]] = []
        self.trace, error = open_trace(source)
        if error:
            self.message.value = message_html(error)
            return
        self.show(request if request is not None else first_request(self.trace))

    def columns(self, request: int) -> dict:
        """Per-iteration columns of `request` (computed once, column-wise)."""
        if request not in self._columns:
            self._columns[request] = request_columns(self.trace.steps, request)
        return self._columns[request]

    def show(self, request: int | None, current: int | None = None) -> None:
        """Show one request's acceptance."""
        if self.trace is None:
            return
        if request is None or request not in self.trace.request_ids:
            self.message.value = message_html(
                "this trace has no draft iterations (empty trace)" if request is None
                else no_iterations_message(self.trace, request))
            return
        self.request, self.current = request, current
        cols = self.columns(request)
        fig = acceptance_figure_from_columns(cols, request, current)
        if len(self.fig.data) != len(fig.data):
            with self.fig.batch_update():
                self.fig.data = []
                self.fig.add_traces(fig.data)
                self.fig.layout = fig.layout
            self.fig.data[0].on_click(self._clicked)
        else:
            with self.fig.batch_update():
                restyle(self.fig, acceptance_traces(cols, current))
                self.fig.layout.title.text = fig.layout.title.text
                for mine, theirs in zip(self.fig.layout.annotations, fig.layout.annotations):
                    mine.text = theirs.text
        note = None if len(cols["iteration"]) else no_iterations_message(self.trace, request)
        self.message.value = message_html(note, "note")

    def set_current(self, position: int | None) -> None:
        """Mark one iteration (a position in the request's iterations), or none."""
        self.current = position
        if self.request is None:
            return
        marker = acceptance_traces(self.columns(self.request), position)[1]
        restyle(self.fig, [{}, marker])

    def on_pick(self, callback: Callable[[int], None]) -> None:
        """Call `callback(position)` when a point of the accept-length plot is clicked."""
        self._pick_callbacks.append(callback)

    def _clicked(self, _trace: Any, points: Any, _state: Any) -> None:
        for i in points.point_inds:
            for cb in self._pick_callbacks:
                cb(int(i))

    def to_figure(self) -> go.Figure:
        """The view as a plain plotly Figure."""
        return figure_copy(self.fig)
