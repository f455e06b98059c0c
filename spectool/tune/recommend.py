"""``spectool.tune``: exact what-if accept lengths of a grid of configurations, ranked.

    table = st.tune(trace, grid={"num_draft_tokens": [4, 8, 16], "max_bfs_breadth": [1, 4, 8]},
                    profile="demo-cpu")
    table.frame            # one row per configuration, best first
    table.best             # the recommended draft config
    table.sglang_flags()   # ... as SGLang launch flags; table.vllm_config() for vLLM

Without a profile the ranking is by predicted tokens per iteration (accept length + 1),
which is what a draft can change; with one, by predicted tokens/s at the chosen batch
size, so the cost of bigger trees counts.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from spectool.config import NgramConfig
from spectool.tune.cost_profile import CostProfile
from spectool.tune.deploy_flags import sglang_flags, vllm_speculative_config
from spectool.tune.prediction import Prediction, RowLog
from spectool.tune.profile_check import ProfileCheck, check_profile, recorded_config
from spectool.tune.schedule import Running, replay
from spectool.tune.workload import TuneError, Workload, workload_from_trace

DEFAULT_GRIDS: dict[str, dict[str, list]] = {
    "ngram": {"max_bfs_breadth": [1, 2, 4, 8], "num_draft_tokens": [4, 8, 12, 16, 24]},
    "eagle": {"num_steps": [2, 3, 4, 5], "topk": [1, 2, 4], "num_draft_tokens": [4, 8, 16]},
    "multi_layer_eagle": {"num_steps": [1, 2, 3, 4]},
}
PARAMS = {"ngram": ("min_bfs_breadth", "max_bfs_breadth", "max_trie_depth", "num_draft_tokens", "match", "capacity"),
          "eagle": ("num_steps", "topk", "num_draft_tokens"),
          "multi_layer_eagle": ("num_steps",)}


@dataclass
class TuneResult:
    """The tuner's answer: every configuration's prediction and the ranked table."""

    predictions: list[Prediction]
    plain: Prediction
    profile: CostProfile | None
    batch_size: int
    skipped: list[str] = field(default_factory=list)
    trace: object = field(default=None, repr=False)  # the recorded trace (for profile_check)
    _check: ProfileCheck | None = field(default=None, init=False, repr=False)

    @property
    def profile_check(self) -> ProfileCheck | None:
        """The profile against the recorded run's own iterations (``spectool.tune.profile_check``); None
        without a profile. Made at its first use: a slider's many one-configuration sweeps never read it."""
        if self._check is None and self.profile is not None and self.trace is not None:
            self._check = check_profile(self.trace, self.profile)
        return self._check

    @property
    def frame(self):
        """The ranked table (pandas): configuration, accept length, tokens/iteration, tokens/s, speedup."""
        import pandas as pd

        rows = [self.row(p) for p in self.predictions]
        key = "predicted_tokens_per_s" if self.profile is not None else "tokens_per_iteration"
        frame = pd.DataFrame(rows)
        return frame.sort_values(key, ascending=False, kind="stable").reset_index(drop=True) if len(frame) else frame

    @property
    def best(self):
        """The recommended draft config (the top of the ranking)."""
        if not self.predictions:
            raise TuneError("no configuration of the grid could be evaluated")
        return self.ranked()[0].config

    def ranked(self) -> list[Prediction]:
        key = self.tokens_per_s if self.profile is not None else _tokens_per_iteration
        return sorted(self.predictions, key=key, reverse=True)

    def sglang_flags(self, config=None) -> list[str]:
        return sglang_flags(config or self.best)

    def vllm_config(self, config=None) -> dict:
        return vllm_speculative_config(config or self.best)

    def prediction(self, config) -> Prediction:
        """The prediction of one configuration of the grid."""
        for p in self.predictions:
            if p.config == config:
                return p
        raise KeyError(f"{config} is not in this sweep")

    def tokens_per_s(self, pred: Prediction) -> float:
        """Predicted decode tokens/s (gained tokens over iteration time, as RunStats.tokens_per_s)."""
        if self.profile is None:
            return float("nan")
        cfg = None if pred.method == "none" else pred.config
        total = float(self.profile.iteration_costs(cfg, pred.batch_size, pred.num_nodes).sum())
        gained = int(pred.accept_length.sum()) + pred.accept_length.size
        return gained / total * 1e6 if total > 0 else float("nan")

    def row(self, p: Prediction) -> dict:
        """One table row: the configuration's settings and its predicted figures."""
        row = {"method": p.method, **{n: getattr(p.config, n) for n in PARAMS[p.method]}}
        if getattr(p.config, "capacity", None) == NgramConfig.capacity:  # the default: not worth a column
            row.pop("capacity")
        row.update(mean_accept_length=p.mean_accept_length, tokens_per_iteration=_tokens_per_iteration(p),
                   iterations=p.num_iterations, exact=p.exact)
        if self.profile is not None:
            tps, base = self.tokens_per_s(p), self.tokens_per_s(self.plain)
            row.update(predicted_tokens_per_s=tps, speedup=tps / base if base > 0 else float("nan"))
        return row

    def report(self, top: int = 10) -> str:
        """The ranked table, the recommendation and its serving flags as text."""
        from spectool.tune.deploy_flags import format_flags, format_vllm

        frame = self.frame.head(top)
        lines = [frame.to_string(index=False, float_format=lambda v: f"{v:.2f}")]
        if self.profile is not None:
            lines.append(f"plain decoding: {self.tokens_per_s(self.plain):.1f} tokens/s predicted at batch "
                         f"{self.batch_size} on {self.profile.device}")
        if self.profile_check is not None:
            lines.append(self.profile_check.describe())
        best = self.best
        lines += ["", f"recommended: {_describe(best)}", f"SGLang: {format_flags(self.sglang_flags())}",
                  f"vLLM speculative_config: {format_vllm(best)}"]
        if not all(p.exact for p in self.predictions):
            lines.append("note: some last iterations needed tokens past the recorded output; their accept length "
                         "is a lower bound (record with a larger max_new_tokens and tune with a smaller one)")
        rounding = next((p.extra["rounding"] for p in self.predictions if p.extra.get("rounding")), None)
        if rounding:
            lines.append(f"note: {rounding}")
        lines += [f"skipped: {s}" for s in self.skipped]
        return "\n".join(lines)


