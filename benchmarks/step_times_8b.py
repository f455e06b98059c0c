"""Per-step times at the Llama-3-8B shape and the speedup they imply with measured accept lengths.

Figure: docs/BENCHMARKS.md "Step times at the 8B shape". Time: about 1 minute on an H200.

    python benchmarks/step_times_8b.py --accept-json $OUT/speculative.json   # H200, bf16, CUDA graphs
    python benchmarks/step_times_8b.py --device cpu --quick                   # smoke test (tiny shape)
    python benchmarks/step_times_8b.py --deterministic   # also decode and verify in deterministic mode

Random bf16 weights built from a ModelConfig (no download), batch 1, a 512-token prefix.
Every step is one spectool forward replayed from a CUDA graph (``GraphRunner``):

* decode: target forward + logits, T = 1;
* verify N: target forward + logits over an N-node tree (random parents) after the prefix,
  N in {4, 5, 8, 12, 16, 64} (5 = the multi-layer chain, 12 = the N-gram default);
* draft T: one draft layer of the 8B shape (enorm/hnorm, eh_proj 2H->H, one decoder block,
  norm) + the shared lm_head + top-k, over T tokens (T = top-k for an EAGLE step,
  1..accept+1 for a draft-extend).

Implied speedup = tau x T_decode / (T_verify(N) + T_draft), tau = mean accept length + 1:
  ngram:  T_draft = 0 (the trie runs on the CPU; its cost is in benchmarks/ngram_corpus.py);
  eagle:  5 steps at T = top-k 4, plus the extend over accept+1 tokens, N = 16;
  multi_layer_eagle: 4 layers, each extended over accept+1 tokens, N = 5.
Accept lengths come from speculative.py's JSON (batch 1; ngram on editing, EAGLE methods on
completion) via --accept-json, or else the labelled defaults below. With --deterministic the
target's decode and verify steps are also timed in deterministic mode (batch-invariant kernels,
docs/INTERNALS.md; the draft layer's steps are the same in both modes) with the speedups they
imply. Prints a table; writes $OUT/step_times_8b.json and $OUT/step_times_8b.png (matplotlib;
"n/a" without it).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time
from pathlib import Path

import torch
from decode import model_config, sync
from speculative import fmt, run_meta, seed_all, write_json

from spectool.graphs import GraphRunner
from spectool.model.draft_layer import DraftLayer
from spectool.model.kv_cache import KVCache
from spectool.model.llama import Transformer

# Used only when no --accept-json is given (or it lacks a method): inputs, not measurements.
DEFAULT_ACCEPT = {"ngram": 1.5, "eagle": 2.5, "multi_layer_eagle": 2.0}
SETTINGS = {  # method -> (verify N, draft: list of (tokens per forward, count) given accept length a)
    "ngram": (12, lambda a: []),
    "eagle": (16, lambda a: [(4, 5), (a + 1, 1)]),
    "multi_layer_eagle": (5, lambda a: [(a + 1, 4)]),
}


def random_tree_mask(n: int, device: torch.device) -> torch.Tensor:
    """[1, n, n] ancestor mask of a random tree in topological order."""
    parents = [-1] + [int(torch.randint(0, i, ()).item()) for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
    return mask[None].to(device)


def time_step(fn, inputs: dict[str, torch.Tensor], iters: int, device: torch.device) -> float:
    """µs per call of ``fn(**inputs)``: captured once in a CUDA graph (eager on CPU), then timed."""
    runner = GraphRunner(fn, buckets=(1,), enabled=device.type == "cuda")
    runner.capture(1, **inputs)
    runner(1, **inputs)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        runner(1, **inputs)
    sync(device)
    return (time.perf_counter() - t0) / iters * 1e6


def load_accept(path: str | None) -> dict[str, dict]:
    """Accept length per method: from speculative.json's batch-1 rows where present, else the defaults."""
    rows = json.loads(Path(path).read_text())["rows"] if path and Path(path).is_file() else []
    workload = {"ngram": "editing", "eagle": "completion", "multi_layer_eagle": "completion"}
    out = {}
    for method, default in DEFAULT_ACCEPT.items():
        hit = [r for r in rows
               if r["method"] == method and r["batch"] == 1 and r["workload"] == workload[method]]
        out[method] = ({"accept": hit[0]["mean_accept_length"],
                        "source": f"speculative.json ({workload[method]}, batch 1)"}
                       if hit else {"accept": default, "source": "assumed input"})
    return out


