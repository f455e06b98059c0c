"""Train a small Llama-style target (and its BPE tokenizer) on a code corpus.

``train_target`` writes a Hugging Face checkpoint (config.json, model.safetensors,
tokenizer.json) that `spectool.load` and `transformers` both read, plus ``eval.json`` with
the held-out loss, and keeps ``train_state.pt`` beside them for ``resume``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from spectool.model.config import ModelConfig
from spectool.model.llama import Transformer
from spectool.model.loader import load
from spectool.train import data
from spectool.train.hf_export import save_target
from spectool.train.loop import (
    CHECKPOINT_NAME,
    apply_gradients,
    atomic_save,
    autocast,
    epoch_steps,
    load_checkpoint,
    lr_at,
    make_optimizer,
    resolve_device,
    restore_checkpoint,
    seed_everything,
    train_loop,
)
from spectool.train.tokenizer import eos_id, save_tokenizer, train_tokenizer

# Fields of TargetRecipe that fix the model's shape: a resumed run must agree on them.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                "max_position_embeddings", "rope_theta", "tie_word_embeddings")


@dataclass
class TargetRecipe:
    """Model shape and optimisation settings of a target training run."""

    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 5
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 640
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    steps: int = 1000
    batch_size: int = 64
    seq_len: int = 512
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.1
    checkpoint_every: int = 200
    eval_windows: int = 64
    seed: int = 0
    tokenizer_docs: int = 0  # train the tokenizer on every n-th document (0 = all)
    edit_fraction: float = 0.25  # share of the training text that is editing pairs (data.editing_pairs)
    epochs: float = 0.0  # when > 0, the step count covers this many passes over the training tokens

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "checkpoint_every", "eval_windows", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0.0 <= self.edit_fraction < 1.0:
            raise ValueError(f"edit_fraction must be in [0, 1), got {self.edit_fraction}")
        if self.epochs < 0:
            raise ValueError(f"epochs must be >= 0, got {self.epochs}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                             f"num_heads {self.num_heads}")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError(f"seq_len {self.seq_len} exceeds max_position_embeddings "
                             f"{self.max_position_embeddings}")

    def model_config(self, eos: int) -> ModelConfig:
        return ModelConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_layers,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.hidden_size // self.num_heads, rms_norm_eps=1e-5, rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings, eos_token_ids=[eos])


def init_weights(model: torch.nn.Module, num_layers: int, std: float = 0.02) -> None:
    """GPT-2 style init: normal(0, std) matrices, output projections also / sqrt(2 * layers), unit norms."""
    for name, p in model.named_parameters():
        if p.dim() < 2:
            torch.nn.init.ones_(p) if name.endswith("norm.weight") else torch.nn.init.zeros_(p)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.nn.init.normal_(p, 0.0, std / math.sqrt(2 * num_layers))
        else:
            torch.nn.init.normal_(p, 0.0, std)


def lm_loss(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a [B, T+1] batch."""
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inp.shape[1], device=inp.device).expand_as(inp)
    logits = model.logits(model(inp, positions))
    return F.cross_entropy(logits.flatten(0, 1), tgt.flatten())


@torch.no_grad()
def heldout_loss(model: Transformer, tokens: torch.Tensor, seq_len: int, max_windows: int,
                 device: torch.device) -> float:
    """Mean next-token loss over evenly spread windows of a held-out token stream."""
    losses = []
    for w in data.eval_windows(tokens, seq_len + 1, max_windows):
        with autocast(device):
            losses.append(float(lm_loss(model, w.to(device))))
    return sum(losses) / len(losses)


