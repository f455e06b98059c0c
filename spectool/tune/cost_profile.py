"""A measured cost profile: what one iteration costs on one device, for one target and drafts.

``spectool bench --calibrate`` writes it (``spectool.tune.calibrate``); the tuner reads it
to turn predicted iterations (batch size and tree size per iteration) into predicted
tokens/s. Every draft grid point holds the mean iteration of the real engine running that
configuration at that batch size (the median of a few runs' means), so the model is exact
there; an iteration is

    iteration_us = plain_us(B) + tree_us(B, N) + draft_us(method, config, B, N)

``plain_us``: plain decoding's iteration as the engine runs it; ``tree_us`` = verify_us(B, N)
- verify_us(B, 1), what verifying N nodes costs beyond one (from the verify step timed
alone); ``draft_us``: the rest of a draft method's measured iteration, i.e. the measured
iteration at the grid point less plain_us and tree_us at the tree size it ran with (N-gram:
by N; EAGLE: by top-k and steps; multi-layer EAGLE: by steps). An EAGLE configuration of
another tree size than its grid point's is carried there by tree_us. Between grid points
values are interpolated linearly (and held at the ends): an N-gram iteration in which no
request matched verifies the roots alone (N 1) and takes the draft share of the smallest N
measured (calibrate always measures N 2).

JSON layout (``format`` = "spectool-cost-profile", ``version`` = 2)::

    {"device": "NVIDIA H200", "dtype": "bfloat16", "context": 256, "iterations": 20,
     "model": {"name": ..., "hash": ..., "shape": {...}},
     "plain_us": {"batch_sizes": [...], "us": [...]},
     "verify_us": {"batch_sizes": [...], "num_nodes": [...], "us": [[per N] per B]},
     "draft_us": {"ngram": {"batch_sizes", "num_nodes", "iteration_us": [[per N] per B]},
                  "eagle": {"batch_sizes", "topk", "num_steps", "num_nodes": [[per S] per k],
                            "iteration_us": [[[per S] per k] per B]},
                  "multi_layer_eagle": {"batch_sizes", "num_steps", "iteration_us": [[per S] per B]}}}

where every ``iteration_us`` is a measured engine iteration (a multi-layer EAGLE tree has
steps + 1 nodes). Version 1 summed parts timed one by one, each with its own host sync.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from spectool.tune.workload import TuneError

FORMAT = "spectool-cost-profile"
VERSION = 2
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


def _interp(x: float, xs, ys) -> float:
    return float(np.interp(x, np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)))


def _interp2(x: float, y: float, xs, ys, table) -> float:
    """Bilinear over a [len(xs), len(ys)] table (held at the edges)."""
    col = [_interp(y, ys, row) for row in table]
    return _interp(x, xs, col)


@dataclass
class CostProfile:
    """A loaded profile (see the module docstring); ``data`` is the JSON object (its draft timings are
    read once, at their first use)."""

    data: dict
    source: str = ""
    _draft_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        """Read a profile JSON; a bare name (``"demo-cpu"``) means one shipped with spectool."""
        p = Path(path)
        if not p.is_file() and (PROFILE_DIR / f"{path}.json").is_file():
            p = PROFILE_DIR / f"{path}.json"
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise TuneError(f"no cost profile at {path} (shipped: {', '.join(shipped_profiles()) or 'none'})") from None
        except (OSError, ValueError) as e:
            raise TuneError(f"cannot read cost profile {path}: {e}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise TuneError(f"{path} is not a spectool cost profile (no \"format\": \"{FORMAT}\")")
        if data.get("version") != VERSION:
            raise TuneError(f"{path} is a version {data.get('version')} cost profile; this spectool reads version "
                            f"{VERSION}: measure it again (spectool bench --calibrate)")
        return cls(data, str(p))

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON, making the folder it goes in (a calibration takes minutes: a
        missing folder must not lose it)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.data, indent=1) + "\n")

    @property
    def device(self) -> str:
        return str(self.data.get("device", "?"))

    @property
    def model(self) -> dict:
        return self.data.get("model") or {}

    def check_model(self, model_hash: str | None, model_name: str | None = None) -> None:
        """One-line TuneError when the profile was measured for another model than the trace's."""
        mine = self.model.get("hash")
        if mine and model_hash and mine != model_hash:
            raise TuneError(f"cost profile {self.source or '?'} was measured for model {self.model.get('name')!r} "
                            f"(hash {mine[:12]}), not this trace's {model_name!r} (hash {model_hash[:12]}): "
                            "calibrate for this model (spectool bench --calibrate), or pass allow_other_model")

    def verify_us(self, batch_size: int, num_nodes: int) -> float:
        """The verify step timed alone (with its host sync) at this batch and tree size."""
        v = self.data["verify_us"]
        return _interp2(batch_size, num_nodes, v["batch_sizes"], v["num_nodes"], v["us"])

    def plain_us(self, batch_size: int) -> float:
        """Plain decoding's iteration at this batch size, as the engine ran it."""
        p = self.data["plain_us"]
        return _interp(batch_size, p["batch_sizes"], p["us"])

    def tree_us(self, batch_size: int, num_nodes: int) -> float:
        """What verifying ``num_nodes`` nodes per request costs beyond the root alone."""
        return self.verify_us(batch_size, num_nodes) - self.verify_us(batch_size, 1)

    def has_method(self, method: str) -> bool:
        return method == "none" or method in (self.data.get("draft_us") or {})

    def _draft_table(self, method: str) -> dict:
        """The method's measured iterations less plain_us and tree_us at each grid point (made once)."""
        if method in self._draft_cache:
            return self._draft_cache[method]
        table = (self.data.get("draft_us") or {}).get(method)
        if table is None:
            flag = {"eagle": " --eagle-path DIR", "multi_layer_eagle": " --multi-layer-path DIR"}.get(method, "")
            raise TuneError(f"cost profile {self.source or '?'} has no {method} draft timings: "
                            f"calibrate with that draft (spectool bench --calibrate{flag})")
        bs, measured = table["batch_sizes"], table["iteration_us"]
        if method == "ngram":
            rest = [[us - self.plain_us(b) - self.tree_us(b, n) for n, us in zip(table["num_nodes"], row)]
                    for b, row in zip(bs, measured)]
        elif method == "multi_layer_eagle":
            rest = [[us - self.plain_us(b) - self.tree_us(b, s + 1) for s, us in zip(table["num_steps"], row)]
                    for b, row in zip(bs, measured)]
        else:
            rest = [[[us - self.plain_us(b) - self.tree_us(b, n) for n, us in zip(sizes, per_s)]
                     for sizes, per_s in zip(table["num_nodes"], per_k)] for b, per_k in zip(bs, measured)]
        self._draft_cache[method] = {**table, "us": rest}
        return self._draft_cache[method]

    def draft_us(self, config, batch_size: int, num_nodes: int) -> float:
        """The drafter's share of an iteration of ``config`` at this batch (0 for plain decoding): its
        measured iteration less plain decoding's and the larger tree's verify (may be below 0 where
        drafting overlaps the device's work)."""
        if config is None:
            return 0.0
        table = self._draft_table(config.method)
        bs = table["batch_sizes"]
        if config.method == "ngram":
            return _interp2(batch_size, num_nodes, bs, table["num_nodes"], table["us"])
        if config.method == "multi_layer_eagle":
            return _interp2(batch_size, config.num_steps, bs, table["num_steps"], table["us"])
        per_b = [_interp2(config.topk, config.num_steps, table["topk"], table["num_steps"], t) for t in table["us"]]
        return _interp(batch_size, bs, per_b)

    def iteration_us(self, config, batch_size: int, num_nodes: int) -> float:
        """Predicted µs of one iteration of ``config`` (None = plain decoding) with this batch and tree."""
        return (self.plain_us(batch_size) + self.tree_us(batch_size, num_nodes)
                + self.draft_us(config, batch_size, num_nodes))

    def iteration_costs(self, config, batch_sizes, num_nodes) -> np.ndarray:
        """``iteration_us`` of many iterations (arrays of their batch and tree sizes), one look-up per
        distinct (batch, tree) pair: a run repeats few of them over many iterations."""
        pairs, inverse = np.unique(np.stack([np.asarray(batch_sizes, np.int64), np.asarray(num_nodes, np.int64)],
                                            axis=1), axis=0, return_inverse=True)
        cost = np.asarray([self.iteration_us(config, int(b), int(n)) for b, n in pairs], np.float64)
        return cost[inverse.reshape(-1)]


def shipped_profiles() -> list[str]:
    """Names of the profiles that ship with spectool (``CostProfile.load(name)``)."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json")) if PROFILE_DIR.is_dir() else []
