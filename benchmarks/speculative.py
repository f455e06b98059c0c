"""End-to-end speculative speedup over spectool's own plain decoding.

Figure: docs/BENCHMARKS.md "Speculative decoding". Time: 2 to 3 minutes on an H200 (--budget-s caps it).

    python benchmarks/speculative.py                       # H200: demo model, bf16, bs 1/4/16, 128 tokens
    python benchmarks/speculative.py --model /tmp/large/target --draft-dir /tmp/large
    python benchmarks/speculative.py --device cpu --quick  # smoke test: bs 1, 1 prompt, 4 tokens
    python benchmarks/speculative.py --model /tmp/large/target --draft-dir /tmp/large --tp 2   # 2 GPUs
    python benchmarks/speculative.py --device cpu --quick --tp 2   # smoke test: 2 processes, gloo

For every workload (completion, editing: the "kind" of prompts.jsonl), batch size,
temperature (``--temperatures``, greedy by default; sampled cells draw with the same seed)
and method (plain = draft None; ngram = NgramConfig defaults; eagle = 5 steps, top-k 4,
16 tokens; multi_layer_eagle = 4 steps), one engine with ``max_batch_size = batch``
decodes max(batch, --min-prompts) prompts (a small batch takes them in turn, so batch 1
is not one prompt's luck) with ``ignore_eos=True`` and a fixed max_new_tokens, so every
method does the same work.
Each cell gets a fresh engine (a reused N-gram trie would remember the previous cell's
outputs), ``Engine.warmup()`` (its time is reported) and one call on random prompts of the
same lengths, then the timed call. Reported per cell: end-to-end tokens/s (the call's wall
time, prefill included) and its speedup over plain at the same workload, batch and
temperature; decode tokens/s (the tokens the iterations delivered over their time, from
``result.stats``; the engine's own figure, which also counts what a request's last iteration
accepted past max_new_tokens, is kept as verified_tokens_per_s) and its speedup;
for sampled cells the speedup their accept length implies at greedy's cost per iteration;
time to first token; the prefill's cost (the median of five one-token calls of the same prompts) and its
ratio to plain's; mean µs per iteration of each phase. A cell whose timed region had a
CUDA-graph capture or an eager step is refused (printed as such, no figures).
Prints a table; writes $OUT/speculative.json (or --out DIR). ``--budget-s`` skips the
cells that would start after the budget (they are listed as skipped, never silently dropped).
``--profile phases|ops|host`` runs one of the profiles that explain these figures instead
(benchmarks/profiling/; the options after it are the profile's own).

``--tp N`` splits the target over N processes (one GPU each; gloo on the CPU), started by the
script as ``spectool record --tp`` does (or run it under ``torchrun --nproc-per-node N``); rank 0
reports. Every row then carries the TP-N bandwidth floor of plain decoding (each GPU reads its
1/N of the weights per step at its copy bandwidth: batch x bandwidth / bytes per rank) and its
tokens/s as a share of it; a speculative row may pass 100 %, since a step yields more than one token.

The other benchmark scripts import the helpers below (they run from benchmarks/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from decode import copy_bandwidth, weight_bytes_per_step
from profiling import profile_help, run_profile

import spectool as st
from spectool.cli.launch import launch, launched
from spectool.prompts import load_prompts

METHODS = ("plain", "ngram", "eagle", "multi_layer_eagle", "eagle3")
WORKLOADS = ("completion", "editing")
PREFILL_REPEATS = 5  # prefill-only calls per cell; their median is the cell's prefill time


# ------------------------------------------------------------------ shared helpers


def seed_all(seed: int) -> None:
    """Seed Python, torch (CPU and CUDA) so random prompts and weights repeat."""
    random.seed(seed)
    torch.manual_seed(seed)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_target(model_dir: str | Path, device: str, tp_size: int = 1):
    """The target in bf16 on CUDA, float32 on CPU (CPU bf16 matmuls are slow); split over
    ``tp_size`` processes when > 1 (this one's shard)."""
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return st.load(model_dir, device=device, dtype=dtype, tp_size=tp_size)


def workload_prompts(target, path: str | Path, kind: str, count: int, max_tokens: int | None = None
                     ) -> list[list[int]]:
    """``count`` prompts of one kind as token ids (cycled if the file holds fewer).

    ``max_tokens`` keeps only each prompt's last tokens (smoke tests on CPU).
    """
    texts = load_prompts(path, kind)
    out = []
    for i in range(count):
        ids = target.encode(texts[i % len(texts)])
        out.append(ids[-max_tokens:] if max_tokens else ids)
    return out


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts of random tokens (for N-gram: trie entries that never match real text)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(count)]


