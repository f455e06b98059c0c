"""Train a >= 100M-parameter target and its draft layers in one GPU run of <= 8 minutes (speed figures).

    python benchmarks/train_large_target.py --out /tmp/large            # one H200, ~7.5 minutes
    python benchmarks/train_large_target.py --out /tmp/large --tiny     # CPU smoke run of the same flow

The target (Llama shape: vocab 4096, hidden 768, 16 layers, 12 query / 4 kv heads, MLP 2048,
untied head: 107M parameters) learns the stdlib training split; then one EAGLE layer and a K=4
multi-layer EAGLE are trained against it. Step counts are fitted to the time budget after the
first steps of each phase (seeded; the fitted counts are printed and recorded). The weights go
to --out (bf16) for the benchmark issue's speed runs; nothing here is bundled. A table is
printed and, if $OUT is set, $OUT/train_large_target.json is written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from train_demo import print_table, tiny_corpus, train_all

from spectool.train.draft import DraftRecipe
from spectool.train.target import TargetRecipe

MIN_PARAMS = 100_000_000


def recipes(tiny: bool, seed: int) -> tuple[TargetRecipe, DraftRecipe, DraftRecipe]:
    if tiny:
        target = TargetRecipe(vocab_size=320, hidden_size=96, num_layers=2, num_heads=6, num_kv_heads=2,
                              intermediate_size=256, steps=8, batch_size=4, seq_len=64, warmup=2,
                              checkpoint_every=4, eval_windows=2, seed=seed)
        small = {"steps": 4, "batch_size": 2, "seq_len": 64, "checkpoint_every": 2, "eval_windows": 2,
                 "gen_prompts": 2, "gen_tokens": 16, "seed": seed}
        return target, DraftRecipe(method="eagle", **small), DraftRecipe(method="multi_layer_eagle", layers=4,
                                                                         **small)
    target = TargetRecipe(vocab_size=4096, hidden_size=768, num_layers=16, num_heads=12, num_kv_heads=4,
                          intermediate_size=2048, max_position_embeddings=4096, tie_word_embeddings=False,
                          steps=6000, batch_size=48, seq_len=1024, lr=1.5e-3, warmup=150, weight_decay=0.1,
                          checkpoint_every=1000, eval_windows=64, seed=seed, tokenizer_docs=2)
    common = {"steps": 3000, "batch_size": 32, "seq_len": 1024, "lr": 1e-3, "warmup": 50,
              "checkpoint_every": 1000, "eval_windows": 32, "gen_prompts": 16, "gen_tokens": 128,
              "seed": seed}
    return target, DraftRecipe(method="eagle", unroll=5, **common), DraftRecipe(method="multi_layer_eagle",
                                                                                layers=4, **common)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="output directory (new or empty)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: the same flow on CPU in seconds")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=390.0, help="wall-clock budget for all training")
    a = p.parse_args(argv)

    t0 = time.perf_counter()
    out: Path = a.out
    if out.exists() and any(out.iterdir()):
        print(f"{out} is not empty; give a new directory", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(a.seed)
    target_r, eagle_r, mle_r = recipes(a.tiny, a.seed)
    corpus = tiny_corpus(out / "tiny_corpus.txt") if a.tiny else "stdlib"
    target, drafts = train_all(out, corpus, target_r, (eagle_r, mle_r), a.device,
                               None if a.tiny else a.budget_s, t0)
    print_table(target, drafts)
    seconds = time.perf_counter() - t0
    print(f"total {seconds:.0f}s; weights in {out}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        report = {"target": target, "drafts": drafts, "seconds": seconds, "torch": torch.__version__}
        (Path(os.environ["OUT"]) / "train_large_target.json").write_text(json.dumps(report, indent=2))
    if not a.tiny and target["params"] < MIN_PARAMS:
        print(f"ERROR: the target has {target['params']:,} parameters, fewer than {MIN_PARAMS:,}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
