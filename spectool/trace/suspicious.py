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

from spectool.trace import reference as ref

MIN_RECORDS = 20          # fewer records than this say nothing
DEAD_LAYER_RATE = 0.02    # acceptance below this where a depth is reached
SAMPLED_MARGIN = 0.25     # sampled mean accept length above greedy's on the same drafts by this much
LOW_REQUEST_FACTOR = 0.25  # a request below this fraction of the other requests' median
ROOT_REPEAT_SHARE = 0.5


def suspicious_numbers(trace) -> list[str]:
    """One sentence per suspicious number of ``trace`` (empty when nothing looks wrong)."""
    cols = ["request_id", "temperature", "tokens", "parents", "valid", "depth", "accept_length",
            "target_argmax"]
    rows = trace.steps.select(cols).to_pylist()
    if len(rows) < MIN_RECORDS:
        return []
    out: list[str] = []
    draft = trace.run_info.get("draft", {}) if isinstance(trace.run_info.get("draft"), dict) else {}
    method = draft.get("method", trace.run_info.get("method", "none"))
    if method in (None, "none"):
        return out
    sampled = [r for r in rows if r["temperature"] not in (None, 0.0)]
    if sampled and all(r["target_argmax"] is not None for r in sampled):
        greedy = statistics.fmean(len(ref.greedy_decision(r["tokens"], r["parents"], r["valid"] or [True] * len(
            r["tokens"]), r["target_argmax"]).path) - 1 for r in sampled)
        got = statistics.fmean(r["accept_length"] for r in sampled)
        if got > greedy + SAMPLED_MARGIN:
            out.append(f"sampled acceptance ({got:.2f} per iteration) is above what greedy verification accepts "
                       f"of the same drafts ({greedy:.2f}): the sampling threshold may accept too much")
    depth = [max(r["depth"]) if r["depth"] else 0 for r in rows]
    deepest = max(depth)
    for d in range(1, deepest + 1):
        reached = [r for r, m in zip(rows, depth) if m >= d and r["accept_length"] >= d - 1]
        if len(reached) >= MIN_RECORDS:
            rate = sum(r["accept_length"] >= d for r in reached) / len(reached)
            if rate < DEAD_LAYER_RATE:
                what = f"layer {d - 1}" if method == "multi_layer_eagle" else f"depth {d}"
                out.append(f"{what} accepts {100 * rate:.1f} % of its drafts when reached ({len(reached)} times): "
                           "a trained draft should do better (wrong positions or inputs?)")
                break
    steps = draft.get("num_steps")
    if method in ("eagle", "multi_layer_eagle") and isinstance(steps, int) and deepest < steps:
        out.append(f"num_steps is {steps} but no draft tree is deeper than {deepest}")
    per_request: dict[int, list[int]] = {}
    for r in rows:
        per_request.setdefault(r["request_id"], []).append(r["accept_length"])
    means = {rid: statistics.fmean(v) for rid, v in per_request.items() if len(v) >= 5}
    for rid, mean in sorted(means.items()):
        others = [m for r, m in means.items() if r != rid]
        if len(others) >= 2 and statistics.median(others) >= 1.0 and mean < LOW_REQUEST_FACTOR * statistics.median(
                others):
            out.append(f"request {rid} accepts {mean:.2f} per iteration, the others {statistics.median(others):.2f} "
                       "(median): state from another request?")
    repeats = sum(any(p == 0 and t == r["tokens"][0] for p, t in zip(r["parents"][1:], r["tokens"][1:]))
                  for r in rows if len(r["tokens"]) > 1)
    if repeats > ROOT_REPEAT_SHARE * len(rows):
        out.append(f"in {repeats} of {len(rows)} iterations a first drafted token repeats the root token "
                   "(drafting one position behind?)")
    return out
