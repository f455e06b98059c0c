"""Bytes per trace record on the demo workloads, by codec, at N = 16 and N = 64.

Figure: docs/BENCHMARKS.md "Trace size on disk". Time: about 2 minutes on the CPU.

    python benchmarks/trace_size.py [--prompts 8] [--max-new-tokens 128]

Decodes the demo prompts (completion and editing) with the bundled demo model on the CPU,
recording every iteration: N-gram (N = 16 and 64) and EAGLE (5 steps, top-4, N = 16; 6 steps,
top-8, N = 64). Each trace is written again with every codec (the narrow on-disk types of
the current format, no compression / lz4 / zstd levels 1 and 3) and reported as
bytes per record (the file less its header, which holds the tokenizer) and the writer's CPU
µs per record. Writes trace_size.json to $OUT when it is set.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

import spectool as st
from spectool.config import EagleConfig, NgramConfig
from spectool.demo import demo_model
from spectool.prompts import load_prompts
from spectool.trace.format import TraceFileWriter
from spectool.trace.schema import STEP_SCHEMA

CODECS = {"none": (None, None), "lz4": ("lz4", None), "zstd-1": ("zstd", 1), "zstd-3": ("zstd", 3)}


def configs(root: Path) -> dict:
    return {
        "ngram N=16": NgramConfig(num_draft_tokens=16),
        "ngram N=64": NgramConfig(num_draft_tokens=64, max_bfs_breadth=16),
        "eagle N=16": EagleConfig(root / "eagle", num_steps=5, topk=4, num_draft_tokens=16),
        "eagle N=64": EagleConfig(root / "eagle", num_steps=6, topk=8, num_draft_tokens=64),
    }


def sizes(trace, tmp: Path) -> dict:
    out = {}
    for name, codec in CODECS.items():
        path = tmp / f"{name}.sptrace"
        writer = TraceFileWriter(path, trace.run_info, trace.tokenizer_json, compression=codec)
        header = path.stat().st_size
        t0 = time.thread_time()
        for start in range(0, trace.steps.num_rows, 1024):  # the engine's flush unit
            writer.write(trace.steps.slice(start, 1024), trace.requests.slice(0, 0))
        cpu = time.thread_time() - t0
        writer.close()
        rows = trace.steps.num_rows
        out[name] = {"bytes_per_record": (path.stat().st_size - header) / rows,
                     "writer_us_per_record": 1e6 * cpu / rows}
    out["in_memory"] = {"bytes_per_record": trace.steps.nbytes / trace.steps.num_rows}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    root = demo_model()
    target = st.load(root / "target", device="cpu", dtype=torch.float32)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in configs(root).items():
            engine = st.Engine(target, draft=cfg, max_batch_size=8, max_seq_len=2048)
            for kind in ("completion", "editing"):
                prompts = load_prompts(root / "prompts.jsonl", kind)[: args.prompts]
                trace = engine.generate(prompts, max_new_tokens=args.max_new_tokens, record=True).trace
                assert trace.steps.schema.equals(STEP_SCHEMA)
                row = {"method": name, "workload": kind, "records": trace.steps.num_rows, **sizes(trace, Path(tmp))}
                results.append(row)
                cells = "  ".join(f"{c} {row[c]['bytes_per_record']:7.0f} B ({row[c]['writer_us_per_record']:5.1f} µs)"
                                  for c in CODECS)
                print(f"{name:<11} {kind:<10} {row['records']:5d} records  in memory "
                      f"{row['in_memory']['bytes_per_record']:6.0f} B  {cells}", flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "trace_size.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
