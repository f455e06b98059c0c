"""What a never-seen prompt length costs: ``generate`` wall time on new lengths, and Triton compiles.

    python benchmarks/prompt_lengths.py [--device cuda] [--methods plain,ngram,eagle,multi_layer_eagle]

Figure: docs/BENCHMARKS.md "Speculative decoding". Time: about 20 s on an H200 with --new-tokens 16.

Per method, one engine on the bundled demo model at batch 1, after ``Engine.warmup()`` and one call
on a prompt of another length: then, for each of --lengths (random tokens, lengths no call used
before), a first call and a repeat on the same prompt, each timed around ``generate``
(prefill included, 32 new tokens, greedy). Reported per length: both wall times, the Triton kernels
compiled and the CUDA graphs captured inside each. A first call that compiles or captures pays for
it; the repeat shows what the length costs once compiled. A good engine compiles nothing on a new
length (its kernels do not specialise on it): the first call then takes about the repeat's time.

Prints a table and writes prompt_lengths.json to $OUT (or --out) when set.
"""

from __future__ import annotations

import argparse
import sys
import time

from speculative import (
    _synchronize,
    add_common_arguments,
    draft_config,
    load_target,
    random_prompts,
    run_meta,
    seed_all,
    write_json,
)

import spectool as st

DEFAULT_LENGTHS = "37,53,71,97,131,173,211,263,331,419"


def compiled_kernels() -> int:
    """Triton kernels compiled so far by spectool's jitted functions (all their cache entries)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return 0
    total = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("spectool.kernels"):
            continue
        for obj in vars(module).values():
            fn = getattr(obj, "fn", obj)  # autotuned / heuristics wrappers hold the JITFunction
            if not isinstance(fn, JITFunction):
                continue
            caches = getattr(fn, "device_caches", None)
            if caches is not None:  # triton >= 3: device -> (kernel cache, ...)
                total += sum(len(entry[0]) for entry in caches.values())
            else:
                total += sum(len(c) for c in getattr(fn, "cache", {}).values())
    return total


def timed_call(engine, prompt: list[int], new_tokens: int, device: str) -> dict:
    kernels, captures = compiled_kernels(), engine.graph_stats()["captures"]
    _synchronize(device)
    t0 = time.perf_counter()
    engine.generate([prompt], max_new_tokens=new_tokens, ignore_eos=True, record=False)
    _synchronize(device)
    return {"s": time.perf_counter() - t0, "compiles": compiled_kernels() - kernels,
            "captures": engine.graph_stats()["captures"] - captures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    p.add_argument("--methods", default="plain,ngram,eagle,multi_layer_eagle")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="comma-separated prompt lengths, none used before")
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args(argv)
    seed_all(args.seed)
    target = load_target(args.model, args.device)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.quick:
        lengths = lengths[:2]
    rows = []
    for method in args.methods.split(","):
        engine = st.Engine(target, draft=draft_config(method, args.draft_dir), max_batch_size=1,
                           max_seq_len=max(lengths) + args.new_tokens + 64)
        warm = engine.warmup(sampling=False, record=False)
        engine.generate(random_prompts(1, 16, target.config.vocab_size, args.seed), max_new_tokens=4,
                        ignore_eos=True, record=False)
        for i, n in enumerate(lengths):
            prompt = random_prompts(1, n, target.config.vocab_size, args.seed + 1 + i)[0]
            first = timed_call(engine, prompt, args.new_tokens, args.device)
            again = timed_call(engine, prompt, args.new_tokens, args.device)
            rows.append({"method": method, "length": n, "warmup_s": warm["seconds"], "first_s": first["s"],
                         "repeat_s": again["s"], "first_compiles": first["compiles"],
                         "first_captures": first["captures"], "repeat_compiles": again["compiles"],
                         "repeat_captures": again["captures"]})
    print(f"\nprompt_lengths.py — {run_meta(args)['gpu'] or args.device}; batch 1, greedy, {args.new_tokens} new "
          f"tokens; first = the first call on that prompt length, repeat = the same prompt again")
    print(f"{'method':>18} {'len':>5} {'first ms':>9} {'repeat ms':>10} {'extra ms':>9} {'compiles':>9} "
          f"{'captures':>9}")
    for r in rows:
        print(f"{r['method']:>18} {r['length']:>5} {r['first_s'] * 1e3:>9.1f} {r['repeat_s'] * 1e3:>10.1f} "
              f"{(r['first_s'] - r['repeat_s']) * 1e3:>9.1f} {r['first_compiles']:>4}/{r['repeat_compiles']:<4} "
              f"{r['first_captures']:>4}/{r['repeat_captures']:<4}")
    write_json("prompt_lengths.json", {"meta": run_meta(args), "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
