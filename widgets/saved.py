"""What a saved notebook keeps of a view: a static picture of it, which needs no kernel and no script.

A view's output carries the live widget (`application/vnd.jupyter.widget-view+json`) and
a `text/html` picture of the view beside it. Which one a reader sees:

- nbconvert's HTML shows the picture: its filter skips a widget view whose model state is
  not in the notebook's metadata (JupyterLab saves none by default).
- JupyterLab shows the picture for an untrusted notebook (one signed elsewhere or not at
  all), since its widget renderer is unsafe and the HTML renderer is safe. For a trusted
  notebook it always picks the widget renderer, which with no live model shows
  "Loading widget..." (no kernel) or "model not found" (a fresh kernel), even when the
  widget state was saved in the metadata.

So the dependable form of a saved view is its picture alone: `keep_static` drops the widget
view from every output that holds a picture (and the widget state no output needs any more).
The shipped notebooks are stored that way, and `pre_save_hook` does it on every save from
JupyterLab (`c.ContentsManager.pre_save_hook = "spectool.widgets.saved.pre_save_hook"` in
jupyter_server_config.py); re-running a cell brings the live view back.
"""

from __future__ import annotations

from typing import Any

from spectool.trace.figures import iteration_title, request_columns
from spectool.trace.snapshot import iteration_svg, snapshot_html

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
STATIC_TYPES = ("text/html", "image/png")


class StaticOutput:
    """Mixin for an ipywidgets view: its output bundle also holds `static_html()`, the view as it stands."""

    def static_html(self) -> str:
        """HTML (no script) picturing the view now; '' for none."""
        return ""

    def _repr_mimebundle_(self, **kwargs: Any):
        bundle = super()._repr_mimebundle_(**kwargs)  # type: ignore[misc]
        data = bundle[0] if isinstance(bundle, tuple) else bundle  # ipywidgets gives data alone
        picture = self.static_html()
        if picture:
            data["text/html"] = picture
        return bundle

    def _ipython_display_(self) -> None:
        from IPython.display import display

        bundle = self._repr_mimebundle_()
        data, metadata = bundle if isinstance(bundle, tuple) else (bundle, {})
        handle = display(data, metadata=metadata, raw=True, display_id=True)
        self._picture_handles = [*getattr(self, "_picture_handles", []), handle]

    def refresh_picture(self) -> None:
        """Put the view's present picture into the outputs that show it (from the kernel's main thread:
        an update from another thread may reach no cell)."""
        handles = getattr(self, "_picture_handles", [])
        if handles:
            bundle = self._repr_mimebundle_()
            data, metadata = bundle if isinstance(bundle, tuple) else (bundle, {})
            for handle in handles:
                handle.update(data, metadata=metadata, raw=True)


def keep_static(nb: dict) -> dict:
    """`nb` (a notebook dict, changed in place) with each output that holds a picture reduced to it."""
    live = set()
    # JupyterLab's "Save Widget State Automatically" saves each model as it stands; a TraceViewer's
    # model holds the picture of the step the page last showed, newer than the one in its output.
    state = nb.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            data = out.get("data", {})
            if WIDGET_VIEW not in data:
                continue
            latest = state.get(data[WIDGET_VIEW].get("model_id"), {}).get("state", {}).get("snapshot")
            if isinstance(latest, str) and latest.startswith("<svg"):
                data["text/html"] = snapshot_html(latest)
            if any(t in data for t in STATIC_TYPES):
                del data[WIDGET_VIEW]
            else:
                live.add(data[WIDGET_VIEW].get("model_id"))
    if not live:  # the state only served the views dropped (and is most of the file's size)
        nb.get("metadata", {}).pop("widgets", None)
    return nb


def pre_save_hook(model: dict, **_: Any) -> None:
    """jupyter_server's pre-save hook: notebooks are saved with `keep_static`."""
    if model.get("type") == "notebook" and isinstance(model.get("content"), dict):
        keep_static(model["content"])


def iteration_picture(trace: Any, view: Any) -> str:
    """The static picture of one iteration of `trace` (tree, mask, its request's accept lengths)."""
    request = int(view.request_id)
    accept = request_columns(trace.steps, request)["accept_length"]
    position = trace.iterations(request).index(int(view.iteration))
    return snapshot_html(iteration_svg(view, trace.token_text, accept, position, iteration_title(view)))