def _tokens_per_iteration(p: Prediction) -> float:
    return p.mean_accept_length + 1.0


def _describe(config) -> str:
    return f"{config.method}(" + ", ".join(f"{n}={getattr(config, n)}" for n in PARAMS[config.method]
                                          if n != "capacity") + ")"


def expand_grid(method: str, grid: dict | None, base) -> tuple[list, list[str]]:
    """The configs of a grid (a dict of lists, or a list of configs), and why any were skipped."""
    if isinstance(grid, (list, tuple)):
        return list(grid), []
    grid = dict(DEFAULT_GRIDS[method] if grid is None else grid)
    grid.pop("method", None)
    unknown = [k for k in grid if k not in PARAMS[method]]
    if unknown:
        raise TuneError(f"{unknown[0]!r} is not a {method} setting (choose from {', '.join(PARAMS[method])})")
    names = list(grid)
    values = [v if isinstance(v, (list, tuple)) else [v] for v in grid.values()]
    configs, skipped = [], []
    for combo in itertools.product(*values):
        try:
            configs.append(replace(base, **dict(zip(names, combo))))
        except ValueError as e:
            skipped.append(f"{dict(zip(names, combo))}: {e}")
    return configs, skipped


def _base_config(method: str, draft_info: dict, path):
    config = recorded_config({**draft_info, "method": method})
    if method == "ngram":
        corpus = draft_info.get("external_corpus")
        return replace(config, external_corpus=corpus) if corpus else config
    from spectool.tune.eagle_whatif import check_checkpoint

    return replace(config, path=check_checkpoint(path or draft_info.get("path"), method))


class _Precomputed:
    """A schedule method that replays per-request (seq_len, accept, censored, tree) rows computed beforehand."""

    def __init__(self, rows: dict[int, list[tuple]], n: int) -> None:
        self.rows = {rid: iter(r) for rid, r in rows.items()}
        self.n = n

    def admit(self, reqs: list[Running]) -> None:
        pass

    def step(self, running: list[Running]) -> tuple[list[int], int, list[bool], list]:
        out = [next(self.rows[r.request_id]) for r in running]
        return [o[1] for o in out], self.n, [o[2] for o in out], [o[3] if len(o) > 3 else None for o in out]

    def release(self, reqs: list[Running]) -> None:
        pass