def measure_steps(shape: str, prefix: int, verify_ns: list[int], draft_ts: list[int], iters: int,
                  device: torch.device, deterministic: bool = False) -> dict:
    """µs of decode, verify per N and a draft layer step per T; with ``deterministic`` also decode
    and verify in deterministic mode, under the key "deterministic"."""
    max_t = max(verify_ns + draft_ts)
    cfg = model_config(shape, prefix + max_t + 64)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = Transformer(cfg).to(dtype).eval()
        layer = DraftLayer(cfg, rope=model.rope).to(dtype).eval()
    cache = KVCache.for_model(cfg, 1, prefix + max_t + 64, dtype, device)
    draft_cache = KVCache.for_model(cfg, 1, prefix + max_t + 64, dtype, device, num_layers=1)
    # The graphed attention reads the cache length on device; the CPU path needs it on the host.
    kv_len = None if device.type == "cuda" else prefix + max_t
    slots = torch.zeros(1, dtype=torch.long, device=device)
    starts = torch.full((1,), prefix, dtype=torch.long, device=device)

    def target_step(tokens, positions, slots, starts, tree_mask, deterministic=False):
        hidden = model(tokens, positions, cache=cache, slots=slots, starts=starts, tree_mask=tree_mask,
                       kv_len=kv_len, deterministic=deterministic)
        return model.logits(hidden, deterministic=deterministic)

    def draft_step(tokens, hidden, positions, slots, starts, tree_mask):
        _, normed = layer(model.embed_tokens(tokens), hidden, positions, draft_cache, slots, starts,
                          tree_mask, kv_len)
        return torch.softmax(model.lm_head(normed).float(), dim=-1).topk(4, dim=-1)

    def inputs(t: int, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, cfg.vocab_size, (1, t), device=device)
        depth = mask.sum(-1) - 1  # ancestors per node = its depth
        return {"tokens": tokens, "positions": prefix + depth, "slots": slots, "starts": starts,
                "tree_mask": mask}

    out = {"decode_us": None, "verify_us": {}, "draft_us": {}}
    with torch.inference_mode():
        one = torch.ones(1, 1, 1, dtype=torch.bool, device=device)
        trees = {n: inputs(n, random_tree_mask(n, device)) for n in verify_ns}
        for mode, where in ((False, out), (True, {"verify_us": {}}))[:1 + deterministic]:
            step = functools.partial(target_step, deterministic=mode)
            where["decode_us"] = time_step(step, inputs(1, one), iters, device)
            for n in verify_ns:
                where["verify_us"][n] = time_step(step, trees[n], iters, device)
            if mode:
                out["deterministic"] = where
        for t in draft_ts:
            # EAGLE frontier nodes see only themselves among the new tokens; a draft-extend is causal.
            x = inputs(t, torch.eye(t, dtype=torch.bool, device=device)[None])
            x["hidden"] = torch.randn(1, t, cfg.hidden_size, dtype=dtype, device=device)
            out["draft_us"][t] = time_step(draft_step, x, iters, device)
    return out


def implied(times: dict, accept: dict[str, dict]) -> list[dict]:
    """tau x T_decode / (T_verify + T_draft) per method; None where a needed time was not measured."""
    rows = []
    for method, (n, drafts) in SETTINGS.items():
        a = accept[method]["accept"]
        parts = [(min(max(1, round(t)), max(times["draft_us"])), c) for t, c in drafts(a)]
        verify = times["verify_us"].get(n)
        draft = sum(times["draft_us"].get(t, math.nan) * c for t, c in parts)
        ok = verify is not None and not math.isnan(draft)
        rows.append({"method": method, "N": n, "accept_length": a, "accept_source": accept[method]["source"],
                     "tau": a + 1, "verify_us": verify, "draft_us": draft if ok else None,
                     "draft_steps": parts,
                     "implied_speedup": (a + 1) * times["decode_us"] / (verify + draft) if ok else None})
    return rows


