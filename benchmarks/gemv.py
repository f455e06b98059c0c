"""GEMVs of 1 to 16 rows at the decoder's weight shapes: cuBLAS vs the fused Triton kernels.

Figure: docs/BENCHMARKS.md "Kernels". Time: about 1 minute on an H200 (--configs sweep several).

    python3 benchmarks/gemv.py --shapes 8B 1B                        # H200: one row, the default configs
    python3 benchmarks/gemv.py --configs sweep                        # every config of the one-row sweep
    python3 benchmarks/gemv.py --shapes 8B 107M --rows 1,4,16 --configs sweep   # the few-row kernel's too
    python3 benchmarks/gemv.py --shapes 8B --rows 8 --split --configs sweep   # several sequences, split along K

For each projection of a decoder layer (and the lm_head) and each row count (1: a batch-1
decode step; 16: a batch-1 tree verify) it times, inside a CUDA graph of back-to-back
calls (weights rotated over copies so that nothing stays in the 50 MB L2):

* ``cublas``: ``F.linear`` alone (the floor for the unfused path's matmul);
* ``unfused``: the glue kernel the model ran before it (residual + RMSNorm, or SiLU·mul)
  followed by ``F.linear``;
* ``triton``: ``gemv_triton`` with the prologue fused, at its default config, or with
  ``--configs sweep`` every config of the sweep (the one-row kernel's for one row, the few-row
  kernel's for more);
* ``one-pass norm``: the RMSNorm prologue without the unfused path's roundings
  (``exact_norm=False``, one row only), at the default config;
* ``split``: with ``--split``, for more than one row, the glue kernel followed by ``gemv_split``
  (the several-sequence kernel, split along K), its default config or with ``--configs sweep``
  every config of its sweep (the fused kernel then runs its default config alone).

µs per call, achieved GB/s (weight bytes / time) and the best config. Prints a table;
writes gemv.json to $OUT when it is set.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F
from decode import SHAPES
from speculative import provenance

from spectool.kernels import gemv_split as split_k
from spectool.kernels import ops
from spectool.kernels.gemv import MAX_ROWS, default_config, gemv_triton

# projection -> (N, K, prologue) as functions of the shape's hidden size H, MLP width I, vocab V.
PROJECTIONS = {
    "qkv": lambda H, I, V, kv: (H + 2 * kv, H, "rms_norm"),
    "o": lambda H, I, V, kv: (H, H, "none"),
    "gate_up": lambda H, I, V, kv: (2 * I, H, "rms_norm"),
    "down": lambda H, I, V, kv: (H, I, "silu_mul"),
    "lm_head": lambda H, I, V, kv: (V, H, "rms_norm"),
}
SWEEP = [c for c in itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (3, 4)) if c[0] * c[1] <= 8192]
# The few-row kernel's tl.dot needs BLOCK_N >= 16.
ROWS_SWEEP = [c for c in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (2, 3, 4)) if c[0] * c[1] <= 16384]
# gemv_split's (BLOCK_N, BLOCK_K, split, warps, stages).
SPLIT_SWEEP = list(itertools.product((16, 32, 64), (256, 512), (1, 2, 4, 8), (4,), (3,)))


def graph_time_us(fn, calls: int, device: torch.device) -> float:
    """µs per call of ``fn(i)`` for i in range(calls), replayed as one CUDA graph (median of 5)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):  # warm-up (compiles Triton kernels outside the capture)
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[2]


