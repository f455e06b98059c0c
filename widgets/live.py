"""LiveDecode: watch an engine decode, token by token, with the accepted drafts coloured.

The widget consumes ``engine.stream(...)`` events. Each event says, per request, the
tokens gained this iteration: the accepted drafts in depth order, then the target's
bonus token. Accepted drafts are coloured by depth (for multi-layer EAGLE depth d was
drafted by layer d-1, so the legend names layers); bonus tokens are plain.

Decoding runs on a background thread (``start()``, the Start button) so the kernel
stays responsive and the Stop button can reach ``engine.request_stop()``; ``run()``
decodes on the calling thread (scripts, tests, notebooks executed headless).
"""

from __future__ import annotations

import html
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import ipywidgets as widgets
import plotly.graph_objects as go

from .saved import StaticOutput

# One colour per draft depth 1..8, then hues that none of those take; the bonus token stays uncoloured.
DEPTH_COLOURS = ["#4e79a7", "#59a14f", "#f28e2b", "#b07aa1", "#e15759", "#76b7b2", "#edc948", "#9c755f"]
# The legend names this many depths at most (deeper accepted drafts still get their own colour).
_LEGEND_DEPTHS = 12
BONUS_COLOUR = "#bab0ac"
# Re-render the text at most this often; stats and the final state are always shown.
_RENDER_INTERVAL_S = 0.1
# Tokens of left context used to decode one token's text (keeps BPE spacing right).
_DECODE_CONTEXT = 4


def depth_colour(depth: int) -> str:
    """Colour of an accepted draft token at ``depth`` (1-based); depths past 8 never repeat a shallow one."""
    if depth <= len(DEPTH_COLOURS):
        return DEPTH_COLOURS[depth - 1]
    hue = (depth * 137.508) % 360  # golden-angle steps: distinct hues, darker than the first eight
    return f"hsl({hue:.0f}, 55%, 38%)"


