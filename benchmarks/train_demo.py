"""Train the bundled demo model: target + EAGLE layer + K=4 multi-layer EAGLE (+ EAGLE-3), prompts and metrics.

Figure: docs/TRAINING.md "The bundled demo model". Time: at most 5.5 minutes on an H200 (--tiny about 15 s on the CPU).

    python benchmarks/pack_stdlib.py                           # .corpus/stdlib-3.11.tar.xz (8.4 M tokens)
    python benchmarks/train_demo.py --out /tmp/demo --stdlib .corpus/stdlib-3.11.tar.xz   # one GPU, <= 5.5 min
    python benchmarks/train_demo.py --out /tmp/demo --tiny     # the same pipeline on CPU in seconds
    python benchmarks/train_demo.py --out /tmp/demo --stdlib .corpus/stdlib-3.11.tar.xz \
        --from spectool/demo --methods multi_layer_eagle --budget-s 0   # retrain one draft kind only
    python benchmarks/train_demo.py --out /tmp/demo --stdlib .corpus/stdlib-3.11.tar.xz \
        --from spectool/demo --methods eagle3 --budget-s 0              # add the EAGLE-3 layer to the bundle

Writes OUT/target/ (Hugging Face Llama: config.json, model.safetensors, tokenizer.json),
OUT/eagle/, OUT/multi_layer_eagle/, OUT/eagle3/ (draft checkpoints), OUT/prompts.jsonl (held-out completion
and editing prompts) and OUT/metrics.json (held-out loss, per-layer agreement, sizes, timings).
Weights are stored bf16 and total at most 19 MB (the bundle stays within 20 MB). Every phase runs under
a time budget: its step count is fitted to the budget after the first steps (printed, and recorded in metrics.json).
With --steps-* given explicitly and --budget-s 0, a run is repeatable step for step.
--stdlib picks the standard library the corpus, the held-out split and the prompts come from
(default: the running Python's; the recipe is sized for Python 3.11's).
With --from BUNDLE the target (and every draft kind not named in --methods) is copied from an
existing bundle, metrics included, and only the named drafts are trained against that target.
If $OUT is set, metrics.json is also copied there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from spectool.train import data
from spectool.train.draft import DraftRecipe, train_draft
from spectool.train.loop import CHECKPOINT_NAME
from spectool.train.target import TargetRecipe, train_target

MAX_WEIGHT_BYTES = 19_000_000
DRAFT_KINDS = ("eagle", "multi_layer_eagle", "eagle3")

# Share of the time budget per phase (the rest covers start-up, tokenizing, evaluation, prompts).
SHARES = {"target": 0.44, "eagle": 0.19, "multi_layer_eagle": 0.23, "eagle3": 0.19}


def eagle3_recipe(eagle: DraftRecipe, tiny: bool) -> DraftRecipe:
    """EAGLE-3 with the EAGLE recipe's optimisation, reading the target's first, middle and last
    layers (the demo's 5 layers are too few for SGLang's default choice).

    Its draft vocabulary is the corpus's 3072 most frequent tokens: they cover 99% of the
    target's greedy tokens on the held-out prompts (the most frequent 2048, 94.5%, left a
    quarter of 5-token chains with a token the draft could never propose). The larger head is
    paid for by a narrower MLP (384), so the bundle stays within its weight limit."""
    if tiny:
        return dataclasses.replace(eagle, method="eagle3", draft_vocab_size=160, aux_layers=(0, 1, 1))
    return dataclasses.replace(eagle, method="eagle3", draft_vocab_size=3072, aux_layers=(0, 2, 4),
                               intermediate_size=384)


def recipes(tiny: bool, seed: int) -> tuple[TargetRecipe, DraftRecipe, DraftRecipe]:
    """The demo's target and draft recipes (``tiny``: a CPU smoke-test of the same pipeline)."""
    if tiny:
        target = TargetRecipe(vocab_size=320, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                              intermediate_size=128, steps=30, batch_size=8, seq_len=64, lr=3e-3, warmup=5,
                              checkpoint_every=10, eval_windows=4, seed=seed)
        small = {"steps": 10, "batch_size": 4, "seq_len": 64, "checkpoint_every": 5, "eval_windows": 2,
                 "gen_prompts": 2, "gen_tokens": 16, "intermediate_size": 96, "seed": seed}
        return (target, DraftRecipe(method="eagle", layers=1, **small),
                DraftRecipe(method="multi_layer_eagle", layers=4, **small))
    # Step counts come from epochs over the training stream (Python 3.11's stdlib: 8.4M tokens,
    # 11.2M with a quarter editing pairs), so a smaller stdlib gets fewer steps, not more epochs:
    # 4000 x 48 x 1024 tokens over 3.12's 2.3M (86 epochs) memorised it (held-out loss 8.3).
    # Batches of 32 x 1024 keep an H200 busy (8 x 1024 left it mostly idle); the time budget caps it.
    # vocab 4096, hidden 256, 5 layers, GQA 4 query / 2 kv heads of 64: 4.5M parameters (9 MB bf16).
    target = TargetRecipe(vocab_size=4096, hidden_size=256, num_layers=5, num_heads=4, num_kv_heads=2,
                          intermediate_size=640, max_position_embeddings=2048, epochs=8, batch_size=32,
                          seq_len=1024, lr=3e-3, warmup=100, weight_decay=0.1, checkpoint_every=500,
                          eval_windows=128, seed=seed, tokenizer_docs=2, edit_fraction=0.25)
    # Draft blocks use a narrower MLP (448) so 5 layers fit in the remaining 7 MB.
    # Sequences of 1024 cover the longest prompt (editing: ~520 tokens) plus 256 new tokens.
    common = {"batch_size": 32, "seq_len": 1024, "lr": 2e-3, "warmup": 50, "checkpoint_every": 500,
              "eval_windows": 64, "gen_prompts": 32, "gen_tokens": 160, "intermediate_size": 448,
              "seed": seed, "epochs": 4, "edit_fraction": 0.25}
    return (target, DraftRecipe(method="eagle", layers=1, unroll=5, **common),
            DraftRecipe(method="multi_layer_eagle", layers=4, **common))


