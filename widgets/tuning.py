"""TuningPanel: try draft settings and see accept length against speed, predicted or measured.

Two ways to get a figure for a configuration:

- **What-if** (``trace=`` a recorded greedy trace): every slider move predicts, exactly and
  without running the engine, the accept length that configuration would have had on the
  trace's requests (``spectool.tune``), and with a cost profile its tokens/s; Sweep fills
  the heatmap with predictions.
- **Run** (``target=`` and prompts, or the trace's prompts): builds a fresh ``Engine`` for the
  slider settings and decodes; the measured point goes beside the prediction. Repeated
  runs of one configuration are grouped, with their spread.

Settings the draft config refuses (e.g. min breadth > max breadth) show their message in
the panel and, in a sweep, leave their cell empty.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from pathlib import Path

import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .saved import StaticOutput

# parameter -> (label, default, min, max)
PARAMS: dict[str, tuple[str, int, int, int]] = {
    "min_bfs_breadth": ("min BFS breadth", 1, 1, 16),
    "max_bfs_breadth": ("max BFS breadth", 10, 1, 16),
    "max_trie_depth": ("trie depth", 18, 1, 32),
    "num_draft_tokens": ("draft tokens (N)", 12, 2, 64),
    "num_steps": ("draft steps", 4, 1, 8),
    "topk": ("top-k", 4, 1, 8),
}
# Which parameters each draft method takes.
METHOD_PARAMS: dict[str, tuple[str, ...]] = {
    "ngram": ("min_bfs_breadth", "max_bfs_breadth", "max_trie_depth", "num_draft_tokens"),
    "eagle": ("num_steps", "topk", "num_draft_tokens"),
    "multi_layer_eagle": ("num_steps",),
}
METRICS = {"mean_accept_length": "accept length", "tokens_per_s": "tokens/s"}
# Columns of the results table: (label, format).
COLUMNS = {"runs": ("runs", "{:d}"), "mean_accept_length": ("accept length", "{:.2f}"),
           "accept_length_spread": ("± accept", "{:.2f}"), "tokens_per_s": ("tokens/s", "{:.1f}"),
           "tokens_per_s_min": ("tokens/s min", "{:.1f}"), "tokens_per_s_max": ("tokens/s max", "{:.1f}"),
           "predicted_accept_length": ("predicted accept", "{:.2f}"),
           "predicted_tokens_per_s": ("predicted tokens/s", "{:.1f}")}


def _stat(stats, name: str) -> float:
    """A figure from result.stats, which may be an object or a dict."""
    value = stats.get(name) if isinstance(stats, dict) else getattr(stats, name, None)
    return float("nan") if value is None else float(value)


def _default_sweep_values(name: str) -> str:
    _, default, lo, hi = PARAMS[name]
    values = sorted({lo, max(lo, default // 2), default, min(hi, default * 2)})
    return ", ".join(map(str, values))


def _nan(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


class TuningPanel(StaticOutput, widgets.VBox):
    """Sliders over a draft method's settings; predictions from a trace, Run and Sweep to measure.

    Args:
        target: a loaded target (``spectool.load(...)``); needed for Run, and for what-if of the
            EAGLE methods (float32 on the CPU is exact).
        prompts: prompt strings (or token-id lists) for Run (default: the trace's prompts).
        draft_kind: ``"ngram"``, ``"eagle"`` or ``"multi_layer_eagle"`` (default: the trace's method).
        draft_path: checkpoint directory for the EAGLE kinds (default: the trace's).
        max_new_tokens: tokens generated per prompt in each run (default: the trace's longest
            output, else 64).
        engine_kwargs: extra ``Engine`` arguments (e.g. ``max_seq_len``, ``cuda_graphs``).
        trace: a greedy Trace (or path): turns on what-if predictions.
        profile: a cost profile (path, shipped name or CostProfile) for predicted tokens/s.
        batch_size: the batch the predictions are for (default: the recorded run's).
    """

    def __init__(self, target=None, prompts: Sequence | None = None, draft_kind: str | None = None,
                 draft_path: str | Path | None = None, max_new_tokens: int | None = None,
                 engine_kwargs: dict | None = None, trace=None, profile=None, batch_size: int | None = None) -> None:
        self.target = target
        self.trace, problem = _open_trace(trace)
        info = (self.trace.run_info.get("draft") or {}) if self.trace is not None else {}
        self.draft_kind = draft_kind or info.get("method") or "ngram"
        self.draft_path = draft_path or (info.get("path") if info.get("method") == self.draft_kind else None)
        self.prompts = list(prompts) if prompts else _trace_prompts(self.trace)
        self.max_new_tokens = max_new_tokens or _longest_output(self.trace) or 64
        self.engine_kwargs = dict(engine_kwargs or {})
        self.profile, self.batch_size = profile, batch_size
        self.results: list[dict] = []  # one row per run (measured)
        self.predicted: dict[tuple, dict] = {}  # config key -> predicted row
        self.profile_check = None  # the profile against the trace's own iterations (spectool.tune.profile_check)
        self.heatmap: dict | None = None  # x, y, values, metric, source of the last sweep
        self.busy = False

        self.message = widgets.HTML()
        relevant = METHOD_PARAMS.get(self.draft_kind, ())
        self.sliders = {name: widgets.IntSlider(value=d, min=lo, max=hi, description=label,
                                                disabled=name not in relevant, continuous_update=False,
                                                style={"description_width": "120px"})
                        for name, (label, d, lo, hi) in PARAMS.items()}
        self._start_from(info)
        layers = _checkpoint_layers(self.draft_path) if self.draft_kind == "multi_layer_eagle" else None
        if layers:  # multi-layer EAGLE drafts at most one step per layer in the checkpoint
            steps = self.sliders["num_steps"]
            steps.value, steps.max = min(steps.value, layers), layers
        self.prompt_picker = widgets.SelectMultiple(
            options=[(f"{i}: {_prompt_label(p)}", i) for i, p in enumerate(self.prompts)],
            value=tuple(range(len(self.prompts))), description="prompts",
            rows=min(6, max(1, len(self.prompts))))
        self.run_button = widgets.Button(description="Run", icon="play", button_style="success",
                                         tooltip="decode the chosen prompts with these settings (measured)")
        self.run_button.on_click(lambda _: self.run())
        self.prediction = widgets.HTML()
        self.prediction.add_class("spectool-tuning-prediction")

        options = [(PARAMS[n][0], n) for n in relevant]
        self.sweep_x = widgets.Dropdown(options=options, description="sweep x")
        self.sweep_y = widgets.Dropdown(options=options, description="sweep y",
                                        value=options[1][1] if len(options) > 1 else None)
        self.sweep_x_values = widgets.Text(description="x values")
        self.sweep_y_values = widgets.Text(description="y values")
        self.sweep_metric = widgets.Dropdown(options=[(v, k) for k, v in METRICS.items()], description="metric")
        self.sweep_source = widgets.ToggleButtons(
            options=[("predicted", "predicted"), ("measured", "measured")],
            value="predicted" if self.trace is not None else "measured",
            tooltips=["from the trace, no decoding", "decode every cell"])
        if self.trace is None:
            self.sweep_source.disabled = True
        for dropdown, text in ((self.sweep_x, self.sweep_x_values), (self.sweep_y, self.sweep_y_values)):
            dropdown.observe(lambda change, text=text: self._fill_values(change["new"], text), "value")
            self._fill_values(dropdown.value, text)
        self.sweep_button = widgets.Button(description="Sweep", icon="th")
        self.sweep_button.on_click(lambda _: self.sweep())
        self.progress = widgets.IntProgress(value=0, min=0, max=1, description="sweep")
        self.run_progress = widgets.IntProgress(value=0, min=0, max=1, description="tokens")
        self.status = widgets.Label()

        self.sort_by = widgets.Dropdown(description="sort by", options=[], style={"description_width": "60px"})
        self.sort_descending = widgets.ToggleButton(value=True, description="descending", icon="sort-amount-desc")
        self.sort_by.observe(lambda _: self._refresh_table(), "value")
        self.sort_descending.observe(lambda _: self._refresh_table(), "value")
        self.table = widgets.HTML()
        self.table.add_class("spectool-tuning-table")

        self.scatter = go.FigureWidget(layout=dict(
            title=dict(text="accept length against tokens/s", x=0.02, y=0.97),
            xaxis_title="tokens/s", yaxis_title="mean accept length (tokens)", template="plotly_white",
            height=380, autosize=True, margin=dict(t=60, b=50, l=60, r=20),
            legend=dict(orientation="h", y=1.0, yanchor="bottom", x=1, xanchor="right")))
        self.scatter.add_scatter(x=[], y=[], mode="markers+text", text=[], textposition="top center",
                                 hovertext=[], hoverinfo="text", name="measured", error_x=dict(array=[]))
        self.scatter.add_scatter(x=[], y=[], mode="markers", hovertext=[], hoverinfo="text", name="predicted",
                                 marker=dict(symbol="diamond-open", size=10))
        self.scatter.add_scatter(x=[], y=[], mode="markers", hovertext=[], hoverinfo="text", name="current",
                                 marker=dict(symbol="star", size=14, color="#d62728"))
        self.heatmap_figure = go.FigureWidget(layout=dict(
            title=dict(text="sweep", x=0.02, y=0.97), template="plotly_white", height=380, autosize=True,
            margin=dict(t=60, b=50, l=70, r=20)))
        self.heatmap_figure.add_heatmap(z=[[]], colorscale="Viridis", texttemplate="%{z:.2f}",
                                        hoverongaps=False, colorbar=dict(title=dict(text=""), thickness=14))

        problem = problem or self._check_setup()
        if problem:
            self._show_message(problem)
            self.run_button.disabled = self.sweep_button.disabled = True
        if self.trace is None or problem:
            self.prediction.value = ""
        else:
            for name in relevant:
                self.sliders[name].observe(lambda _: self.predict(), "value")
        if self.target is None or not self.prompts:
            self.run_button.disabled = True
            self.run_button.tooltip = "Run needs a target and prompts"
        sliders = [self.sliders[n] for n in PARAMS]
        cell = widgets.Layout(width="100%", min_width="0")
        plots = widgets.GridBox([widgets.Box([self.scatter], layout=cell), widgets.Box([self.heatmap_figure],
                                                                                   layout=cell)],
                                layout=widgets.Layout(grid_template_columns="repeat(auto-fit, minmax(380px, 1fr))",
                                                      width="100%"))
        super().__init__([
            self.message,
            widgets.HBox([widgets.VBox(sliders), widgets.VBox([self.prompt_picker,
                                                               widgets.HBox([self.run_button, self.run_progress]),
                                                               self.prediction])],
                         layout=widgets.Layout(flex_flow="row wrap")),
            widgets.HBox([widgets.VBox([self.sweep_x, self.sweep_x_values]),
                          widgets.VBox([self.sweep_y, self.sweep_y_values]),
                          widgets.VBox([self.sweep_metric, self.sweep_source]),
                          widgets.VBox([self.sweep_button, self.progress, self.status])],
                         layout=widgets.Layout(flex_flow="row wrap")),
            plots,
            widgets.HBox([self.sort_by, self.sort_descending]),
            self.table,
        ], layout=widgets.Layout(width="100%"))
        self.add_class("spectool-tuning")
        if self.trace is not None and not problem:
            self.predict()

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

    def predict(self, **overrides: int) -> dict | None:
        """The what-if prediction for the current settings (cached per configuration), also shown."""
        try:
            row = self._predicted_rows([self.config(**overrides)])[0]
        except ValueError as exc:  # TuneError is a ValueError
            self.prediction.value = f"<i>no prediction: {html.escape(str(exc))}</i>"
            return None
        self._show_prediction(row)
        self._refresh_plots(current=row)
        return row

    def run(self, **overrides: int) -> dict | None:
        """Decode the chosen prompts with the current settings; add and return a results row."""
        if self.busy:
            return None
        try:
            config = self.config(**overrides)
            with self._busy("running"):
                row = self._measure(config)
        except ValueError as exc:
            self._show_message(str(exc))
            return None
        if self.trace is not None:
            try:
                pred = self._predicted_rows([config])[0]
                row["predicted_accept_length"] = pred["mean_accept_length"]
                row["predicted_tokens_per_s"] = pred.get("tokens_per_s", float("nan"))
            except ValueError:
                pass
        self.results.append(row)
        self._show_message("")
        self._refresh_results()
        return row

    def sweep(self, x: str | None = None, x_values: Sequence[int] | None = None, y: str | None = None,
              y_values: Sequence[int] | None = None, metric: str | None = None,
              source: str | None = None) -> dict | None:
        """Fill the heatmap over every (x, y) pair; arguments default to the panel's controls.

        ``source`` "predicted" (from the trace, nothing decoded) or "measured" (decode each cell).
        Returns ``{"x", "y", "x_values", "y_values", "metric", "source", "values"}`` with
        ``values[j][i]`` the metric at (x_values[i], y_values[j]) (NaN where the config is invalid).
        """
        if self.busy:
            return None
        x, y = x or self.sweep_x.value, y or self.sweep_y.value
        metric = metric or self.sweep_metric.value
        source = source or self.sweep_source.value
        try:
            x_values = list(x_values) if x_values is not None else _parse_values(self.sweep_x_values.value)
            y_values = list(y_values) if y_values is not None else _parse_values(self.sweep_y_values.value)
            relevant = METHOD_PARAMS[self.draft_kind]
            for name in (x, y):
                if name not in relevant:
                    raise ValueError(f"{name!r} is not a setting of {self.draft_kind} (choose from {relevant})")
            if x == y:
                raise ValueError("choose two different parameters to sweep")
            if metric not in METRICS:
                raise ValueError(f"metric must be one of {list(METRICS)}, got {metric!r}")
            if source == "predicted" and self.trace is None:
                raise ValueError("a predicted sweep needs a trace (TuningPanel(trace=...))")
            if source == "predicted" and metric == "tokens_per_s" and self.profile is None:
                raise ValueError("predicted tokens/s needs a cost profile (TuningPanel(profile=...))")
        except ValueError as exc:
            self._show_message(str(exc))
            return None

        values = [[float("nan")] * len(x_values) for _ in y_values]
        skipped, cells = [], []
        for j, yv in enumerate(y_values):
            for i, xv in enumerate(x_values):
                try:
                    cells.append((i, j, f"{x}={xv}, {y}={yv}", self.config(**{x: xv, y: yv})))
                except ValueError as exc:
                    skipped.append(f"{x}={xv}, {y}={yv}: {exc}")
        self.progress.max, self.progress.value = max(1, len(x_values) * len(y_values)), len(skipped)
        with self._busy(f"sweeping {len(cells)} settings ({source})"):
            if source == "predicted":
                try:
                    rows = self._predicted_rows([c for *_, c in cells])
                except ValueError as exc:
                    self._show_message(str(exc))
                    return None
                for (i, j, _, _), row in zip(cells, rows):
                    values[j][i] = row.get(metric, float("nan"))
                self.progress.value = self.progress.max
            else:
                for i, j, where, config in cells:
                    try:
                        row = self._measure(config)
                        self.results.append(row)
                        values[j][i] = row[metric]
                    except ValueError as exc:
                        skipped.append(f"{where}: {exc}")
                    self.progress.value += 1
        self.heatmap = {"x": x, "y": y, "x_values": x_values, "y_values": y_values,
                        "metric": metric, "source": source, "values": values}
        self._show_message(f"{len(skipped)} settings skipped: " + "; ".join(skipped) if skipped else "")
        self._refresh_results()
        return self.heatmap

    def to_frame(self) -> pd.DataFrame:
        """Measured runs grouped by configuration: runs, mean and spread of each figure, predictions."""
        if not self.results:
            return pd.DataFrame()
        names = list(METHOD_PARAMS[self.draft_kind])
        frame = pd.DataFrame(self.results)
        agg = {"runs": ("tokens_per_s", "size"), "mean_accept_length": ("mean_accept_length", "mean"),
               "accept_length_spread": ("mean_accept_length", "std"), "tokens_per_s": ("tokens_per_s", "mean"),
               "tokens_per_s_min": ("tokens_per_s", "min"), "tokens_per_s_max": ("tokens_per_s", "max")}
        for col in ("predicted_accept_length", "predicted_tokens_per_s"):
            if col in frame:
                agg[col] = (col, "first")
        grouped = frame.groupby(names, sort=False).agg(**agg).reset_index()
        grouped["accept_length_spread"] = grouped["accept_length_spread"].fillna(0.0)
        return grouped

    def static_html(self) -> str:
        """Any message, the current prediction and the results table, as they stand."""
        return (f'<div class="spectool-tuning-static">{self.message.value}{self.prediction.value}'
                f"{self.table.value}</div>")

    def to_figure(self) -> go.Figure:
        """The scatter of every run and prediction and, after a sweep, its heatmap (a plain Figure)."""
        cols = 2 if self.heatmap else 1
        titles = ["accept length against tokens/s"] + ([self._heatmap_title()] if self.heatmap else [])
        fig = make_subplots(rows=1, cols=cols, subplot_titles=titles)
        for data, name in zip(self._scatter_data(), ("measured", "predicted", "current")):
            if len(data["x"]) or name == "measured":
                fig.add_trace(go.Scatter(**data, name=name), row=1, col=1)
        fig.update_xaxes(title_text="tokens/s", row=1, col=1)
        fig.update_yaxes(title_text="mean accept length (tokens)", row=1, col=1)
        if self.heatmap:
            fig.add_trace(go.Heatmap(**self._heatmap_data()), row=1, col=2)
            fig.update_xaxes(title_text=PARAMS[self.heatmap["x"]][0], type="category", row=1, col=2)
            fig.update_yaxes(title_text=PARAMS[self.heatmap["y"]][0], type="category", row=1, col=2)
        fig.update_layout(template="plotly_white")
        return fig

    # ----- internals --------------------------------------------------------------------

    def _start_from(self, info: dict) -> None:
        """Sliders start at the recorded run's settings (what-if: the point the trace measured)."""
        if info.get("method") != self.draft_kind:
            return
        for name in METHOD_PARAMS.get(self.draft_kind, ()):
            value = info.get(name)
            if isinstance(value, int):
                slider = self.sliders[name]
                slider.max = max(slider.max, value)
                slider.value = value

    def _check_setup(self) -> str | None:
        if self.draft_kind not in METHOD_PARAMS:
            return f"draft_kind must be one of {list(METHOD_PARAMS)}, got {self.draft_kind!r}"
        if not self.prompts and self.trace is None:
            return "no prompts to decode"
        if self.draft_kind != "ngram" and (self.draft_path is None or not Path(self.draft_path).is_dir()):
            return f"{self.draft_kind} needs draft_path, a checkpoint directory (got {self.draft_path!s})"
        if self.max_new_tokens < 1:
            return f"max_new_tokens must be >= 1, got {self.max_new_tokens}"
        return None

    def _busy(self, what: str):
        panel = self

        class _Busy:
            def __enter__(self):
                panel.busy = True
                panel.run_button.disabled = panel.sweep_button.disabled = True
                panel.status.value = what + "…"

            def __exit__(self, *exc):
                panel.busy = False
                panel.sweep_button.disabled = False
                panel.run_button.disabled = panel.target is None or not panel.prompts
                panel.status.value = ""

        return _Busy()

    def _fill_values(self, name: str | None, text: widgets.Text) -> None:
        text.value = _default_sweep_values(name) if name else ""

    def _show_message(self, text: str) -> None:
        self.message.value = f"<span style='color:#c0392b'>{html.escape(text)}</span>" if text else ""

    def _predicted_rows(self, configs: list) -> list[dict]:
        """Predicted rows of ``configs`` (cached), computed together in one what-if sweep."""
        from spectool.tune.recommend import tune

        todo = [c for c in configs if _key(c) not in self.predicted]
        if todo:
            result = tune(self.trace, grid=todo, profile=self.profile, batch_size=self.batch_size,
                          target=self.target, progress=len(todo) > 8)
            if self.profile_check is None and result.profile is not None:
                self.profile_check = result.profile_check  # the same for every configuration: made once
            for c, p in zip(todo, result.predictions):
                row = result.row(p)
                row["tokens_per_s"] = row.pop("predicted_tokens_per_s", float("nan"))
                self.predicted[_key(c)] = row
        return [self.predicted[_key(c)] for c in configs]

    def _show_prediction(self, row: dict) -> None:
        tps = row.get("tokens_per_s", float("nan"))
        speed = "" if _nan(tps) else f", <b>{tps:.1f}</b> tokens/s ({row.get('speedup', float('nan')):.2f}× plain)"
        exact = "exact" if row.get("exact") else "last iterations are lower bounds"
        check = "" if self.profile_check is None else (
            f"<br><span class='spectool-tuning-profile-check' style='color:#777'>"
            f"{html.escape(self.profile_check.describe())}</span>")
        self.prediction.value = (f"predicted from the trace: accept length <b>{row['mean_accept_length']:.2f}</b>, "
                                 f"{row['tokens_per_iteration']:.2f} tokens/iteration, {row['iterations']} "
                                 f"iterations{speed} <span style='color:#777'>({exact})</span>{check}")

    def _measure(self, config) -> dict:
        """Decode the chosen prompts with ``config``; one results row (settings + figures)."""
        import spectool as st

        chosen = [self.prompts[i] for i in self.prompt_picker.value]
        if not chosen:
            raise ValueError("choose at least one prompt")
        if self.target is None:
            raise ValueError("Run needs a target (TuningPanel(target, ...))")
        # What-if predicts the recorded batch (or batch_size): a run to confirm it decodes the same.
        batch = self.batch_size or ((self.trace.run_info.get("engine") or {}).get("max_batch_size")
                                    if self.trace is not None else None)
        kwargs = {"max_batch_size": batch or len(chosen), **self.engine_kwargs}
        engine = st.Engine(self.target, draft=config, **kwargs)
        total = self.max_new_tokens * len(chosen)
        self.run_progress.max, self.run_progress.value = max(1, total), 0
        done, stats = 0, {}
        for event in engine.stream(chosen, max_new_tokens=self.max_new_tokens, temperature=0.0, record=False):
            done += sum(len(t) for t in event.new_tokens.values()) + len(event.prefill_tokens)
            self.run_progress.value = min(total, done)
            stats = event.stats
        row = {n: getattr(config, n) for n in METHOD_PARAMS[self.draft_kind]}
        row["prompts"] = len(chosen)
        row["mean_accept_length"] = _stat(stats, "mean_accept_length")
        row["tokens_per_s"] = _stat(stats, "tokens_per_s")
        return row

    def _scatter_data(self, current: dict | None = None) -> list[dict]:
        names = METHOD_PARAMS.get(self.draft_kind, ())

        def hover(r: dict, what: str) -> str:
            settings = ", ".join(f"{PARAMS[n][0]} {r[n]}" for n in names)
            lines = [f"<b>{what}</b>: {html.escape(settings)}",
                     f"accept length {r['mean_accept_length']:.2f}"]
            if not _nan(r.get("tokens_per_s", float("nan"))):
                lines.append(f"tokens/s {r['tokens_per_s']:.1f}")
            if r.get("runs", 1) > 1:
                lines.append(f"{r['runs']} runs: tokens/s {r['tokens_per_s_min']:.1f}–{r['tokens_per_s_max']:.1f}, "
                             f"accept ± {r['accept_length_spread']:.2f}")
            if not _nan(r.get("predicted_accept_length", float("nan"))):
                lines.append(f"predicted accept length {r['predicted_accept_length']:.2f}")
            return "<br>".join(lines)

        frame = self.to_frame()
        measured = frame.to_dict("records") if len(frame) else []
        half = [(r["tokens_per_s_max"] - r["tokens_per_s_min"]) / 2 for r in measured]
        centre = [(r["tokens_per_s_max"] + r["tokens_per_s_min"]) / 2 for r in measured]
        predicted = [r for r in self.predicted.values() if not _nan(r.get("tokens_per_s", float("nan")))
                     or self.profile is None]
        pred_x = [r.get("tokens_per_s", float("nan")) for r in predicted]
        cur = [current] if current else []
        return [
            dict(x=centre, y=[r["mean_accept_length"] for r in measured], mode="markers+text",
                 text=[str(i) for i in range(len(measured))], textposition="top center",
                 hovertext=[hover(r, "measured") for r in measured], hoverinfo="text",
                 error_x=dict(type="data", array=half, visible=True)),
            dict(x=[0.0 if _nan(v) else v for v in pred_x], y=[r["mean_accept_length"] for r in predicted],
                 mode="markers", hovertext=[hover(r, "predicted") for r in predicted], hoverinfo="text"),
            dict(x=[0.0 if _nan(r.get("tokens_per_s", float("nan"))) else r["tokens_per_s"] for r in cur],
                 y=[r["mean_accept_length"] for r in cur], mode="markers",
                 hovertext=[hover(r, "current (predicted)") for r in cur], hoverinfo="text"),
        ]

    def _heatmap_title(self) -> str:
        h = self.heatmap
        return f"{h['source']} {METRICS[h['metric']]} by {PARAMS[h['x']][0]} and {PARAMS[h['y']][0]}"

    def _heatmap_data(self) -> dict:
        h = self.heatmap
        fmt = "%{z:.2f}" if h["metric"] == "mean_accept_length" else "%{z:.0f}"
        hover = (f"{PARAMS[h['x']][0]} %{{x}}<br>{PARAMS[h['y']][0]} %{{y}}<br>"
                 f"{METRICS[h['metric']]} %{{z:.2f}}<extra></extra>")
        # A setting that cannot be built is a gap (None): NaN is not JSON, and the page would get nothing.
        z = [[None if _nan(v) else v for v in row] for row in h["values"]]
        return dict(z=z, x=[str(v) for v in h["x_values"]], y=[str(v) for v in h["y_values"]],
                    colorscale="Viridis", texttemplate=fmt, hovertemplate=hover, hoverongaps=False,
                    colorbar=dict(title=dict(text=METRICS[h["metric"]]), thickness=14))

    def _refresh_plots(self, current: dict | None = None) -> None:
        data = self._scatter_data(current)
        with self.scatter.batch_update():
            for trace, new in zip(self.scatter.data, data):
                trace.update(new)
        if self.heatmap:
            with self.heatmap_figure.batch_update():
                self.heatmap_figure.data[0].update(**self._heatmap_data())
                self.heatmap_figure.layout.title.text = self._heatmap_title()
                self.heatmap_figure.layout.xaxis.title = PARAMS[self.heatmap["x"]][0]
                self.heatmap_figure.layout.yaxis.title = PARAMS[self.heatmap["y"]][0]
                self.heatmap_figure.layout.xaxis.type = self.heatmap_figure.layout.yaxis.type = "category"

    def _refresh_results(self) -> None:
        self._refresh_plots()
        frame = self.to_frame()
        options = [(COLUMNS[c][0] if c in COLUMNS else PARAMS[c][0], c) for c in frame.columns]
        if [o[1] for o in self.sort_by.options] != [o[1] for o in options]:
            keep = self.sort_by.value
            self.sort_by.options = options
            self.sort_by.value = keep if keep in frame.columns else ("tokens_per_s" if options else None)
        self._refresh_table()

    def _refresh_table(self) -> None:
        frame = self.to_frame()
        if not len(frame):
            self.table.value = ""
            return
        key = self.sort_by.value
        if key in frame.columns:
            frame = frame.sort_values(key, ascending=not self.sort_descending.value, kind="stable")
        self.table.value = _table_html(frame)


def _table_html(frame: pd.DataFrame) -> str:
    """The grouped results as an HTML table: readable headers, formatted numbers, escaped text."""
    def label(col: str) -> str:
        return COLUMNS[col][0] if col in COLUMNS else PARAMS.get(col, (col,))[0]

    def cell(col: str, v) -> str:
        if v is None or _nan(v):
            return "–"
        fmt = COLUMNS.get(col, (None, "{}"))[1]
        try:
            return html.escape(fmt.format(int(v) if fmt == "{:d}" else v))
        except (ValueError, TypeError):
            return html.escape(str(v))

    head = "".join(f"<th style='padding:2px 8px;text-align:right'>{html.escape(label(c))}</th>"
                   for c in frame.columns)
    body = "".join("<tr>" + "".join(f"<td style='padding:2px 8px;text-align:right'>{cell(c, v)}</td>"
                                    for c, v in row.items()) + "</tr>" for row in frame.to_dict("records"))
    return (f"<table class='spectool-results' style='border-collapse:collapse;font-variant-numeric:tabular-nums'>"
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def _key(config) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in config.to_dict().items()))


def _open_trace(trace):
    """(Trace or None, a one-line problem or None)."""
    if trace is None:
        return None, None
    from .common import open_trace

    loaded, problem = open_trace(trace)
    if loaded is not None and problem and loaded.requests.num_rows:
        problem = None  # a trace of requests alone (no step rows) still has prompts and outputs
    return (loaded if problem is None else None), problem


def _longest_output(trace) -> int | None:
    if trace is None or not trace.requests.num_rows:
        return None
    return max(len(r or []) for r in trace.requests.column("output_tokens").to_pylist()) or None


def _trace_prompts(trace) -> list:
    if trace is None:
        return []
    return [list(r["prompt_tokens"] or []) for r in sorted(trace.requests.to_pylist(), key=lambda r: r["request_id"])]


def _prompt_label(prompt) -> str:
    if isinstance(prompt, str):
        return repr(prompt[:60])
    return f"{len(prompt)} tokens"


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
