"""Train EAGLE (one layer), EAGLE-3 (one layer) or multi-layer EAGLE (K layers) drafts against a frozen target.

Alignment is the engine's (docs/INTERNALS.md), with h = target hidden before the final norm:
- EAGLE, step 1: at index i the layer reads (emb(x[i+1]), h[i]) at position i+1 and predicts the
  target's prediction at i+1. Step s > 1 reads (emb(x[i+s]), its own step s-1 feature at i), at
  position i+s. Training unrolls ``unroll`` such steps (gradients flow through the features) and
  also regresses each step's feature onto h at the index it stands for, so long chains stay on track.
- Multi-layer EAGLE, layer k: at index i reads (emb(x[i+k+1]), h[i]) at position i+k+1 and
  predicts the target's prediction at i+k+1. Chained (the default), layer k > 0 reads layer
  k-1's feature at i in place of h[i] (gradients flow through it, as through EAGLE's unroll).
- EAGLE-3: as EAGLE, but step 1 reads fc(three target layers' outputs at i) in place of h[i], its
  head covers a reduced vocabulary (the ``draft_vocab_size`` most frequent target ids of the
  training tokens, mapped by d2t), its labels are the target's distribution renormalised over
  that vocabulary (at positions whose target top-1 lies in it), and there is no feature
  regression (EAGLE-3 drops it: its features need not imitate a target layer). Instead each
  step s > 1 attends as it does in the engine, to step 1's entries of the prefix and to its own
  path's entries (EAGLE-3's training-time test), so the engine drafts what training taught.

Labels are the target's own next-token distributions (self-distillation): acceptance, not corpus
likelihood, is what the loss optimises.

Inputs can also match inference: in the engine, the tokens a draft layer reads are the committed
ones, i.e. the target's own greedy continuation. With ``greedy_fraction`` > 0 that share of each
batch is a corpus prefix followed by the target's greedy continuation of it (``DraftBatches``).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from spectool.model.draft_layer import KINDS, DraftModel, load_draft, save_draft
from spectool.model.eagle3 import Eagle3Draft, load_eagle3, new_eagle3, save_eagle3
from spectool.model.kv_cache import KVCache
from spectool.model.loader import Target, load
from spectool.train import data
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
from spectool.train.target import init_weights


@dataclass
class DraftRecipe:
    """What to train (method, layers) and how (optimisation settings)."""

    method: str = "eagle"
    layers: int = 1
    steps: int = 600
    batch_size: int = 32
    seq_len: int = 512
    lr: float = 2e-3
    warmup: int = 30
    weight_decay: float = 0.0
    checkpoint_every: int = 200
    eval_windows: int = 32
    seed: int = 0
    intermediate_size: int | None = None  # the draft block's MLP width; None = the target's
    chained: bool = True       # multi-layer EAGLE: layer k > 0 reads layer k-1's feature, not h
    unroll: int = 5            # EAGLE: draft steps unrolled in training (the engine drafts 5)
    feature_weight: float = 1.0  # EAGLE: weight of the feature regression loss
    eval_steps: int = 5        # EAGLE: chain steps evaluated
    gen_prompts: int = 16      # greedy continuations of held-out prompts for the acceptance estimate
    gen_tokens: int = 128
    edit_fraction: float = 0.25  # share of the training text that is editing pairs (data.editing_pairs)
    epochs: float = 0.0  # when > 0, the step count covers this many passes over the training tokens
    greedy_fraction: float = 0.0  # share of each batch: corpus prefix + the target's greedy continuation
    greedy_refresh: int = 16  # steps whose greedy sequences are generated together (one batched decode)
    draft_vocab_size: int | None = None  # EAGLE-3: the draft head's vocabulary; None = the target's
    aux_layers: tuple[int, ...] | None = None  # EAGLE-3: target layers read; None = SGLang's default

    def __post_init__(self) -> None:
        if self.method not in (*KINDS, "eagle3"):
            raise ValueError(f"method must be one of {', '.join((*KINDS, 'eagle3'))}, got {self.method!r}")
        if self.layers < 1:
            raise ValueError(f"--layers must be >= 1, got {self.layers}")
        if self.method in ("eagle", "eagle3") and self.layers != 1:
            raise ValueError(f"EAGLE reuses one draft layer for every step; --layers must be 1, "
                             f"got {self.layers}")
        if self.method in ("eagle", "eagle3"):
            self.chained = False  # a property of multi-layer drafts only
        if self.method != "eagle3" and (self.draft_vocab_size is not None or self.aux_layers is not None):
            raise ValueError("draft_vocab_size and aux_layers are EAGLE-3 settings (--method eagle3)")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1, got {self.draft_vocab_size}")
        if self.aux_layers is not None:
            self.aux_layers = tuple(self.aux_layers)
            if len(self.aux_layers) != 3:
                raise ValueError(f"aux_layers must name three target layers, got {self.aux_layers}")
        for name in ("steps", "batch_size", "checkpoint_every", "eval_windows", "unroll", "eval_steps",
                     "greedy_refresh"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0.0 <= self.edit_fraction < 1.0:
            raise ValueError(f"edit_fraction must be in [0, 1), got {self.edit_fraction}")
        if self.epochs < 0:
            raise ValueError(f"epochs must be >= 0, got {self.epochs}")
        if not 0.0 <= self.greedy_fraction <= 1.0:  # also rejects NaN
            raise ValueError(f"greedy_fraction must be in [0, 1], got {self.greedy_fraction}")
        if self.gen_tokens < max(self.depth, self.eval_steps) + 1:
            raise ValueError(f"gen_tokens must exceed the evaluated draft depth, got {self.gen_tokens}")
        if self.seq_len < self.depth + 2:
            raise ValueError(f"seq_len must be >= {self.depth + 2} for {self.depth} draft steps, "
                             f"got {self.seq_len}")

    @property
    def depth(self) -> int:
        """How many tokens ahead training reaches (layers, or unrolled EAGLE steps)."""
        return self.layers if self.method == "multi_layer_eagle" else self.unroll

    @property
    def greedy_rows(self) -> int:
        """Sequences per batch that end in the target's greedy continuation."""
        return round(self.greedy_fraction * self.batch_size)