def timed_region(engine) -> dict:
    """Graph counters of ``engine`` now, to diff after a timed region (``region_faults``)."""
    return dict(engine.graph_stats())


def region_faults(engine, before: dict) -> dict:
    """CUDA-graph captures and eager steps since ``before``: a timed region must have none (each
    capture costs more than many iterations, and an eager step is not what a user runs)."""
    now = engine.graph_stats()
    return {"timed_graph_captures": now["captures"] - before["captures"],
            "timed_eager_steps": now["eager"] - before["eager"]}


def refused(row: dict, device: str) -> str | None:
    """Why a measured row must not be reported (None: it may): any capture or eager step inside
    its timed region on CUDA (on the CPU everything runs eagerly anyway)."""
    if torch.device(device).type != "cuda":
        return None
    if row.get("timed_graph_captures") or row.get("timed_eager_steps"):
        return (f"{row.get('timed_graph_captures', 0)} graph captures and {row.get('timed_eager_steps', 0)} "
                f"eager steps inside the timed region")
    return None


def draft_config(method: str, draft_dir: str | Path, **overrides):
    """The benchmark's setting of each method (None for plain); ``overrides`` replace fields."""
    draft_dir = Path(draft_dir)
    if method == "plain":
        return None
    if method == "ngram":
        return st.NgramConfig(**overrides)
    if method == "eagle":
        return st.EagleConfig(draft_dir / "eagle", **{"num_steps": 5, "topk": 4, "num_draft_tokens": 16,
                                                      **overrides})
    if method == "multi_layer_eagle":
        return st.MultiLayerEagleConfig(draft_dir / "multi_layer_eagle", **{"num_steps": 4, **overrides})
    if method == "eagle3":  # EAGLE's tree settings, so their accept lengths compare
        return st.Eagle3Config(draft_dir / "eagle3", **{"num_steps": 5, "topk": 4, "num_draft_tokens": 16,
                                                        **overrides})
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def _synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure(target, draft, prompts: list[list[int]], new_tokens: int, max_seq_len: int, seed: int,
            batch: int | None = None, temperature: float = 0.0, deterministic: bool = False) -> dict:
    """Fresh engine decoding ``prompts`` at most ``batch`` at a time (default: all in one batch;
    the rest wait for a free slot): ``Engine.warmup()`` (timed), one untimed call on random
    prompts of the same lengths (kernels that specialise on a prefill's shape), then the timed
    call, end to end (prefill included), and the median of ``PREFILL_REPEATS`` prefill-only calls
    of the same prompts (one new token each; a single one moved by a fifth between runs), timed to
    the GPU's end, after the timed call so no trie has seen the prompts before it.
    ``deterministic``: the engine's deterministic mode (greedy output then equals plain output
    exactly)."""
    batch = batch or len(prompts)
    engine = st.Engine(target, draft=draft, max_batch_size=batch, max_seq_len=max_seq_len,
                       deterministic=deterministic)
    warm = engine.warmup(sampling=temperature > 0, record=False)  # the modes the timed call runs
    vocab = target.config.vocab_size
    shaped = [random_prompts(1, len(p), vocab, seed + 1 + i)[0] for i, p in enumerate(prompts[:batch])]
    engine.generate(shaped, max_new_tokens=2, record=False, ignore_eos=True, seed=seed, temperature=temperature)
    before = timed_region(engine)
    _synchronize(target.device)
    t0 = time.perf_counter()
    result = engine.generate(prompts, max_new_tokens=new_tokens, record=False, ignore_eos=True, seed=seed,
                             temperature=temperature)
    _synchronize(target.device)
    wall = time.perf_counter() - t0
    prefills = []
    for _ in range(PREFILL_REPEATS):
        t0 = time.perf_counter()
        engine.generate(prompts, max_new_tokens=1, record=False, ignore_eos=True, seed=seed, temperature=temperature)
        _synchronize(target.device)
        prefills.append(time.perf_counter() - t0)
    prefill = statistics.median(prefills)
    faults = region_faults(engine, before)
    stats = result.stats.to_dict()
    # Decode tokens/s counts the tokens the iterations delivered (every prompt's first token is the
    # prefill's), as end to end does: the engine's own figure also counts what a request's last
    # iteration accepted past max_new_tokens, which only a draft method does, and which would make
    # the end-to-end speedup look further below the decode one than the time outside the iterations does.
    delivered = stats["generated_tokens"] - len(prompts)
    return {"tokens_per_s": delivered / stats["decode_s"] if stats["decode_s"] > 0 else 0.0,
            "verified_tokens_per_s": stats["tokens_per_s"] or 0.0, "decode_ms": stats["decode_s"] * 1e3,
            "mean_accept_length": stats["mean_accept_length"],
            **faults, "phase_us": stats["phase_us"], "iterations": stats["iterations"],
            "generated_tokens": stats["generated_tokens"], "wall_s": wall,
            "end_to_end_tokens_per_s": stats["generated_tokens"] / wall,
            "time_to_first_token_ms": (stats["time_to_first_token_s"] or 0.0) * 1e3,
            "prefill_ms": prefill * 1e3, "warmup_s": warm["seconds"],
            "between_iterations_ms": (stats["elapsed_s"] - stats["prefill_s"] - stats["decode_s"]) * 1e3,
            # The call's wall time outside the engine's own clock: its set-up, the results, the GPU
            # work still queued when the last iteration returns.
            "outside_call_ms": (wall - stats["elapsed_s"]) * 1e3,
            "warmup_captures": warm["captures"],
            "temperature": temperature, "token_ids": result.token_ids}


