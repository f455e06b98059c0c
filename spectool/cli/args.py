"""Arguments that several ``spectool`` commands share: the model and prompts, the draft method, training."""

from __future__ import annotations

import argparse

import torch

from spectool.config import DraftModelConfig, Eagle3Config, EagleConfig, MultiLayerEagleConfig, NgramConfig
from spectool.deploy import SGLANG_FLAGS, draft_from_sglang_args

METHODS = ["none", "ngram", "eagle", "multi_layer_eagle", "eagle3", "draft_model"]


def add_draft_arguments(p: argparse.ArgumentParser) -> None:
    """Options that choose and shape a draft method (shared by record and bench), spectool's own
    or SGLang's ``--speculative-*`` flags (docs/DEPLOYMENT.md)."""
    p.add_argument("--draft", choices=METHODS, default=None, help="draft method (default: ngram)")
    p.add_argument("--draft-path", help="draft checkpoint directory (eagle, multi_layer_eagle, eagle3) or the "
                                        "draft model's directory (draft_model)")
    p.add_argument("--num-draft-tokens", type=int, help="tree nodes including the root")
    p.add_argument("--num-steps", type=int, help="draft steps (eagle, multi_layer_eagle, eagle3, draft_model)")
    p.add_argument("--topk", type=int, help="top-k per step (eagle, eagle3, draft_model)")
    p.add_argument("--max-bfs-breadth", type=int)
    p.add_argument("--min-bfs-breadth", type=int)
    p.add_argument("--max-trie-depth", type=int)
    p.add_argument("--match", choices=["bfs", "prob"])
    sglang = p.add_argument_group("SGLang's flags", "the same settings under SGLang's names (instead of --draft)")
    for flag in SGLANG_FLAGS:
        sglang.add_argument(flag, dest=_sglang_dest(flag), metavar="VALUE")


def _sglang_dest(flag: str) -> str:
    return "sglang_" + flag.removeprefix("--").replace("-", "_")


def draft_config(args: argparse.Namespace):
    """The draft config the options describe (None for plain decoding)."""
    given = {k: v for k, v in vars(args).items() if v is not None}
    sglang = [part for flag in SGLANG_FLAGS if _sglang_dest(flag) in given
              for part in (flag, given[_sglang_dest(flag)])]
    if sglang:
        ours = [f"--{n.replace('_', '-')}" for n in ("draft", "draft_path", "num_draft_tokens", "num_steps", "topk",
                                                       "max_bfs_breadth", "min_bfs_breadth", "max_trie_depth",
                                                       "match") if n in given]
        if ours:
            raise ValueError(f"give the draft either with spectool's options or SGLang's flags, not both "
                             f"({ours[0]} and {sglang[0]})")
        return draft_from_sglang_args(sglang)

    def pick(*names: str) -> dict:
        return {n: given[n] for n in names if n in given}

    draft = args.draft or "ngram"
    if draft == "none":
        return None
    if draft == "ngram":
        return NgramConfig(**pick("num_draft_tokens", "max_bfs_breadth", "min_bfs_breadth", "max_trie_depth",
                                  "match"))
    if not args.draft_path:
        raise ValueError(f"--draft {draft} needs --draft-path")
    tree = pick("num_steps", "topk", "num_draft_tokens")
    if draft == "eagle":
        return EagleConfig(args.draft_path, **tree)
    if draft == "eagle3":
        return Eagle3Config(args.draft_path, **tree)
    if draft == "draft_model":
        return DraftModelConfig(args.draft_path, **tree)
    return MultiLayerEagleConfig(args.draft_path, **pick("num_steps"))


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Model, prompts and sampling options."""
    p.add_argument("--model", required=True, help="target directory (Hugging Face format) or hub id")
    p.add_argument("--prompts", required=True, help="JSONL ({'prompt': ...}) or text, one prompt per line")
    p.add_argument("--kind", help="only JSONL prompts of this kind (completion, editing)")
    p.add_argument("--num-prompts", type=int, help="use only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tp", type=int, default=1,
                   help="split the target over this many processes (tensor parallelism; one GPU each on CUDA, "
                        "gloo on CPUs); default %(default)s")


def build_engine(args: argparse.Namespace):
    """Load the target and make the engine the options describe."""
    import spectool as st

    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    target = st.load(args.model, device=args.device, dtype=dtype, tp_size=args.tp)
    return st.Engine(target, draft=draft_config(args), max_batch_size=args.batch_size,
                     max_seq_len=args.max_seq_len)


def add_training_arguments(p: argparse.ArgumentParser, steps: int, batch_size: int, seq_len: int, lr: float,
            checkpoint_every: int) -> None:
    """Corpus, output and optimiser options of train-target and train-draft, with these defaults."""
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
