"""Where an engine iteration's time goes, per phase: GPU kernel time against host wall time.

    python3 benchmarks/speculative.py --profile phases                     # H200: 107M shape, every method, bs 1
    python3 benchmarks/speculative.py --profile phases --shape 8B --methods none ngram

Explains: docs/BENCHMARKS.md "Speculative decoding" (its batch-1 cells; with ``--record``, those of
"Recording"). Time: about 1 minute on an H200.

The target has random weights of one of decode.py's shapes (default "107M", the shape of
benchmarks/train_large_target.py's target) and the draft layers are random too: acceptance
means nothing here, but every graph has its real shape (EAGLE's full tree, the multi-layer
chain), so the time per iteration is what a trained model of that shape pays. Each method
decodes ``--tokens`` tokens under torch.profiler after a warm-up run; every timed phase
(PhaseTimer: draft, index, verify, commit, trie_get, trie_put) is also a profiler range,
and each kernel is charged to the phase whose host range launched it (through the
runtime call's correlation id), or to "outside" (the engine's own ops between phases).

Per method and phase, per iteration: host µs (the phase's wall time on the engine thread,
from a run without the profiler; "profiled": the same under the profiler), GPU µs (its
kernels' summed durations) and kernels. A phase whose host time is far above its GPU time
is launch- or Python-bound; the reverse means the GPU queue was already ahead.
``iteration`` is the engine's own iteration_us (unprofiled, then profiled) and ``gpu busy``
the union of every kernel interval in the run divided by the iterations. Prints a table; writes
profile_iteration.json to $OUT when it is set.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from decode import random_drafts, random_target
from speculative import draft_config

import spectool as st
from profiling.host import prompts_for
from spectool import timing

METHODS = ("none", "ngram", "eagle", "multi_layer_eagle")


def _ranged_phases(host_us: dict[str, float] | None = None):
    """Make every PhaseTimer phase a profiler range too, or (``host_us`` given) add its host wall
    time there instead; restored by the returned undo."""
    enter, exit_ = timing._Phase.__enter__, timing._Phase.__exit__

    def new_enter(self):
        if host_us is None:
            self.range = torch.profiler.record_function(f"phase:{self.phase}")
            self.range.__enter__()
        else:
            self.host_start = time.perf_counter()
        enter(self)

    def new_exit(self, *exc):
        exit_(self, *exc)
        if host_us is None:
            self.range.__exit__(*exc)
        else:
            host_us[self.phase] = host_us.get(self.phase, 0.0) + (time.perf_counter() - self.host_start) * 1e6

    timing._Phase.__enter__, timing._Phase.__exit__ = new_enter, new_exit

    def undo():
        timing._Phase.__enter__, timing._Phase.__exit__ = enter, exit_
    return undo


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _short(kernel: str) -> str:
    """A kernel's name without its parameter list, cut to 80 characters (cuBLAS and ATen names
    run to hundreds)."""
    return kernel.replace("(anonymous namespace)::", "").split("(")[0].removeprefix("void ").strip()[:80]


def attribute(events: list[dict]) -> dict:
    """Per phase: summed host range µs, kernel µs and kernel count; plus the kernels' union."""
    ranges = sorted((e["ts"], e["ts"] + e["dur"], e["name"].removeprefix("phase:")) for e in events
                    if e.get("cat") == "user_annotation" and e["name"].startswith("phase:"))
    starts = [r[0] for r in ranges]
    launch_phase = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
            i = bisect.bisect_right(starts, e["ts"]) - 1
            # Innermost range holding the call: phases nest (trie_get inside draft), so look back.
            phase = "outside"
            while i >= 0:
                if ranges[i][0] <= e["ts"] <= ranges[i][1]:
                    phase = ranges[i][2]
                    break
                i -= 1
            launch_phase[e["args"]["correlation"]] = phase
    out = collections.defaultdict(lambda: {"host_us": 0.0, "gpu_us": 0.0, "kernels": 0,
                                           "by_kernel": collections.Counter(),
                                           "count_by_kernel": collections.Counter()})
    for s, e, phase in ranges:
        out[phase]["host_us"] += e - s
    intervals = []
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            phase = launch_phase.get(e.get("args", {}).get("correlation"), "outside")
            out[phase]["gpu_us"] += e["dur"]
            out[phase]["kernels"] += 1
            out[phase]["by_kernel"][_short(e["name"])] += e["dur"]
            out[phase]["count_by_kernel"][_short(e["name"])] += 1
            intervals.append((e["ts"], e["ts"] + e["dur"]))
    return {"phases": dict(out), "gpu_busy_us": _union_us(intervals)}