def bench_projection(name: str, n: int, k: int, prologue: str, rows: int, configs: list, calls: int,
                     device: torch.device, dtype: torch.dtype, split_configs: list | None = None) -> dict:
    copies = max(2, min(16, (400 << 20) // (n * k * 2) + 1))  # > 400 MB in all: past the L2
    weights = [torch.randn(n, k, device=device, dtype=dtype) / k**0.5 for _ in range(copies)]
    width = 2 * k if prologue == "silu_mul" else k
    x = torch.randn(1, rows, width, device=device, dtype=dtype)  # one sequence of `rows` tokens
    res = torch.randn(1, rows, k, device=device, dtype=dtype)
    nw = torch.ones(k, device=device, dtype=dtype)
    out_dtype = torch.float32 if name == "lm_head" else dtype
    residual = res if prologue == "rms_norm" and name != "lm_head" else None

    def glue():
        if prologue == "rms_norm":
            return ops.rms_norm(x, nw, 1e-5) if residual is None else ops.add_rms_norm(x, residual, nw, 1e-5)[0]
        return ops.silu_mul(x) if prologue == "silu_mul" else x

    def unfused(i):
        y = F.linear(glue(), weights[i % copies])
        return y.float() if out_dtype == torch.float32 else y

    def split(config):
        # Several sequences of one token each, as a decode step of a batch.
        return lambda i: split_k.gemv_split(glue().view(rows, 1, k), weights[i % copies], None, out_dtype, config)

    def fused(config, exact_norm=True):
        return lambda i: gemv_triton(x, weights[i % copies], None, prologue, residual, nw, 1e-5, out_dtype,
                                     config, exact_norm)

    bytes_ = n * k * 2
    row = {"projection": name, "N": n, "K": k, "prologue": prologue, "rows": rows, "MB": bytes_ / 2**20}
    with torch.inference_mode():
        row["cublas_us"] = graph_time_us(lambda i: F.linear(x[..., :k], weights[i % copies]), calls, device)
        row["unfused_us"] = graph_time_us(unfused, calls, device)
        results = {}
        for config in configs:
            try:
                results[config] = graph_time_us(fused(config), calls, device)
            except Exception as exc:  # a config the compiler rejects (e.g. out of registers)
                results[config] = float("inf")
                row.setdefault("failed", []).append(f"{config}: {type(exc).__name__}")
        if prologue == "rms_norm" and rows == 1:  # what the unfused roundings cost: the one-pass variant
            row["triton_onepass_us"] = graph_time_us(fused(default_config(k), exact_norm=False), calls, device)
        if split_configs and rows > 1:
            times = {c: graph_time_us(split(c), calls, device) for c in split_configs}
            best_split = min(times, key=times.get)
            row.update(split_default_us=times.get(split_k.config_for(n, k)), split_best_us=times[best_split],
                       split_best_config=best_split, split_all={str(c): t for c, t in times.items()})
    best = min(results, key=results.get)
    row.update(triton_default_us=results.get(default_config(k, rows, n)), triton_best_us=results[best],
               best_config=best, all={str(c): t for c, t in results.items()})
    for key in ("cublas", "unfused", "triton_best"):
        row[f"{key}_gb_s"] = bytes_ / (row[f"{key}_us"] * 1e-6) / 1e9
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", nargs="+", default=["8B"], choices=sorted(SHAPES))
    parser.add_argument("--configs", choices=("sweep", "default"), default="default",
                        help="default: the kernel's own config per shape; sweep: every config of the sweep "
                        "(how the defaults were chosen)")
    parser.add_argument("--rows", default="1",
                        help=f"comma-separated input row counts, each 1 to {MAX_ROWS} (e.g. 1,4,16)")
    parser.add_argument("--split", action="store_true",
                        help="also glue + gemv_split, the several-sequence kernel split along K (rows > 1)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    row_counts = [int(r) for r in args.rows.split(",") if r.strip().isdigit()]
    if len(row_counts) != len(args.rows.split(",")) or not all(1 <= r <= MAX_ROWS for r in row_counts):
        parser.error(f"--rows takes counts from 1 to {MAX_ROWS}, got {args.rows!r}")
    device = torch.device(args.device)
    if device.type != "cuda":
        raise SystemExit("benchmarks/gemv.py times CUDA kernels: it needs a GPU")
    rows = []
    for shape in args.shapes:
        s = SHAPES[shape]
        H, I, V = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
        kv = H // s["num_heads"] * s["num_kv_heads"]
        for name, make in PROJECTIONS.items():
            n, k, prologue = make(H, I, V, kv)
            for m in row_counts:
                if args.configs == "default":
                    configs = [default_config(k, m, n)]
                    split_configs = [split_k.config_for(n, k)]
                else:  # with --split the sweep is the split kernel's alone
                    configs = [default_config(k, m, n)] if args.split else SWEEP if m == 1 else ROWS_SWEEP
                    split_configs = SPLIT_SWEEP
                row = bench_projection(name, n, k, prologue, m, configs, 8 if args.quick else 32, device,
                                       torch.bfloat16, split_configs if args.split else None)
                row["shape"] = shape
                rows.append(row)
                print(f"{shape} {name:8s} {n}x{k} {prologue:9s} rows {m:2d} cublas {row['cublas_us']:7.1f} µs "
                      f"({row['cublas_gb_s']:5.0f} GB/s) | unfused {row['unfused_us']:7.1f} | triton best "
                      f"{row['triton_best_us']:7.1f} ({row['triton_best_gb_s']:5.0f} GB/s) {row['best_config']} | "
                      f"default {row['triton_default_us']}", flush=True)
                if "split_best_us" in row:
                    print(f"    split: best {row['split_best_us']:7.1f} µs {row['split_best_config']} | default "
                          f"{row['split_default_us']}", flush=True)
    print("\n| shape | projection | N×K | prologue | rows | cuBLAS µs | glue + cuBLAS µs | fused Triton µs | "
          "one-pass norm µs | config (BLOCK_N, BLOCK_K, warps, stages) | glue + split µs | split config |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---|---:|---|")
    for r in rows:
        onepass = f"{r['triton_onepass_us']:.1f}" if "triton_onepass_us" in r else "–"
        split = (f"{r['split_best_us']:.1f} | {r['split_best_config']}" if "split_best_us" in r else "– | –")
        print(f"| {r['shape']} | {r['projection']} | {r['N']}×{r['K']} | {r['prologue']} | {r['rows']} | "
              f"{r['cublas_us']:.1f} | {r['unfused_us']:.1f} | {r['triton_best_us']:.1f} | {onepass} | "
              f"{r['best_config']} | {split} |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gemv.json"), "w") as f:
            json.dump({"meta": {"torch": torch.__version__, **provenance("gemv", None, args.device)},
                       "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
