"""The cost profile against the run a trace recorded: the same iterations, predicted and measured.

A trace holds every iteration's batch size, tree size and measured ``iteration_us``. The
profile predicts each of those iterations for the recorded configuration, so the two can be
compared before any other configuration's predicted tokens/s is trusted: a profile measured
on another machine, under another load, or a cost the calibration's synthetic prompts do not
have, shows here as the recorded configuration's own error. The figure is the median over the
iterations of predicted / measured: a run's first iterations capture CUDA graphs and would
outweigh the rest in a sum. The trace was recorded with recording on, which slows the engine
by a few percent (docs/BENCHMARKS.md, "Recording"), so a profile that is right reads a little
fast here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from spectool.config import EagleConfig, MultiLayerEagleConfig, NgramConfig


@dataclass(frozen=True)
class ProfileCheck:
    """The recorded configuration's iterations, predicted by the profile and as the trace measured
    them; ``skipped`` says why there is no comparison (then the figures are 0)."""

    method: str
    iterations: int = 0
    predicted_us: float = 0.0  # median predicted iteration
    measured_us: float = 0.0  # median measured iteration
    ratio: float = float("nan")  # median over iterations of predicted / measured
    skipped: str = ""

    @property
    def error(self) -> float:
        """How far the profile's prediction of an iteration of the recorded run is from its measurement."""
        return self.ratio - 1.0

    def describe(self) -> str:
        if self.skipped:
            return f"profile check: not made ({self.skipped})"
        return (f"profile check: the profile predicts the recorded {self.method} run's iterations {self.error:+.1%} "
                f"against their timings in the trace (median over {self.iterations} iterations; medians "
                f"{self.predicted_us:.0f} and {self.measured_us:.0f} us), so its tokens/s for this run read "
                f"{1 / self.ratio - 1:+.0%}")


CONFIGS = {"ngram": NgramConfig, "eagle": EagleConfig, "multi_layer_eagle": MultiLayerEagleConfig}


def recorded_config(draft: dict):
    """The draft configuration a trace's ``run_info["draft"]`` describes, as far as a cost profile reads
    it (None: plain decoding; a setting it lacks takes its default); a method the profile cannot time
    raises KeyError. The external corpus is left out: it adds no cost the profile times, and its file
    may be gone (the tuner adds it back where it replays one)."""
    method = draft.get("method", "none")
    if method == "none":
        return None
    cls = CONFIGS[method]
    keys = {f.name: draft[f.name] for f in fields(cls)
            if f.name in draft and f.name != "path" and not f.name.startswith("external_corpus")}
    return cls(**keys) if cls is NgramConfig else cls(draft.get("path", ""), **keys)


def _same_device(run_info: dict, profile_device: str) -> str:
    """Why the trace's device is not the profile's ('' when it is, or cannot be told apart)."""
    name = run_info.get("device_name")
    kind = str(run_info.get("device", "")).split(":")[0]
    if name and name != profile_device:
        return f"the trace was recorded on {name}, the profile measured on {profile_device}"
    if kind and (kind == "cpu") != (profile_device == "cpu"):
        return f"the trace was recorded on {run_info.get('device')}, the profile measured on {profile_device}"
    return ""


def check_profile(trace, profile) -> ProfileCheck:
    """Compare ``profile``'s prediction of every iteration of ``trace`` with its recorded ``iteration_us``."""
    info = trace.run_info or {}
    draft = dict(info.get("draft") or {"method": "none"})
    method = str(draft.get("method", "none"))
    record = info.get("record") or {}
    why = _same_device(info, profile.device)
    if not why and not profile.has_method(method):
        why = f"the profile has no {method} timings"
    if not why and (record.get("requests") is not None or record.get("where") or record.get("slowest")):
        # Kept rows of some requests only miscount an iteration's batch; the slowest iterations are not a sample.
        why = "the trace keeps a selection of the run's records, not every request of the iterations it holds"
    if why:
        return ProfileCheck(method, skipped=why)
    try:
        config = recorded_config(draft)
    except (KeyError, TypeError, ValueError):
        return ProfileCheck(method, skipped=f"the trace's {method} settings cannot be read")
    table = trace.columns(["iteration", "num_nodes", "iteration_us"])
    its = np.asarray(table["iteration"].to_numpy(), np.int64)
    nodes = np.asarray(table["num_nodes"].fill_null(1).to_numpy(), np.int64)
    us = np.asarray(table["iteration_us"].to_numpy(zero_copy_only=False), np.float64)
    _, first, batch = np.unique(its, return_index=True, return_counts=True)
    measured = us[first]
    keep = np.isfinite(measured) & (measured > 0)
    if not keep.any():
        return ProfileCheck(method, skipped="the trace has no iteration timings")
    predicted = profile.iteration_costs(config, batch[keep], nodes[first][keep])
    return ProfileCheck(method, int(keep.sum()), float(np.median(predicted)), float(np.median(measured[keep])),
                        float(np.median(predicted / measured[keep])))
