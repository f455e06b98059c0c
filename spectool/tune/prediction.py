"""What a what-if replay predicts for one configuration: its iterations, row by row.

A ``Prediction`` is the per-iteration table a real run of that configuration would
record (iteration, request, seq_len, accept length, tree size), with which rows needed a
target token past what the trace knows (``censored``). ``to_frame`` gives it as a
DataFrame with the columns of a trace's steps table that CompareView and the
acceptance plots read (``iteration``, ``request_id``, ``seq_len``, ``num_nodes``,
``accept_length``, ``method``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Prediction:
    """Predicted iterations of one configuration over a workload (greedy, exact).

    Row arrays (one entry per iteration and running request): ``iteration``, ``request_id``,
    ``seq_len`` (tokens in the cache before the iteration), ``accept_length``, ``censored``.
    Iteration arrays: ``batch_size`` and ``num_nodes`` (N verified per request that iteration).
    """

    config: object
    method: str
    iteration: np.ndarray
    request_id: np.ndarray
    seq_len: np.ndarray
    accept_length: np.ndarray
    censored: np.ndarray
    batch_size: np.ndarray
    num_nodes: np.ndarray
    output_tokens: int
    extra: dict = field(default_factory=dict)
    trees: Sequence | None = None  # per row: (tokens, parents, valid) of the tree that iteration verifies

    @property
    def num_iterations(self) -> int:
        return int(self.batch_size.shape[0])

    @property
    def mean_accept_length(self) -> float:
        return float(self.accept_length.mean()) if self.accept_length.size else 0.0

    @property
    def exact(self) -> bool:
        """True when no iteration needed a token past what the trace knows."""
        return not bool(self.censored.any())

    def accept_lengths(self, request_id: int) -> list[int]:
        """The accept length of each iteration of one request, in order."""
        return self.accept_length[self.request_id == request_id].tolist()

    def to_trace(self, trace):
        """This prediction as a ``Trace`` of the recorded one's requests: per row its tree, accepted path,
        accept length and bonus (what the engine would have recorded, less the target's top-k and
        timings), so trace views and CompareView show it like a recorded run::

            CompareView(trace, result.prediction(config).to_trace(trace), labels=("recorded", "predicted"))
        """
        from spectool.tune.trace_export import prediction_trace

        return prediction_trace(self, trace)

    def to_frame(self):
        """The rows as a pandas DataFrame (steps-table column names)."""
        import pandas as pd

        return pd.DataFrame({"iteration": self.iteration, "request_id": self.request_id, "seq_len": self.seq_len,
                             "num_nodes": self.num_nodes[self.iteration], "accept_length": self.accept_length,
                             "censored": self.censored, "method": self.method})


class FlatTrees(Sequence):
    """Per-row trees kept as flat arrays (row r = [offsets[r], offsets[r + 1])), made lists only when read:
    a sweep keeps every configuration's trees, and most are never looked at."""

    def __init__(self, tokens: np.ndarray, parents: np.ndarray, valid: np.ndarray, offsets: np.ndarray) -> None:
        self.tokens, self.parents, self.valid, self.offsets = tokens, parents, valid, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, r):
        if isinstance(r, slice):
            return [self[i] for i in range(*r.indices(len(self)))]
        if r < 0:
            r += len(self)
        if not 0 <= r < len(self):
            raise IndexError(r)
        lo, hi = self.offsets[r], self.offsets[r + 1]
        return self.tokens[lo:hi].tolist(), self.parents[lo:hi].tolist(), self.valid[lo:hi].tolist()


class RowLog:
    """Collects a replay's rows and iterations (plain lists, made arrays once at the end)."""

    def __init__(self) -> None:
        self.iteration: list[int] = []
        self.request_id: list[int] = []
        self.seq_len: list[int] = []
        self.accept_length: list[int] = []
        self.censored: list[bool] = []
        self.batch_size: list[int] = []
        self.num_nodes: list[int] = []
        self.trees: list = []

    def add_iteration(self, batch_size: int, num_nodes: int) -> int:
        self.batch_size.append(batch_size)
        self.num_nodes.append(num_nodes)
        return len(self.batch_size) - 1

    def add_row(self, iteration: int, request_id: int, seq_len: int, accept_length: int, censored: bool,
                tree=None) -> None:
        self.trees.append(tree)
        self.iteration.append(iteration)
        self.request_id.append(request_id)
        self.seq_len.append(seq_len)
        self.accept_length.append(accept_length)
        self.censored.append(censored)

    def finish(self, config, method: str, output_tokens: int, **extra) -> Prediction:
        i64 = np.int64
        return Prediction(config, method, np.asarray(self.iteration, i64), np.asarray(self.request_id, i64),
                          np.asarray(self.seq_len, i64), np.asarray(self.accept_length, i64),
                          np.asarray(self.censored, bool), np.asarray(self.batch_size, i64),
                          np.asarray(self.num_nodes, i64), output_tokens, extra,
                          self.trees if any(t is not None for t in self.trees) else None)
