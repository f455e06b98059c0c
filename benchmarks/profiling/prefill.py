"""What a prefill costs: its wall time with and without CUDA graphs, and its GPU kernels' time.

    python3 benchmarks/speculative.py --profile prefill                 # on a GPU
    python3 benchmarks/speculative.py --profile prefill --batch 16 --length 530   # sixteen long prompts
    python3 benchmarks/speculative.py --profile prefill --device cpu --length 40   # smoke test
    python3 benchmarks/speculative.py --profile prefill --model out/large/target --draft-dir out/large \
        --methods plain,eagle,multi_layer_eagle --length 530                 # what each draft adds

Explains: docs/BENCHMARKS.md "Speculative decoding" (the end-to-end figures: time to first token).
Time: under a minute on an H200.

For the bundled demo target and a random-weight target of the trained 113M shape (decode.py's
"113M"), or the target ``--model`` names, and each of ``--methods`` (plain decoding by default; a
draft method reads its checkpoint from ``--draft-dir``, the demo's own drafts for the demo target,
and is left out for the random-weight one), ``--batch`` prompts (one by default) of ``--length`` random tokens: the
median of ``--repeats`` one-token ``generate`` calls (the prefill and its first token) with CUDA graphs and without,
each after warm-up calls on the same length; and the summed self time of the CUDA kernels of one
graphed and one eager call (torch.profiler), what the GPU itself works. Prints a table; writes
prefill.json to $OUT when it is set; the graphed calls also list their costliest kernels and
host calls (self CPU time: where a call waits or launches).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from decode import random_target
from speculative import default_device, draft_config

import spectool as st
from spectool.demo import demo_model

TOP_KERNELS = 8  # the costliest kernels listed per graphed call


def call_ms(engine, prompts: list[list[int]], repeats: int, sync) -> float:
    for _ in range(3):  # the padded length's graph is captured here, not in the timed calls
        engine.generate(prompts, max_new_tokens=1, record=False, ignore_eos=True)
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        engine.generate(prompts, max_new_tokens=1, record=False, ignore_eos=True)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kernel_ms(engine, prompts: list[list[int]]) -> tuple[float | None, list[dict], list[dict]]:
    """Summed self CUDA time of the kernels of one call (None on the CPU), the costliest kernels
    and the costliest host calls by self CPU time: name (shortened), count and ms."""
    if engine.device.type != "cuda":
        return None, [], []
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from profiling._kernel_table import short_name

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, max_new_tokens=1, record=False, ignore_eos=True)
        torch.cuda.synchronize()
    # The kernels' own rows: an aten op's row also carries the device time of the kernels it
    # launched, so summing every row counts those kernels twice.
    events = [e for e in prof.key_averages()
              if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:TOP_KERNELS]
    host = sorted((e for e in prof.key_averages() if e.device_type == DeviceType.CPU),
                  key=lambda e: -e.self_cpu_time_total)[:TOP_KERNELS]
    return (sum(e.self_device_time_total for e in events) / 1e3,
            [{"kernel": short_name(e.key), "count": e.count, "ms": e.self_device_time_total / 1e3} for e in top],
            [{"call": e.key, "count": e.count, "ms": e.self_cpu_time_total / 1e3} for e in host])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=default_device())
    p.add_argument("--length", type=int, default=200, help="prompt tokens")
    p.add_argument("--batch", type=int, default=1, help="prompts per call")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--model", help="target directory to profile instead of the demo and the 113M shape")
    p.add_argument("--draft-dir", help="the draft checkpoints of --model (eagle/, multi_layer_eagle/, eagle3/)")
    p.add_argument("--methods", default="plain", help="comma list of plain, ngram, eagle, multi_layer_eagle, eagle3")
    args = p.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    if args.model and not args.draft_dir and set(methods) - {"plain", "ngram"}:
        p.error("a draft method on --model needs --draft-dir")
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows = []
    targets = [("model", args.model)] if args.model else [("demo", None), ("113M", None)]
    for name, path in targets:
        if name == "113M":
            target, drafts = random_target("113M", str(dev), 2048), None  # random weights: no draft fits it
        else:
            target = st.load(path or demo_model() / "target", device=str(dev), dtype=dtype)
            drafts = args.draft_dir if path else demo_model()
        prompts = torch.randint(1, target.config.vocab_size, (args.batch, args.length),
                                generator=torch.Generator().manual_seed(0)).tolist()
        for method in methods:
            if drafts is None and method not in ("plain", "ngram"):
                print(f"{name:<5} {method}: left out (no draft checkpoint for a random-weight target)")
                continue
            for graphs in (True, False):
                # Room for a padded prefill: a cache shorter than the padded length prefills eagerly.
                engine = st.Engine(target, draft=draft_config(method, drafts or ""), max_batch_size=args.batch,
                                   max_seq_len=2 * args.length + 8, cuda_graphs=graphs)
                ms = call_ms(engine, prompts, args.repeats, sync)  # warms up first: the profiled call captures nothing
                kernels, top, host = kernel_ms(engine, prompts)
                rows.append({"target": name, "method": method, "layers": target.config.num_layers,
                             "cuda_graphs": graphs, "prompts": args.batch, "prompt_tokens": args.length,
                             "call_ms": ms, "kernel_ms": kernels, "kernels": top, "host_calls": host})
                r = rows[-1]
                gpu = "n/a" if kernels is None else f"{kernels:.2f}"
                print(f"{name:<5} {method:<17} {r['layers']:>3} layers  {args.batch} x {args.length} tokens  "
                      f"graphs {str(graphs):<5}  one-token call {ms:7.2f} ms  GPU kernels {gpu} ms",
                      flush=True)
                if graphs:
                    for k in top:
                        print(f"    {k['kernel']:<60} {k['count']:>5} x  {k['ms']:7.2f} ms")
                    for h in host:
                        print(f"    host {h['call']:<55} {h['count']:>5} x  {h['ms']:7.2f} ms")
                del engine
        del target
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        (Path(out) / "prefill.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