def plain_prediction(workload: Workload) -> Prediction:
    """Plain decoding over the workload: one token per request per iteration."""
    rows = {r.request_id: [(L, 0, False) for L in range(r.prompt_len, r.end - 1)] for r in workload.requests}
    log = RowLog()
    replay(workload, _Precomputed(rows, 1), log)
    return log.finish(None, "none", workload.output_tokens)


def _predict_eagle_family(method: str, configs: list, workload: Workload, target, bar) -> list[Prediction]:
    """Every EAGLE / multi-layer config over every request: one lane each, batched per drafter."""
    if target is None:
        raise TuneError(f"{method} what-if needs the target (pass target=st.load(..., dtype=torch.float32))")
    from spectool.kernels import ops

    # A deterministic trace is replayed with the kernels it was recorded with (eagle_whatif docstring).
    deterministic = bool((workload.run_info.get("engine") or {}).get("deterministic"))
    with ops.deterministic(deterministic):
        return _eagle_family_rows(method, configs, workload, target, bar, deterministic)


def _eagle_family_rows(method: str, configs: list, workload: Workload, target, bar, deterministic: bool
                       ) -> list[Prediction]:
    import torch

    from spectool.tune import eagle_whatif as ew

    for path in dict.fromkeys(str(c.path) for c in configs):  # a grid of configs skipped _base_config's check
        ew.check_checkpoint(path, method)
    dev = torch.device(target.device)
    works = workload.requests
    capacity = max(len(r.known) for r in works) + 8
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(configs):
        groups.setdefault((str(c.path), getattr(c, "topk", None)), []).append(i)
    known = {w.request_id: w.known.tolist() for w in works}
    hidden = {}
    for w in works:
        hidden[w.request_id] = ew.target_hidden(target, torch.as_tensor(w.known, device=dev), deterministic)
    rows: dict[tuple[int, int], list] = {}
    # The bar counts output tokens replayed (configurations x requests x tokens): a group of
    # configurations sharing drafts can take most of a sweep.
    bar.reset(total=len(configs) * sum(max(w.end - w.prompt_len - 1, 0) for w in works))
    bar.unit = "tok"
    for (path, k), idx in groups.items():
        lane_of = [(wi, ci) for wi in range(len(works)) for ci in idx]
        lane_requests = [works[wi].request_id for wi, _ in lane_of]
        steps = max(configs[i].num_steps for i in idx)
        if method == "eagle":
            lanes = ew.EagleLanes(target, path, k, steps, capacity, lane_requests)
            accept_rows = ew.eagle_accepts(known)
        else:
            lanes = ew.MultiLayerLanes(target, path, steps, capacity, lane_requests)
            accept_rows = ew.multi_layer_accepts(known)
        for w in works:
            lanes.load(w.request_id, torch.as_tensor(w.known, device=dev), hidden[w.request_id])
        rows.update(ew.sweep_lanes(lanes, works, configs, lane_of, accept_rows, bar.update))
        del lanes
    rounding = _rounding_note(workload, target, deterministic)
    preds = []
    for ci, c in enumerate(configs):
        log = RowLog()
        replay(workload, _Precomputed({w.request_id: rows[(w.request_id, ci)] for w in works}, c.num_draft_tokens),
               log)
        preds.append(log.finish(c, method, workload.output_tokens, rounding=rounding))
    return preds


def _rounding_note(workload: Workload, target, deterministic: bool) -> str | None:
    """Why a replay's float forwards may not be the engine's bits, or None when they are (a float32
    CPU trace replayed on the CPU in float32; a deterministic trace replayed in its dtype on CUDA)."""
    import torch

    recorded = (workload.run_info.get("model") or {}).get("dtype")
    device = str(workload.run_info.get("device") or "cpu")
    dtype = str(target.dtype).replace("torch.", "")
    on_cuda = torch.device(target.device).type == "cuda"
    if not on_cuda and dtype == recorded == "float32" and device.startswith("cpu"):
        return None
    if deterministic and on_cuda and dtype == recorded and device.startswith("cuda"):
        return None
    return (f"a {recorded or 'unknown'}-dtype trace from {device} replayed in {dtype} on {target.device}"
            f"{'' if deterministic else ' without deterministic mode'}: near-ties between draft tokens can round "
            "differently from the engine's, so accept lengths may be off by a few percent (exact: record with "
            "deterministic=True and tune on the same GPU and dtype, or record and tune in float32 on the CPU)")


