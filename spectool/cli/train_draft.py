"""``spectool train-draft``: train draft layers against a frozen target."""

from __future__ import annotations

import argparse
from pathlib import Path

from spectool.cli.args import (
    POSITIVE,
    BadInput,
    add_training_arguments,
    check_corpus,
    fail,
    number,
    parser,
    recipe_defaults,
)


def main(argv: list[str]) -> int:
    """``spectool train-draft``: train EAGLE, EAGLE-3 or multi-layer EAGLE drafts for a target; returns the exit
    code."""
    d = recipe_defaults("spectool.train.draft", "DraftRecipe")
    p = parser("train-draft", "Train draft layers against a frozen target (self-distillation: the labels are the "
                              "target's own predictions). Writes the draft checkpoint, eval.json and a resumable "
                              "training state to --out; see docs/TRAINING.md.")
    p.add_argument("--target", required=True, help="target model directory (Hugging Face format)")
    p.add_argument("--method", required=True, choices=["eagle", "multi_layer_eagle", "eagle3"], help="draft method")
    p.add_argument("--layers", type=POSITIVE, default=None,
                   help="draft layers K (default: 1 for eagle and eagle3, 4 for multi_layer_eagle)")
    p.add_argument("--draft-vocab-size", type=POSITIVE, default=None,
                   help="eagle3: the draft head's vocabulary, the most frequent target tokens of the corpus "
                        "(default: the target's whole vocabulary)")
    p.add_argument("--aux-layers", type=number(int, 0), nargs=3, default=None, metavar="LAYER",
                   help="eagle3: the three target layers (0-based) whose outputs the draft reads "
                        "(default: SGLang's, the outputs of layers 1, L/2-1 and L-4)")
    add_training_arguments(p, d["steps"], d["batch_size"], d["seq_len"], d["lr"], d["checkpoint_every"])
    p.add_argument("--intermediate-size", type=POSITIVE, default=None,
                   help="MLP width of the draft block (default: the target's)")
    p.add_argument("--chained", action=argparse.BooleanOptionalAction, default=d["chained"],
                   help="multi_layer_eagle: layer k > 0 reads layer k-1's feature instead of the target's "
                        "hidden state, as DeepSeek-V3's MTP")
    p.add_argument("--unroll", type=POSITIVE, default=d["unroll"], help="eagle: draft steps unrolled in training")
    p.add_argument("--greedy-fraction", type=number(float, 0.0, 1.0), default=d["greedy_fraction"],
                   help="share of each batch's sequences that are a corpus prefix followed by the target's "
                        "greedy continuation, the tokens drafts read while decoding")
    a = p.parse_args(argv)
    layers = a.layers if a.layers is not None else (4 if a.method == "multi_layer_eagle" else 1)
    try:
        if not (Path(a.target) / "config.json").is_file():
            raise BadInput(f"--target {a.target}: " + ("no config.json there" if Path(a.target).is_dir()
                                                        else "no such directory"))
        check_corpus(a.corpus, a.stdlib)
        from spectool.train.draft import DraftRecipe, train_draft

        recipe = DraftRecipe(method=a.method, layers=layers, steps=a.steps, batch_size=a.batch_size,
                             seq_len=a.seq_len, lr=a.lr, checkpoint_every=a.checkpoint_every, seed=a.seed,
                             intermediate_size=a.intermediate_size, chained=a.chained, unroll=a.unroll,
                             edit_fraction=a.edit_fraction, epochs=a.epochs,
                             greedy_fraction=a.greedy_fraction, draft_vocab_size=a.draft_vocab_size,
                             aux_layers=a.aux_layers)
        train_draft(a.target, a.corpus, a.out, recipe, device=a.device, resume=a.resume,
                    progress=not a.no_progress, max_seconds=a.max_seconds, stdlib=a.stdlib)
    except (ValueError, OSError) as e:  # BadInput is a ValueError
        return fail("train-draft", e)
    return 0
