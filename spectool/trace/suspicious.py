"""Numbers that point at a bug: what `spectool summary` and the report warn about.

A lossless speculative decoder can be broken and still produce the right output (a wrong
draft only costs acceptance), so its statistics are where such a bug shows first:
- sampled acceptance above what greedy verification accepts of the same drafts;
- a draft depth (a multi-layer EAGLE layer) whose drafts are almost never accepted when reached;
- a configured number of draft steps that no tree ever reaches;
- one request accepting far less than the others;
- the first drafted token repeating the root token in most iterations (an off-by-one draft).
"""

from __future__ import annotations

import statistics

import numpy as np

from spectool.trace import reference as ref
from spectool.trace.format import list_parts

MIN_RECORDS = 20          # fewer records than this say nothing
DEAD_LAYER_RATE = 0.02    # acceptance below this where a depth is reached
SAMPLED_MARGIN = 0.25     # sampled mean accept length above greedy's on the same drafts by this much
LOW_REQUEST_FACTOR = 0.25  # a request below this fraction of the other requests' median
ROOT_REPEAT_SHARE = 0.5
MAX_SAMPLED_REPLAYS = 20_000  # sampled records re-verified greedily: runs of consecutive ones spread over the trace
_REPLAY_RUNS = 20


class _Tally:
    """What the warnings need, added up one stored batch at a time (memory: one batch)."""

    def __init__(self) -> None:
        self.records = self.repeats = 0
        self.reached = np.zeros(1, np.int64)   # [d]: records whose tree reaches depth d with d - 1 accepted
        self.accepted = np.zeros(1, np.int64)  # [d]: those of them that accept depth d too
        self.deepest = 0
        self.request_sum: dict[int, float] = {}
        self.request_count: dict[int, int] = {}
        self.sampled_rows: list[np.ndarray] = []  # row numbers (trace order) of sampled records

    def add(self, t) -> None:
        n = t.num_rows
        self.records += n
        accept = np.asarray(t["accept_length"].fill_null(0).to_numpy(), np.int64)
        values, offsets, _ = list_parts(t["depth"])
        lengths = np.diff(offsets)
        depth = np.zeros(n, np.int64)
        has = lengths > 0
        if has.any():
            # Starts of the non-empty rows only: each segment is then exactly one row's depths.
            depth[has] = np.maximum.reduceat(np.asarray(values, np.int64), offsets[:-1][has])
        self.deepest = max(self.deepest, int(depth.max()) if n else 0)
        self._count(np.minimum(depth, accept + 1), "reached")
        self._count(np.minimum(depth, accept), "accepted")
        ids = np.asarray(t["request_id"].fill_null(-1).to_numpy(), np.int64)
        uniq, inverse = np.unique(ids, return_inverse=True)
        sums, counts = np.bincount(inverse, weights=accept), np.bincount(inverse)
        for rid, total, count in zip(uniq.tolist(), sums.tolist(), counts.tolist()):
            self.request_sum[rid] = self.request_sum.get(rid, 0.0) + total
            self.request_count[rid] = self.request_count.get(rid, 0) + count
        tokens, tok_offsets, _ = list_parts(t["tokens"])
        parents, _, _ = list_parts(t["parents"])
        if tokens.size and parents.size == tokens.size:
            row = np.repeat(np.arange(n), np.diff(tok_offsets))
            position = np.arange(tokens.size) - tok_offsets[row]
            root = tokens[tok_offsets[:-1][row]]
            self.repeats += np.unique(row[(position >= 1) & (parents == 0) & (tokens == root)]).size
        temperature = np.asarray(t["temperature"].to_numpy(zero_copy_only=False), np.float64)
        sampled = np.flatnonzero(~np.isnan(temperature) & (temperature != 0.0))
        if sampled.size:
            self.sampled_rows.append(self.records - n + sampled)

    def _count(self, reach: np.ndarray, name: str) -> None:
        """Add, for every d, the records with ``reach`` >= d."""
        hist = np.bincount(np.maximum(reach, 0))
        at_least = np.cumsum(hist[::-1])[::-1]  # [d]: records with reach >= d
        have = getattr(self, name)
        if len(at_least) > len(have):
            have = np.concatenate([have, np.zeros(len(at_least) - len(have), np.int64)])
        have[:len(at_least)] += at_least
        setattr(self, name, have)


