"""How fast the what-if tuner sweeps: N-gram over a 10,000-token trace, EAGLE over 2,000 tokens.

Figure: docs/BENCHMARKS.md "What-if tuner". Time: about 3 minutes on one CPU core.

    taskset -c 0 python benchmarks/tune_speed.py          # one CPU core (the figure's setting)
    python benchmarks/tune_speed.py --quick               # smoke test

N-gram: a greedy trace of held-out source (each request: a held-out module's first 64
tokens as prompt, its next tokens as output, 10,000 output tokens in all; the N-gram
replay needs only tokens, not the target), swept over 100 configurations (breadth, N,
trie depth, match). EAGLE: a real greedy trace of the demo model (2,000 output tokens,
recorded once on the CPU in float32), swept over 20 EAGLE configurations and the 4
multi-layer EAGLE ones. Also the what-if TuningPanel over a recorded N-gram trace of the demo
model (4 editing prompts, 128 tokens each): kernel time from a slider move to the updated
prediction, for settings not predicted before. Prints seconds per sweep; writes
$OUT/tune_speed.json (or --out).
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import pyarrow as pa
import torch
from speculative import add_common_arguments, run_meta, write_json

import spectool as st
from spectool.prompts import load_prompts
from spectool.trace.reader import Trace
from spectool.trace.schema import REQUEST_SCHEMA, STEP_SCHEMA
from spectool.tune.recommend import tune


def token_trace(target, prompts_path: str, total: int, per_request: int) -> Trace:
    """A greedy trace of held-out text: prompt = first 64 tokens of a source, output = the next ones."""
    texts = load_prompts(prompts_path)
    streams = [target.encode(t) for t in texts]
    streams = [s for s in streams if len(s) > 64 + 16]
    rows, made, i = [], 0, 0
    while made < total:
        s = streams[i % len(streams)]
        out = s[64:64 + min(per_request, total - made)]
        while len(out) < min(per_request, total - made):  # short sources repeat (edits of the same file)
            out = out + s[:min(per_request, total - made) - len(out)]
        rows.append({"request_id": i, "prompt_tokens": s[:64], "output_tokens": out, "finish_reason": "length",
                     "prompt_text": ""})
        made += len(out)
        i += 1
    requests = pa.Table.from_pylist(rows, schema=REQUEST_SCHEMA)
    info = {"engine": {"max_batch_size": 8, "temperature": 0.0}, "draft": {"method": "ngram"},
            "model": {"name": target.name, "hash": target.model_hash}}
    return Trace.from_tables(STEP_SCHEMA.empty_table(), requests, info)


def ngram_grid(count: int) -> list:
    grid = itertools.product([1, 2, 4, 8, 16], [4, 8, 12, 16, 24], [6, 18], ["bfs", "prob"])
    configs = [st.NgramConfig(max_bfs_breadth=b, num_draft_tokens=n, max_trie_depth=d, match=m)
               for b, n, d, m in grid]
    return configs[:count]


def eagle_grid(path, count: int) -> list:
    out = []
    for s, k, n in itertools.product([2, 3, 4, 5, 6], [1, 2, 4, 8], [8, 16]):
        try:
            out.append(st.EagleConfig(path, num_steps=s, topk=k, num_draft_tokens=n))
        except ValueError:
            continue
    return out[:count]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    p.add_argument("--ngram-tokens", type=int, default=10_000)
    p.add_argument("--eagle-tokens", type=int, default=2_000)
    args = p.parse_args(argv)
    target = st.load(args.model, device="cpu", dtype=torch.float32)
    n_tokens = 500 if args.quick else args.ngram_tokens
    e_tokens = 32 if args.quick else args.eagle_tokens
    n_configs, e_configs = (10, 4) if args.quick else (100, 20)

    trace = token_trace(target, args.prompts, n_tokens, 1250)
    t0, c0 = time.perf_counter(), time.process_time()
    ngram = tune(trace, grid=ngram_grid(n_configs), progress=False)
    ngram_s, ngram_cpu = time.perf_counter() - t0, time.process_time() - c0

    per_request = e_tokens // 4
    prompts = [target.encode(t)[-64:] for t in load_prompts(args.prompts, "completion")[:4]]
    eagle_path = f"{args.draft_dir}/eagle"
    t0 = time.perf_counter()
    recorded = st.Engine(target, draft=st.EagleConfig(eagle_path), max_batch_size=4, max_seq_len=1024).generate(
        prompts, max_new_tokens=per_request, ignore_eos=True).trace
    record_s = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    eagle = tune(recorded, grid=eagle_grid(eagle_path, e_configs), target=target, progress=False)
    eagle_s, eagle_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    mle = tune(recorded, method="multi_layer_eagle", draft_path=f"{args.draft_dir}/multi_layer_eagle",
               target=target, progress=False)
    mle_s, mle_cpu = time.perf_counter() - t0, time.process_time() - c0

    editing = [target.encode(t)[-128:] for t in load_prompts(args.prompts, "editing")[:4]]
    panel_trace = st.Engine(target, draft=st.NgramConfig(), max_batch_size=4, max_seq_len=1024).generate(
        editing, max_new_tokens=16 if args.quick else 128).trace
    from spectool.widgets import TuningPanel

    panel = TuningPanel(trace=panel_trace, profile="demo-cpu")
    slider_ms = []
    for value in (4, 6, 8, 10, 14, 16, 20, 24):
        t0 = time.perf_counter()
        panel.sliders["num_draft_tokens"].value = value
        slider_ms.append((time.perf_counter() - t0) * 1e3)

    rows = [
        {"sweep": "ngram", "configs": len(ngram.predictions), "output_tokens": n_tokens, "seconds": ngram_s,
         "cpu_seconds": ngram_cpu},
        {"sweep": "eagle", "configs": len(eagle.predictions), "output_tokens": per_request * 4, "seconds": eagle_s,
         "cpu_seconds": eagle_cpu},
        {"sweep": "multi_layer_eagle", "configs": len(mle.predictions), "output_tokens": per_request * 4,
         "seconds": mle_s, "cpu_seconds": mle_cpu},
    ]
    # CPU seconds (this process, all threads) as well as wall: on a shared machine the wall time
    # counts the other work too.
    print(f"{'sweep':<18} {'configs':>7} {'tokens':>7} {'seconds':>8} {'cpu s':>8} {'ms/config':>9}")
    for r in rows:
        print(f"{r['sweep']:<18} {r['configs']:>7} {r['output_tokens']:>7} {r['seconds']:>8.2f} "
              f"{r['cpu_seconds']:>8.2f} {r['seconds'] / r['configs'] * 1e3:>9.1f}")
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"what-if panel, slider move to prediction: median {sorted(slider_ms)[len(slider_ms) // 2]:.0f} ms, "
          f"max {max(slider_ms):.0f} ms over {len(slider_ms)} moves")
    print(f"(recording the EAGLE trace took {record_s:.1f} s; torch threads {torch.get_num_threads()})")
    write_json("tune_speed.json", {"meta": run_meta(args), "rows": rows, "panel_slider_ms": slider_ms}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