def plot(times: dict, rows: list[dict], path: Path) -> str:
    """Bar charts of step times and implied speedups; returns the file written or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "n/a (matplotlib not installed)"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels = (["decode"] + [f"verify N={n}" for n in times["verify_us"]]
              + [f"draft T={t}" for t in times["draft_us"]])
    values = [times["decode_us"], *times["verify_us"].values(), *times["draft_us"].values()]
    left.barh(labels, values, color=["grey"] + ["tab:blue"] * len(times["verify_us"])
              + ["tab:orange"] * len(times["draft_us"]))
    left.invert_yaxis()
    left.set_xlabel("µs per step (batch 1, CUDA graph)")
    left.set_title("8B-shape step times")
    done = [r for r in rows if r["implied_speedup"] is not None]
    right.bar([r["method"] for r in done], [r["implied_speedup"] for r in done], color="tab:green")
    right.axhline(1.0, color="black", linewidth=0.8)
    for i, r in enumerate(done):
        right.text(i, r["implied_speedup"], f"{r['implied_speedup']:.2f}x\naccept {r['accept_length']:.2f}",
                   ha="center", va="bottom", fontsize=8)
    right.set_ylabel("implied speedup over plain decode")
    right.set_title("τ × T_decode / (T_verify + T_draft)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny shape, short prefix, few iterations (CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="directory for the JSON and PNG (default: $OUT)")
    p.add_argument("--shape", default="8B")
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--accept-json", help="speculative.py's JSON (accept lengths measured on the demo model)")
    p.add_argument("--deterministic", action="store_true",
                   help="also time decode and verify in deterministic mode and the speedups they imply")
    args = p.parse_args(argv)
    shape, prefix, iters = args.shape, args.prefix, args.iters
    verify_ns, draft_ts = [4, 5, 8, 12, 16, 64], [1, 2, 3, 4, 5, 6]
    if args.quick:
        shape, prefix, iters = "tiny", 32, 1
    device = torch.device(args.device)
    seed_all(args.seed)
    accept = load_accept(args.accept_json)
    times = measure_steps(shape, prefix, verify_ns, draft_ts, iters, device, args.deterministic)
    rows = implied(times, accept)
    det_rows = implied({**times, **times["deterministic"]}, accept) if args.deterministic else None

    folder = args.out or os.environ.get("OUT")
    png = plot(times, rows, Path(folder) / "step_times_8b.png") if folder else "n/a (no --out or $OUT)"
    print(f"\nstep_times_8b.py — {run_meta(args)['gpu'] or args.device}; shape {shape}, batch 1, "
          f"prefix {prefix}, {'CUDA graphs' if device.type == 'cuda' else 'eager'}; µs per step")
    print(f"decode {times['decode_us']:.1f}"
          + " | verify " + ", ".join(f"N={n}: {v:.1f}" for n, v in times["verify_us"].items())
          + " | draft layer " + ", ".join(f"T={t}: {v:.1f}" for t, v in times["draft_us"].items()))
    print(f"{'method':<18} {'N':>3} {'accept':>6} {'verify':>8} {'draft':>8} {'implied':>8}  accept from")
    for r in rows:
        print(f"{r['method']:<18} {r['N']:>3} {r['accept_length']:>6.2f} {fmt(r['verify_us']):>8} "
              f"{fmt(r['draft_us']):>8} {fmt(r['implied_speedup'], '.2f'):>7}x  {r['accept_source']}")
    if det_rows is not None:
        det = times["deterministic"]
        print(f"deterministic mode: decode {det['decode_us']:.1f} | verify "
              + ", ".join(f"N={n}: {v:.1f}" for n, v in det["verify_us"].items()))
        for r in det_rows:
            print(f"{r['method']:<18} {r['N']:>3} {r['accept_length']:>6.2f} {fmt(r['verify_us']):>8} "
                  f"{fmt(r['draft_us']):>8} {fmt(r['implied_speedup'], '.2f'):>7}x  deterministic")
    print(f"plot: {png}")
    meta = {**run_meta(args), "shape": shape, "prefix": prefix, "iters": iters,
            "accept_json": args.accept_json}
    payload = {"meta": meta, "times": times, "rows": rows, "plot": png}
    if det_rows is not None:
        payload["deterministic_rows"] = det_rows
    write_json("step_times_8b.json", payload, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
