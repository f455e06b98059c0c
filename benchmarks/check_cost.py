"""What checking costs: seconds per 1,000 records of `check` alone and of `check --replay`.

Figure: docs/BENCHMARKS.md "The checker". Time: about 2 minutes on the CPU.

    python benchmarks/check_cost.py [--device cpu|cuda] [--max-new-tokens 64] [--prompts 4]

Records a greedy and a sampled trace of the demo model with each draft method, then times
``check_trace`` (the checker's reference over every record) and ``replay`` (plain causal
target forwards over every request and every tree's other branches, plus the drafters'
replay) on each. Prints a table and writes check_cost.json to $OUT when it is set.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import spectool as st
from spectool.trace.check import check_trace
from spectool.trace.replay import replay


def configs(demo: Path) -> dict:
    return {"none": None, "ngram": st.NgramConfig(num_draft_tokens=12),
            "eagle": st.EagleConfig(str(demo / "eagle"), num_steps=4, topk=4, num_draft_tokens=12),
            "multi_layer_eagle": st.MultiLayerEagleConfig(str(demo / "multi_layer_eagle"), num_steps=4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=4)
    args = p.parse_args()
    demo = st.demo_model()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    target = st.load(str(demo / "target"), device=args.device, dtype=dtype)
    lines = (demo / "prompts.jsonl").read_text().splitlines()[: args.prompts]
    prompts = [json.loads(line)["prompt"] for line in lines]
    rows = []
    print(f"{'method':<18} {'temp':>5} {'records':>8} {'check s/1k':>11} {'replay s/1k':>12} {'divergences':>12}")
    for method, cfg in configs(demo).items():
        engine = st.Engine(target, draft=cfg, max_batch_size=4, max_seq_len=2048)
        for temperature in (0.0, 0.8):
            trace = engine.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=temperature).trace
            n = trace.steps.num_rows
            t0 = time.perf_counter()
            fault = check_trace(trace)
            t1 = time.perf_counter()
            report = replay(trace, str(demo / "target"), args.device)
            t2 = time.perf_counter()
            row = {"method": method, "temperature": temperature, "records": n, "device": args.device,
                   "check_s_per_1k": (t1 - t0) / n * 1000, "replay_s_per_1k": (t2 - t1) / n * 1000,
                   "fault": None if fault is None else str(fault),
                   "replay_fault": None if report.fault is None else str(report.fault),
                   "divergences": len(report.divergences),
                   "near_ties": sum(d.near_tie for d in report.divergences)}
            rows.append(row)
            print(f"{method:<18} {temperature:>5} {n:>8} {row['check_s_per_1k']:>11.3f} "
                  f"{row['replay_s_per_1k']:>12.2f} {row['divergences']:>12}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "check_cost.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