def _greedy_replays(trace, rows: np.ndarray) -> list[tuple[int, int]] | None:
    """(greedy accept length, recorded accept length) of some sampled records: all of them up to
    MAX_SAMPLED_REPLAYS, else _REPLAY_RUNS runs of consecutive ones spread over the trace (a run lies in
    one or two stored batches, so few are decoded). None when a record lacks the target's argmax."""
    if rows.size > MAX_SAMPLED_REPLAYS:
        run = MAX_SAMPLED_REPLAYS // _REPLAY_RUNS
        starts = np.linspace(0, rows.size - run, _REPLAY_RUNS).astype(np.int64)
        rows = rows[(starts[:, None] + np.arange(run)).reshape(-1)]
    table = trace.take(rows, ["tokens", "parents", "valid", "target_argmax", "accept_length"])
    if table["target_argmax"].null_count:
        return None
    out = []
    for r in table.to_pylist():
        valid = r["valid"] or [True] * len(r["tokens"])
        out.append((len(ref.greedy_decision(r["tokens"], r["parents"], valid, r["target_argmax"]).path) - 1,
                    r["accept_length"]))
    return out


def _median_of_others(means: dict[int, float]) -> dict[int, float]:
    """For every request, the median of the other requests' means (one sort, not one per request)."""
    ids = list(means)
    values = np.array([means[i] for i in ids])
    order = np.argsort(values, kind="stable")
    ranked = values[order]
    n = len(ranked)
    lo, hi = (n - 2) // 2, (n - 1) // 2  # the median's positions among n - 1 others
    out = {}
    for position, k in enumerate(order.tolist()):
        a = ranked[lo if lo < position else lo + 1]
        b = ranked[hi if hi < position else hi + 1]
        out[ids[k]] = float((a + b) / 2)
    return out


def suspicious_numbers(trace) -> list[str]:
    """One sentence per suspicious number of ``trace`` (empty when nothing looks wrong).

    Streams the trace's batches (a few columns each), so it runs on a trace of any size; sampled
    acceptance is re-verified greedily on at most MAX_SAMPLED_REPLAYS records (see `_greedy_replays`)."""
    if len(trace) < MIN_RECORDS:
        return []
    draft = trace.run_info.get("draft", {}) if isinstance(trace.run_info.get("draft"), dict) else {}
    method = draft.get("method", trace.run_info.get("method", "none"))
    if method in (None, "none"):
        return []
    tally = _Tally()
    for part in trace.iter_batches(["request_id", "temperature", "tokens", "parents", "depth", "accept_length"]):
        tally.add(part)
    out: list[str] = []
    replays = _greedy_replays(trace, np.concatenate(tally.sampled_rows)) if tally.sampled_rows else None
    if replays:
        greedy = statistics.fmean(g for g, _ in replays)
        got = statistics.fmean(a for _, a in replays)
        if got > greedy + SAMPLED_MARGIN:
            out.append(f"sampled acceptance ({got:.2f} per iteration) is above what greedy verification accepts "
                       f"of the same drafts ({greedy:.2f}): the sampling threshold may accept too much")
    for d in range(1, tally.deepest + 1):
        reached = int(tally.reached[d]) if d < len(tally.reached) else 0
        if reached >= MIN_RECORDS:
            rate = (int(tally.accepted[d]) if d < len(tally.accepted) else 0) / reached
            if rate < DEAD_LAYER_RATE:
                what = f"layer {d - 1}" if method == "multi_layer_eagle" else f"depth {d}"
                out.append(f"{what} accepts {100 * rate:.1f} % of its drafts when reached ({reached} times): "
                           "a trained draft should do better (wrong positions or inputs?)")
                break
    steps = draft.get("num_steps")
    if method in ("eagle", "multi_layer_eagle") and isinstance(steps, int) and tally.deepest < steps:
        out.append(f"num_steps is {steps} but no draft tree is deeper than {tally.deepest}")
    means = {rid: tally.request_sum[rid] / count for rid, count in tally.request_count.items() if count >= 5}
    others = _median_of_others(means) if len(means) >= 3 else {}
    for rid, mean in sorted(means.items()):
        if rid in others and others[rid] >= 1.0 and mean < LOW_REQUEST_FACTOR * others[rid]:
            out.append(f"request {rid} accepts {mean:.2f} per iteration, the others {others[rid]:.2f} "
                       "(median): state from another request?")
    if tally.repeats > ROOT_REPEAT_SHARE * tally.records:
        out.append(f"in {tally.repeats} of {tally.records} iterations a first drafted token repeats the root token "
                   "(drafting one position behind?)")
    return out
