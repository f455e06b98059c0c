"""Host work per engine iteration outside the timed phases.

    python3 benchmarks/speculative.py --profile host                   # CPU: methods x batch 1, 4
    python3 benchmarks/speculative.py --profile host --cprofile --methods none --batches 1
    python3 benchmarks/speculative.py --profile host --device cuda     # on a GPU

Explains: docs/BENCHMARKS.md "Speculative decoding" (what the engine's loop adds beyond its phases).
Time: about 1 minute on the CPU.

On the CPU a tiny model's forward is cheap, so most of an iteration's wall time is host
work. For each method (none and ngram on decode.py's "tiny" random-weight target, eagle and
multi_layer_eagle on the bundled demo model, whose draft layers fit only their own target)
and batch size, a greedy ``Engine.stream`` run reports medians per iteration of:

- iteration_us: the engine's own ``iteration_us`` stat (``Engine._iteration``);
- phases_us: the top-level timed phases (draft + verify + commit + trie_put; trie_get and
  index run inside draft, so they are not added again);
- host_us: iteration_us - phases_us, the host work outside every phase;
- loop_us: wall time between consecutive stream events (adds the stream loop's own work).

``--cprofile`` prints a cProfile top-20 (by own time, the model forwards left out) of one more
run per configuration.
``--record`` measures with recording on. Prints a table; writes host_overhead.json to
$OUT when it is set.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time
from pathlib import Path

import torch
from decode import random_target
from speculative import draft_config

import spectool as st

METHODS = ("none", "ngram", "eagle", "multi_layer_eagle")
TOP_PHASES = ("draft_us", "verify_us", "commit_us", "trie_put_us")
# cProfile rows ("file:line(function)") outside the model forward (its modules and its torch ops).
_OUTSIDE_FORWARD = (r"^(?!.*(spectool/model/|spectool/kernels/|torch/nn/modules/|_nn\.|torch\.rms_norm"
                    r"|torch\.embedding|scaled_dot_product))")


def prompts_for(target, batch: int, length: int) -> list[list[int]]:
    """Random prompts whose second half repeats the first (so N-gram drafting finds matches)."""
    gen = torch.Generator().manual_seed(0)
    half = [torch.randint(1, target.config.vocab_size, (length // 2,), generator=gen).tolist()
            for _ in range(batch)]
    return [h + h for h in half]


def run_once(engine, prompts, new_tokens: int, record: bool) -> dict:
    """One greedy stream; per-iteration medians of the engine's stats and of the loop's wall time."""
    gaps, last = [], None
    state: dict = {}
    for _ in engine.stream(prompts, max_new_tokens=new_tokens, record=record, ignore_eos=True, _state=state):
        now = time.perf_counter()
        if last is not None:
            gaps.append((now - last) * 1e6)
        last = now
    cols = state["stats"].columns
    first = [i for i in range(len(cols["iteration"])) if i == 0 or cols["iteration"][i] != cols["iteration"][i - 1]]
    iteration = [cols["iteration_us"][i] for i in first]
    phases = [sum(cols[p][i] for p in TOP_PHASES) for i in first]
    return {"iteration_us": statistics.median(iteration), "phases_us": statistics.median(phases),
            "host_us": statistics.median(i - p for i, p in zip(iteration, phases)),
            "loop_us": statistics.median(gaps) if gaps else float("nan"),
            "accept_length": state["stats"].mean_accept_length, "iterations": len(first)}


def measure(method: str, batch: int, args, targets: dict, demo: Path) -> dict:
    target = targets["demo" if method in ("eagle", "multi_layer_eagle") else "tiny"]
    engine = st.Engine(target, draft=draft_config("plain" if method == "none" else method, demo), max_batch_size=batch,
                       max_seq_len=args.prompt_len + args.new_tokens + 8)
    prompts = prompts_for(target, batch, args.prompt_len)
    run_once(engine, prompts, args.new_tokens, args.record)  # warm-up: graph capture, allocator, JIT
    runs = [run_once(engine, prompts, args.new_tokens, args.record) for _ in range(args.repeats)]
    row = {"method": method, "batch": batch, "target": Path(target.name).parent.name or target.name,
           "record": args.record}
    for key in runs[0]:
        row[key] = statistics.median(r[key] for r in runs)
    if args.cprofile:
        prof = cProfile.Profile()
        prof.enable()
        run_once(engine, prompts, args.new_tokens, args.record)
        prof.disable()
        text = io.StringIO()
        # Leave out the target's and draft layers' forwards: what remains is the loop's host work.
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(_OUTSIDE_FORWARD, 20)
        row["profile"] = text.getvalue()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--record", action="store_true", help="measure with recording on")
    p.add_argument("--cprofile", action="store_true", help="cProfile top-20 of one more run per configuration")
    args = p.parse_args(argv)
    if args.new_tokens < 3 or args.prompt_len < 2 or args.repeats < 1 or min(args.batches) < 1:
        p.error("need --new-tokens >= 3, --prompt-len >= 2, --repeats >= 1 and batch sizes >= 1")

    demo = Path(st.demo_model())
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    targets = {"tiny": random_target("tiny", args.device, args.prompt_len + args.new_tokens + 64)}
    if {"eagle", "multi_layer_eagle"} & set(args.methods):
        targets["demo"] = st.load(str(demo / "target"), device=args.device, dtype=dtype)

    print(f"device {args.device}, torch {torch.__version__}, record={args.record}, "
          f"prompt {args.prompt_len} + {args.new_tokens} new tokens, medians of {args.repeats} runs")
    print(f"{'method':>18} {'bs':>3} {'target':>12} {'iter_us':>9} {'phases_us':>9} {'host_us':>8} "
          f"{'loop_us':>8} {'accept':>6}")
    rows = []
    for method in args.methods:
        for batch in args.batches:
            row = measure(method, batch, args, targets, demo)
            rows.append(row)
            print(f"{method:>18} {batch:>3} {row['target']:>12} {row['iteration_us']:>9.1f} "
                  f"{row['phases_us']:>9.1f} {row['host_us']:>8.1f} {row['loop_us']:>8.1f} "
                  f"{row['accept_length']:>6.2f}", flush=True)
    for row in rows:
        if "profile" in row:
            print(f"\n--- cProfile, {row['method']} bs {row['batch']} (one run) ---")
            print(row["profile"])
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / "host_overhead.json"
        path.write_text(json.dumps({"args": vars(args), "torch": torch.__version__, "rows": rows}, indent=1))
        print(f"wrote {path}")
    return 0

