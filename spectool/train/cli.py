"""``spectool train-target`` and ``spectool train-draft``: argument parsing around target.py and draft.py."""

from __future__ import annotations

import argparse

from spectool.train.target import TargetRecipe


def _common(p: argparse.ArgumentParser, steps: int, batch_size: int, seq_len: int, lr: float,
            checkpoint_every: int) -> None:
    p.add_argument("--corpus", required=True,
                   help="'stdlib' (this Python's standard library less the held-out modules), "
                        "a text/JSONL file, or a directory of .py/.txt/.md files")
    p.add_argument("--out", required=True, help="output directory (checkpoint, weights, eval.json)")
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=batch_size,
                   help="sequences per step (default %(default)s)")
    p.add_argument("--seq-len", type=int, default=seq_len, help="tokens per sequence (default %(default)s)")
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate (default %(default)s)")
    p.add_argument("--checkpoint-every", type=int, default=checkpoint_every,
                   help="steps between checkpoints (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:1, ...")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--max-seconds", type=float, default=None, help="stop training after this long")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--stdlib", default=None,
                   help="with --corpus stdlib: the standard library to read, a Lib/ directory or a .tar.xz "
                        "of one (benchmarks/pack_stdlib.py); default: this Python's")
    p.add_argument("--edit-fraction", type=float, default=0.25,
                   help="share of the training text made of editing pairs, a chunk then a lightly changed "
                        "copy (teaches copying; default %(default)s)")
    p.add_argument("--epochs", type=float, default=0.0,
                   help="when > 0, overrides --steps: passes over the training tokens")


def train_target_main(argv: list[str]) -> int:
    """``spectool train-target``: train a BPE tokenizer and a Llama-style target; returns the exit code."""
    d = TargetRecipe()
    p = argparse.ArgumentParser(prog="spectool train-target",
                                description="Train a BPE tokenizer and a small Llama-style target; "
                                            "writes a Hugging Face checkpoint to --out.")
    _common(p, d.steps, d.batch_size, d.seq_len, d.lr, d.checkpoint_every)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--layers", type=int, default=d.num_layers, help="decoder layers")
    p.add_argument("--heads", type=int, default=d.num_heads)
    p.add_argument("--kv-heads", type=int, default=d.num_kv_heads)
    p.add_argument("--intermediate-size", type=int, default=d.intermediate_size)
    p.add_argument("--max-position-embeddings", type=int, default=d.max_position_embeddings)
    p.add_argument("--untied", action="store_true", help="separate lm_head and embedding weights")
    a = p.parse_args(argv)
    from spectool.train.target import train_target

    try:
        recipe = TargetRecipe(
            vocab_size=a.vocab_size, hidden_size=a.hidden_size, num_layers=a.layers, num_heads=a.heads,
            num_kv_heads=a.kv_heads, intermediate_size=a.intermediate_size,
            max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=not a.untied,
            steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr,
            checkpoint_every=a.checkpoint_every, seed=a.seed, edit_fraction=a.edit_fraction, epochs=a.epochs)
        train_target(a.corpus, a.out, recipe, device=a.device, resume=a.resume, progress=not a.no_progress,
                     max_seconds=a.max_seconds, stdlib=a.stdlib)
    except ValueError as e:
        raise SystemExit(f"spectool train-target: error: {e}") from None
    return 0


def train_draft_main(argv: list[str]) -> int:
    """``spectool train-draft``: train (multi-layer) EAGLE layers for a target; returns the exit code."""
    from spectool.train.draft import DraftRecipe

    d = DraftRecipe()
    p = argparse.ArgumentParser(prog="spectool train-draft",
                                description="Train draft layers against a frozen target (self-distillation: "
                                            "labels are the target's own predictions).")
    p.add_argument("--target", required=True, help="target model directory (Hugging Face format)")
    p.add_argument("--method", required=True, choices=["eagle", "multi_layer_eagle"])
    p.add_argument("--layers", type=int, default=None,
                   help="draft layers K (eagle: 1; multi_layer_eagle: default 4)")
    _common(p, d.steps, d.batch_size, d.seq_len, d.lr, d.checkpoint_every)
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="MLP width of the draft block (default: the target's)")
    p.add_argument("--chained", action=argparse.BooleanOptionalAction, default=d.chained,
                   help="multi_layer_eagle: layer k > 0 reads layer k-1's feature instead of the target's "
                        "hidden state, as DeepSeek-V3's MTP (default: chained)")
    p.add_argument("--unroll", type=int, default=d.unroll, help="EAGLE: draft steps unrolled in training")
    p.add_argument("--greedy-fraction", type=float, default=d.greedy_fraction,
                   help="share of each batch's sequences that are a corpus prefix followed by the target's "
                        "greedy continuation, the tokens drafts read while decoding (0 to 1; default "
                        "%(default)s)")
    a = p.parse_args(argv)
    from spectool.train.draft import train_draft

    layers = a.layers if a.layers is not None else (1 if a.method == "eagle" else 4)
    try:
        recipe = DraftRecipe(method=a.method, layers=layers, steps=a.steps, batch_size=a.batch_size,
                             seq_len=a.seq_len, lr=a.lr, checkpoint_every=a.checkpoint_every, seed=a.seed,
                             intermediate_size=a.intermediate_size, chained=a.chained, unroll=a.unroll,
                             edit_fraction=a.edit_fraction, epochs=a.epochs,
                             greedy_fraction=a.greedy_fraction)
        train_draft(a.target, a.corpus, a.out, recipe, device=a.device, resume=a.resume,
                    progress=not a.no_progress, max_seconds=a.max_seconds, stdlib=a.stdlib)
    except ValueError as e:
        raise SystemExit(f"spectool train-draft: error: {e}") from None
    return 0