def write_json(name: str, payload: dict, out: str | None) -> Path | None:
    """Write ``payload`` to OUT/name (``out`` or $OUT); nothing when neither is set."""
    folder = out or os.environ.get("OUT")
    if not folder:
        return None
    path = Path(folder) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str))
    return path


def provenance(script: str, argv: list[str] | None, device: str) -> dict:
    """Where a figure came from, as docs/BENCHMARKS.md's tables name it (benchmarks/headline.py
    reads it): the date (UTC), the machine and the command that reproduces it (--out left out:
    it only says where the JSON went)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    while "--out" in argv:
        at = argv.index("--out")
        del argv[at:at + 2]
    dev = torch.device(device)
    machine = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
               else f"{os.cpu_count()}-core {platform.machine()} CPU")
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "machine": machine,
            "command": shlex.join(["python3", f"benchmarks/{script}.py", *argv])}


def run_meta(args: argparse.Namespace, script: str | None = None, argv: list[str] | None = None) -> dict:
    """The JSON's meta: versions, device, seed, and with ``script`` the run's provenance."""
    device = torch.device(args.device)
    meta = {"torch": torch.__version__, "device": str(device), "quick": args.quick, "seed": args.seed,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    return {**meta, **provenance(script, argv, args.device)} if script else meta


def fmt(value, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """--device, --quick, --seed, --out, --model, --draft-dir, --prompts."""
    demo = st.demo_model()
    p.add_argument("--device", default=default_device())
    p.add_argument("--quick", action="store_true", help="tiny settings (CPU smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="directory for the JSON (default: $OUT)")
    p.add_argument("--model", default=str(demo / "target"), help="target directory (HF Llama format)")
    p.add_argument("--draft-dir", default=str(demo), help="directory holding eagle/ and multi_layer_eagle/")
    p.add_argument("--prompts", default=str(demo / "prompts.jsonl"), help="JSONL with 'kind' per prompt")


# ------------------------------------------------------------------ this benchmark


def parse_overrides(items: list[str]) -> dict[str, dict]:
    """``["eagle.topk=2", ...]`` -> ``{"eagle": {"topk": 2}}``; values are JSON when they parse as JSON."""
    out: dict[str, dict] = {}
    for item in items:
        name, eq, raw = item.partition("=")
        method, dot, field = name.partition(".")
        if not (eq and dot and field) or method not in METHODS or method == "plain":
            raise ValueError(f"--set {item!r}: expected METHOD.FIELD=VALUE with METHOD one of "
                             f"{', '.join(METHODS[1:])}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out.setdefault(method, {})[field] = value
    return out


def add_implied_speedups(rows: list[dict]) -> None:
    """A sampled row's ``implied_speedup``: the greedy row's speedup (same workload, batch and
    method) scaled by the tokens per iteration, (1 + its accept length) / (1 + greedy's), i.e.
    what its accept length would give at greedy's cost per iteration."""
    greedy = {(r["workload"], r["batch"], r["method"]): r for r in rows if r["temperature"] == 0}
    for r in rows:
        g = greedy.get((r["workload"], r["batch"], r["method"]))
        r["implied_speedup"] = (g["speedup"] * (1 + r["mean_accept_length"]) / (1 + g["mean_accept_length"])
                                if r["temperature"] and g and g["speedup"] and r["speedup"] is not None else None)


def print_table(rows: list[dict], args: argparse.Namespace, new_tokens: int) -> None:
    print(f"\nspeculative.py — {run_meta(args)['gpu'] or args.device}; target {args.model}; "
          f"{new_tokens} new tokens per request; e2e = end to end (prefill included), decode = iterations only; "
          f"prefill = the median of {PREFILL_REPEATS} one-token calls of the same prompts; "
          f"a cell with a graph capture or an eager step inside its timed region is refused"
          + ("; deterministic mode" if args.deterministic else ""))
    floor = rows[0]["floor_tok_s"] / rows[0]["batch"] if rows else 0.0
    print(f"TP {args.tp}: floor of plain decoding {floor:.1f} tok/s per request (each device reads its "
          f"1/{args.tp} of the target's weights per step at its copy bandwidth); %fl = decode tok/s / floor")
    phases = ("draft_us", "index_us", "verify_us", "commit_us", "trie_get_us", "trie_put_us")
    print(f"{'workload':<10} {'bs':>3} {'temp':>4} {'method':<18} {'e2e tok/s':>9} {'decode':>9} {'%fl':>5} "
          f"{'e2e x':>6} {'dec x':>6} {'impl x':>6} {'accept':>6} {'ttft ms':>7} {'prefill':>7} {'pf x':>5} "
          + " ".join(f"{name.removesuffix('_us'):>8}" for name in phases) + f" {'same':>5}   (µs/iteration)")
    for r in rows:
        head = f"{r['workload']:<10} {r['batch']:>3} {r['temperature']:>4g} {r['method']:<18}"
        if r["refused"]:
            print(f"{head} refused: {r['refused']}")
            continue
        ph = r["phase_us"]
        print(f"{head} {r['end_to_end_tokens_per_s']:>9.1f} {r['tokens_per_s']:>9.1f} {r['pct_floor']:>5.1f} "
              f"{fmt(r['end_to_end_speedup'], '.2f'):>6} {fmt(r['speedup'], '.2f'):>6} "
              f"{fmt(r['implied_speedup'], '.2f'):>6} {r['mean_accept_length']:>6.2f} "
              f"{r['time_to_first_token_ms']:>7.1f} {r['prefill_ms']:>7.1f} {fmt(r['prefill_vs_plain'], '.2f'):>5} "
              + " ".join(f"{ph.get(name, 0):>8.0f}" for name in phases)
              + f" {str(r['same_tokens_as_plain']):>5}")
    warm = [r for r in rows if r["warmup_captures"]]
    if warm:
        print("Engine.warmup(): " + ", ".join(f"{r['method']}/bs{r['batch']} {r['warmup_s']:.2f} s "
                                               f"({r['warmup_captures']} graphs)" for r in warm[:8])
              + (" ..." if len(warm) > 8 else ""))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    code = run_profile("speculative", argv)
    if code is not None:
        return code
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    p.add_argument("--profile", metavar="KIND", help=profile_help("speculative"))
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--methods", help="comma-separated (default: every method whose draft is in --draft-dir)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--temperatures", default="0",
                   help="comma-separated; 0 = greedy, > 0 sampled cells (e.g. 0,0.7,1.0)")
    p.add_argument("--min-prompts", type=int, default=4,
                   help="prompts per cell at least: a batch smaller than this decodes them in turn")
    p.add_argument("--budget-s", type=float, default=float("inf"),
                   help="start no cell after this many seconds")
    p.add_argument("--set", action="append", default=[], metavar="METHOD.FIELD=VALUE",
                   help="override one field of a method's config, e.g. eagle.num_draft_tokens=8 (repeatable)")
    p.add_argument("--deterministic", action="store_true",
                   help="every engine (plain too) in deterministic mode: batch-invariant target kernels")
    p.add_argument("--tp", type=int, default=1,
                   help="split the target over this many processes (one GPU each; gloo on the CPU); rank 0 reports")
    args = p.parse_args(argv)
    if args.tp > 1 and not launched():  # one process per rank, this script in each
        return launch([sys.executable, os.path.abspath(__file__), *argv], args.tp)
    try:
        overrides = parse_overrides(args.set)
    except ValueError as e:
        p.error(str(e))
    batches = [int(b) for b in args.batches.split(",")]
    methods = args.methods.split(",") if args.methods else [
        m for m in METHODS if m in ("plain", "ngram") or (Path(args.draft_dir) / m).is_dir()]
    if "plain" not in methods:
        methods.insert(0, "plain")  # the baseline of every speedup
    new_tokens, max_prompt = args.new_tokens, None
    if args.quick:
        batches, new_tokens, max_prompt = [1], 3, 16
    seed_all(args.seed)
    target = load_target(args.model, args.device, args.tp)
    # Plain decoding's floor per request: one step reads this rank's weights once.
    floor = copy_bandwidth(target.device) / weight_bytes_per_step(target.model)
    # Bad method or field names fail here, before any decoding.
    try:
        configs = {m: draft_config(m, args.draft_dir, **overrides.get(m, {})) for m in methods}
    except (TypeError, ValueError) as e:
        p.error(f"--set: {e}")
    max_seq_len = target.config.max_position_embeddings

    started = time.perf_counter()
    rows, skipped = [], []
    temperatures = [float(t) for t in args.temperatures.split(",")]
    for workload in args.workloads.split(","):
        for batch in batches:
            count = 1 if args.quick else max(batch, args.min_prompts)
            prompts = workload_prompts(target, args.prompts, workload, count, max_prompt)
            for temperature in temperatures:
                base, base_tokens = None, None
                for method in methods:
                    cell = {"workload": workload, "batch": batch, "temperature": temperature, "method": method}
                    if time.perf_counter() - started > args.budget_s:
                        skipped.append(cell)
                        continue
                    seed_all(args.seed)
                    r = measure(target, configs[method], prompts, new_tokens,
                                min(max_seq_len, max(map(len, prompts)) + new_tokens + 8), args.seed, batch,
                                temperature, args.deterministic)
                    tokens = r.pop("token_ids")
                    row = {**cell, **r, "tp": args.tp, "new_tokens": new_tokens, "refused": refused(r, args.device),
                           "floor_tok_s": batch * floor, "pct_floor": 100 * r["tokens_per_s"] / (batch * floor)}
                    if method == "plain":
                        base, base_tokens = row, tokens
                    ok = base is not None and not base["refused"] and not row["refused"]
                    row.update(
                        speedup=r["tokens_per_s"] / base["tokens_per_s"] if ok else None,
                        end_to_end_speedup=(r["end_to_end_tokens_per_s"] / base["end_to_end_tokens_per_s"]
                                            if ok else None),
                        prefill_vs_plain=r["prefill_ms"] / base["prefill_ms"] if ok else None,
                        # greedy speculative output must equal plain greedy output (in bf16 outside
                        # deterministic mode it may differ on near-ties)
                        same_tokens_as_plain=tokens == base_tokens if base and temperature == 0 else None)
                    rows.append(row)
    add_implied_speedups(rows)
    if target.tp is not None and target.tp.rank != 0:
        return 0  # every rank measured the same run; rank 0 reports it
    print_table(rows, args, new_tokens)
    big = max(batches)
    keep = [f"{r['method']}/{r['workload']}/t{r['temperature']:g}" for r in rows
            if r["batch"] == big and r["method"] != "plain" and (r["end_to_end_speedup"] or 0) >= 1.0]
    print(f"end-to-end speedup >= 1 at batch {big}: {', '.join(keep) if keep else 'none'}")
    if skipped:
        print(f"skipped (budget {args.budget_s:.0f} s): "
              + ", ".join(f"{c['method']}/{c['workload']}/bs{c['batch']}/t{c['temperature']:g}" for c in skipped))
    settings = {m: (c.to_dict() if c is not None else None) for m, c in configs.items()}
    meta = {**run_meta(args, "speculative", argv), "model": args.model, "settings": settings,
            "deterministic": args.deterministic}
    write_json("speculative.json", {"meta": meta,
                                    "rows": rows, "skipped": skipped,
                                    f"end_to_end_speedup_ge_1_at_batch_{big}": keep}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
