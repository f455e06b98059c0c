"""Sweep of draft settings on the demo model: the heatmaps the TuningPanel shows, as PNGs.

Figure: docs/BENCHMARKS.md "Setting sweeps". Time: about 1 minute on an H200 (--budget-s caps it).

    python benchmarks/sweep.py --out docs              # H200: docs/sweep_ngram.png, docs/sweep_eagle.png
    python benchmarks/sweep.py --device cpu --quick    # smoke test: 2x2 grids, 3 tokens

Two grids, each cell a fresh engine (warmed up on random tokens) decoding the same
prompts greedily with ``ignore_eos``:

* N-gram on the editing workload: max BFS breadth (x) x draft tokens N (y), other
  settings NgramConfig defaults (min breadth 1);
* EAGLE on the completion workload: steps (x) x top-k (y), N = min(16, the most the
  tree can hold).

Each cell holds the mean accept length (colour) and decode tokens/s (text). Prints both
grids; writes $OUT/sweep.json (or --out DIR) and, with matplotlib, sweep_ngram.png and
sweep_eagle.png beside it. ``--budget-s`` leaves the cells that would start later empty.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

from speculative import (
    add_common_arguments,
    draft_config,
    fmt,
    load_target,
    measure,
    run_meta,
    seed_all,
    workload_prompts,
    write_json,
)


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def eagle_overrides(steps: int, topk: int) -> dict:
    most = 1 + topk + (steps - 1) * topk * topk
    return {"num_steps": steps, "topk": topk, "num_draft_tokens": min(16, most)}


GRIDS = {  # name -> (method, workload, x label, y label, config overrides of (x, y))
    "ngram": ("ngram", "editing", "max BFS breadth", "draft tokens N",
              lambda x, y: {"max_bfs_breadth": x, "num_draft_tokens": y}),
    "eagle": ("eagle", "completion", "steps", "top-k", eagle_overrides),
}


def run_grid(name: str, xs: list[int], ys: list[int], target, args, new_tokens: int, max_prompt: int | None,
             deadline: float) -> dict:
    method, workload, _, _, overrides = GRIDS[name]
    prompts = workload_prompts(target, args.prompts, workload, args.num_prompts, max_prompt)
    max_seq_len = max(map(len, prompts)) + new_tokens + 8
    accept = [[math.nan] * len(xs) for _ in ys]
    tok_s = [[math.nan] * len(xs) for _ in ys]
    for j, y in enumerate(ys):
        for i, x in enumerate(xs):
            if time.perf_counter() > deadline:
                continue
            seed_all(args.seed)
            r = measure(target, draft_config(method, args.draft_dir, **overrides(x, y)), prompts, new_tokens,
                        max_seq_len, args.seed)
            accept[j][i], tok_s[j][i] = r["mean_accept_length"], r["tokens_per_s"]
    return {"method": method, "workload": workload, "x": GRIDS[name][2], "y": GRIDS[name][3],
            "x_values": xs, "y_values": ys, "mean_accept_length": accept, "tokens_per_s": tok_s}


def heatmap(grid: dict, path: Path) -> str:
    """The grid as a PNG (accept length coloured, tokens/s written in); returns the path or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "n/a (matplotlib not installed)"
    fig, ax = plt.subplots(figsize=(1.4 * len(grid["x_values"]) + 2.5, 1.1 * len(grid["y_values"]) + 1.5))
    image = ax.imshow(grid["mean_accept_length"], cmap="viridis", origin="lower", aspect="auto")
    ax.set_xticks(range(len(grid["x_values"])), [str(v) for v in grid["x_values"]])
    ax.set_yticks(range(len(grid["y_values"])), [str(v) for v in grid["y_values"]])
    ax.set_xlabel(grid["x"])
    ax.set_ylabel(grid["y"])
    for j, row in enumerate(grid["tokens_per_s"]):
        for i, v in enumerate(row):
            if not math.isnan(v):
                ax.text(i, j, f"{v:.0f} tok/s", ha="center", va="center", color="white", fontsize=8)
    fig.colorbar(image, ax=ax, label="mean accept length")
    ax.set_title(f"{grid['method']} on {grid['workload']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    p.add_argument("--breadths", default="1,4,10", help="N-gram max BFS breadths (x)")
    p.add_argument("--ngram-tokens", default="4,8,16", help="N-gram draft tokens N (y)")
    p.add_argument("--steps", default="2,3,5", help="EAGLE steps (x)")
    p.add_argument("--topks", default="1,2,4", help="EAGLE top-k (y)")
    p.add_argument("--num-prompts", type=int, default=2, help="prompts decoded together per cell")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--budget-s", type=float, default=float("inf"),
                   help="start no cell after this many seconds")
    args = p.parse_args(argv)
    axes = {"ngram": (ints(args.breadths), ints(args.ngram_tokens)),
            "eagle": (ints(args.steps), ints(args.topks))}
    new_tokens, max_prompt = args.new_tokens, None
    if args.quick:
        axes = {"ngram": ([1, 4], [4, 8]), "eagle": ([1, 2], [1, 2])}
        new_tokens, max_prompt, args.num_prompts = 3, 16, 1
    seed_all(args.seed)
    target = load_target(args.model, args.device)
    deadline = time.perf_counter() + args.budget_s
    grids = {name: run_grid(name, *axes[name], target, args, new_tokens, max_prompt, deadline)
             for name in GRIDS}

    folder = args.out or os.environ.get("OUT")
    print(f"\nsweep.py — {run_meta(args)['gpu'] or args.device}; target {args.model}; {args.num_prompts} "
          f"prompts x {new_tokens} tokens per cell; each cell: mean accept length / decode tokens/s")
    for name, grid in grids.items():
        grid["png"] = (heatmap(grid, Path(folder) / f"sweep_{name}.png") if folder
                       else "n/a (no --out or $OUT)")
        print(f"{grid['method']} on {grid['workload']}: rows {grid['y']}, columns {grid['x']}")
        print(f"{'':>6}" + "".join(f"{x:>14}" for x in grid["x_values"]))
        for y, accept, speed in zip(grid["y_values"], grid["mean_accept_length"], grid["tokens_per_s"]):
            cells = [f"{fmt(None if math.isnan(a) else a, '.2f')}/{fmt(None if math.isnan(s) else s, '.0f')}"
                     for a, s in zip(accept, speed)]
            print(f"{y:>6}" + "".join(f"{c:>14}" for c in cells))
        print(f"plot: {grid['png']}")
    write_json("sweep.json", {"meta": {**run_meta(args), "model": args.model, "new_tokens": new_tokens,
                                       "num_prompts": args.num_prompts}, "grids": grids}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
