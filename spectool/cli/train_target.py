"""``spectool train-target``: train a BPE tokenizer and a small Llama-style target."""

from __future__ import annotations

import argparse

from spectool.cli.args import add_training_arguments
from spectool.train.target import TargetRecipe


def main(argv: list[str]) -> int:
    """``spectool train-target``: train a BPE tokenizer and a Llama-style target; returns the exit code."""
    d = TargetRecipe()
    p = argparse.ArgumentParser(prog="spectool train-target",
                                description="Train a BPE tokenizer and a small Llama-style target; "
                                            "writes a Hugging Face checkpoint to --out.")
    add_training_arguments(p, d.steps, d.batch_size, d.seq_len, d.lr, d.checkpoint_every)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--layers", type=int, default=d.num_layers, help="decoder layers")
    p.add_argument("--heads", type=int, default=d.num_heads)
    p.add_argument("--kv-heads", type=int, default=d.num_kv_heads)
    p.add_argument("--intermediate-size", type=int, default=d.intermediate_size)
    p.add_argument("--max-position-embeddings", type=int, default=d.max_position_embeddings)
    p.add_argument("--untied", action="store_true", help="separate lm_head and embedding weights")
    p.add_argument("--tokenizer", help="use this tokenizer.json instead of training one (e.g. a draft model "
                                       "for a target, which must share its tokenizer)")
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
                     max_seconds=a.max_seconds, stdlib=a.stdlib, tokenizer=a.tokenizer)
    except ValueError as e:
        raise SystemExit(f"spectool train-target: error: {e}") from None
    return 0
