"""Live statistics of a decoding run: what ``result.stats`` and stream events report.

The formulas live in ``spectool.trace.stats.summarize``; the engine feeds it the
same columns the recorder writes, so live stats equal ``Trace.summary()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spectool.timing import PHASE_KEYS
from spectool.trace.stats import summarize

_TIMING_COLUMNS = ("iteration_us", *PHASE_KEYS)


@dataclass
class RunStats:
    """Per-record outcomes of one generate/stream call (a record = one request in one iteration)."""

    method: str = "none"
    columns: dict[str, list] = field(default_factory=lambda: {
        "iteration": [], "request_id": [], "accept_length": [], "depth": [], "iteration_us": [],
        "draft_us": [], "index_us": [], "verify_us": [], "commit_us": [], "trie_get_us": [],
        "trie_put_us": []})
    prefill_tokens: int = 0
    generated_tokens: int = 0
    elapsed_s: float = 0.0
    prefill_s: float = 0.0  # host wall time inside prefills (the drafters' GPU work may run on past it)
    time_to_first_token_s: float | None = None  # from the call's start to the first prefill's tokens
    graphs: dict[str, int] = field(default_factory=dict)  # CUDA-graph replays / eager runs / captures
    # Running totals behind the live tokens/s and accept length (summarize's formulas, without
    # re-reading every record each iteration).
    _accepted: int = 0
    _gained: int = 0
    _iteration_us: float = 0.0

    def add_iteration(self, iteration: int, request_ids: list[int], accept_lengths: list[int],
                      tree_depths: list[int], phase_us: dict[str, float]) -> None:
        """One record per request of an iteration; ``phase_us`` holds iteration_us and every
        ``<phase>_us`` (per batch, so each record gets the same values)."""
        cols = self.columns
        rows = len(request_ids)
        accepted = sum(accept_lengths)
        self._accepted += accepted
        self._gained += accepted + rows
        self._iteration_us += phase_us["iteration_us"]
        cols["iteration"].extend([iteration] * rows)
        cols["request_id"].extend(request_ids)
        cols["accept_length"].extend(accept_lengths)
        cols["depth"].extend([d] for d in tree_depths)  # the deepest node is all summarize reads of a tree
        for name in _TIMING_COLUMNS:
            cols[name].extend([phase_us[name]] * rows)

    def add_prefill(self, began_s: float, took_s: float) -> None:
        """A prefill that began ``began_s`` after the call's start and took ``took_s``."""
        self.prefill_s += took_s
        if self.time_to_first_token_s is None:
            self.time_to_first_token_s = began_s + took_s

    def summary(self) -> dict:
        """``spectool.trace.stats.summarize`` over the records so far."""
        return summarize(self.columns)

    # One attribute per key of ``summary()``, under the same name (``stats.X == stats.summary()["X"]``).

    @property
    def records(self) -> int:
        return len(self.columns["accept_length"])

    @property
    def iterations(self) -> int:
        return len(set(self.columns["iteration"]))

    @property
    def tokens(self) -> int:
        """Tokens verified (accepted + bonus) by the decode iterations; see ``spectool.trace.stats``."""
        return self._gained

    @property
    def mean_accept_length(self) -> float:
        records = len(self.columns["accept_length"])
        return self._accepted / records if records else 0.0

    @property
    def accept_length_histogram(self) -> list[int]:
        """Records with accept length a, at index a."""
        return self.summary()["accept_length_histogram"]

    @property
    def accept_rate_by_depth(self) -> list[float]:
        """Fraction of records reaching depth d among those whose tree has depth d (index d-1)."""
        return self.summary()["accept_rate_by_depth"]

    @property
    def tokens_per_s(self) -> float:
        """Tokens gained per second of decode iterations (prefill excluded), as in the trace summary."""
        return self._gained / self._iteration_us * 1e6 if self._iteration_us > 0 else 0.0

    @property
    def decode_s(self) -> float:
        """Seconds of decode iterations (their ``iteration_us`` summed): what ``tokens_per_s`` divides by.
        ``elapsed_s`` less this and ``prefill_s`` is the call's time between them."""
        return self._iteration_us / 1e6

    @property
    def phase_us(self) -> dict[str, float]:
        """Mean µs per iteration of each timed phase."""
        return self.summary()["phase_us"]

    @property
    def end_to_end_tokens_per_s(self) -> float:
        """Generated tokens (first tokens included) per second of the whole call, prefill included."""
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict:
        per_request: dict[int, list[int]] = {}
        for rid, a in zip(self.columns["request_id"], self.columns["accept_length"]):
            per_request.setdefault(rid, []).append(a)
        return {
            "method": self.method,
            **self.summary(),
            "prefill_tokens": self.prefill_tokens,
            "generated_tokens": self.generated_tokens,
            "elapsed_s": self.elapsed_s,
            "end_to_end_tokens_per_s": self.end_to_end_tokens_per_s,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "time_to_first_token_s": self.time_to_first_token_s,
            "graphs": dict(self.graphs),
            "per_request_mean_accept_length": {rid: sum(v) / len(v) for rid, v in per_request.items()},
        }

    def __repr__(self) -> str:
        return (f"RunStats(method={self.method}, mean_accept_length={self.mean_accept_length:.3f}, "
                f"tokens_per_s={self.tokens_per_s:.1f}, iterations={self.iterations})")
