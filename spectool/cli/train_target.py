"""``spectool train-target``: train a BPE tokenizer and a small Llama-style target."""

from __future__ import annotations

from spectool.cli.args import POSITIVE, add_training_arguments, check_corpus, fail, parser, recipe_defaults


def main(argv: list[str]) -> int:
    """``spectool train-target``: train a BPE tokenizer and a Llama-style target; returns the exit code."""
    d = recipe_defaults("spectool.train.target", "TargetRecipe")
    p = parser("train-target", "Train a BPE tokenizer and a small Llama-style target; writes a Hugging Face "
                               "checkpoint (config.json, model.safetensors, tokenizer.json) to --out.")
    add_training_arguments(p, d["steps"], d["batch_size"], d["seq_len"], d["lr"], d["checkpoint_every"])
    p.add_argument("--vocab-size", type=POSITIVE, default=d["vocab_size"], help="BPE vocabulary")
    p.add_argument("--hidden-size", type=POSITIVE, default=d["hidden_size"], help="model width")
    p.add_argument("--layers", type=POSITIVE, default=d["num_layers"], help="decoder layers")
    p.add_argument("--heads", type=POSITIVE, default=d["num_heads"], help="attention heads")
    p.add_argument("--kv-heads", type=POSITIVE, default=d["num_kv_heads"], help="key/value heads (GQA)")
    p.add_argument("--intermediate-size", type=POSITIVE, default=d["intermediate_size"], help="MLP width")
    p.add_argument("--max-position-embeddings", type=POSITIVE, default=d["max_position_embeddings"],
                   help="the model's longest sequence")
    p.add_argument("--untied", action="store_true", help="separate lm_head and embedding weights")
    p.add_argument("--tokenizer", help="use this tokenizer.json instead of training one (e.g. a draft model "
                                       "for a target, which must share its tokenizer)")
    a = p.parse_args(argv)
    try:
        check_corpus(a.corpus, a.stdlib)
        from spectool.train.target import TargetRecipe, train_target

        recipe = TargetRecipe(
            vocab_size=a.vocab_size, hidden_size=a.hidden_size, num_layers=a.layers, num_heads=a.heads,
            num_kv_heads=a.kv_heads, intermediate_size=a.intermediate_size,
            max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=not a.untied,
            steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr,
            checkpoint_every=a.checkpoint_every, seed=a.seed, edit_fraction=a.edit_fraction, epochs=a.epochs)
        train_target(a.corpus, a.out, recipe, device=a.device, resume=a.resume, progress=not a.no_progress,
                     max_seconds=a.max_seconds, stdlib=a.stdlib, tokenizer=a.tokenizer)
    except (ValueError, OSError) as e:
        return fail("train-target", e)
    return 0
