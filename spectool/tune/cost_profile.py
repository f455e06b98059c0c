"""A measured cost profile: what one iteration costs on one device, for one target and drafts.

``spectool bench --calibrate`` writes it (``spectool.tune.calibrate``); the tuner reads it
to turn predicted iterations (batch size and tree size per iteration) into predicted
tokens/s. An iteration's time is modelled as the sum of the parts the engine runs:

    iteration_us = verify_us(B, N) + draft_us(method, config, B) + overhead_us(B)

``verify_us``: the engine's greedy verify step (target forward over B trees of N nodes
after ``context`` cached tokens, verify, KV commit, host table copy); ``draft_us``: the
drafter's per-iteration work (N-gram: trie get, put and tree upload by N; EAGLE: extend +
draft by top-k and steps; multi-layer EAGLE: extend of every layer by steps); and
``overhead_us``: the rest of the engine's host work per iteration, from plain decoding.
Between measured grid points values are interpolated linearly (and held at the ends).

JSON layout (``format`` = "spectool-cost-profile", ``version`` = 1)::

    {"device": "NVIDIA H200", "dtype": "bfloat16", "context": 256,
     "model": {"name": ..., "hash": ..., "shape": {...}},
     "verify_us": {"batch_sizes": [...], "num_nodes": [...], "us": [[per N] per B]},
     "overhead_us": {"batch_sizes": [...], "us": [...]},
     "draft_us": {"ngram": {"batch_sizes", "num_nodes", "us": [[per N] per B]},
                  "eagle": {"batch_sizes", "topk", "num_steps", "us": [[[per S] per k] per B]},
                  "multi_layer_eagle": {"batch_sizes", "num_steps", "us": [[per S] per B]}}}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spectool.tune.workload import TuneError

FORMAT = "spectool-cost-profile"
VERSION = 1
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


def _interp(x: float, xs, ys) -> float:
    return float(np.interp(x, np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)))


def _interp2(x: float, y: float, xs, ys, table) -> float:
    """Bilinear over a [len(xs), len(ys)] table (held at the edges)."""
    col = [_interp(y, ys, row) for row in table]
    return _interp(x, xs, col)


@dataclass
class CostProfile:
    """A loaded profile (see the module docstring); ``data`` is the JSON object."""

    data: dict
    source: str = ""

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
            raise TuneError(f"{path} is a version {data.get('version')} profile; this spectool reads version {VERSION}")
        return cls(data, str(p))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.data, indent=1) + "\n")

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
        v = self.data["verify_us"]
        return _interp2(batch_size, num_nodes, v["batch_sizes"], v["num_nodes"], v["us"])

    def overhead_us(self, batch_size: int) -> float:
        o = self.data.get("overhead_us")
        return _interp(batch_size, o["batch_sizes"], o["us"]) if o else 0.0

    def has_method(self, method: str) -> bool:
        return method == "none" or method in (self.data.get("draft_us") or {})

    def draft_us(self, config, batch_size: int, num_nodes: int) -> float:
        """The drafter's per-iteration µs for ``config`` at this batch (0 for plain decoding)."""
        if config is None:
            return 0.0
        table = (self.data.get("draft_us") or {}).get(config.method)
        if table is None:
            raise TuneError(f"cost profile {self.source or '?'} has no {config.method} draft timings: "
                            f"calibrate with that draft (spectool bench --calibrate --draft {config.method})")
        bs = table["batch_sizes"]
        if config.method == "ngram":
            return _interp2(batch_size, num_nodes, bs, table["num_nodes"], table["us"])
        if config.method == "multi_layer_eagle":
            return _interp2(batch_size, config.num_steps, bs, table["num_steps"], table["us"])
        per_b = [_interp2(config.topk, config.num_steps, table["topk"], table["num_steps"], t) for t in table["us"]]
        return _interp(batch_size, bs, per_b)

    def iteration_us(self, config, batch_size: int, num_nodes: int) -> float:
        """Predicted µs of one iteration of ``config`` (None = plain decoding) with this batch and tree."""
        return (self.verify_us(batch_size, num_nodes) + self.draft_us(config, batch_size, num_nodes)
                + self.overhead_us(batch_size))


def shipped_profiles() -> list[str]:
    """Names of the profiles that ship with spectool (``CostProfile.load(name)``)."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json")) if PROFILE_DIR.is_dir() else []
