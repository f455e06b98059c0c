"""``spectool bench``: plain decoding against one draft method on the same prompts."""

from __future__ import annotations

import json

from spectool.cli.args import POSITIVE, add_draft_arguments, add_run_arguments, build_engine, fail, parser


def main(argv: list[str]) -> int:
    if "--calibrate" in argv:  # a cost profile for `spectool tune` instead of a comparison
        from spectool.tune.calibrate import calibrate_cli

        return calibrate_cli([a for a in argv if a != "--calibrate"])
    p = parser("bench", "Time plain decoding against one draft method on the same model and prompts "
                        "(output length fixed: end-of-sequence tokens are ignored) and print tokens/s and the "
                        "speedup.")
    add_run_arguments(p)
    add_draft_arguments(p)
    p.add_argument("--repeats", type=POSITIVE, default=1, help="timed runs of each (the best is kept)")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--calibrate", action="store_true",
                   help="measure a cost profile for `spectool tune` instead (see `spectool bench --calibrate -h`)")
    args = p.parse_args(argv)
    import spectool as st
    from spectool.prompts import load_prompts

    try:
        prompts = load_prompts(args.prompts, args.kind)[: args.num_prompts]
        spec = build_engine(args, prompts)
        plain = st.Engine(spec.target, draft=None, max_batch_size=args.batch_size, max_seq_len=args.max_seq_len,
                          deterministic=spec.deterministic)
    except (ValueError, OSError) as e:  # bad options or files (BadInput is a ValueError); an unreachable hub id
        return fail("bench", e)
    rows = []
    for name, engine in (("plain", plain), (spec.method, spec)):
        engine.generate(prompts[:1], max_new_tokens=8, record=False)  # warm-up (and graph capture)
        best = None
        for _ in range(args.repeats):
            r = engine.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                seed=args.seed, record=False, ignore_eos=True)
            if best is None or r.stats.tokens_per_s > best.stats.tokens_per_s:
                best = r
        rows.append({**best.stats.to_dict(), "method": name})
    base = rows[0]["tokens_per_s"]
    speedup = f"speedup on {args.device}"
    print(f"{'method':<18} {'accept len':>10} {'tok/s':>9} {speedup:>16}")
    for r in rows:
        accept = "-" if r["method"] == "plain" else f"{r['mean_accept_length']:.2f}"
        print(f"{r['method']:<18} {accept:>10} {r['tokens_per_s']:>9.1f} {r['tokens_per_s'] / base:>15.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