def tune(trace, grid: dict | list | None = None, profile: str | Path | CostProfile | None = None,
         batch_size: int | None = None, method: str | None = None, max_new_tokens: int | None = None,
         target=None, draft_path=None, allow_other_model: bool = False, progress: bool = True) -> TuneResult:
    """Exact greedy what-if of every configuration in ``grid`` over a recorded trace.

    Args:
        trace: a greedy ``Trace`` (or path). Sampled traces are refused.
        grid: {setting: [values]} of one draft method (default: a grid per method), or a list of configs.
        profile: a cost profile (path, shipped name, or CostProfile) for predicted tokens/s.
        batch_size: the engine's max_batch_size to predict for (default: the recorded run's).
        method: ``ngram`` / ``eagle`` / ``multi_layer_eagle`` (default: the trace's, or the grid's configs').
        max_new_tokens: decode fewer output tokens per request than recorded (keeps the tail known).
        target: the loaded target (EAGLE methods need it; float32 on CPU is exact).
        draft_path: the draft checkpoint (EAGLE methods; default: the recorded run's).
        allow_other_model: accept a profile measured for another model (e.g. the same shape).
        progress: a progress bar over the sweep.
    """
    from tqdm.auto import tqdm

    if not hasattr(trace, "steps"):
        from spectool.trace.reader import Trace

        trace = Trace.load(trace)
    workload = workload_from_trace(trace, max_new_tokens=max_new_tokens, max_batch_size=batch_size)
    draft_info = dict(workload.run_info.get("draft") or {})
    if isinstance(grid, (list, tuple)) and grid:
        method = method or grid[0].method
    if isinstance(grid, dict):
        method = method or grid.get("method")
    method = method or draft_info.get("method")
    if method not in PARAMS:
        raise TuneError(f"choose a draft method to tune (ngram, eagle, multi_layer_eagle); the trace's is {method!r}")
    if draft_info.get("method") != method:
        draft_info = {}
    base = None if isinstance(grid, (list, tuple)) else _base_config(method, draft_info, draft_path)
    configs, skipped = expand_grid(method, grid, base)
    if any(c.method != method for c in configs):
        raise TuneError("every configuration of a sweep must be of one draft method")
    if isinstance(profile, (str, Path)):
        profile = CostProfile.load(profile)
    if profile is not None:
        if not allow_other_model:
            profile.check_model(workload.model_hash, (workload.run_info.get("model") or {}).get("name"))
        if not profile.has_method(method):
            raise TuneError(f"cost profile {profile.source} has no {method} timings: calibrate with that draft")
    bar = tqdm(total=len(configs), disable=not progress,
               desc=f"what-if {method}", leave=False)
    try:
        if method == "ngram":
            from spectool.tune.ngram_whatif import predict_ngram

            encode = _encoder(trace)
            preds = []
            for c in configs:
                preds.append(predict_ngram(c, workload, encode))
                bar.update(1)
        else:
            preds = _predict_eagle_family(method, configs, workload, target, bar)
    finally:
        bar.close()
    for p in preds:
        p.extra["workload"] = workload  # what to_trace and compare read: the known tokens, outputs
    return TuneResult(preds, plain_prediction(workload), profile, workload.max_batch_size, skipped, trace)


def _encoder(trace):
    """Text -> token ids through the trace's tokenizer (None when it has none)."""
    tok_json = getattr(trace, "tokenizer_json", None)
    if not tok_json:
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_json)
    return lambda text: tok.encode(text).ids


def mean_accept_lengths(result: TuneResult) -> np.ndarray:
    """Each prediction's mean accept length, in grid order."""
    return np.asarray([p.mean_accept_length for p in result.predictions])
