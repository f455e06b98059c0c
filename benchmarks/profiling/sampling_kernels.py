"""Where the graphed sampling verify's time goes, kernel by kernel.

    python3 benchmarks/tree_kernels.py --profile sampling              # bs 1 and 64, N 16, V 128256
    python3 benchmarks/tree_kernels.py --profile sampling --configs c1024-p16-w4,c4096-p16-w4 --dtype bfloat16
    python3 benchmarks/tree_kernels.py --profile sampling --cuts top-p --batches 1   # top-p 0.9 alone

Explains: docs/BENCHMARKS.md "Kernels" (the chunked sampling verify's µs). Time: under a minute on an H200.

The engine's sampling verify (its coins kernel, then ``verify_sampling_chunked``) on random
logits and trees, captured in a CUDA graph and replayed under the profiler, at temperature 0.8
alone, with top-k 50 and with top-k 50 and top-p 0.9 (``--cuts``): per kernel its launches and µs per replay,
and the replay's span, kernel time and idle time between kernels (benchmarks/profiling/_kernel_table.py). Writes
profile_sampling.json to $OUT when it is set.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from profiling._kernel_table import graph_kernels, print_rows
from spectool.kernels.sampling import sampling_coins
from spectool.kernels.verify_sampling_chunked import CONFIGS, DEFAULT_CONFIG, FEW_ROWS_CONFIG
from spectool.verify import verify_sampling_chunked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,64", help="batch sizes, comma-separated")
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--configs", default=f"{FEW_ROWS_CONFIG},{DEFAULT_CONFIG}",
                        help=f"launch shapes, comma-separated, of {', '.join(sorted(CONFIGS))}")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cuts", default="temperature,top-k,top-k-top-p",
                        help="cuts, joined by commas: temperature, top-k (50), top-k-top-p (50, 0.9), top-p (0.9)")
    args = parser.parse_args(argv)
    from tree_kernels import capture, cuts_label, sampling_case, sampling_cuts, warm_up_gpu

    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown launch shape {unknown[0]!r}; one of {', '.join(sorted(CONFIGS))}")
    try:
        cut_list = sampling_cuts(args.cuts)
    except ValueError as err:
        parser.error(str(err))
    if not torch.cuda.is_available():
        raise SystemExit("tree_kernels.py --profile sampling profiles CUDA kernels: it needs a GPU")

    g = torch.Generator().manual_seed(0)
    n, vocab = args.nodes, args.vocab
    warm_up_gpu()
    results = []
    for bs in (int(b) for b in args.batches.split(",")):
        tree, logits, seed, nonces, temps = sampling_case(bs, n, vocab, getattr(torch, args.dtype), g)
        for (top_k, top_p), config in ((cut, c) for cut in cut_list for c in configs):
            def step(top_k=top_k, top_p=top_p, config=config, tree=tree, logits=logits, seed=seed, nonces=nonces,
                     temps=temps):
                coins = sampling_coins(seed, nonces, tree.seq_lens, n)
                return verify_sampling_chunked(tree, logits, temps, top_k, top_p, coins, config)

            graph = capture(step)
            for _ in range(3):
                graph.replay()
            summary, rows = graph_kernels(graph.replay, args.steps)
            cuts = cuts_label(top_k, top_p)
            summary.update(bs=bs, N=n, V=vocab, top_k=top_k, top_p=top_p, config=config, dtype=args.dtype)
            print(f"\nbs {bs}, N {n}, V {vocab}, {args.dtype}, {cuts}, {config}: "
                  f"{summary['kernels_per_step']:.0f} kernels, span {summary['span_us']:.1f} µs, kernels "
                  f"{summary['kernel_us']:.1f} µs, idle {summary['idle_us']:.1f} µs (medians over "
                  f"{summary['steps']} replays)")
            print_rows(rows)
            results.append({"summary": summary, "kernels": rows})
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "profile_sampling.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0
