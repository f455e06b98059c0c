"""Where a graphed decode step's time goes, kernel by kernel (torch.profiler over CUDA graph replays).

    python3 benchmarks/decode.py --profile kernels --shape 8B        # H200, bf16, batch 1, 512-token prefix
    python3 benchmarks/decode.py --profile kernels --shape 8B --unfused

Explains: docs/BENCHMARKS.md "Plain decoding" (its "% of floor" column). Time: under a minute on an H200.

One decode step (forward + final norm + lm_head + argmax, as benchmarks/decode.py
times it) is captured in a CUDA graph and replayed under the profiler. From the
kernels' own start/end times it reports per step: each kernel (name shortened) with
its count and total µs, the sum of kernel time, the step's span from the first
kernel's start to the last one's end, and the idle time between kernels (span - sum:
what launches cost inside the graph). Prints a table; writes profile_decode.json to
$OUT when it is set.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import tempfile

import torch
from decode import model_config

from spectool.graphs import GraphRunner
from spectool.kernels import ops
from spectool.kernels.fused import argmax_triton
from spectool.model.kv_cache import KVCache
from spectool.model.llama import Transformer


def short_name(name: str) -> str:
    """A readable kernel name: Triton kernels keep theirs, cuBLAS/ATen ones lose template noise."""
    name = re.sub(r"<.*", "", name.split("(")[0])
    return name[:60]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8B")
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--unfused", action="store_true", help="without the fused one-row GEMVs")
    args = parser.parse_args(argv)
    ops.FUSED_GEMV = not args.unfused
    if not torch.cuda.is_available():
        raise SystemExit("decode.py --profile kernels profiles CUDA kernels: it needs a GPU")
    device = torch.device("cuda")
    torch.manual_seed(0)
    cfg = model_config(args.shape, args.prefix + args.steps + 64)
    with torch.device(device):
        model = Transformer(cfg).to(torch.bfloat16).eval()
    cache = KVCache.for_model(cfg, 1, args.prefix + args.steps + 64, torch.bfloat16, device)

    def step(tokens, positions, slots, starts):
        hidden = model(tokens, positions, cache=cache, slots=slots, starts=starts)
        return argmax_triton(model.logits(hidden)[:, -1])

    runner = GraphRunner(step, buckets=(1,), enabled=True)
    slots = torch.zeros(1, dtype=torch.long, device=device)
    starts = torch.full((1,), args.prefix, dtype=torch.long, device=device)
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    with torch.inference_mode():
        runner.capture(1, tokens=token, positions=starts[:, None], slots=slots, starts=starts)
        for _ in range(3):
            runner(1, tokens=token, positions=starts[:, None], slots=slots, starts=starts)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                runner(1, tokens=token, positions=starts[:, None], slots=slots, starts=starts)
                torch.cuda.synchronize()  # steps apart, so each one's span is its own
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    # Split into steps at the host syncs: a gap much longer than any in-graph gap.
    steps, current = [], []
    for e in kernels:
        if current and e["ts"] - (current[-1]["ts"] + current[-1]["dur"]) > 50:
            steps.append(current)
            current = []
        current.append(e)
    steps.append(current)
    steps = steps[1:] if len(steps) > args.steps else steps  # a stray first group, if any
    per_kernel = collections.defaultdict(lambda: [0, 0.0])
    spans, busy = [], []
    for s in steps:
        spans.append(s[-1]["ts"] + s[-1]["dur"] - s[0]["ts"])
        busy.append(sum(e["dur"] for e in s))
        for e in s:
            per_kernel[short_name(e["name"])][0] += 1
            per_kernel[short_name(e["name"])][1] += e["dur"]
    n = len(steps)
    rows = sorted(({"kernel": k, "per_step": c / n, "us_per_step": t / n, "us_each": t / c}
                   for k, (c, t) in per_kernel.items()), key=lambda r: -r["us_per_step"])
    summary = {"shape": args.shape, "steps": n, "kernels_per_step": len(kernels) / max(1, len(steps)),
               "span_us": sorted(spans)[n // 2], "kernel_us": sorted(busy)[n // 2]}
    summary["idle_us"] = summary["span_us"] - summary["kernel_us"]
    label = args.shape + " (unfused GEMVs)" * args.unfused
    print(f"{label}, batch 1, prefix {args.prefix}: {summary['kernels_per_step']:.0f} kernels per step, "
          f"span {summary['span_us']:.0f} µs, kernels {summary['kernel_us']:.0f} µs, "
          f"idle between kernels {summary['idle_us']:.0f} µs (medians over {n} steps)")
    print("\n| kernel | per step | µs per step | µs each |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kernel']} | {r['per_step']:.0f} | {r['us_per_step']:.1f} | {r['us_each']:.2f} |")
    if os.environ.get("OUT"):
        name = f"profile_decode_{args.shape}{'_unfused' * args.unfused}.json"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump({"summary": summary, "kernels": rows}, f, indent=1)
    return 0

