"""Train a >= 100M-parameter target and its draft layers in one GPU run of <= 6 minutes (speed figures).

Figure: docs/BENCHMARKS.md "Speculative decoding". Time: at most 6 minutes on an H200 (--budget-s).

    python benchmarks/train_large_target.py --out /tmp/large --stdlib .corpus/stdlib-3.11.tar.xz  # H200, ~6 min
    python benchmarks/train_large_target.py --out /tmp/large --tiny     # CPU smoke run of the same flow
    python benchmarks/speculative.py --model /tmp/large/target --draft-dir /tmp/large \
        --prompts /tmp/large/prompts.jsonl                              # then its speed figures

The target (Llama shape, untied head; ``--shape deep``, the default: vocab 4096, hidden 512,
32 layers, 8 query / 2 kv heads, MLP 1792, 113M parameters; ``--shape wide``: hidden 768,
16 layers, 12 query / 4 kv heads, MLP 2048, 107M, the shape of the earlier figures) learns the
stdlib training split; then one EAGLE layer and a K=4
multi-layer EAGLE are trained against it. Step counts are fitted to the time budget after the
first steps of each phase (seeded; the fitted counts are printed and recorded). The weights go
to --out (bf16) with held-out prompts (prompts.jsonl), the layout benchmarks/speculative.py
reads; nothing here is bundled. A table is printed and, if $OUT is set,
$OUT/train_large_target.json is written. --stdlib as in train_demo.py (benchmarks/pack_stdlib.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from train_demo import print_table, tiny_corpus, train_all, write_prompts

from spectool.train.draft import DraftRecipe
from spectool.train.target import TargetRecipe

MIN_PARAMS = 100_000_000


# Layers, hidden, query heads, kv heads, MLP width. At batch 1 every layer costs about the same
# few microseconds of kernel launches whatever its width, so what sets the draft's share of an
# iteration is the target's depth: "deep" has Llama-3-8B's 32 layers (one draft layer = 1/32 of
# the target's launches, as at 8B); "wide" has 16, which doubles the draft's relative cost.
SHAPES = {"deep": (32, 512, 8, 2, 1792), "wide": (16, 768, 12, 4, 2048)}


def recipes(tiny: bool, seed: int, shape: str = "deep",
            edit_fraction: float = 0.25) -> tuple[TargetRecipe, DraftRecipe, DraftRecipe]:
    if tiny:
        target = TargetRecipe(vocab_size=320, hidden_size=96, num_layers=2, num_heads=6, num_kv_heads=2,
                              intermediate_size=256, steps=8, batch_size=4, seq_len=64, warmup=2,
                              checkpoint_every=4, eval_windows=2, seed=seed)
        small = {"steps": 4, "batch_size": 2, "seq_len": 64, "checkpoint_every": 2, "eval_windows": 2,
                 "gen_prompts": 2, "gen_tokens": 16, "seed": seed}
        return target, DraftRecipe(method="eagle", **small), DraftRecipe(method="multi_layer_eagle", layers=4,
                                                                         **small)
    layers, hidden, heads, kv_heads, mlp = SHAPES[shape]
    target = TargetRecipe(vocab_size=4096, hidden_size=hidden, num_layers=layers, num_heads=heads,
                          num_kv_heads=kv_heads, intermediate_size=mlp, max_position_embeddings=4096,
                          tie_word_embeddings=False,
                          epochs=6, batch_size=48, seq_len=1024, lr=1.5e-3, warmup=150, weight_decay=0.1,
                          checkpoint_every=1000, eval_windows=64, seed=seed, tokenizer_docs=2,
                          edit_fraction=edit_fraction)
    # Epochs are upper bounds: the time budget ends each phase first on one H200.
    common = {"epochs": 4, "batch_size": 32, "seq_len": 1024, "lr": 1e-3, "warmup": 50,
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
    p.add_argument("--stdlib", default=None,
                   help="standard library to train on: a Lib/ directory or a .tar.xz of one; default: this Python's")
    p.add_argument("--shape", choices=sorted(SHAPES), default="deep",
                   help="target shape: deep = 32 layers x 512 (default), wide = 16 layers x 768")
    # N-gram drafting on the editing workload is bounded by how faithfully the target copies its
    # context (drafting the reference continuation itself accepts ~9 tokens per iteration at N 12,
    # the trained target's outputs ~2.4). On the H200, 0.5 raised N-gram's editing accept length
    # from 2.35 to 2.66 but EAGLE's on completion fell from 3.44 to 2.02 (in a run that also
    # trained beside the GPU tests; BENCHMARKS.md), so the default stays at the recipe's 0.25.
    p.add_argument("--edit-fraction", type=float, default=0.25,
                   help="share of the target's training text made of editing pairs (default 0.25)")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="wall-clock budget for training and evaluation (start-up and tokenizing come on top)")
    a = p.parse_args(argv)

    t0 = time.perf_counter()
    out: Path = a.out
    if out.exists() and any(out.iterdir()):
        print(f"{out} is not empty; give a new directory", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(a.seed)
    target_r, eagle_r, mle_r = recipes(a.tiny, a.seed, a.shape, a.edit_fraction)
    try:
        corpus = tiny_corpus(out / "tiny_corpus.txt", a.stdlib) if a.tiny else "stdlib"
        target, drafts = train_all(out, corpus, target_r, (eagle_r, mle_r), a.device,
                                   None if a.tiny else a.budget_s, t0, None if a.tiny else a.stdlib)
        prompts = write_prompts(out, 32, 16, a.seed, a.stdlib)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    (out / "tiny_corpus.txt").unlink(missing_ok=True)
    print_table(target, drafts)
    seconds = time.perf_counter() - t0
    print(f"total {seconds:.0f}s; target in {out / 'target'}, drafts in {out / 'eagle'} and "
          f"{out / 'multi_layer_eagle'}, prompts in {prompts}")
    print(f"speed figures: python benchmarks/speculative.py --model {out / 'target'} --draft-dir {out} "
          f"--prompts {prompts}")
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
