"""A standalone draft model against plain decoding: accept length and speedup (about 3 minutes on a GPU).

Figure: docs/BENCHMARKS.md "Standalone draft model". Time: about 3 minutes on a GPU.

    python benchmarks/draft_model.py --device cuda                 # trains the small draft first if missing
    python benchmarks/draft_model.py --draft /tmp/small_target     # any checkpoint with the target's tokenizer
    python benchmarks/draft_model.py --device cpu --quick          # smoke test: 1 prompt, 8 tokens

The draft is a smaller target trained by the recipe (``spectool train-target`` with the target's
own tokenizer; 2 layers of width 128 by default, ``--train-seconds`` of training) unless
``--draft`` names one. For every workload (completion, editing) and setting (a chain of 4; a
tree of 3 steps, top-k 2, 8 tokens), one engine decodes the prompts at batch 1 with
``ignore_eos`` and a fixed token count, after ``Engine.warmup()`` and a warm-up call; reported: mean
accept length, decode tokens/s and the speedup over plain decoding in the same run, with the graph
captures and eager steps inside the timed call (on CUDA a row with any is refused: no figures).
Writes $OUT/draft_model.json (or --out DIR).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from speculative import load_target, refused, region_faults, run_meta, seed_all, timed_region, write_json

import spectool as st
from spectool.prompts import load_prompts

SETTINGS = {"chain4": dict(num_steps=4), "tree3x2": dict(num_steps=3, topk=2, num_draft_tokens=8)}


def train_small_draft(target_dir: Path, out: Path, device: str, seconds: float) -> Path:
    """A 2-layer, width-128 target trained on the stdlib with the target's tokenizer."""
    from spectool.train.target import TargetRecipe, train_target

    if (out / "config.json").is_file():
        return out
    recipe = TargetRecipe(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=384,
                          vocab_size=st.load(target_dir).config.vocab_size, steps=100_000)
    train_target("stdlib", out, recipe, device=device, max_seconds=seconds, tokenizer=target_dir / "tokenizer.json")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo = st.demo_model()
    p.add_argument("--model", default=str(demo / "target"))
    p.add_argument("--prompts", default=str(demo / "prompts.jsonl"))
    p.add_argument("--draft", help="draft model directory (default: train one into --train-dir)")
    p.add_argument("--train-dir", default="/tmp/spectool_small_draft")
    p.add_argument("--train-seconds", type=float, default=120.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="folder for draft_model.json (default: $OUT)")
    args = p.parse_args(argv)
    seed_all(args.seed)
    draft_dir = Path(args.draft) if args.draft else train_small_draft(Path(args.model), Path(args.train_dir),
                                                                       args.device, args.train_seconds)
    target = load_target(args.model, args.device)
    new_tokens = 8 if args.quick else args.new_tokens
    rows = []
    for workload in ("completion", "editing"):
        texts = load_prompts(args.prompts, workload)[: 1 if args.quick else args.num_prompts]
        prompts = [target.encode(t) for t in texts]
        longest = max(map(len, prompts)) + new_tokens + 16
        base = None
        settings = [("plain", None)] + [(n, st.DraftModelConfig(draft_dir, **s)) for n, s in SETTINGS.items()]
        for name, draft in settings:
            engine = st.Engine(target, draft=draft, max_batch_size=1, max_seq_len=longest)
            engine.warmup(sampling=False, record=False)  # every graph the timed call runs
            engine.generate(prompts[:1], max_new_tokens=8, ignore_eos=True, record=False)  # Triton JIT of prefill
            before = timed_region(engine)
            stats = engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True, record=False).stats
            row = {"workload": workload, "setting": name, **region_faults(engine, before)}
            row["refused"] = refused(row, args.device)
            if not row["refused"]:
                if name == "plain":
                    base = stats.tokens_per_s
                row.update(mean_accept_length=stats.mean_accept_length, tokens_per_s=stats.tokens_per_s)
                if base is not None:
                    row["speedup"] = stats.tokens_per_s / base
            rows.append(row)
    print(f"\ndraft_model.py — {run_meta(args)['gpu'] or args.device}; target {args.model}; draft {draft_dir}; "
          f"batch 1, greedy, {new_tokens} tokens per prompt")
    print(f"{'workload':<11} {'setting':<8} {'accept':>7} {'tok/s':>9} {'speedup':>8} {'captures':>8} {'eager':>5}")
    for r in rows:
        faults = f"{r['timed_graph_captures']:>8} {r['timed_eager_steps']:>5}"
        if r["refused"] or "speedup" not in r:  # refused, or plain decoding was (no speedup to give)
            why = r["refused"] or "plain decoding was refused"
            print(f"{r['workload']:<11} {r['setting']:<8} refused: {why}")
            continue
        print(f"{r['workload']:<11} {r['setting']:<8} {r['mean_accept_length']:>7.2f} {r['tokens_per_s']:>9.1f} "
              f"{r['speedup']:>7.2f}x {faults}")
    write_json("draft_model.json", {"meta": run_meta(args), "draft": str(draft_dir), "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
