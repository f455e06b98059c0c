"""What the trace views share: opening a trace without tracebacks, messages, restyling.

Views accept a Trace, a path to a `.sptrace` file, or (tree and mask views) one
IterationView. Anything that cannot be shown becomes a message inside the widget.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go


def open_trace(source: Any) -> tuple[Any | None, str | None]:
    """(trace, None) for a usable Trace or path, else (None, a one-line reason)."""
    if isinstance(source, (str, Path)):
        from spectool.trace.reader import Trace

        try:
            source = Trace.load(source)
        except FileNotFoundError:
            return None, f"no trace file at {source}"
        except (ValueError, OSError) as e:  # TraceFormatError is a ValueError
            return None, f"cannot read {source}: {e}"
    # On the class: a lazily loaded trace's `steps` property would read the whole file.
    if source is None or not (hasattr(type(source), "steps") or "steps" in getattr(source, "__dict__", {})):
        return None, f"expected a spectool Trace or a path to a .sptrace file, got {type(source).__name__}"
    if len(source) == 0:  # from the index: a lazily loaded trace decodes nothing
        return source, "this trace has no draft iterations (empty trace)"
    return source, None


def tokenizer_note(trace: Any) -> str | None:
    """A note when the trace carries no tokenizer, so tokens show as ids."""
    if trace is not None and hasattr(trace, "tokenizer_json") and not trace.tokenizer_json:
        return "this trace has no tokenizer: tokens are shown as ids"
    return None


def message_html(text: str | None, level: str = "error") -> str:
    """HTML for a message shown inside a view ('' for none)."""
    if not text:
        return ""
    color = {"error": "#a94442", "note": "#6b6b6b"}[level]
    return f'<div style="color:{color};padding:4px 0">{html.escape(text)}</div>'


# The trace keys that change between iterations; styling stays as first built, and
# not re-validating it is most of what keeps a step fast.
DATA_KEYS = ("x", "y", "z", "text", "hovertext", "customdata")


def restyle(fig: go.FigureWidget, traces: list[dict]) -> None:
    """Replace the data of `fig`'s traces in place, one batched message to the frontend."""
    with fig.batch_update():
        for trace, new in zip(fig.data, traces):
            trace.update({k: new[k] for k in DATA_KEYS if k in new})


def figure_copy(fig: go.FigureWidget) -> go.Figure:
    """A plain plotly Figure with the widget's current data and layout."""
    return go.Figure(fig)


def message_box() -> widgets.HTML:
    """The HTML widget a view shows its messages in."""
    box = widgets.HTML()
    box.add_class("spectool-message")
    return box