def train_all(out: Path, corpus: str | Path, target_r: TargetRecipe, draft_rs: tuple[DraftRecipe, ...],
              device: str, budget: float | None, t0: float, stdlib: str | Path | None = None,
              reuse: Path | None = None) -> tuple[dict, dict[str, dict]]:
    """Train the target into OUT/target, then each draft recipe into OUT/<method>; returns their evals.

    ``reuse``: a bundle whose target is copied (with its metrics) instead of trained.
    """
    progress = sys.stderr.isatty()

    def phase_budget(name: str) -> float | None:
        return None if budget is None else SHARES[name] * budget

    if reuse is None:
        print(f"[{time.perf_counter() - t0:6.1f}s] training the target", flush=True)
        target = train_target(corpus, out / "target", target_r, device=device, progress=progress,
                              max_seconds=phase_budget("target"), stdlib=stdlib)
    else:
        shutil.copytree(reuse / "target", out / "target")
        target = json.loads((reuse / "metrics.json").read_text())["target"] | {"reused_from": str(reuse)}
    drafts = {}
    for recipe in draft_rs:
        print(f"[{time.perf_counter() - t0:6.1f}s] training {recipe.method}", flush=True)
        drafts[recipe.method] = train_draft(out / "target", corpus, out / recipe.method, recipe,
                                            device=device, progress=progress,
                                            max_seconds=phase_budget(recipe.method), stdlib=stdlib)
    return target, drafts


