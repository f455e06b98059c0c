"""TraceViewer: tree, mask, text, timing, acceptance and calibration of a trace, stepped in the browser.

    viewer = TraceViewer("run.sptrace")     # or a Trace
    viewer                                   # Play (with speed) / slider / ← → keys, request picker, find

The page gets a header at once (`spectool.trace.viewdata.header_data`: run facts, the
request list, whole-run series downsampled to at most 1,000 buckets with their min and max,
calibration) and the shown request's data: its per-iteration columns and the per-node arrays
of the iterations around the shown one, in chunks of 256 iterations sent as binary buffers.
widgets/static/viewer.js renders every step from those (the same module the standalone report
runs), asks the kernel for another request or chunk when it is first needed and for the next
chunk before the player reaches it: stepping needs no kernel round trip, and a trace of a
million records opens in the time it takes to read its index and one request. A small trace
(at most PRELOAD_RECORDS records) is sent whole, so a saved notebook steps through all of it
without a kernel. The page reports its position back (`request`, `position`), so `to_figure()`
and the static snapshot kept in the notebook show the last state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anywidget
import numpy as np
import plotly.graph_objects as go
import traitlets
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from spectool.trace.figures import (
    TEMPLATE,
    acceptance_traces,
    iteration_title,
    mask_figure,
    request_columns,
    tree_figure,
)
from spectool.trace.snapshot import iteration_svg, snapshot_html
from spectool.trace.viewdata import (
    LARGE_RECORDS,
    Blob,
    chunk_data,
    chunk_rows,
    header_data,
    preload,
    request_data,
    text_data,
)

from .common import open_trace
from .views import first_request, last_accepted, no_iterations_message

STATIC = Path(__file__).parent / "static"
# A trace of at most this many records goes to the page whole (every request, every iteration).
PRELOAD_RECORDS = 4096


class TraceViewer(anywidget.AnyWidget):
    """Every view of a trace, linked, rendered in the browser from data already in the page.

    The request picker is searchable (an id, or any part of a request's label). Plots over many
    iterations are downsampled: the whole-run plot shows `Trace.aggregates` (at most 1,000 buckets
    of consecutive iterations, each its mean with a min-max band), and a request of more than
    1,500 iterations draws its per-iteration plots as bucket means with their min-max band too.

    Args:
        source: a Trace or a path to a `.sptrace` file.
        request: the request shown first (default: the first with draft iterations).
        parts: what the page shows, of "tree", "mask", "text", "find" and "plots" (default: all).
    """

    _esm = STATIC / "viewer.js"
    # The header travels as UTF-8 JSON bytes: ipywidgets walks a Dict trait's every list looking for
    # buffers, which costs seconds on a long request's per-iteration columns.
    header_json = traitlets.Bytes().tag(sync=True)
    blob = traitlets.Bytes().tag(sync=True)
    request = traitlets.Int(0).tag(sync=True)
    position = traitlets.Int(0).tag(sync=True)
    snapshot = traitlets.Unicode("").tag(sync=True)
    # What the page shows: every part when empty; TreeView and MaskView show ["tree"] and ["mask"].
    parts = traitlets.List(traitlets.Unicode()).tag(sync=True)
    # A node marked with its ancestors until the next step (-1: the accepted path).
    selected = traitlets.Int(-1).tag(sync=True)

    def __init__(self, source: Any, request: int | None = None, parts: list[str] | None = None):
        self.trace, error = open_trace(source)
        start = request if request is not None else (first_request(self.trace) if self.trace is not None else 0)
        self.data = PageData(self.trace, error, start)
        super().__init__(header_json=self.data.header_json(), blob=self.data.blob, request=int(start or 0),
                         position=0, parts=list(parts or []))
        self.header = self.data.header  # what the page got (`requests`: the picker's list)
        self.add_class("spectool-viewer")
        self.error = self.data.header.get("error")
        if self.trace is not None and request is not None and not self.positions:
            self.error = no_iterations_message(self.trace, request)
        self.on_msg(self._message)
        self.observe(lambda _: self._snap(), names=["request", "position"])
        self._snap()

    @property
    def positions(self) -> list[int]:
        """Iteration numbers of the shown request (the slider's range)."""
        return self.trace.iterations(self.request) if self.trace is not None else []

    @property
    def iteration(self) -> int | None:
        """The iteration on show (None when the request has none)."""
        its = self.positions
        return its[min(self.position, len(its) - 1)] if its else None

    def go_to(self, position: int) -> None:
        """Show the request's `position`-th iteration (the page follows)."""
        self.position = max(0, min(position, len(self.positions) - 1))

    def show_request(self, request: int, position: int = 0) -> None:
        """Switch to another request (the page follows)."""
        with self.hold_trait_notifications():
            self.request = request
            self.position = position

    def _message(self, _widget: Any, content: dict, _buffers: list) -> None:
        """The page's questions: plotly.js, or a request's data (`PageData.answer`)."""
        reply = plotly_reply(content) or self.data.answer(content)
        if reply is not None:
            self.send(*reply)

    def _view(self):
        it = self.iteration
        return None if it is None else self.trace.iteration(it, self.request)

    def _snap(self) -> None:
        view = self._view()
        if view is None:
            self.snapshot = ""
            return
        acc = np.asarray(self.data.request_data(self.request)["accept_length"], np.int64)
        self.snapshot = iteration_svg(view, self.trace.token_text, acc, self.position, iteration_title(view))

    def _repr_mimebundle_(self, **kwargs: Any):
        data, metadata = super()._repr_mimebundle_(**kwargs)
        if self.snapshot:  # what an untrusted or kernel-less notebook and nbconvert's HTML show
            data["text/html"] = snapshot_html(self.snapshot)
        if self.error:
            data["text/plain"] = f"TraceViewer: {self.error}"
        return data, metadata

    def to_figure(self) -> go.Figure:
        """Tree, mask and acceptance of the current step as one static plotly Figure."""
        view = self._view()
        if view is None:
            return go.Figure(layout=dict(title=self.error or "no draft iterations", template=TEMPLATE))
        sel = last_accepted(view)
        tree = tree_figure(view, sel, self.trace.token_text)
        mask = mask_figure(view, sel)
        cols = request_columns(self.trace.request_steps(self.request), self.request)
        acc = acceptance_traces(cols, self.position)
        fig = make_subplots(rows=2, cols=2, subplot_titles=("draft tree", "tree mask", "accept length",
                                                            acc[2]["name"]),
                            vertical_spacing=0.12, horizontal_spacing=0.08)
        for t in tree.data:
            fig.add_trace(t, row=1, col=1)
        for t in mask.data:
            fig.add_trace(t, row=1, col=2)
        for t in acc[:2]:
            fig.add_trace(go.Scatter({k: v for k, v in t.items() if k not in ("xaxis", "yaxis")}), row=2, col=1)
        fig.add_trace(go.Bar({k: v for k, v in acc[2].items() if k not in ("xaxis", "yaxis")}), row=2, col=2)
        ml = mask.layout
        fig.update_yaxes(autorange="reversed", tickvals=ml.yaxis.tickvals, ticktext=ml.yaxis.ticktext, row=1, col=2)
        fig.update_xaxes(tickvals=ml.xaxis.tickvals, ticktext=ml.xaxis.ticktext, tickangle=-60, row=1, col=2)
        fig.update_xaxes(visible=False, row=1, col=1)
        fig.update_xaxes(title_text="iteration", row=2, col=1)
        fig.update_yaxes(title_text="accept length (tokens)", row=2, col=1)
        fig.update_yaxes(tickformat=".0%", range=[0, 1], title_text="accepted", row=2, col=2)
        fig.update_layout(height=900, showlegend=False, plot_bgcolor="white", template=TEMPLATE,
                          title=iteration_title(view))
        return fig


def plotly_reply(content: Any) -> tuple[dict, list[bytes]] | None:
    """The answer to a page's question for plotly.js (sent once per page), or None for another question."""
    if isinstance(content, dict) and content.get("kind") == "plotly":
        return {"kind": "plotly"}, [get_plotlyjs().encode()]
    return None


class PageData:
    """One trace as the page gets it: a header and a first blob, then answers to the page's questions.

    A trace of at most PRELOAD_RECORDS records goes whole; a larger one with the `start` request's
    first chunk, the rest when the page asks (`answer`).
    """

    def __init__(self, trace: Any, error: str | None, start: int | None):
        self.trace = trace
        header: dict = {"requests": [], "texts": {}, "facts": [], "calibration": {"groups": []}, "phases": []}
        blob = Blob()
        if trace is not None and not error:
            header = header_data(trace)
        if error or not header["requests"]:
            header["error"] = error or "this trace has no draft iterations"
        if not header.get("error"):
            ids = [r["id"] for r in header["requests"]]
            if len(trace) <= PRELOAD_RECORDS:
                for r in ids:
                    preload(header, blob, trace, r)
            elif start in ids:
                preload(header, blob, trace, start, [0])
        self.header = header
        self.blob = blob.bytes()
        self._requests: dict[int, dict] = {r["id"]: {k: v for k, v in r.items() if k != "loaded"}
                                           for r in header.get("loaded", [])}

    def header_json(self) -> bytes:
        """The header as UTF-8 JSON bytes (see TraceViewer.header_json)."""
        return json.dumps(self.header, separators=(",", ":"), allow_nan=False).encode()

    def answer(self, content: Any) -> tuple[dict, list[bytes]] | None:
        """The reply (message, buffers) to a page's question for a request's columns, a chunk of per-node
        arrays or a request's text; None for anything else."""
        if self.trace is None or not isinstance(content, dict) or not isinstance(content.get("request"), int):
            return None
        kind, request = content.get("kind"), content["request"]
        if kind == "request":
            # With the chunk of the position the page will show: one round trip to the first tree, not two.
            data, blob = dict(self.request_data(request)), Blob()
            position = content.get("position")
            chunk = position // data["chunk"] if isinstance(position, int) and position >= 0 else 0
            if chunk < data["chunks"]:
                data["loaded"] = {str(chunk): chunk_data(chunk_rows(self.trace, request, chunk), blob, self.trace)}
            return {"kind": "request", "data": data}, [blob.bytes()]
        if kind == "chunk" and isinstance(content.get("chunk"), int):
            blob = Blob()
            data = chunk_data(chunk_rows(self.trace, request, content["chunk"]), blob, self.trace)
            return {"kind": "chunk", "request": request, "chunk": content["chunk"], "data": data}, [blob.bytes()]
        if kind == "text":
            accept = self.request_data(request)["accept_length"]
            return {"kind": "text", "request": request, "data": text_data(self.trace, request, accept)}, []
        return None

    def request_data(self, request: int) -> dict:
        """A request's per-iteration columns, kept for the last few requests shown."""
        if request not in self._requests:
            if len(self._requests) >= 8:
                self._requests.pop(next(iter(self._requests)))
            # A large trace without a request index reads every request row the first time a text is
            # asked for: the text follows in its own message, after the tree is drawn.
            self._requests[request] = request_data(self.trace, request, with_text=len(self.trace) <= LARGE_RECORDS
                                                   or self.trace.finds_requests_fast)
        return self._requests[request]