def draft_depth(engine) -> int | None:
    """How deep the engine's drafts can go: draft steps (layers for multi-layer EAGLE), None when unknown."""
    config = getattr(engine, "draft_config", None) or getattr(engine, "draft", None)
    for name in ("num_steps", "max_trie_depth"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@dataclass
class _Piece:
    text: str
    depth: int  # 0 = bonus token, d >= 1 = accepted draft at depth d


@dataclass
class _RequestText:
    prompt: str
    tokens: list[int] = field(default_factory=list)
    pieces: list[_Piece] = field(default_factory=list)
    finished: bool = False


def _method_of(engine) -> str:
    """Draft method name of an engine: 'ngram', 'eagle', 'multi_layer_eagle' or 'none'."""
    for name in ("draft_config", "draft"):
        method = getattr(getattr(engine, name, None), "method", None)
        if isinstance(method, str):
            return method
    return "none"


class LiveDecode(StaticOutput, widgets.VBox):
    """Stream an engine's output into the notebook while it decodes.

    Args:
        engine: a ``spectool.Engine`` (anything with ``stream(prompts, ...)`` and
            ``request_stop()``).
        prompts: prompt strings (or token-id lists) to decode as one batch.
        max_new_tokens: tokens to generate per request.
        temperature: 0 for greedy.
        record: ask the engine to record (so ``event.records`` is filled).
        decode: token ids -> text; defaults to ``engine.target.decode``.
    """

    def __init__(self, engine, prompts: Sequence[str] | Sequence[Sequence[int]], max_new_tokens: int = 128,
                 temperature: float = 0.0, record: bool = False, decode=None) -> None:
        self.engine = engine
        self.prompts = list(prompts) if prompts is not None else []
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.record = record
        self.method = _method_of(engine)
        target = getattr(engine, "target", None)
        self._decode = decode or getattr(target, "decode", None)

        # Bounded and scrolling: a long decode must not push the rest of the notebook away.
        self.text = widgets.HTML(layout=widgets.Layout(width="100%", max_height="360px", overflow="auto"))
        self.stats_label = widgets.HTML()
        self.message = widgets.HTML()
        self.start_button = widgets.Button(description="Start", icon="play", button_style="success")
        self.stop_button = widgets.Button(description="Stop", icon="stop", button_style="danger",
                                          disabled=True)
        self.start_button.on_click(lambda _: self.start())
        self.stop_button.on_click(lambda _: self.stop())
        super().__init__([widgets.HBox([self.start_button, self.stop_button, self.stats_label]),
                          self.message, self._legend(), self.text])
        self.add_class("spectool-live")

        self.stats: dict = {}
        self.accept_lengths: list[dict[int, int]] = []  # per iteration: request -> accept length
        self.iteration_depths: list[list[int]] = []  # per iteration: depth of every token shown (0 = bonus)
        self.error: str | None = None
        self._requests: list[_RequestText] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._last_render = 0.0
        problem = self._check_input()
        if problem:
            self._show_message(problem)
            self.start_button.disabled = True
        self._reset()

    # ----- public API -------------------------------------------------------------------

    def start(self) -> None:
        """Decode on a background thread (what the Start button does)."""
        if self.running or self.start_button.disabled:
            return
        self._thread = threading.Thread(target=self.run, name="spectool-live-decode", daemon=True)
        self._set_running(True)
        self._thread.start()

    def run(self) -> dict:
        """Decode on the calling thread until done or stopped; return the final stats."""
        if self._check_input():
            return {}
        self._set_running(True)
        self._reset()
        self._stop.clear()
        start = time.perf_counter()
        try:
            stream = self.engine.stream(self.prompts, max_new_tokens=self.max_new_tokens,
                                        temperature=self.temperature, record=self.record)
            for event in stream:
                self._consume(event, time.perf_counter() - start)
                if self._stop.is_set():
                    break
        except Exception as exc:  # shown in the widget: a live view must not leave a traceback behind
            self.error = f"{type(exc).__name__}: {exc}"
            self._show_message(f"decoding failed: {self.error}")
        finally:
            self._render()
            self._set_running(False)
            if threading.current_thread() is threading.main_thread():
                self.refresh_picture()
        return self.stats

    def stop(self) -> None:
        """Ask the engine to finish its current iteration and return (thread-safe)."""
        self._stop.set()
        request_stop = getattr(self.engine, "request_stop", None)
        if request_stop is not None:
            request_stop()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a ``start()``-ed decode ends; False if it is still running after ``timeout``."""
        if self._thread is not None:
            self._thread.join(timeout)
        if not self.running:
            self.refresh_picture()  # the outputs keep the finished text, not the first frame
        return not self.running

    @property
    def running(self) -> bool:
        return self.stop_button.disabled is False

    @property
    def texts(self) -> list[str]:
        """Generated text per request so far (without the prompt)."""
        return ["".join(p.text for p in r.pieces) for r in self._requests]

    @property
    def token_ids(self) -> list[list[int]]:
        """Generated token ids per request so far."""
        return [list(r.tokens) for r in self._requests]

    def to_figure(self) -> go.Figure:
        """Tokens gained per iteration, stacked by draft depth (layer) with the bonus on top."""
        fig = go.Figure()
        iters = list(range(len(self.iteration_depths)))
        max_depth = max((d for it in self.iteration_depths for d in it), default=0)
        label = "layer" if self.method == "multi_layer_eagle" else "depth"
        for d in range(1, max_depth + 1):
            counts = [it.count(d) for it in self.iteration_depths]
            name = f"{label} {d - 1}" if label == "layer" else f"depth {d}"
            fig.add_bar(x=iters, y=counts, name=f"accepted, {name}", marker_color=depth_colour(d))
        bonus = [it.count(0) for it in self.iteration_depths]
        fig.add_bar(x=iters, y=bonus, name="bonus", marker_color=BONUS_COLOUR)
        fig.update_layout(barmode="stack", title=self._stats_text(html_markup=False),
                          xaxis_title="iteration", yaxis_title="tokens gained (all requests)",
                          template="plotly_white")
        return fig

    # ----- internals --------------------------------------------------------------------

    def static_html(self) -> str:
        """The stats line, any message and the text decoded so far (escaped, coloured by depth)."""
        return f'<div class="spectool-live-static">{self.stats_label.value}{self.message.value}{self.text.value}</div>'

    def _check_input(self) -> str | None:
        if not self.prompts:
            return "no prompts to decode"
        if self.max_new_tokens < 1:
            return f"max_new_tokens must be >= 1, got {self.max_new_tokens}"
        if not callable(getattr(self.engine, "stream", None)):
            return f"{type(self.engine).__name__} has no stream(); pass a spectool.Engine"
        return None

    def _reset(self) -> None:
        self._requests = [_RequestText(p if isinstance(p, str) else self._token_text(list(p)))
                          for p in self.prompts]
        self.accept_lengths = []
        self.iteration_depths = []
        self.stats = {}
        self.error = None
        self._render()

    def _set_running(self, running: bool) -> None:
        with self.hold_sync():
            self.start_button.disabled = running
            self.stop_button.disabled = not running

    def _show_message(self, text: str) -> None:
        self.message.value = f"<span style='color:#c0392b'>{html.escape(text)}</span>"

    def _token_text(self, ids: list[int]) -> str:
        if self._decode is None:
            return " ".join(f"<{i}>" for i in ids)
        return self._decode(ids)

    def _piece(self, context: list[int], token: int) -> str:
        """Text that ``token`` adds after ``context`` (decoding it alone loses BPE spacing)."""
        if self._decode is None:
            return f"<{token}>"
        before = self._decode(context)
        after = self._decode(context + [token])
        return after[len(before):] if after.startswith(before) else self._decode([token])

    def _append(self, req: _RequestText, token: int, depth: int) -> None:
        req.pieces.append(_Piece(self._piece(req.tokens[-_DECODE_CONTEXT:], token), depth))
        req.tokens.append(token)

    def _consume(self, event, elapsed: float) -> None:
        accepted = dict(event.accept_lengths)
        self.accept_lengths.append(accepted)
        # The prefill token (sampled from the prompt alone) comes first and is plain.
        for rid, tok in event.prefill_tokens.items():
            self._append(self._requests[rid], tok, depth=0)
        depths = []
        for rid, new in event.new_tokens.items():
            n_drafts = accepted.get(rid, 0)
            for j, tok in enumerate(new):
                # Tokens beyond the accepted drafts are the bonus (normally exactly one).
                depths.append(j + 1 if j < n_drafts else 0)
                self._append(self._requests[rid], tok, depth=depths[-1])
        self.iteration_depths.append(depths)
        for rid in event.finished:
            self._requests[rid].finished = True
        self.stats = dict(event.stats)
        self.stats.setdefault("elapsed_s", elapsed)
        if time.perf_counter() - self._last_render >= _RENDER_INTERVAL_S:
            self._render()

    def _stats_text(self, html_markup: bool = True) -> str:
        s = self.stats
        if not s:
            return "not started" if not self.running else "decoding…"
        parts = [f"{s.get('tokens_per_s', 0.0):.1f} tokens/s",
                 f"accept length {s.get('mean_accept_length', 0.0):.2f}",
                 f"{s.get('iterations', len(self.accept_lengths))} iterations",
                 f"{s.get('elapsed_s', 0.0):.1f} s"]
        text = " · ".join(parts)
        return f"<b>{html.escape(text)}</b>" if html_markup else text

    def _legend(self) -> widgets.HTML:
        label = "layer" if self.method == "multi_layer_eagle" else "depth"
        depth = min(draft_depth(self.engine) or 5, _LEGEND_DEPTHS)
        chips = [f"<span style='background:{depth_colour(d)};color:white;padding:0 4px;margin-right:4px'>"
                 f"{label} {d - 1 if label == 'layer' else d}</span>" for d in range(1, depth + 1)]
        return widgets.HTML("accepted drafts: " + "".join(chips) + " bonus tokens plain; "
                            "<span style='color:#888'>prompt in grey</span>")

    def _render(self) -> None:
        self._last_render = time.perf_counter()
        blocks = []
        for rid, req in enumerate(self._requests):
            spans = []
            for p in req.pieces:
                text = html.escape(p.text)
                if p.depth:
                    colour = depth_colour(p.depth)
                    spans.append(f"<span title='accepted draft, depth {p.depth}' style='background:"
                                 f"{colour}33;border-bottom:2px solid {colour}'>{text}</span>")
                else:
                    spans.append(text)
            done = " ✓" if req.finished else ""
            blocks.append(f"<div style='margin:4px 0'><b>request {rid}{done}</b>"
                          f"<pre style='white-space:pre-wrap;margin:2px 0;font-size:12px'>"
                          f"<span style='color:#888'>{html.escape(req.prompt[-400:])}</span>"
                          f"{''.join(spans)}</pre></div>")
        with self.hold_sync():
            self.text.value = "".join(blocks)
            self.stats_label.value = self._stats_text()