def profile_method(target, method: str, drafts: Path, batch: int, tokens: int, prompt_len: int,
                   record: bool = False) -> dict:
    engine = st.Engine(target, draft=draft_config("plain" if method == "none" else method, drafts),
                       max_batch_size=batch, max_seq_len=prompt_len + 2 * tokens + 64)
    prompts = prompts_for(target, batch, prompt_len)
    engine.generate(prompts, max_new_tokens=tokens, ignore_eos=True, record=record)  # captures, JIT
    host_us: dict[str, float] = {}
    undo = _ranged_phases(host_us)  # first without the profiler, whose own host cost inflates every range
    try:
        plain_run = engine.generate(prompts, max_new_tokens=tokens, ignore_eos=True, record=record)
    finally:
        undo()
    undo = _ranged_phases()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            res = engine.generate(prompts, max_new_tokens=tokens, ignore_eos=True, record=record)
            torch.cuda.synchronize()
    finally:
        undo()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text())["traceEvents"]
    cols = res.stats.columns
    iters = sorted(set(cols["iteration"]))
    per_iter = [cols["iteration_us"][cols["iteration"].index(i)] for i in iters]
    found = attribute(events)
    n = len(iters)
    phases = {p: {k: ({name: x / n for name, x in v.items()} if isinstance(v, dict) else v / n)
                  for k, v in d.items()} for p, d in found["phases"].items()}
    plain_cols = plain_run.stats.columns
    plain_iters = sorted(set(plain_cols["iteration"]))
    for p, us in host_us.items():
        row = phases.setdefault(p, {"host_us": 0.0, "gpu_us": 0.0, "kernels": 0})
        row["host_us_unprofiled"] = us / len(plain_iters)
    return {"method": method, "batch": batch, "iterations": n, "iteration_us": statistics.median(per_iter),
            "iteration_us_unprofiled": statistics.median(
                plain_cols["iteration_us"][plain_cols["iteration"].index(i)] for i in plain_iters),
            "tokens_per_s_unprofiled": plain_run.stats.tokens_per_s,
            "gpu_busy_us": found["gpu_busy_us"] / n, "tokens_per_s": res.stats.tokens_per_s,
            "accept_length": res.stats.mean_accept_length, "phases": phases}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="107M")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--record", action="store_true", help="decode with record=True (what recording adds)")
    p.add_argument("--kernels", type=int, default=0, metavar="K",
                   help="also list each phase's K kernels with the most GPU time per iteration")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("speculative.py --profile phases profiles CUDA kernels: it needs a GPU")
    target = random_target(args.shape, "cuda", args.prompt_len + 2 * args.tokens + 128)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        drafts = random_drafts(target, Path(tmp))
        for method in args.methods:
            row = profile_method(target, method, drafts, args.batch, args.tokens, args.prompt_len, args.record)
            rows.append(row)
            print(f"\n{method}, bs {args.batch}, {args.shape}, record={args.record}: "
                  f"iteration {row['iteration_us_unprofiled']:.0f} µs "
                  f"({row['iteration_us']:.0f} profiled), GPU busy {row['gpu_busy_us']:.0f} µs, "
                  f"{row['tokens_per_s_unprofiled']:.0f} tok/s ({row['iterations']} iterations)")
            print(f"  {'phase':>10} {'host µs':>9} {'profiled':>9} {'GPU µs':>9} {'kernels':>8}")
            for phase, d in sorted(row["phases"].items(), key=lambda kv: -kv[1]["gpu_us"]):
                print(f"  {phase:>10} {d.get('host_us_unprofiled', 0.0):>9.1f} {d['host_us']:>9.1f} "
                      f"{d['gpu_us']:>9.1f} {d['kernels']:>8.1f}")
            for phase, d in row["phases"].items() if args.kernels else ():
                top = sorted(d["by_kernel"].items(), key=lambda kv: -kv[1])[:args.kernels]
                if top:
                    print(f"  {phase}: kernel, GPU µs and launches per iteration")
                for name, us in top:
                    print(f"    {us:>8.1f} {d['count_by_kernel'][name]:>6.1f}  {name}")
    out = os.environ.get("OUT")
    if out:
        name = "profile_iteration_record.json" if args.record else "profile_iteration.json"
        Path(out, name).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0

