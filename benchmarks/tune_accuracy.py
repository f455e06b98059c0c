"""How close the tuner's predictions are to real runs: accept length and decode tokens/s.

    python benchmarks/tune_accuracy.py --profile $OUT/demo-h200.json                # H200, demo model
    python benchmarks/tune_accuracy.py --model /tmp/large/target --draft-dir /tmp/large \
        --prompts /tmp/large/prompts.jsonl --profile $OUT/large-h200.json          # the trained larger target
    python benchmarks/tune_accuracy.py --device cpu --quick                         # smoke test

Per draft method: one greedy trace is recorded with the method's default settings (batch
``--batch-size``, ``--new-tokens`` tokens per prompt, ignore_eos), ``spectool.tune`` predicts
8 other configurations from it (accept lengths from the trace; tokens/s from the profile,
measured first with ``spectool.tune.calibrate`` when ``--profile`` is not a file), then each
configuration is decoded for real (a warm-up run, then the best of ``--repeats``) and the
relative errors are reported: of the mean accept length (exact in float32 on the CPU; in bf16
the teacher-forced and incremental forwards round differently) and of tokens/s (the profile's
model of an iteration against the engine's measured iterations). Prints a table; writes
$OUT/tune_accuracy.json (or --out).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from speculative import add_common_arguments, load_target, run_meta, write_json

import spectool as st
from spectool.prompts import load_prompts
from spectool.tune import CostProfile
from spectool.tune.calibrate import calibrate
from spectool.tune.recommend import tune

WORKLOAD = {"ngram": "editing", "eagle": "completion", "multi_layer_eagle": "completion"}


def configs(method: str, draft_dir: str, quick: bool) -> list:
    if method == "ngram":
        grid = [(1, 4), (2, 8), (4, 8), (4, 12), (8, 16), (10, 12), (1, 24), (16, 32)]
        out = [st.NgramConfig(max_bfs_breadth=b, num_draft_tokens=n) for b, n in grid]
    elif method == "eagle":
        grid = [(1, 1, 2), (3, 1, 4), (5, 1, 6), (3, 2, 6), (4, 2, 8), (5, 4, 16), (4, 4, 12), (6, 4, 24)]
        out = [st.EagleConfig(f"{draft_dir}/eagle", num_steps=s, topk=k, num_draft_tokens=n) for s, k, n in grid]
    else:
        out = [st.MultiLayerEagleConfig(f"{draft_dir}/multi_layer_eagle", num_steps=s) for s in (1, 2, 3, 4)]
    return out[:3] if quick else out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    p.add_argument("--profile", help="cost profile JSON (measured here and written beside the results if absent)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", default="ngram,eagle,multi_layer_eagle")
    args = p.parse_args(argv)
    target = load_target(args.model, args.device)
    new_tokens = 12 if args.quick else args.new_tokens
    n_prompts = 2 if args.quick else args.num_prompts
    if args.profile and Path(args.profile).is_file():
        profile = CostProfile.load(args.profile)
    else:
        grid = dict(batch_sizes=(1, 2), num_nodes=(1, 4, 8), topks=(1, 2), eagle_steps=(1, 3), repeats=2,
                    context=32) if args.quick else {}
        profile = calibrate(target, eagle_path=f"{args.draft_dir}/eagle",
                            multi_layer_path=f"{args.draft_dir}/multi_layer_eagle", **grid)
        if args.profile:
            profile.save(args.profile)
    rows = []
    for method in args.methods.split(","):
        prompts = [target.encode(t)[-256:] for t in load_prompts(args.prompts, WORKLOAD[method])[:n_prompts]]
        cfgs = configs(method, args.draft_dir, args.quick)
        base = cfgs[len(cfgs) // 2]
        engine_kwargs = dict(max_batch_size=args.batch_size, max_seq_len=2048)
        recorded = st.Engine(target, draft=base, **engine_kwargs).generate(
            prompts, max_new_tokens=new_tokens, ignore_eos=True).trace
        result = tune(recorded, grid=cfgs, profile=profile, target=target, allow_other_model=True,
                      progress=False)
        for cfg, pred in zip(cfgs, result.predictions):
            engine = st.Engine(target, draft=cfg, **engine_kwargs)
            engine.generate(prompts[:1], max_new_tokens=8, record=False, ignore_eos=True)  # graphs, warm-up
            runs = []
            for _ in range(max(1, args.repeats)):
                if method == "ngram":  # the trie outlives a generate call: each run starts from an empty one
                    engine.drafter.corpus.reset()
                runs.append(engine.generate(prompts, max_new_tokens=new_tokens, record=False, ignore_eos=True).stats)
            best = max(runs, key=lambda s: s.tokens_per_s)
            pt = result.tokens_per_s(pred)
            rows.append({"method": method, "config": cfg.to_dict(), "workload": WORKLOAD[method],
                         "predicted_accept_length": pred.mean_accept_length,
                         "measured_accept_length": best.mean_accept_length,
                         "accept_error": pred.mean_accept_length / best.mean_accept_length - 1
                         if best.mean_accept_length else None,
                         "predicted_tokens_per_s": pt, "measured_tokens_per_s": best.tokens_per_s,
                         "tokens_per_s_error": pt / best.tokens_per_s - 1})
    print(f"{'method':<18} {'config':<28} {'accept pred':>11} {'meas':>6} {'err':>6} "
          f"{'tok/s pred':>10} {'meas':>8} {'err':>6}")
    for r in rows:
        c = r["config"]
        short = ",".join(f"{k[:4]}={c[k]}" for k in ("num_steps", "topk", "max_bfs_breadth", "num_draft_tokens")
                         if k in c)
        acc_err = "n/a" if r["accept_error"] is None else f"{r['accept_error']:+.1%}"
        print(f"{r['method']:<18} {short:<28} {r['predicted_accept_length']:>11.2f} "
              f"{r['measured_accept_length']:>6.2f} {acc_err:>6} {r['predicted_tokens_per_s']:>10.1f} "
              f"{r['measured_tokens_per_s']:>8.1f} {r['tokens_per_s_error']:>+6.1%}")
    write_json("tune_accuracy.json", {"meta": {**run_meta(args), "profile": profile.source,
                                               "profile_device": profile.device}, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
