"""TuningPanel: try draft settings on your prompts and see accept length against speed.

Each Run builds a fresh ``Engine`` for the slider settings, decodes the chosen prompts
and adds one row to the results table and one point to the accept-length vs tokens/s
plot. Sweep decodes every pair of values of two chosen parameters and fills a heatmap
of a chosen metric. Settings the draft config refuses (e.g. min breadth > max breadth)
show their message in the panel and, in a sweep, leave their cell empty.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path

import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

# parameter -> (label, default, min, max)
PARAMS: dict[str, tuple[str, int, int, int]] = {
    "min_bfs_breadth": ("min BFS breadth", 1, 1, 16),
    "max_bfs_breadth": ("max BFS breadth", 10, 1, 16),
    "max_trie_depth": ("trie depth", 18, 1, 32),
    "num_draft_tokens": ("draft tokens", 12, 2, 64),
    "num_steps": ("steps", 4, 1, 8),
    "topk": ("top-k", 4, 1, 8),
}
# Which parameters each draft method takes.
METHOD_PARAMS: dict[str, tuple[str, ...]] = {
    "ngram": ("min_bfs_breadth", "max_bfs_breadth", "max_trie_depth", "num_draft_tokens"),
    "eagle": ("num_steps", "topk", "num_draft_tokens"),
    "multi_layer_eagle": ("num_steps",),
}
METRICS = {"mean_accept_length": "accept length", "tokens_per_s": "tokens/s"}


def _stat(stats, name: str) -> float:
    """A figure from result.stats, which may be an object or a dict."""
    value = stats.get(name) if isinstance(stats, dict) else getattr(stats, name, None)
    return float("nan") if value is None else float(value)


def _default_sweep_values(name: str) -> str:
    _, default, lo, hi = PARAMS[name]
    values = sorted({lo, max(lo, default // 2), default, min(hi, default * 2)})
    return ", ".join(map(str, values))


class TuningPanel(widgets.VBox):
    """Sliders over a draft method's settings; Run and Sweep decode and tabulate.

    Args:
        target: a loaded target (``spectool.load(...)``).
        prompts: prompt strings to choose from (all chosen at first).
        draft_kind: ``"ngram"``, ``"eagle"`` or ``"multi_layer_eagle"``.
        draft_path: checkpoint directory for the EAGLE kinds.
        max_new_tokens: tokens generated per prompt in each run.
        engine_kwargs: extra ``Engine`` arguments (e.g. ``max_seq_len``, ``cuda_graphs``).
    """

    def __init__(self, target, prompts: Sequence[str], draft_kind: str = "ngram",
                 draft_path: str | Path | None = None, max_new_tokens: int = 64,
                 engine_kwargs: dict | None = None) -> None:
        self.target = target
        self.prompts = list(prompts or [])
        self.draft_kind = draft_kind
        self.draft_path = draft_path
        self.max_new_tokens = max_new_tokens
        self.engine_kwargs = dict(engine_kwargs or {})
        self.results: list[dict] = []
        self.heatmap: dict | None = None  # x, y, values, metric of the last sweep

        self.message = widgets.HTML()
        relevant = METHOD_PARAMS.get(draft_kind, ())
        self.sliders = {name: widgets.IntSlider(value=d, min=lo, max=hi, description=label,
                                                disabled=name not in relevant, continuous_update=False,
                                                style={"description_width": "110px"})
                        for name, (label, d, lo, hi) in PARAMS.items()}
        layers = _checkpoint_layers(draft_path) if draft_kind == "multi_layer_eagle" else None
        if layers:  # multi-layer EAGLE drafts at most one step per layer in the checkpoint
            steps = self.sliders["num_steps"]
            steps.value, steps.max = min(steps.value, layers), layers
        self.prompt_picker = widgets.SelectMultiple(
            options=[(f"{i}: {p[:60]!r}", i) for i, p in enumerate(self.prompts)],
            value=tuple(range(len(self.prompts))), description="prompts",
            rows=min(6, max(1, len(self.prompts))))
        self.run_button = widgets.Button(description="Run", icon="play", button_style="success")
        self.run_button.on_click(lambda _: self.run())

        options = [(PARAMS[n][0], n) for n in relevant]
        self.sweep_x = widgets.Dropdown(options=options, description="sweep x")
        self.sweep_y = widgets.Dropdown(options=options, description="sweep y",
                                        value=options[1][1] if len(options) > 1 else None)
        self.sweep_x_values = widgets.Text(description="x values")
        self.sweep_y_values = widgets.Text(description="y values")
        self.sweep_metric = widgets.Dropdown(options=[(v, k) for k, v in METRICS.items()],
                                             description="metric")
        for dropdown, text in ((self.sweep_x, self.sweep_x_values), (self.sweep_y, self.sweep_y_values)):
            dropdown.observe(lambda change, text=text: self._fill_values(change["new"], text), "value")
            self._fill_values(dropdown.value, text)
        self.sweep_button = widgets.Button(description="Sweep", icon="th")
        self.sweep_button.on_click(lambda _: self.sweep())
        self.progress = widgets.IntProgress(value=0, min=0, max=1, description="sweep")

        self.table = widgets.HTML()
        self.scatter = go.FigureWidget(layout=dict(
            title="accept length vs tokens/s", xaxis_title="tokens/s", yaxis_title="mean accept length",
            template="plotly_white", height=360, margin=dict(t=40, b=40, l=50, r=10)))
        self.scatter.add_scatter(x=[], y=[], mode="markers+text", text=[], textposition="top center",
                                 hovertext=[], hoverinfo="text", name="runs")
        self.heatmap_figure = go.FigureWidget(layout=dict(
            title="sweep", template="plotly_white", height=360, margin=dict(t=40, b=40, l=50, r=10)))
        self.heatmap_figure.add_heatmap(z=[[]], colorscale="Viridis")

        problem = self._check_setup()
        if problem:
            self._show_message(problem)
            self.run_button.disabled = self.sweep_button.disabled = True
        sliders = [self.sliders[n] for n in PARAMS]
        super().__init__([
            self.message,
            widgets.HBox([widgets.VBox(sliders), widgets.VBox([self.prompt_picker, self.run_button])]),
            widgets.HBox([widgets.VBox([self.sweep_x, self.sweep_x_values]),
                          widgets.VBox([self.sweep_y, self.sweep_y_values]),
                          widgets.VBox([self.sweep_metric,
                                        widgets.HBox([self.sweep_button, self.progress])])]),
            widgets.HBox([self.scatter, self.heatmap_figure]),
            self.table,
        ])
        self.add_class("spectool-tuning")

    # ----- public API -------------------------------------------------------------------

    def config(self, **overrides: int):
        """The draft config for the current slider values (``overrides`` win); ValueError if invalid."""
        import spectool as st

        values = {n: self.sliders[n].value for n in METHOD_PARAMS[self.draft_kind]}
        values.update(overrides)
        if self.draft_kind == "ngram":
            return st.NgramConfig(**values)
        if self.draft_kind == "eagle":
            return st.EagleConfig(self.draft_path, **values)
        return st.MultiLayerEagleConfig(self.draft_path, **values)

    def run(self, **overrides: int) -> dict | None:
        """Decode the chosen prompts with the current settings; add and return a results row."""
        try:
            row = self._measure(self.config(**overrides))
        except ValueError as exc:
            self._show_message(str(exc))
            return None
        self.results.append(row)
        self._show_message("")
        self._refresh_results()
        return row

    def sweep(self, x: str | None = None, x_values: Sequence[int] | None = None, y: str | None = None,
              y_values: Sequence[int] | None = None, metric: str | None = None) -> dict | None:
        """Decode every (x, y) pair and fill the heatmap; arguments default to the panel's controls.

        Returns ``{"x", "y", "x_values", "y_values", "metric", "values"}`` with ``values[j][i]``
        the metric at (x_values[i], y_values[j]) (NaN where the config is invalid).
        """
        x, y = x or self.sweep_x.value, y or self.sweep_y.value
        metric = metric or self.sweep_metric.value
        try:
            x_values = list(x_values) if x_values is not None else _parse_values(self.sweep_x_values.value)
            y_values = list(y_values) if y_values is not None else _parse_values(self.sweep_y_values.value)
            relevant = METHOD_PARAMS[self.draft_kind]
            for name in (x, y):
                if name not in relevant:
                    raise ValueError(
                        f"{name!r} is not a setting of {self.draft_kind} (choose from {relevant})")
            if x == y:
                raise ValueError("choose two different parameters to sweep")
            if metric not in METRICS:
                raise ValueError(f"metric must be one of {list(METRICS)}, got {metric!r}")
        except ValueError as exc:
            self._show_message(str(exc))
            return None

        values = [[float("nan")] * len(x_values) for _ in y_values]
        skipped = []
        self.progress.max, self.progress.value = len(x_values) * len(y_values), 0
        for j, yv in enumerate(y_values):
            for i, xv in enumerate(x_values):
                try:
                    row = self._measure(self.config(**{x: xv, y: yv}))
                    self.results.append(row)
                    values[j][i] = row[metric]
                except ValueError as exc:
                    skipped.append(f"{x}={xv}, {y}={yv}: {exc}")
                self.progress.value += 1
        self.heatmap = {"x": x, "y": y, "x_values": x_values, "y_values": y_values,
                        "metric": metric, "values": values}
        self._show_message(f"{len(skipped)} settings skipped: " + "; ".join(skipped) if skipped else "")
        self._refresh_results()
        return self.heatmap

    def to_frame(self) -> pd.DataFrame:
        """All runs so far, one row per configuration tried."""
        return pd.DataFrame(self.results)

    def to_figure(self) -> go.Figure:
        """The scatter of every run and, after a sweep, its heatmap (a plain plotly Figure)."""
        cols = 2 if self.heatmap else 1
        titles = ["accept length vs tokens/s"] + ([self._heatmap_title()] if self.heatmap else [])
        fig = make_subplots(rows=1, cols=cols, subplot_titles=titles)
        fig.add_trace(go.Scatter(**self._scatter_data()), row=1, col=1)
        fig.update_xaxes(title_text="tokens/s", row=1, col=1)
        fig.update_yaxes(title_text="mean accept length", row=1, col=1)
        if self.heatmap:
            fig.add_trace(go.Heatmap(**self._heatmap_data()), row=1, col=2)
            fig.update_xaxes(title_text=PARAMS[self.heatmap["x"]][0], row=1, col=2)
            fig.update_yaxes(title_text=PARAMS[self.heatmap["y"]][0], row=1, col=2)
        fig.update_layout(template="plotly_white", showlegend=False)
        return fig

    # ----- internals --------------------------------------------------------------------

    def _check_setup(self) -> str | None:
        if self.draft_kind not in METHOD_PARAMS:
            return f"draft_kind must be one of {list(METHOD_PARAMS)}, got {self.draft_kind!r}"
        if not self.prompts:
            return "no prompts to decode"
        if self.draft_kind != "ngram" and (self.draft_path is None or not Path(self.draft_path).is_dir()):
            return f"{self.draft_kind} needs draft_path, a checkpoint directory (got {self.draft_path!s})"
        if self.max_new_tokens < 1:
            return f"max_new_tokens must be >= 1, got {self.max_new_tokens}"
        return None

    def _fill_values(self, name: str | None, text: widgets.Text) -> None:
        text.value = _default_sweep_values(name) if name else ""

    def _show_message(self, text: str) -> None:
        self.message.value = f"<span style='color:#c0392b'>{html.escape(text)}</span>" if text else ""

    def _measure(self, config) -> dict:
        """Decode the chosen prompts with ``config``; one results row (settings + figures)."""
        import spectool as st

        chosen = [self.prompts[i] for i in self.prompt_picker.value]
        if not chosen:
            raise ValueError("choose at least one prompt")
        kwargs = {"max_batch_size": len(chosen), **self.engine_kwargs}
        engine = st.Engine(self.target, draft=config, **kwargs)
        result = engine.generate(chosen, max_new_tokens=self.max_new_tokens, temperature=0.0, record=False)
        row = {n: getattr(config, n) for n in METHOD_PARAMS[self.draft_kind]}
        row["prompts"] = len(chosen)
        row["mean_accept_length"] = _stat(result.stats, "mean_accept_length")
        row["tokens_per_s"] = _stat(result.stats, "tokens_per_s")
        return row

    def _scatter_data(self) -> dict:
        names = METHOD_PARAMS.get(self.draft_kind, ())
        hover = ["<br>".join(f"{n}={r[n]}" for n in names) for r in self.results]
        return dict(x=[r["tokens_per_s"] for r in self.results],
                    y=[r["mean_accept_length"] for r in self.results], mode="markers+text",
                    text=[str(i) for i in range(len(self.results))], textposition="top center",
                    hovertext=hover, hoverinfo="text")

    def _heatmap_title(self) -> str:
        return f"{METRICS[self.heatmap['metric']]} over {self.heatmap['x']} × {self.heatmap['y']}"

    def _heatmap_data(self) -> dict:
        h = self.heatmap
        return dict(z=h["values"], x=[str(v) for v in h["x_values"]], y=[str(v) for v in h["y_values"]],
                    colorscale="Viridis", colorbar=dict(title=METRICS[h["metric"]]))

    def _refresh_results(self) -> None:
        with self.scatter.batch_update():
            self.scatter.data[0].update(**self._scatter_data())
        if self.heatmap:
            with self.heatmap_figure.batch_update():
                self.heatmap_figure.data[0].update(**self._heatmap_data())
                self.heatmap_figure.layout.title = self._heatmap_title()
                self.heatmap_figure.layout.xaxis.title = PARAMS[self.heatmap["x"]][0]
                self.heatmap_figure.layout.yaxis.title = PARAMS[self.heatmap["y"]][0]
        frame = self.to_frame()
        self.table.value = frame.to_html(index=True, float_format=lambda v: f"{v:.2f}") if len(frame) else ""


def _checkpoint_layers(path: str | Path | None) -> int | None:
    """Draft layers in a checkpoint directory (its config.json), or None when it cannot be read."""
    try:
        return int(json.loads((Path(path) / "config.json").read_text())["num_layers"])
    except (TypeError, OSError, ValueError, KeyError):
        return None


def _parse_values(text: str) -> list[int]:
    """'1, 2, 4' -> [1, 2, 4]; ValueError naming the bad item."""
    values = []
    for item in text.replace(";", ",").split(","):
        item = item.strip()
        if not item:
            continue
        try:
            values.append(int(item))
        except ValueError:
            raise ValueError(f"sweep values must be integers separated by commas, got {item!r}") from None
    if not values:
        raise ValueError("give at least one sweep value")
    return values
