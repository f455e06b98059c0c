"""How close the tuner's predictions are to real runs: accept length and decode tokens/s.

Figure: docs/BENCHMARKS.md "What-if tuner". Time: 3 to 5 minutes on an H200.

    python benchmarks/tune_accuracy.py --profile $OUT/demo-h200.json                # H200, demo model
    python benchmarks/tune_accuracy.py --model /tmp/large/target --draft-dir /tmp/large \
        --prompts /tmp/large/prompts.jsonl --batch-sizes 1,4 --max-configs 8 \
        --num-prompts 4 --new-tokens 96 --repeats 2                               # the trained larger target
    python benchmarks/tune_accuracy.py --device cpu --quick                         # smoke test
    OMP_NUM_THREADS=1 python benchmarks/tune_accuracy.py --device cpu --process-clock --batch-sizes 1,2 \
        --num-prompts 2 --new-tokens 32 --repeats 2 --calibration-repeats 6        # CPU shared with other work

Per draft method and batch size of ``--batch-sizes``: one greedy trace is recorded at that
batch size with the method's middle configuration (``--new-tokens`` tokens per prompt,
ignore_eos), as a user records the workload they tune; ``spectool.tune`` predicts up to
``--max-configs`` configurations from it (a point = configuration x batch size: multi-layer
EAGLE has only its num_steps to vary), then each point is decoded for real (an untimed run of the
workload, then the median of ``--repeats`` by tokens/s, the repeats in passes over the points:
``measure``) and the relative errors are reported: of the mean accept length (exact in
float32 on the CPU; in bf16 the teacher-forced and incremental forwards round differently,
spectool/tune/eagle_whatif.py) and of tokens/s (the profile's model of an iteration against
the engine's measured iterations; the JSON splits both into the iterations that verified a
drafted tree and those that verified the roots alone, medians, means and counts, and the profile
checked against the recorded trace's own iterations (``spectool.tune.profile_check``); ``--recheck`` adds
the point's configuration timed again as the calibration times a grid point, right after its
runs). Tokens/s come from ``--profile``; when that is not a file it is measured first, in the
same run, by ``spectool.tune.calibrate`` on exactly the batch sizes, tree sizes, top-k and
steps the points use, from a cache as long as the workload's mean prompt plus half its output
(and written to ``--profile`` when given).
Prints a table and the seconds each phase took; writes $OUT/tune_accuracy.json (or --out).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from speculative import add_common_arguments, load_target, run_meta, write_json

import spectool as st
from spectool.prompts import load_prompts
from spectool.tune import CostProfile
from spectool.tune.calibrate import calibrate, time_iterations
from spectool.tune.recommend import tune

WORKLOAD = {"ngram": "editing", "eagle": "completion", "multi_layer_eagle": "completion"}


def configs(method: str, draft_dir: str, quick: bool, most: int) -> list:
    if method == "ngram":
        grid = [(1, 4), (2, 8), (4, 8), (4, 12), (8, 16), (10, 12), (1, 24), (16, 32)]
        out = [st.NgramConfig(max_bfs_breadth=b, num_draft_tokens=n) for b, n in grid]
    elif method == "eagle":
        grid = [(1, 1, 2), (3, 1, 4), (5, 1, 6), (3, 2, 6), (4, 2, 8), (5, 4, 16), (4, 4, 12), (6, 4, 24)]
        out = [st.EagleConfig(f"{draft_dir}/eagle", num_steps=s, topk=k, num_draft_tokens=n) for s, k, n in grid]
    else:
        out = [st.MultiLayerEagleConfig(f"{draft_dir}/multi_layer_eagle", num_steps=s) for s in (1, 2, 3, 4)]
    out = out[:3] if quick else out
    if len(out) > most:  # spread over the grid, not its first entries
        out = [out[round(i * (len(out) - 1) / (most - 1))] for i in range(most)] if most > 1 else out[:1]
    return out


def calibration_grid(points: dict[str, list], batch_sizes: list[int]) -> dict:
    """What calibrate must measure for these configurations: their batch sizes, tree sizes, top-k, steps
    (EAGLE run at each (top-k, steps) with a tree size some configuration there uses)."""
    eagle = points.get("eagle", [])
    nodes = {1} | {c.num_draft_tokens for cs in points.values() for c in cs}
    return dict(batch_sizes=sorted(set(batch_sizes) | {1}), num_nodes=sorted(nodes),
                topks=sorted({c.topk for c in eagle}) or [1], eagle_steps=sorted({c.num_steps for c in eagle}) or [1],
                eagle_num_nodes={(c.topk, c.num_steps): c.num_draft_tokens for c in eagle},
                ngram_num_nodes=sorted({c.num_draft_tokens for c in points.get("ngram", [])}),
                ngram="ngram" in points)


def print_row(r: dict) -> None:
    c = r["config"]
    names = {"num_steps": "steps", "topk": "topk", "max_bfs_breadth": "breadth", "num_draft_tokens": "N"}
    short = ",".join(f"{n}={c[k]}" for k, n in names.items() if k in c)
    acc_err = "n/a" if r["accept_error"] is None else f"{r['accept_error']:+.1%}"
    print(f"{r['method']:<18} {short:<28} {r['batch_size']:>3} {r['predicted_accept_length']:>11.2f} "
          f"{r['measured_accept_length']:>6.2f} {acc_err:>6} {r['predicted_tokens_per_s']:>10.1f} "
          f"{r['measured_tokens_per_s']:>8.1f} {r['tokens_per_s_error']:>+6.1%}", flush=True)


def iteration_split(stats, pred, profile: CostProfile) -> dict:
    """Measured and predicted µs per iteration, medians over the iterations that verified a drafted
    tree and over those that verified the roots alone, with their counts: where a tokens/s error
    comes from (the iteration's cost, or how often each kind ran)."""
    cols = stats.columns
    measured: dict[int, list] = {}
    for it, depth, us in zip(cols["iteration"], cols["depth"], cols["iteration_us"]):
        drafted, _ = measured.get(it, (False, us))
        measured[it] = (drafted or depth[0] > 0, us)
    cfg = None if pred.method == "none" else pred.config
    predicted = list(zip((pred.num_nodes > 1).tolist(),
                         profile.iteration_costs(cfg, pred.batch_size, pred.num_nodes).tolist()))

    def split(pairs) -> dict:
        out = {}
        for kind, flag in (("drafted", True), ("roots", False)):
            us = [u for d, u in pairs if d == flag]
            out[kind] = {"iterations": len(us), "median_us": statistics.median(us) if us else None,
                         "mean_us": statistics.fmean(us) if us else None}
        return out

    return {"measured": split(measured.values()), "predicted": split(predicted)}


def measure(target, cfgs: list, batch_size: int, prompts: list, new_tokens: int, repeats: int) -> list[list]:
    """Each configuration's ``repeats`` timed runs (RunStats) of the whole workload. One engine per
    configuration, warmed by an untimed run of the workload (every graph bucket it meets is captured
    there); then ``repeats`` passes, each running every configuration once: the device's speed moves
    from one stretch of seconds to the next, and a point's runs taken back to back would all land in
    one stretch. A timed run that captured a graph is refused (SystemExit)."""
    engines = [st.Engine(target, draft=cfg, max_batch_size=batch_size, max_seq_len=2048) for cfg in cfgs]
    runs: list[list] = [[] for _ in cfgs]
    for k in range(repeats + 1):
        for engine, cfg, out in zip(engines, cfgs, runs):
            if engine.method == "ngram":  # the trie outlives a generate call: each run starts from an empty one
                engine.drafter.corpus.reset()
            stats = engine.generate(prompts, max_new_tokens=new_tokens, record=False, ignore_eos=True).stats
            if k == 0:
                continue
            if stats.graphs.get("captures"):
                raise SystemExit(f"{cfg}: {stats.graphs['captures']} graph capture(s) inside a timed run")
            out.append(stats)
    return runs


def context_of(prompts: dict[str, list[list[int]]], new_tokens: int) -> int:
    """The cache length the calibration starts from: the workload's mean prompt, half decoded."""
    lengths = [len(p) for ps in prompts.values() for p in ps]
    return max(8, round(sum(lengths) / max(1, len(lengths))) + new_tokens // 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    p.add_argument("--profile", help="cost profile JSON (measured here and written there if it is not a file)")
    p.add_argument("--batch-sizes", default="4", help="comma list: every configuration is predicted and run at each")
    p.add_argument("--max-configs", type=int, default=8, help="configurations per method (spread over its grid)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--calibration-repeats", type=int, default=10, help="timed repeats per calibration point")
    p.add_argument("--methods", default="ngram,eagle,multi_layer_eagle")
    p.add_argument("--recheck", action="store_true",
                   help="after each point's runs, time its configuration again as the calibration does (a "
                        "fresh engine on the synthetic prompts): whether the profile's figure still holds then")
    p.add_argument("--process-clock", action="store_true",
                   help="CPU only: every timing (engine and calibration) reads the process's CPU time, what one "
                        "thread's wall time would be on an idle core of a CPU shared with other work")
    args = p.parse_args(argv)
    if not args.process_clock:
        return run(p, args)
    if args.device != "cpu":
        p.error("--process-clock is for --device cpu (a GPU's work is not the process's CPU time)")
    wall = time.perf_counter
    time.perf_counter = time.process_time  # read through the module by the engine, its timer and calibrate
    try:
        return run(p, args)
    finally:
        time.perf_counter = wall


def run(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Calibrate (unless --profile is a file), record, predict and run every point; print and save the table."""
    t_start = time.perf_counter()
    target = load_target(args.model, args.device)
    new_tokens = 12 if args.quick else args.new_tokens
    n_prompts = 2 if args.quick else args.num_prompts
    batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",") if b.strip()})
    if not batch_sizes or batch_sizes[0] < 1 or args.max_configs < 1:
        p.error("--batch-sizes needs sizes >= 1 and --max-configs >= 1")
    methods = args.methods.split(",")
    points = {m: configs(m, args.draft_dir, args.quick, args.max_configs) for m in methods}
    prompts = {m: [target.encode(t)[-256:] for t in load_prompts(args.prompts, WORKLOAD[m])[:n_prompts]]
               for m in methods}
    seconds = {}
    t0 = time.perf_counter()
    context = 32 if args.quick else context_of(prompts, new_tokens)
    if args.profile and Path(args.profile).is_file():
        profile = CostProfile.load(args.profile)
    else:
        grid = calibration_grid(points, batch_sizes)
        has = {m: m in points for m in ("eagle", "multi_layer_eagle")}
        profile = calibrate(target, eagle_path=f"{args.draft_dir}/eagle" if has["eagle"] else None,
                            multi_layer_path=f"{args.draft_dir}/multi_layer_eagle" if has["multi_layer_eagle"]
                            else None, repeats=2 if args.quick else args.calibration_repeats,
                            context=context, **grid)
        if args.profile:
            profile.save(args.profile)
    seconds["calibrate"] = time.perf_counter() - t0
    print(f"profile {profile.source} ({profile.device}): {seconds['calibrate']:.0f} s", flush=True)
    print(f"{'method':<18} {'config':<28} {'bs':>3} {'accept pred':>11} {'meas':>6} {'err':>6} "
          f"{'tok/s pred':>10} {'meas':>8} {'err':>6}")
    rows = []

    def save() -> None:  # after every method: a run cut short still leaves the points it measured
        write_json("tune_accuracy.json", {"meta": {**run_meta(args, "tune_accuracy"), "profile": profile.source,
                                                   "profile_device": profile.device, "seconds": seconds},
                                          "rows": rows}, args.out)

    t0 = time.perf_counter()
    for method in methods:
        cfgs = points[method]
        base = cfgs[len(cfgs) // 2]
        for bs in batch_sizes:
            recorded = st.Engine(target, draft=base, max_batch_size=bs, max_seq_len=2048).generate(
                prompts[method], max_new_tokens=new_tokens, ignore_eos=True).trace
            result = tune(recorded, grid=cfgs, profile=profile, batch_size=bs, target=target,
                          allow_other_model=True, progress=False)
            check = result.profile_check
            print(f"{method} bs {bs}: {check.describe()}", flush=True)
            runs = measure(target, cfgs, bs, prompts[method], new_tokens, max(1, args.repeats))
            for cfg, pred, point_runs in zip(cfgs, result.predictions, runs):
                measured = sorted(point_runs, key=lambda s: s.tokens_per_s)[len(point_runs) // 2]  # the median run
                pt = result.tokens_per_s(pred)
                rows.append({"method": method, "config": cfg.to_dict(), "batch_size": bs,
                             "workload": WORKLOAD[method],
                             "predicted_accept_length": pred.mean_accept_length,
                             "measured_accept_length": measured.mean_accept_length,
                             "accept_error": pred.mean_accept_length / measured.mean_accept_length - 1
                             if measured.mean_accept_length else None,
                             "predicted_tokens_per_s": pt, "measured_tokens_per_s": measured.tokens_per_s,
                             "tokens_per_s_error": pt / measured.tokens_per_s - 1,
                             "runs_tokens_per_s": [r.tokens_per_s for r in point_runs],
                             "iteration_us": iteration_split(measured, pred, profile),
                             "profile_check": {"iterations": check.iterations, "predicted_us": check.predicted_us,
                                               "measured_us": check.measured_us, "ratio": check.ratio,
                                               "skipped": check.skipped}})
                if args.recheck:
                    rows[-1]["iteration_us"]["recheck_us"] = time_iterations(
                        target, cfg, bs, context=context, iterations=2 if args.quick else args.calibration_repeats)
                print_row(rows[-1])
        save()
    seconds["record, predict and run"] = time.perf_counter() - t0
    within = {m: sum(abs(r["tokens_per_s_error"]) <= 0.10 for r in rows if r["method"] == m) for m in methods}
    print("points with tokens/s within 10 %: " + ", ".join(
        f"{m} {within[m]}/{sum(r['method'] == m for r in rows)}" for m in methods))
    seconds["total"] = time.perf_counter() - t_start
    print("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