def train_target(corpus: str | Path, out_dir: str | Path, recipe: TargetRecipe | None = None,
                 device: str | None = "auto", resume: bool = False, progress: bool = True,
                 max_seconds: float | None = None, stdlib: str | Path | None = None,
                 tokenizer: str | Path | None = None) -> dict:
    """Train tokenizer + target on ``corpus`` (``"stdlib"``, a file or a directory) into ``out_dir``.

    Args:
        recipe: model shape and optimisation settings (defaults: the demo target).
        device: "auto", "cpu", "cuda", ...; bf16 autocast is used on CUDA.
        resume: continue from ``out_dir/train_state.pt``. Without it, an existing checkpoint is
            never overwritten (ValueError).
        max_seconds: a time budget: the step count is fitted to it after the first steps.
        stdlib: the standard library ``"stdlib"`` means: a Lib/ directory or a tar archive of one
            (default: the running interpreter's).
        tokenizer: a tokenizer.json to use instead of training one (a draft model for another
            target must share that target's tokenizer).

    Returns the evaluation dict also written to ``out_dir/eval.json``.
    """
    recipe = recipe or TargetRecipe()
    dev = resolve_device(device)
    out = Path(out_dir)
    state = load_checkpoint(out) if resume else None
    if not resume and (out / CHECKPOINT_NAME).exists():
        raise ValueError(f"{out} already holds a training checkpoint; pass --resume to continue it "
                         "or choose another --out")
    if state is not None:
        if state.get("kind") != "target":
            raise ValueError(f"{out / CHECKPOINT_NAME} is not a target checkpoint")
        diff = [f for f in SHAPE_FIELDS if state["recipe"][f] != getattr(recipe, f)]
        if diff:
            have = ", ".join(f"{f}={state['recipe'][f]}" for f in diff)
            raise ValueError(f"cannot resume: the checkpoint has {have}; pass the same model shape")
    seed_everything(recipe.seed)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    if state is not None and (out / "tokenizer.json").is_file():
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    elif tokenizer is not None:
        if not Path(tokenizer).is_file():
            raise ValueError(f"tokenizer {tokenizer} is not a file (a tokenizer.json is needed)")
        tok = Tokenizer.from_file(str(tokenizer))
        if tok.get_vocab_size() != recipe.vocab_size:
            raise ValueError(f"tokenizer {tokenizer} has {tok.get_vocab_size()} tokens; pass --vocab-size "
                             f"{tok.get_vocab_size()}")
        save_tokenizer(tok, out)
    else:
        docs = data.read_corpus(corpus, stdlib)
        step = max(1, recipe.tokenizer_docs)
        tok = train_tokenizer(docs[::step], recipe.vocab_size)
        save_tokenizer(tok, out)
    train_tokens, eval_tokens = data.corpus_tokens(corpus, tok, eos_id(tok), recipe.seq_len, stdlib=stdlib,
                                                   edit_fraction=recipe.edit_fraction, seed=recipe.seed)
    steps = epoch_steps(recipe.epochs, len(train_tokens), recipe.batch_size, recipe.seq_len) or recipe.steps
    prep_s = time.perf_counter() - t0
    print(f"corpus: {len(train_tokens):,} training tokens (editing pairs: {recipe.edit_fraction:.0%}), "
          f"{len(eval_tokens):,} held-out tokens ({prep_s:.1f}s to tokenize); {steps} steps")

    cfg = recipe.model_config(eos_id(tok))
    model = Transformer(cfg)
    init_weights(model, cfg.num_layers)
    model.to(dev).train()
    opt = make_optimizer(model.parameters(), recipe.lr, recipe.weight_decay, fused=dev.type == "cuda")
    gen = torch.Generator().manual_seed(recipe.seed)
    start = restore_checkpoint(state, "model", model, opt, gen)

    def step_fn(step: int, total: int):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, recipe.lr, recipe.warmup)
        batch = data.random_windows(train_tokens, recipe.batch_size, recipe.seq_len + 1, gen)
        with autocast(dev):
            loss = lm_loss(model, batch.to(dev, non_blocking=True))
        loss.backward()
        apply_gradients(model, opt, first=step == start)
        return loss.detach(), batch.numel() - batch.shape[0]

    def save_fn(step: int) -> None:
        atomic_save({"kind": "target", "step": step, "model": model.state_dict(),
                     "optimizer": opt.state_dict(), "generator": gen.get_state(), "recipe": asdict(recipe)},
                    out / CHECKPOINT_NAME)

    run = train_loop(step_fn, save_fn, start=start, steps=steps,
                     checkpoint_every=recipe.checkpoint_every,
                     batch_size=recipe.batch_size, out_dir=out, desc="target", progress=progress,
                     max_seconds=max_seconds)
    weight_bytes = save_target(model, out)
    # Evaluate what was saved, in the dtype the engine runs it in (bf16 on CUDA).
    saved = load(out, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32).model
    result = {
        "heldout_loss": heldout_loss(saved, eval_tokens, recipe.seq_len, recipe.eval_windows, dev),
        "heldout_source": "held-out stdlib modules" if str(corpus) == "stdlib" else "last 5% of the corpus",
        "params": sum(p.numel() for p in model.parameters()),
        "weight_bytes": weight_bytes,
        "train_tokens": len(train_tokens),
        "device": str(dev),
        "resumed_from": start,
        **run,
        "recipe": asdict(recipe),
        "seconds": time.perf_counter() - t0,
    }
    (out / "eval.json").write_text(json.dumps(result, indent=2))
    print(f"target: held-out loss {result['heldout_loss']:.3f} after {run['steps']} steps "
          f"({run['tokens_per_s']:,.0f} tok/s); saved to {out}")
    return result

