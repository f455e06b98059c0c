"""`spectool report`: one standalone HTML file with every view of a trace, stepped in the page.

The page runs the notebook's renderer (widgets/static/viewer.js) on the same data
(`spectool.trace.viewdata`): plotly.js and the module are inlined, the header goes
in as JSON and the typed-array blob gzipped and base64-encoded, so the file opens from disk with no
kernel and no network, and a step is rendered from arrays already in the page.
"""

from __future__ import annotations

import base64
import gzip
import html
import importlib.util
import json
from pathlib import Path
from typing import Any

from plotly.offline import get_plotlyjs

from spectool.trace.viewdata import view_data


def viewer_module() -> str:
    """The ES module's source, read without importing spectool.widgets (no ipywidgets needed)."""
    spec = importlib.util.find_spec("spectool.widgets")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("spectool.widgets is not installed: the report needs its static/viewer.js")
    source = (Path(next(iter(spec.submodule_search_locations))) / "static" / "viewer.js").read_text(encoding="utf-8")
    if "</script" in source.lower():  # it is inlined in a script element
        raise ValueError("viewer.js must not contain '</script'")
    return source


def _script_safe(text: str) -> str:
    """Text that cannot end the script element it sits in (a token's text can be anything)."""
    return text.replace("</", "<\\/").replace("<!--", "<\\!--")


def write_report(trace_or_path: Any, out_html: str | Path) -> Path:
    """Write one standalone HTML report of a trace (a Trace or a `.sptrace` path); returns its path.

    Raises TraceFormatError (a ValueError) when the path is not a readable trace.
    """
    if isinstance(trace_or_path, (str, Path)):
        from spectool.trace.reader import Trace

        trace = Trace.load(trace_or_path)
        source = Path(trace_or_path).name
    else:
        trace = trace_or_path
        source = ""
    header, blob = view_data(trace)
    out = Path(out_html)
    out.write_text(page_html(header, blob, source), encoding="utf-8")
    return out


def page_html(header: dict, blob: bytes, source: str = "") -> str:
    """A standalone page that mounts viewer.js on ``header`` and ``blob`` (`view_data`'s, or any part of
    them: a request or chunk that is not there shows as loading)."""
    header = dict(header, source=source)
    payload = _script_safe(json.dumps(header, separators=(",", ":"), allow_nan=False))
    title = header["title"] + (f" · {source}" if source else "")
    return _PAGE.format(title=html.escape(title), plotlyjs=get_plotlyjs(), header=payload,
                        blob=base64.b64encode(gzip.compress(blob, 6)).decode(), module=viewer_module())


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline' 'unsafe-eval';
 style-src 'unsafe-inline'; img-src data:; font-src data:">
<style>body {{ margin: 12px 16px; font-family: system-ui, sans-serif; }}
h2 {{ font-size: 16px; margin: 0 0 6px; }}</style>
<script>{plotlyjs}</script>
</head><body>
<h2 id="title"></h2>
<div id="app"></div>
<script type="application/json" id="spectool-header">{header}</script>
<script type="application/octet-stream" id="spectool-blob">{blob}</script>
<script type="module">
{module}
const header = JSON.parse(document.getElementById('spectool-header').textContent);
document.getElementById('title').textContent = header.title + (header.source ? ' · ' + header.source : '');
const raw = atob(document.getElementById('spectool-blob').textContent);
const packed = new Uint8Array(raw.length);
for (let i = 0; i < raw.length; i++) packed[i] = raw.charCodeAt(i);
// gzip: a big trace's arrays shrink several times, and parsing the page is most of its opening time.
const buffer = await new Response(new Blob([packed]).stream().pipeThrough(new DecompressionStream('gzip')))
  .arrayBuffer();
performance.mark('spectool-mount');
window.spectoolViewer = mount(document.getElementById('app'), header, buffer, window.Plotly);
performance.measure('spectool-mounted', 'spectool-mount');
</script>
</body></html>
"""
