"""Mean accept length per draft method on every held-out prompt (the demo model's quality figure).

Figure: docs/TRAINING.md "The bundled demo model". Time: about 5 minutes on the CPU.

    python benchmarks/accept_lengths.py                     # bundled demo model, CPU float32 (about 5 minutes)
    python benchmarks/accept_lengths.py --device cuda       # bf16 on the GPU
    python benchmarks/accept_lengths.py --quick             # smoke test: 1 prompt per workload, 8 tokens
    python benchmarks/accept_lengths.py --methods eagle,eagle3 --max-prompts 8   # two methods, 8 prompts each

Each prompt of prompts.jsonl is decoded alone, greedily, ``--new-tokens`` tokens with
``ignore_eos``, by a fresh engine per prompt (so the N-gram trie holds only that prompt and
its own output), with the benchmark settings of speculative.py (N-gram defaults; EAGLE 5
steps, top-k 4, 16 tokens; EAGLE-3 the same as EAGLE, so the two compare; multi-layer EAGLE 4
steps). Reported per method and workload:
the mean accept length over all iterations of all prompts (what the engine's stats give
for the whole run) and the mean and range of the per-prompt means. Speed is not measured
here (speculative.py does that). Prints a table; writes $OUT/accept_lengths.json (or --out).
"""

from __future__ import annotations

import argparse

from speculative import add_common_arguments, draft_config, load_target, run_meta, seed_all, write_json
from tqdm import tqdm

import spectool as st
from spectool.prompts import load_prompts

METHODS = ("ngram", "eagle", "multi_layer_eagle", "eagle3")
WORKLOADS = ("completion", "editing")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {','.join(METHODS)}")
    p.add_argument("--max-prompts", type=int, help="the first N prompts of each workload only (default: all)")
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if args.max_prompts is not None and args.max_prompts < 1:
        p.error("--max-prompts must be at least 1")
    seed_all(args.seed)
    target = load_target(args.model, args.device)
    new_tokens = 8 if args.quick else args.new_tokens
    rows = []
    for workload in WORKLOADS:
        prompts = [target.encode(text) for text in load_prompts(args.prompts, workload)]
        prompts = prompts[:1] if args.quick else prompts[:args.max_prompts]
        for method in methods:
            per_prompt, accepted, iterations = [], 0, 0
            for ids in tqdm(prompts, desc=f"{workload}/{method}", leave=False):
                engine = st.Engine(target, draft=draft_config(method, args.draft_dir), max_batch_size=1,
                                   max_seq_len=len(ids) + new_tokens + 8)
                stats = engine.generate([ids], max_new_tokens=new_tokens, ignore_eos=True, record=False,
                                        seed=args.seed).stats
                per_prompt.append(stats.mean_accept_length)
                accepted += stats.mean_accept_length * stats.iterations
                iterations += stats.iterations
            rows.append({"workload": workload, "method": method, "prompts": len(prompts),
                         "mean_accept_length": accepted / max(iterations, 1),
                         "per_prompt_mean": sum(per_prompt) / len(per_prompt),
                         "per_prompt_min": min(per_prompt), "per_prompt_max": max(per_prompt)})
    print(f"\naccept_lengths.py — {run_meta(args)['gpu'] or args.device}; target {args.model}; batch 1, "
          f"greedy, {new_tokens} new tokens per prompt, one fresh engine per prompt")
    print(f"{'workload':<11} {'method':<18} {'prompts':>7} {'accept (all iterations)':>24} "
          f"{'per-prompt mean':>16} {'range':>13}")
    for r in rows:
        print(f"{r['workload']:<11} {r['method']:<18} {r['prompts']:>7} {r['mean_accept_length']:>24.2f} "
              f"{r['per_prompt_mean']:>16.2f} {r['per_prompt_min']:>6.2f}-{r['per_prompt_max']:<6.2f}")
    write_json("accept_lengths.json", {"meta": {**run_meta(args), "model": args.model, "new_tokens": new_tokens,
                                                "max_prompts": args.max_prompts},
                                       "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
