"""Live statistics of a decoding run: what ``result.stats`` and stream events report."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from spectool.timing import PHASES


@dataclass
class RunStats:
    """Accumulates per-iteration outcomes of one generate/stream call.

    Acceptance by depth d = iterations whose accepted path reached depth d, over
    iterations whose draft tree had a node at depth d. For multi-layer EAGLE depth d
    is drafted by layer d-1, so this is also acceptance by layer.
    """

    method: str = "none"
    accept_lengths: list[int] = field(default_factory=list)
    tree_depths: list[int] = field(default_factory=list)
    per_request: dict[int, list[int]] = field(default_factory=dict)
    phase_us: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    forwards: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    elapsed_s: float = 0.0
    graph_replays: int = 0
    eager_fallbacks: int = 0

    def add_iteration(self, request_ids: list[int], accept_lengths: list[int], tree_depths: list[int],
                      phase_us: dict[str, float]) -> None:
        self.forwards += 1
        self.accept_lengths.extend(accept_lengths)
        self.tree_depths.extend(tree_depths)
        for rid, a in zip(request_ids, accept_lengths):
            self.per_request.setdefault(rid, []).append(a)
        for k, v in phase_us.items():
            self.phase_us[k] = self.phase_us.get(k, 0.0) + v

    @property
    def iterations(self) -> int:
        """Request-iterations (one per request per engine iteration)."""
        return len(self.accept_lengths)

    @property
    def mean_accept_length(self) -> float:
        return float(np.mean(self.accept_lengths)) if self.accept_lengths else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def accept_length_histogram(self) -> dict[int, int]:
        values, counts = np.unique(np.asarray(self.accept_lengths, dtype=np.int64), return_counts=True)
        return {int(v): int(c) for v, c in zip(values, counts)}

    def acceptance_by_depth(self) -> dict[int, float]:
        acc = np.asarray(self.accept_lengths, dtype=np.int64)
        depth = np.asarray(self.tree_depths, dtype=np.int64)
        out = {}
        for d in range(1, int(depth.max(initial=0)) + 1):
            drafted = depth >= d
            out[d] = float((acc[drafted] >= d).mean()) if drafted.any() else 0.0
        return out

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "iterations": self.iterations,
            "forwards": self.forwards,
            "mean_accept_length": self.mean_accept_length,
            "accept_length_histogram": self.accept_length_histogram(),
            "acceptance_by_depth": self.acceptance_by_depth(),
            "generated_tokens": self.generated_tokens,
            "prefill_tokens": self.prefill_tokens,
            "elapsed_s": self.elapsed_s,
            "tokens_per_s": self.tokens_per_s,
            "phase_us": dict(self.phase_us),
            "per_request_mean_accept_length": {
                rid: float(np.mean(v)) for rid, v in self.per_request.items()},
            "graph_replays": self.graph_replays,
            "eager_fallbacks": self.eager_fallbacks,
        }

    def __repr__(self) -> str:
        return (f"RunStats(method={self.method}, mean_accept_length={self.mean_accept_length:.3f}, "
                f"tokens_per_s={self.tokens_per_s:.1f}, iterations={self.iterations})")
