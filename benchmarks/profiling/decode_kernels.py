"""Where a graphed decode step's time goes, kernel by kernel (torch.profiler over CUDA graph replays).

    python3 benchmarks/decode.py --profile kernels --shape 8B        # H200, bf16, batch 1, 512-token prefix
    python3 benchmarks/decode.py --profile kernels --shape 8B --batch 8
    python3 benchmarks/decode.py --profile kernels --shape 8B --unfused

Explains: docs/BENCHMARKS.md "Plain decoding" (its "% of floor" column). Time: under a minute on an H200.

One decode step (forward + final norm + lm_head + argmax, as benchmarks/decode.py
times it) is captured in a CUDA graph and replayed under the profiler. From the
kernels' own start/end times it reports per step: each kernel (name shortened) with
its count and total µs, the sum of kernel time, the step's span from the first
kernel's start to the last one's end, and the idle time between kernels (span - sum:
what launches cost inside the graph). Prints a table; writes profile_decode_<shape>_b<batch>.json to
$OUT when it is set.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from decode import model_config

from profiling._kernel_table import graph_kernels, print_rows
from spectool.graphs import GraphRunner
from spectool.kernels import ops
from spectool.kernels.fused import argmax_triton
from spectool.model.kv_cache import KVCache
from spectool.model.llama import Transformer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8B")
    parser.add_argument("--batch", type=int, default=1)
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
    b = args.batch
    cache = KVCache.for_model(cfg, b, args.prefix + args.steps + 64, torch.bfloat16, device)

    def step(tokens, positions, slots, starts):
        hidden = model(tokens, positions, cache=cache, slots=slots, starts=starts)
        return argmax_triton(model.logits(hidden)[:, -1])

    runner = GraphRunner(step, buckets=(b,), enabled=True)
    slots = torch.arange(b, dtype=torch.long, device=device)
    starts = torch.full((b,), args.prefix, dtype=torch.long, device=device)
    token = torch.zeros(b, 1, dtype=torch.long, device=device)
    with torch.inference_mode():
        runner.capture(b, tokens=token, positions=starts[:, None], slots=slots, starts=starts)
        for _ in range(3):
            runner(b, tokens=token, positions=starts[:, None], slots=slots, starts=starts)
        summary, rows = graph_kernels(lambda: runner(b, tokens=token, positions=starts[:, None], slots=slots,
                                                      starts=starts), args.steps)
    summary["shape"], summary["batch"] = args.shape, b
    n = summary["steps"]
    label = args.shape + " (unfused GEMVs)" * args.unfused
    print(f"{label}, batch {b}, prefix {args.prefix}: {summary['kernels_per_step']:.0f} kernels per step, "
          f"span {summary['span_us']:.0f} µs, kernels {summary['kernel_us']:.0f} µs, "
          f"idle between kernels {summary['idle_us']:.0f} µs (medians over {n} steps)")
    print_rows(rows)
    if os.environ.get("OUT"):
        name = f"profile_decode_{args.shape}_b{b}{'_unfused' * args.unfused}.json"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump({"summary": summary, "kernels": rows}, f, indent=1)
    return 0