def print_table(target: dict, drafts: dict[str, dict]) -> None:
    print(f"\n{'part':<20}{'params':>12}{'steps':>8}{'tok/s':>12}  result")
    print(f"{'target':<20}{target['params']:>12,}{target['steps']:>8}{target['tokens_per_s']:>12,.0f}  "
          f"held-out loss {target['heldout_loss']:.3f}")
    for m, r in drafts.items():
        agree = " ".join(f"{x:.2f}" for x in r["agreement"])
        print(f"{m:<20}{r['params']:>12,}{r['steps']:>8}{r['tokens_per_s']:>12,.0f}  agreement [{agree}], "
              f"greedy chain accept {r['greedy_accept_length']:.2f}")


def tiny_corpus(path: Path, stdlib: str | Path | None = None, files: int = 12) -> Path:
    """A small slice of the stdlib training split, for the --tiny smoke run."""
    path.write_text("\n\n".join(data.stdlib_documents(stdlib=stdlib)[:files]))
    return path


def write_prompts(out: Path, completion: int, editing: int, seed: int, stdlib: str | Path | None) -> Path:
    """OUT/prompts.jsonl: completion and editing prompts from the held-out modules (speculative.py reads it)."""
    named = data.heldout_named_documents(stdlib)
    path = out / "prompts.jsonl"
    data.write_prompts_jsonl(path, data.completion_prompts(named, completion, seed=seed)
                             + data.editing_prompts(named, editing, seed=seed))
    return path


