"""Arguments that several ``spectool`` commands share: the parser, number checks, the model and prompts,
the draft method, training.

Nothing here imports torch at module level: ``spectool COMMAND --help`` and bad options are answered
before it loads.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from spectool.config import DraftModelConfig, Eagle3Config, EagleConfig, MultiLayerEagleConfig, NgramConfig
from spectool.deploy import SGLANG_FLAGS, draft_from_sglang_args

METHODS = ["none", "ngram", "eagle", "multi_layer_eagle", "eagle3", "draft_model"]


class BadInput(ValueError):
    """A command-line input the command refuses (exit code 2)."""


class NoCompleteRecord(BadInput):
    """A trace file cut short before its first complete record: nothing in it can be used or checked."""


class _HelpFormatter(argparse.HelpFormatter):
    """Appends each option's default to its help when it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or default is None or default is False or default is argparse.SUPPRESS
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def parser(command: str, description: str) -> argparse.ArgumentParser:
    """The parser of ``spectool COMMAND``: user-facing description, defaults shown in --help."""
    return argparse.ArgumentParser(prog=f"spectool {command}", description=description,
                                   formatter_class=_HelpFormatter)


def number(kind: type, low: float | None = None, high: float | None = None, low_open: bool = False,
           ) -> Callable[[str], int | float]:
    """An argparse ``type`` that parses ``kind`` and refuses values outside [low, high] (low excluded
    when ``low_open``), so bad numbers are answered before any model loads."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if value != value:
            raise argparse.ArgumentTypeError(f"expected a number, got {text}")
        if low is not None and (value <= low if low_open else value < low):
            raise argparse.ArgumentTypeError(f"must be {'>' if low_open else '>='} {low}, got {text}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


POSITIVE = number(int, 1)
NON_NEGATIVE = number(int, 0)


def fail(command: str, message: object) -> int:
    """Print ``spectool COMMAND: message`` on stderr; the bad-input exit code (2)."""
    print(f"spectool {command}: {message}", file=sys.stderr)
    return 2


def resolve_device(device: str) -> str:
    """``auto`` -> cuda when torch sees a GPU, else cpu; anything else as given."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_device_argument(p: argparse.ArgumentParser, default: str = "auto") -> None:
    """``--device``: auto (CUDA when present), cpu, cuda, cuda:1, ..."""
    p.add_argument("--device", default=default, help="auto (CUDA when present, else cpu), cpu, cuda, cuda:1, ...")


def _default(config: type, name: str) -> object:
    return config.__dataclass_fields__[name].default


def add_draft_arguments(p: argparse.ArgumentParser) -> None:
    """Options that choose and shape a draft method (shared by record and bench), spectool's own or SGLang's
    ``--speculative-*`` flags (docs/DEPLOYMENT.md); unset ones take the draft config's defaults, which the help
    names."""
    ng, ea, ml = NgramConfig, EagleConfig, MultiLayerEagleConfig
    g = p.add_argument_group("draft method")
    g.add_argument("--draft", choices=METHODS, default=None, help="draft method; none = plain decoding "
                                                                   "(default: ngram)")
    g.add_argument("--draft-path", help="draft checkpoint directory (eagle, multi_layer_eagle, eagle3) or the "
                                        "draft model's directory (draft_model)")
    g.add_argument("--num-draft-tokens", type=number(int, 2),
                   help=f"tree nodes including the root (default: ngram {_default(ng, 'num_draft_tokens')}, "
                        f"eagle {_default(ea, 'num_draft_tokens')})")
    g.add_argument("--num-steps", type=POSITIVE, help=f"draft steps (eagle, eagle3, draft_model, multi_layer_eagle; "
                                                     f"default: eagle {_default(ea, 'num_steps')}, "
                                                     f"multi_layer_eagle {_default(ml, 'num_steps')})")
    g.add_argument("--topk", type=POSITIVE, help=f"eagle, eagle3, draft_model: top-k per draft step "
                                                f"(default: {_default(ea, 'topk')})")
    g.add_argument("--max-bfs-breadth", type=POSITIVE, help="ngram: children per node for the shortest match "
                                                           f"(default: {_default(ng, 'max_bfs_breadth')})")
    g.add_argument("--min-bfs-breadth", type=POSITIVE, help="ngram: children per node for the longest match "
                                                           f"(default: {_default(ng, 'min_bfs_breadth')})")
    g.add_argument("--max-trie-depth", type=POSITIVE,
                   help=f"ngram: longest n-gram stored (default: {_default(ng, 'max_trie_depth')})")
    g.add_argument("--match", choices=["bfs", "prob"],
                   help=f"ngram: bfs (recency) or prob (frequency) (default: {_default(ng, 'match')})")
    sglang = p.add_argument_group("SGLang's flags", "the same settings under SGLang's names (instead of --draft)")
    for flag in SGLANG_FLAGS:
        sglang.add_argument(flag, dest=_sglang_dest(flag), metavar="VALUE")