def load_target(path: str | Path, device: torch.device) -> Target:
    """The frozen target, or a ValueError saying why ``path`` is not one.

    On CUDA it is bf16, as the engine runs it, so the drafts learn from the hidden states they
    will see (and every op gets one dtype); on CPU float32.
    """
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"--target {p} is not a directory")
    if not (p / "config.json").is_file() or not list(p.glob("*.safetensors")):
        raise ValueError(f"--target {p} is not a model directory (config.json and *.safetensors needed)")
    try:
        target = load(p, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    except (ValueError, OSError, RuntimeError) as e:
        raise ValueError(f"--target {p} could not be loaded as a model: {e}") from e
    if target.tokenizer is None:
        raise ValueError(f"--target {p} has no tokenizer.json (needed to tokenize the corpus)")
    return target


@dataclass
class TargetView:
    """What the frozen target says about a batch: hidden states, next-token probabilities, argmax."""

    emb: torch.Tensor     # [B, T, H] token embeddings
    hidden: torch.Tensor  # [B, T, H] before the final norm
    probs: torch.Tensor   # [B, T, V] float32
    argmax: torch.Tensor  # [B, T]
    aux: torch.Tensor | None = None  # [B, T, 3H] EAGLE-3's target layers' outputs


@torch.no_grad()
def target_view(target: Target, tokens: torch.Tensor, aux_layers: tuple[int, ...] | None = None) -> TargetView:
    model = target.model
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    hidden, aux = model(tokens, positions, aux_layers=aux_layers) if aux_layers else (model(tokens, positions), None)
    probs = model.logits(hidden).softmax(-1)
    return TargetView(model.embed_tokens(tokens), hidden, probs, probs.argmax(-1), aux)


def view_of(draft: DraftModel | Eagle3Draft, target: Target, tokens: torch.Tensor) -> TargetView:
    """The target's view of a batch with what this draft reads."""
    return target_view(target, tokens, draft.aux_layers if isinstance(draft, Eagle3Draft) else None)


def draft_chain(draft: DraftModel | Eagle3Draft, target: Target, view: TargetView, depth: int):
    """Run the draft over a batch for ``depth`` steps; yields (step s, feature, logits) per step.

    Step s (0-based) covers indices i = 0 .. T-s-2 and predicts the target's prediction at i+s+1
    (compare ``predicted_ids(draft, logits)`` with ``view.argmax[:, s+1:]``). Logits are over the
    target's vocabulary, an EAGLE-3 draft's over its own (``predicted_ids`` maps them). An
    EAGLE-3 step s > 0 attends as the engine's does (``Eagle3Layer._training_time_attention``).
    """
    T = view.hidden.shape[1]
    feature = None
    eagle3 = isinstance(draft, Eagle3Draft)
    past: list = []  # EAGLE-3: every step's keys and values
    for s in range(depth):
        n = T - s - 1
        positions = torch.arange(s + 1, T, device=view.hidden.device).expand(view.hidden.shape[0], n)
        if eagle3:
            layer = draft.layer
            hidden = feature[:, :n] if feature is not None else layer.project(view.aux[:, :n])
            feature, normed = layer(view.emb[:, s + 1:], hidden, positions, past=past)
            yield s, feature, layer.logits(normed).float()
            continue
        own = feature is not None and (draft.kind == "eagle" or draft.chained)
        layer = draft.layers[s] if draft.kind == "multi_layer_eagle" else draft.layers[0]
        hidden = feature[:, :n] if own else view.hidden[:, :n]
        feature, normed = layer(view.emb[:, s + 1:], hidden, positions)
        yield s, feature, target.model.lm_head(normed).float()


def draft_ids(layer) -> torch.Tensor:
    """The target ids of an EAGLE-3 layer's draft vocabulary, in draft-id order."""
    return torch.arange(layer.draft_vocab_size, device=layer.d2t.device) + layer.d2t


def predicted_ids(draft: DraftModel | Eagle3Draft, logits: torch.Tensor) -> torch.Tensor:
    """The target id each of ``draft_chain``'s logits rows drafts (its top-1)."""
    top = logits.argmax(-1)
    return draft_ids(draft.layer)[top] if isinstance(draft, Eagle3Draft) else top


def draft_loss(draft: DraftModel | Eagle3Draft, target: Target, view: TargetView, recipe: DraftRecipe) -> torch.Tensor:
    """Mean over steps of soft cross-entropy to the target (+ EAGLE feature regression).

    EAGLE-3 learns the target's distribution renormalised over its draft vocabulary, at the
    positions whose target top-1 it can draft (elsewhere no draft of it is ever accepted).
    """
    total = 0.0
    if isinstance(draft, Eagle3Draft):
        ids = draft_ids(draft.layer)
        probs_all = view.probs[..., ids]
        probs_all = probs_all / probs_all.sum(-1, keepdim=True).clamp(min=1e-12)
        in_vocab = torch.zeros(view.probs.shape[-1], dtype=torch.bool, device=ids.device)
        in_vocab[ids] = True
        draftable = in_vocab[view.argmax].float()
    for s, feature, logits in draft_chain(draft, target, view, recipe.depth):
        if isinstance(draft, Eagle3Draft):
            ce = -(probs_all[:, s + 1:] * logits.log_softmax(-1)).sum(-1)
            keep = draftable[:, s + 1:]
            total = total + (ce * keep).sum() / keep.sum().clamp(min=1.0)
            continue
        probs = view.probs[:, s + 1:]
        total = total - (probs * logits.log_softmax(-1)).sum(-1).mean()
        if recipe.method == "eagle" and recipe.feature_weight > 0:
            # The step-s feature at i stands in for h[i+s+1]; compare scale-free (per-token RMS of h).
            h = view.hidden[:, s + 1:].float()
            scale = h.pow(2).mean(-1, keepdim=True).sqrt().clamp(min=1e-6)
            total = total + recipe.feature_weight * F.smooth_l1_loss(feature.float() / scale, h / scale)
    return total / recipe.depth


@torch.no_grad()
def greedy_continuations(target: Target, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[torch.Tensor]:
    """Each prompt followed by the target's greedy continuation of ``new_tokens`` tokens (1-D int64).

    Prompts of one length are prefilled together; otherwise each is prefilled alone into its own
    cache slot. Then all rows decode together, each at its own position (the cache's per-row ``starts``).
    """
    model = target.model
    param = next(model.parameters())
    dev = param.device
    lens = [len(p) for p in prompts]
    cache = KVCache.for_model(target.config, len(prompts), max(lens) + new_tokens, param.dtype, dev)
    groups = [list(range(len(prompts)))] if len(set(lens)) == 1 else [[b] for b in range(len(prompts))]
    last = []
    for rows in groups:
        tokens = torch.tensor([list(prompts[b]) for b in rows], device=dev)
        n = tokens.shape[1]
        hidden = model(tokens, torch.arange(n, device=dev).expand_as(tokens), cache=cache,
                       slots=torch.tensor(rows, device=dev),
                       starts=torch.zeros(len(rows), dtype=torch.long, device=dev), kv_len=n)
        last.append(model.logits(hidden[:, -1:]).argmax(-1))
    tokens = torch.cat(last)
    out = [tokens]
    slots = torch.arange(len(prompts), device=dev)
    starts = torch.tensor(lens, device=dev)  # where each row's latest token goes
    for step in range(new_tokens - 1):
        hidden = model(tokens, starts[:, None], cache=cache, slots=slots, starts=starts,
                       kv_len=max(lens) + step + 1)
        tokens = model.logits(hidden).argmax(-1)
        out.append(tokens)
        starts = starts + 1
    generated = torch.cat(out, dim=1).cpu()
    return [torch.cat([torch.tensor(list(p), dtype=torch.long), row]) for p, row in zip(prompts, generated)]


def greedy_windows(target: Target, tokens: torch.Tensor, recipe: DraftRecipe, chunk: int) -> torch.Tensor:
    """The greedy rows of ``recipe.greedy_refresh`` steps' batches, starting at step chunk x greedy_refresh.

    Each row [seq_len] is a random corpus window of seq_len // 2 tokens followed by the target's
    greedy continuation of it (so the draft reads committed tokens as the engine does, and sees
    them both early and late in the sequence). The windows are drawn from a generator seeded by
    (seed, chunk): the rows are a function of the recipe and the chunk alone, so a resumed run
    regenerates exactly the rows an uninterrupted one used.
    """
    prefix = recipe.seq_len // 2
    gen = torch.Generator().manual_seed(recipe.seed * 1_000_003 + chunk + 1)
    prompts = data.random_windows(tokens, recipe.greedy_refresh * recipe.greedy_rows, prefix, gen)
    return torch.stack(greedy_continuations(target, prompts.tolist(), recipe.seq_len - prefix))


class DraftBatches:
    """The training batch of each step: random corpus windows, and with ``recipe.greedy_fraction``
    > 0 its first ``recipe.greedy_rows`` rows from ``greedy_windows`` instead.

    The corpus rows come from ``generator`` (saved in checkpoints), so greedy_fraction 0 gives
    exactly the batches training has always used. Greedy rows are generated ``greedy_refresh``
    steps at a time, one batched decode on the target's device: one row of the target's decode
    costs about as much as a training row, so generating them one step at a time would leave a
    GPU idle.
    """

    def __init__(self, target: Target, tokens: torch.Tensor, recipe: DraftRecipe, generator: torch.Generator):
        self.target, self.tokens, self.recipe, self.generator = target, tokens, recipe, generator
        self._chunk, self._greedy = -1, torch.empty(0, recipe.seq_len, dtype=torch.long)

    def __call__(self, step: int) -> torch.Tensor:
        """[batch_size, seq_len] int64 on the CPU (greedy rows first)."""
        r = self.recipe
        corpus = data.random_windows(self.tokens, r.batch_size - r.greedy_rows, r.seq_len, self.generator)
        if not r.greedy_rows:
            return corpus
        chunk, k = divmod(step, r.greedy_refresh)
        if chunk != self._chunk:
            self._chunk, self._greedy = chunk, greedy_windows(self.target, self.tokens, r, chunk)
        return torch.cat([self._greedy[k * r.greedy_rows:(k + 1) * r.greedy_rows], corpus])


def iteration_accepts(accepted: Sequence[int]) -> list[int]:
    """Accept lengths of the engine's iterations, from per-position chain accept counts.

    ``accepted[j]`` is how many leading chain drafts match the target when a draft starts j
    tokens into the greedy continuation. The engine accepts a drafts, commits a + 1 tokens and
    starts its next draft there, so only those positions are iterations: where drafting fails
    the engine spends more iterations than a mean over every position counts.
    """
    walks, j = [], 0
    while j < len(accepted):
        walks.append(int(accepted[j]))
        j += int(accepted[j]) + 1
    return walks


@torch.no_grad()
def greedy_accept_estimate(draft: DraftModel, target: Target, prompts: Sequence[Sequence[int]],
                           new_tokens: int, depth: int, device: torch.device) -> dict:
    """What greedy top-1 chain drafting of ``depth`` steps accepts while the engine decodes ``prompts``.

    The target continues every prompt greedily; the draft then runs teacher-forced over each
    whole sequence (``draft_chain``), and at every generated position the count of leading chain
    steps that equal the target's tokens is taken. ``greedy_accept_length`` walks those counts
    the way the engine's iterations do (``iteration_accepts``) for ``new_tokens`` output tokens,
    as in ``Engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)``: exact for
    multi-layer EAGLE and for EAGLE-3's top-1 chain (tests/test_mle_alignment.py,
    tests/test_eagle3_alignment.py), an estimate for EAGLE, whose training steps attend to
    their own step's features; an engine tree (top-k) accepts more than a chain.
    ``greedy_accept_length_per_position`` is the plain mean over positions (higher: it counts
    easy, repetitive stretches once per token instead of once per iteration).
    """
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 for at least one drafting iteration, got {new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("the accept-length estimate needs at least one non-empty prompt")
    # The last iteration's drafts reach up to depth tokens past the output's end.
    seqs = greedy_continuations(target, prompts, new_tokens + depth)
    lens = torch.tensor([len(p) for p in prompts])
    tokens = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True).to(device)  # right padding: causal
    # Iteration j starts with the cache holding P + j tokens, i.e. at index P - 1 + j; the engine
    # runs iterations while fewer than new_tokens tokens are out (the first comes from prefill).
    idx = ((lens - 1)[:, None] + torch.arange(new_tokens - 1)).to(device)
    with autocast(device):
        view = view_of(draft, target, tokens)
        run = torch.ones(idx.shape, dtype=torch.bool, device=device)
        accepted = torch.zeros(idx.shape, dtype=torch.long, device=device)
        for s, _, logits in draft_chain(draft, target, view, depth):
            run &= predicted_ids(draft, logits).gather(1, idx) == view.argmax.gather(1, idx + s + 1)
            accepted += run
    walks = [a for row in accepted.tolist() for a in iteration_accepts(row)]
    return {"greedy_accept_length": sum(walks) / len(walks),
            "greedy_accept_length_per_position": float(accepted.float().mean()),
            "iterations": len(walks)}


def frequent_ids_offsets(tokens: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """d2t for a draft vocabulary of the ``draft_vocab_size`` most frequent ids of ``tokens`` (ties
    to the smaller id), in id order: target id = draft id + d2t[draft id]."""
    if draft_vocab_size > vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} is larger than the target's vocabulary ({vocab_size})")
    counts = torch.bincount(tokens.flatten().cpu(), minlength=vocab_size)[:vocab_size].double()
    order = torch.argsort(-counts + torch.arange(vocab_size) / (2 * vocab_size))  # stable ties
    ids = order[:draft_vocab_size].sort().values
    return ids - torch.arange(draft_vocab_size)


@torch.no_grad()
def init_head_from_target(draft: Eagle3Draft, target: Target) -> None:
    """Start an EAGLE-3 draft's output where the target's is: its ``lm_head`` rows are the target's
    rows of the draft vocabulary and its final norm the target's. EAGLE reuses the target's head
    as it is; a head learnt from random rows spends much of a short training on what the target
    already knows (the rows for its own ids)."""
    layer = draft.layer
    layer.lm_head.weight.copy_(target.model.lm_head.weight[draft_ids(layer).to(target.device)])
    layer.norm.weight.copy_(target.model.norm.weight)


def estimate_prompts(target: Target, corpus: str | Path, eval_tokens: torch.Tensor, recipe: DraftRecipe,
                     stdlib: str | Path | None = None) -> tuple[list[list[int]], str]:
    """(token-id prompts, what they are) for the accept-length estimate.

    For the stdlib corpus: the benchmark's own completion prompts (``data.completion_prompts``
    of the held-out modules, same seed, so the first ones equal those in the demo's
    prompts.jsonl). A user corpus has no named held-out files: windows of its held-out tail.
    Prompts keep their last tokens when the continuation would pass the target's positions.
    """
    if str(corpus) == "stdlib":
        named = data.heldout_named_documents(stdlib)
        texts = [p["prompt"] for p in data.completion_prompts(named, recipe.gen_prompts, seed=recipe.seed)]
        prompts, source = [target.encode(t) for t in texts], "completion prompts of the held-out modules"
    else:
        P = min(recipe.seq_len // 2, 128)
        prompts = [w[0].tolist() for w in data.eval_windows(eval_tokens, P, recipe.gen_prompts)]
        source = f"{P}-token windows of the held-out tail"
    room = target.config.max_position_embeddings - recipe.gen_tokens - max(recipe.depth, recipe.eval_steps)
    if room < 1:
        raise ValueError(f"gen_tokens={recipe.gen_tokens} leaves no room for a prompt within the target's "
                         f"{target.config.max_position_embeddings} positions")
    return [p[-room:] for p in prompts], source


@torch.no_grad()
def evaluate_draft(draft: DraftModel, target: Target, eval_tokens: torch.Tensor, recipe: DraftRecipe,
                   device: torch.device, prompts: Sequence[Sequence[int]], prompt_source: str = "") -> dict:
    """Held-out agreement of each draft layer/step with the target, and a greedy accept-length estimate.

    ``agreement[s]``: top-1 of draft step s equals the target's top-1, on held-out text.
    ``greedy_accept_length`` (per engine iteration) and ``greedy_accept_length_per_position``:
    ``greedy_accept_estimate`` over ``prompts`` with ``recipe.gen_tokens`` new tokens each.
    """
    depth = recipe.layers if recipe.method == "multi_layer_eagle" else recipe.eval_steps
    hits, counts = [0.0] * depth, [0] * depth
    for w in data.eval_windows(eval_tokens, recipe.seq_len, recipe.eval_windows):
        with autocast(device):
            view = view_of(draft, target, w.to(device))
            for s, _, logits in draft_chain(draft, target, view, depth):
                hits[s] += float((predicted_ids(draft, logits) == view.argmax[:, s + 1:]).sum())
                counts[s] += logits.shape[0] * logits.shape[1]
    estimate = greedy_accept_estimate(draft, target, prompts, recipe.gen_tokens, depth, device)
    return {"agreement": [h / max(1, c) for h, c in zip(hits, counts)],
            "greedy_accept_length": estimate["greedy_accept_length"],
            "greedy_accept_length_per_position": estimate["greedy_accept_length_per_position"],
            "greedy_eval": {"prompts": len(prompts), "prompt_source": prompt_source,
                            "prompt_tokens": sum(map(len, prompts)) / len(prompts),
                            "new_tokens": recipe.gen_tokens, "chain_steps": depth,
                            "iterations": estimate["iterations"]}}


def train_draft(target_dir: str | Path, corpus: str | Path, out_dir: str | Path,
                recipe: DraftRecipe | None = None, device: str | None = "auto", resume: bool = False,
                progress: bool = True, max_seconds: float | None = None,
                save_dtype: torch.dtype = torch.bfloat16, stdlib: str | Path | None = None) -> dict:
    """Train draft layers for the target in ``target_dir`` on ``corpus``; write them to ``out_dir``.

    ``out_dir`` receives the draft checkpoint (config.json + model.safetensors, what
    ``load_draft`` reads), ``eval.json`` (per-layer agreement) and ``train_state.pt`` (for
    ``resume``; an existing one is never overwritten without ``resume``). ``max_seconds`` is a
    time budget the step count is fitted to; ``save_dtype`` is the dtype of the saved weights;
    ``stdlib`` the standard library ``"stdlib"`` means (a Lib/ directory or a tar archive of one).
    """
    recipe = recipe or DraftRecipe()
    dev = resolve_device(device)
    out = Path(out_dir)
    if not resume and (out / CHECKPOINT_NAME).exists():
        raise ValueError(f"{out} already holds a training checkpoint; pass --resume to continue it "
                         "or choose another --out")
    target = load_target(target_dir, dev)
    state = load_checkpoint(out) if resume else None
    if state is not None:
        if state.get("kind") != "draft":
            raise ValueError(f"{out / CHECKPOINT_NAME} is not a draft checkpoint")
        for name in ("method", "layers", "intermediate_size", "chained"):
            had = state["recipe"].get(name, False)  # checkpoints from before "chained" are unchained
            if had != getattr(recipe, name):
                raise ValueError(f"cannot resume: the checkpoint has {name}={had!r}, "
                                 f"this run {getattr(recipe, name)!r}")
        if state["target_hash"] != target.model_hash:
            raise ValueError(f"cannot resume: {out} was trained against a different target")
    seed_everything(recipe.seed)

    t0 = time.perf_counter()
    eos = target.eos_token_ids[0] if target.eos_token_ids else 0
    train_tokens, eval_tokens = data.corpus_tokens(corpus, target.tokenizer, eos, recipe.seq_len, stdlib=stdlib,
                                                   edit_fraction=recipe.edit_fraction, seed=recipe.seed)
    out.mkdir(parents=True, exist_ok=True)  # only once the inputs have been read: a bad one leaves nothing
    steps = epoch_steps(recipe.epochs, len(train_tokens), recipe.batch_size, recipe.seq_len) or recipe.steps
    print(f"corpus: {len(train_tokens):,} training tokens (editing pairs: {recipe.edit_fraction:.0%}), "
          f"{len(eval_tokens):,} held-out tokens; {steps} steps; {recipe.greedy_rows} of "
          f"{recipe.batch_size} sequences per batch end in the target's greedy continuation")

    cfg = target.config
    if recipe.intermediate_size:
        cfg = dataclasses.replace(cfg, intermediate_size=recipe.intermediate_size)
    if recipe.method == "eagle3":
        draft = new_eagle3(target.config, recipe.draft_vocab_size, recipe.aux_layers, recipe.intermediate_size)
        init_weights(draft, 1)
        draft.layer.d2t.copy_(frequent_ids_offsets(train_tokens, target.config.vocab_size,
                                                   draft.layer.draft_vocab_size))
        init_head_from_target(draft, target)
    else:
        draft = DraftModel(cfg, recipe.layers, recipe.method, rope=target.model.rope, chained=recipe.chained)
        init_weights(draft, 1)
    draft.to(dev).train()
    opt = make_optimizer(draft.parameters(), recipe.lr, recipe.weight_decay, fused=dev.type == "cuda")
    gen = torch.Generator().manual_seed(recipe.seed)
    start = restore_checkpoint(state, "draft", draft, opt, gen)
    batches = DraftBatches(target, train_tokens, recipe, gen)

    def step_fn(step: int, total: int):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, recipe.lr, recipe.warmup)
        batch = batches(step).to(dev, non_blocking=True)
        with autocast(dev):
            loss = draft_loss(draft, target, view_of(draft, target, batch), recipe)
        loss.backward()
        apply_gradients(draft, opt, first=step == start)
        return loss.detach(), batch.numel()

    def save_fn(step: int) -> None:
        atomic_save({"kind": "draft", "step": step, "draft": draft.state_dict(),
                     "optimizer": opt.state_dict(), "generator": gen.get_state(), "recipe": asdict(recipe),
                     "target_hash": target.model_hash}, out / CHECKPOINT_NAME)

    run = train_loop(step_fn, save_fn, start=start, steps=steps,
                     checkpoint_every=recipe.checkpoint_every,
                     batch_size=recipe.batch_size, out_dir=out, desc=recipe.method, progress=progress,
                     max_seconds=max_seconds)
    if recipe.method == "eagle3":
        export = new_eagle3(target.config, recipe.draft_vocab_size, draft.aux_layers, recipe.intermediate_size)
        export.load_state_dict(draft.state_dict())
        save_eagle3(export.to(save_dtype), out)
        saved = load_eagle3(out, target)
    else:
        export = DraftModel(cfg, recipe.layers, recipe.method, chained=recipe.chained)
        export.load_state_dict(draft.state_dict())
        save_draft(export.to(save_dtype), out)
        saved = load_draft(out, target)
    # Evaluate what was saved, loaded the way the engine loads it.
    prompts, prompt_source = estimate_prompts(target, corpus, eval_tokens, recipe, stdlib)
    result = evaluate_draft(saved, target, eval_tokens, recipe, dev, prompts, prompt_source)
    result |= {
        "method": recipe.method, "layers": recipe.layers,
        "heldout_source": "held-out stdlib modules" if str(corpus) == "stdlib" else "last 5% of the corpus",
        "params": sum(p.numel() for p in draft.parameters()),
        "weight_bytes": sum(p.numel() * p.element_size() for p in export.parameters()),
        "train_tokens": len(train_tokens), "device": str(dev), "resumed_from": start, **run,
        "recipe": asdict(recipe), "seconds": time.perf_counter() - t0,
    }
    (out / "eval.json").write_text(json.dumps(result, indent=2))
    agree = ", ".join(f"{a:.3f}" for a in result["agreement"])
    print(f"{recipe.method}: per-step top-1 agreement [{agree}], greedy chain accept length "
          f"{result['greedy_accept_length']:.2f} per iteration "
          f"({result['greedy_accept_length_per_position']:.2f} per position); saved to {out}")
    return result