def with_steps(target: TargetRecipe, eagle: DraftRecipe, mle: DraftRecipe, steps_target: int | None,
               steps_draft: int | None) -> tuple[TargetRecipe, DraftRecipe, DraftRecipe]:
    """The recipes with explicit step counts, which replace the epoch-derived ones (a recipe with
    epochs > 0 takes its step count from them and would ignore ``steps``)."""
    if steps_target:
        target = dataclasses.replace(target, steps=steps_target, epochs=0.0)
    if steps_draft:
        eagle = dataclasses.replace(eagle, steps=steps_draft, epochs=0.0)
        mle = dataclasses.replace(mle, steps=steps_draft, epochs=0.0)
    return target, eagle, mle


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="output directory (new or empty)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it is not empty")
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes and corpus: the pipeline on CPU in seconds")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stdlib", default=None,
                   help="standard library to train on: a Lib/ directory or a .tar.xz of one "
                        "(benchmarks/pack_stdlib.py); default: this Python's")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="wall-clock budget for all training (0 = run the full step counts)")
    p.add_argument("--steps-target", type=int, default=None,
                   help="target training steps (default: from the recipe's epochs)")
    p.add_argument("--steps-draft", type=int, default=None,
                   help="steps for each draft (default: from the recipe's epochs)")
    p.add_argument("--mle-greedy-fraction", type=float, default=0.0,
                   help="multi-layer EAGLE: share of each batch that is a corpus prefix followed by the "
                        "target's greedy continuation (DraftRecipe.greedy_fraction; default %(default)s)")
    p.add_argument("--from", dest="reuse", type=Path, default=None,
                   help="an existing bundle (e.g. spectool/demo): reuse its target and the drafts not in --methods")
    p.add_argument("--methods", default="eagle,multi_layer_eagle",
                   help="draft kinds to train (default: both); with --from the others are copied")
    p.add_argument("--completion-prompts", type=int, default=32)
    p.add_argument("--editing-prompts", type=int, default=16)
    a = p.parse_args(argv)

    t0 = time.perf_counter()
    torch.manual_seed(a.seed)
    out: Path = a.out
    if out.exists() and any(out.iterdir()):
        if not a.overwrite:
            print(f"{out} is not empty; pass --overwrite to replace it", file=sys.stderr)
            return 2
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    target_r, eagle_r, mle_r = recipes(a.tiny, a.seed)
    target_r, eagle_r, mle_r = with_steps(target_r, eagle_r, mle_r, a.steps_target, a.steps_draft)
    try:
        mle_r = dataclasses.replace(mle_r, greedy_fraction=a.mle_greedy_fraction)
    except ValueError as e:
        print(f"error: --mle-greedy-fraction: {e}", file=sys.stderr)
        return 2
    methods = [m for m in a.methods.split(",") if m]
    if not methods or any(m not in DRAFT_KINDS for m in methods):
        print(f"error: --methods must name some of {', '.join(DRAFT_KINDS)}, got {a.methods!r}", file=sys.stderr)
        return 2
    eagle3_r = eagle3_recipe(eagle_r, a.tiny)
    reuse_metrics = None
    if a.reuse is not None:
        try:
            reuse_metrics = json.loads((a.reuse / "metrics.json").read_text())
            if not (a.reuse / "target" / "config.json").is_file():
                raise FileNotFoundError(a.reuse / "target" / "config.json")
        except (OSError, ValueError) as e:
            print(f"error: --from {a.reuse} is not a demo bundle (target/ and metrics.json): {e}", file=sys.stderr)
            return 2
    try:
        corpus = tiny_corpus(out / "tiny_corpus.txt", a.stdlib) if a.tiny else "stdlib"
        budget = a.budget_s if a.budget_s > 0 and not a.tiny else None
        # The tiny corpus is a plain file; --stdlib then only picks the prompts' held-out modules.
        draft_rs = tuple(r for r in (eagle_r, mle_r, eagle3_r) if r.method in methods)
        target, drafts = train_all(out, corpus, target_r, draft_rs, a.device, budget, t0,
                                   None if a.tiny else a.stdlib, a.reuse)
        if a.reuse is not None:  # the kinds not retrained come with the bundle, metrics and all
            for kind in DRAFT_KINDS:
                if kind not in methods and (a.reuse / kind).is_dir():
                    shutil.copytree(a.reuse / kind, out / kind)
                    drafts[kind] = reuse_metrics[kind]
            drafts = {k: drafts[k] for k in DRAFT_KINDS if k in drafts}
        write_prompts(out, a.completion_prompts, a.editing_prompts, a.seed, a.stdlib)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    # The bundle holds weights, tokenizer and eval.json; training state stays out of it.
    for sub in ("target", *DRAFT_KINDS):
        (out / sub / CHECKPOINT_NAME).unlink(missing_ok=True)
    (out / "tiny_corpus.txt").unlink(missing_ok=True)
    weight_bytes = sum(f.stat().st_size for f in out.rglob("*.safetensors"))

    # Entries copied with --from may predate a field: keep what they have.
    metrics = {
        "target": {k: target[k] for k in ("heldout_loss", "heldout_source", "params", "steps", "planned_steps",
                                          "tokens_per_s", "train_tokens", "seconds", "reused_from")
                   if k in target},
        **{m: {k: r[k] for k in ("agreement", "greedy_accept_length", "greedy_accept_length_per_position",
                                 "greedy_eval", "params", "steps", "planned_steps", "tokens_per_s", "seconds",
                                 "device") if k in r}
           for m, r in drafts.items()},
        "held_out_modules": list(data.HELD_OUT_MODULES),
        "stdlib": a.stdlib or "running interpreter",
        "edit_fraction": target_r.edit_fraction,
        "prompts": {"completion": a.completion_prompts, "editing": a.editing_prompts},
        "weight_bytes": weight_bytes,
        "device": next((r["device"] for m, r in drafts.items() if m in methods), None) if a.reuse
        else target["device"],
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "seed": a.seed,
        "tiny": a.tiny,
        "seconds": time.perf_counter() - t0,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        shutil.copy(out / "metrics.json", Path(os.environ["OUT"]) / "train_demo_metrics.json")

    print_table(target, drafts)
    print(f"weights {weight_bytes / 1e6:.2f} MB (limit {MAX_WEIGHT_BYTES / 1e6:.0f} MB); "
          f"total {metrics['seconds']:.0f}s; written to {out}")
    if weight_bytes > MAX_WEIGHT_BYTES:
        print(f"ERROR: the demo weights exceed the {MAX_WEIGHT_BYTES / 1e6:.0f} MB limit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