def _sglang_dest(flag: str) -> str:
    return "sglang_" + flag.removeprefix("--").replace("-", "_")


def draft_config(args: argparse.Namespace):
    """The draft config the options describe (None for plain decoding); BadInput when they do not fit."""
    given = {k: v for k, v in vars(args).items() if v is not None}
    sglang = [part for flag in SGLANG_FLAGS if _sglang_dest(flag) in given
              for part in (flag, given[_sglang_dest(flag)])]
    if sglang:
        ours = [f"--{n.replace('_', '-')}" for n in ("draft", "draft_path", "num_draft_tokens", "num_steps", "topk",
                                                       "max_bfs_breadth", "min_bfs_breadth", "max_trie_depth",
                                                       "match") if n in given]
        if ours:
            raise BadInput(f"give the draft either with spectool's options or SGLang's flags, not both "
                           f"({ours[0]} and {sglang[0]})")
        try:
            return draft_from_sglang_args(sglang)
        except ValueError as e:
            raise BadInput(str(e)) from e

    def pick(*names: str) -> dict:
        return {n: given[n] for n in names if n in given}

    draft = args.draft or "ngram"
    if draft == "none":
        return None
    try:
        if draft == "ngram":
            return NgramConfig(**pick("num_draft_tokens", "max_bfs_breadth", "min_bfs_breadth", "max_trie_depth",
                                      "match"))
        if not args.draft_path:
            raise BadInput(f"--draft {draft} needs --draft-path")
        if not Path(args.draft_path).is_dir():
            raise BadInput(f"--draft-path {args.draft_path}: no such directory")
        tree = pick("num_steps", "topk", "num_draft_tokens")
        if draft == "eagle":
            return EagleConfig(args.draft_path, **tree)
        if draft == "eagle3":
            return Eagle3Config(args.draft_path, **tree)
        if draft == "draft_model":
            return DraftModelConfig(args.draft_path, **tree)
        return MultiLayerEagleConfig(args.draft_path, **pick("num_steps"))
    except BadInput:
        raise
    except ValueError as e:
        raise BadInput(str(e).replace("num_draft_tokens", "--num-draft-tokens").replace(
            "num_steps", "--num-steps")) from e


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Model, prompts and sampling options."""
    p.add_argument("--model", required=True, help="target directory (Hugging Face format) or hub id")
    p.add_argument("--prompts", required=True, help="JSONL ({\"prompt\": ...} per line) or text, one prompt a line")
    p.add_argument("--kind", help="only the JSONL prompts of this kind (completion, editing)")
    p.add_argument("--num-prompts", type=POSITIVE, help="use only the first N prompts (default: all)")
    p.add_argument("--max-new-tokens", type=POSITIVE, default=128, help="tokens generated per prompt")
    p.add_argument("--temperature", type=number(float, 0.0), default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=NON_NEGATIVE, default=0, help="sample from the k most likely tokens; 0 = all")
    p.add_argument("--top-p", type=number(float, 0.0, 1.0, low_open=True), default=1.0, help="nucleus sampling")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--batch-size", type=POSITIVE, default=8, help="requests decoded together")
    p.add_argument("--max-seq-len", type=number(int, 2),
                   help="prompt + output tokens per request (default: the model's limit, max_position_embeddings)")
    add_device_argument(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="weights and activations (default: bfloat16 on CUDA, float32 on cpu)")
    p.add_argument("--tp", type=POSITIVE, default=1,
                   help="split the target over this many processes (tensor parallelism; one GPU each on CUDA, "
                        "gloo on CPUs)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant target kernels on CUDA: greedy speculative output equals plain "
                        "output bit for bit in any dtype (slower prefill; no effect on CPU)")


def build_engine(args: argparse.Namespace, prompts: list[str]):
    """Load the target and make the engine the options describe; BadInput (before any decoding) when the
    options or the prompts do not fit the model."""
    draft = draft_config(args)
    import torch

    import spectool as st

    args.device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    target = st.load(args.model, device=args.device, dtype=dtype, tp_size=args.tp)
    limit = target.config.max_position_embeddings
    if args.max_seq_len is None:
        args.max_seq_len = limit
    elif args.max_seq_len > limit:
        raise BadInput(f"--max-seq-len {args.max_seq_len} is above the model's limit of {limit} positions "
                       "(max_position_embeddings in its config.json)")
    check_prompt_lengths(target, prompts, args.max_new_tokens, args.max_seq_len)
    return st.Engine(target, draft=draft, max_batch_size=args.batch_size, max_seq_len=args.max_seq_len,
                     deterministic=args.deterministic)


def check_prompt_lengths(target, prompts: list[str], max_new_tokens: int, max_seq_len: int) -> None:
    """BadInput naming the first prompt that does not fit ``max_seq_len`` with ``max_new_tokens`` after it."""
    limit = target.config.max_position_embeddings
    what = "the model's limit" if max_seq_len == limit else "--max-seq-len"
    for i, prompt in enumerate(prompts):
        n = len(target.encode(prompt))
        if n + max_new_tokens > max_seq_len:
            raise BadInput(f"prompt {i + 1} has {n} tokens; with --max-new-tokens {max_new_tokens} it needs "
                           f"{n + max_new_tokens} positions, more than {what} of {max_seq_len}")


def add_training_arguments(p: argparse.ArgumentParser, steps: int, batch_size: int, seq_len: int, lr: float,
                           checkpoint_every: int) -> None:
    """Corpus, output and optimiser options of train-target and train-draft, with these defaults."""
    p.add_argument("--corpus", required=True,
                   help="'stdlib' (this Python's standard library less the held-out modules), "
                        "a text/JSONL file, or a directory of .py/.txt/.md files")
    p.add_argument("--out", required=True, help="output directory (checkpoint, weights, eval.json)")
    p.add_argument("--steps", type=POSITIVE, default=steps, help="optimizer steps")
    p.add_argument("--batch-size", type=POSITIVE, default=batch_size, help="sequences per step")
    p.add_argument("--seq-len", type=number(int, 2), default=seq_len, help="tokens per sequence")
    p.add_argument("--lr", type=number(float, 0.0, low_open=True), default=lr, help="peak learning rate")
    p.add_argument("--checkpoint-every", type=POSITIVE, default=checkpoint_every, help="steps between checkpoints")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data order")
    add_device_argument(p)
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--max-seconds", type=number(float, 0.0, low_open=True), default=None,
                   help="stop training after this long")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--stdlib", default=None,
                   help="with --corpus stdlib: the standard library to read, a Lib/ directory or a .tar.xz "
                        "of one (benchmarks/pack_stdlib.py); default: this Python's")
    p.add_argument("--edit-fraction", type=number(float, 0.0, 1.0), default=0.25,
                   help="share of the training text made of editing pairs, a chunk then a lightly changed "
                        "copy (teaches copying)")
    p.add_argument("--epochs", type=number(float, 0.0), default=0.0,
                   help="when > 0, overrides --steps: passes over the training tokens")


def check_corpus(corpus: str, stdlib: str | None) -> None:
    """BadInput when --corpus (or --stdlib) names nothing readable; checked before --out is created."""
    if corpus != "stdlib" and not Path(corpus).exists():
        raise BadInput(f"--corpus {corpus}: no such file or directory (or pass 'stdlib')")
    if stdlib is not None and not Path(stdlib).exists():
        raise BadInput(f"--stdlib {stdlib}: no such file or directory")


def recipe_defaults(module: str, cls: str) -> dict[str, object]:
    """The literal field defaults of dataclass ``cls`` in ``module``, read from its source: the training recipes
    live beside torch code, and --help shows their defaults without importing it."""
    import ast
    from importlib.util import find_spec

    spec = find_spec(module)
    tree = ast.parse(open(spec.origin, encoding="utf-8").read())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return {n.target.id: ast.literal_eval(n.value) for n in body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None
            and isinstance(n.value, ast.Constant)}


def open_trace(command: str, path: str):
    """Load a trace for ``spectool COMMAND``. A file cut short inside a batch prints one line saying so and how
    many complete records were recovered; BadInput when the file is unreadable or, cut short, holds none."""
    from spectool.trace.format import TraceFormatError
    from spectool.trace.reader import Trace

    try:
        trace = Trace.load(path)
    except (TraceFormatError, OSError) as e:
        raise BadInput(f"cannot read {path}: {e}") from e
    if trace.truncated:  # len(trace) counts the records from the index, without reading them
        where = f": {trace.damage}" if trace.damage else ""
        if len(trace) == 0:
            raise NoCompleteRecord(f"{path} ends inside its first batch: 0 complete records recovered{where}")
        print(f"spectool {command}: {path} ends inside a batch (the run was cut short); "
              f"{len(trace)} complete records recovered{where}", file=sys.stderr)
    return trace
