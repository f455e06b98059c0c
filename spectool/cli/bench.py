"""``spectool bench``: plain decoding against one draft method on the same prompts."""

from __future__ import annotations

import argparse
import json
import sys

from spectool.cli.args import add_draft_arguments, add_run_arguments, build_engine
from spectool.prompts import load_prompts


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="spectool bench", description=__doc__)
    add_run_arguments(p)
    add_draft_arguments(p)
    p.add_argument("--repeats", type=int, default=1, help="timed runs of each (the best is kept)")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    import spectool as st

    try:
        prompts = load_prompts(args.prompts, args.kind)[: args.num_prompts]
        spec = build_engine(args)
        plain = st.Engine(spec.target, draft=None, max_batch_size=args.batch_size, max_seq_len=args.max_seq_len)
    except (ValueError, OSError) as e:  # bad options or files; an unreachable hub id
        print(f"spectool bench: {e}", file=sys.stderr)
        return 2
    rows = []
    for name, engine in (("plain", plain), (spec.method, spec)):
        engine.generate(prompts[:1], max_new_tokens=8, record=False)  # warm-up (and graph capture)
        best = None
        for _ in range(max(args.repeats, 1)):
            r = engine.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                seed=args.seed, record=False, ignore_eos=True)
            if best is None or r.stats.tokens_per_s > best.stats.tokens_per_s:
                best = r
        rows.append({**best.stats.to_dict(), "method": name})
    base = rows[0]["tokens_per_s"]
    print(f"{'method':<18} {'accept len':>10} {'tok/s':>9} {'speedup':>8}")
    for r in rows:
        print(f"{r['method']:<18} {r['mean_accept_length']:>10.2f} {r['tokens_per_s']:>9.1f} "
              f"{r['tokens_per_s'] / base:>7.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
