"""Tree-index kernel and verify timings.

Figure: docs/BENCHMARKS.md "Kernels". Time: about 1 minute on an H200.

    python benchmarks/tree_kernels.py            # CUDA if available, else CPU (torch reference only)
    python benchmarks/tree_kernels.py --sampling-only --sampling-configs sweep   # every chunked launch shape
    python benchmarks/tree_kernels.py --sampling-only --sampling-cuts top-p --sampling-dtypes float32   # some cells
    python benchmarks/tree_kernels.py --profile sampling   # the graphed sampling verify, kernel by kernel

Prints a table and, when $OUT is set, writes $OUT/tree_kernels.json. Index kernel: µs per
call of the Triton kernel and of the torch reference for bs x N, in interleaved rounds; verify: µs per iteration
outside the forward (greedy and sampling, V = 128256 logits per node; on CUDA also replayed
from a CUDA graph, as the engine runs it: sampling with its coins kernel and a temperature input,
also with top-k 50 and top-p 0.9, with the torch verify and with the fused one (one program per node for
its cuts); bf16 logits as the model writes them); sampling verify, CUDA only: graphed per iteration at bs 1 and 64, N
16, V 128256, float32 logits (the engine's) and bf16, temperature 0.8 alone, with top-k 50 + top-p 0.9 and with
top-p 0.9 alone: the torch
verify, the fused one and the chunked one the engine runs (with ``--sampling-configs``: ``default``, ``sweep`` = every
launch shape of spectool/kernels/verify_sampling_chunked.py's CONFIGS, or names joined by commas), each chunked
cell also checked for the torch verify's decision on the same coins; draft top-k: ``row_topk`` against softmax +
topk. On CUDA the
timings are medians of triton.testing.do_bench (CUDA events); on CPU, medians of
time.perf_counter over repeated calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from profiling import profile_help, run_profile
from speculative import provenance

from spectool.draft.tree import DraftTree, parents_to_mask
from spectool.kernels.sampling import sampling_coins
from spectool.kernels.topk import row_topk
from spectool.kernels.tree_indices import reconstruct_indices_torch, reconstruct_indices_triton
from spectool.kernels.verify_sampling_chunked import CONFIGS, default_config
from spectool.verify import verify_greedy, verify_sampling, verify_sampling_chunked, verify_sampling_fused


def bench_us(fn, device: torch.device) -> float:
    """Median µs per call of ``fn``."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1000
    fn()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def capture(fn) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph after three warm-up runs on a side stream (RuntimeError when
    it cannot be captured)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graphed_us(fn) -> float:
    """Median µs per replay of ``fn`` captured in a CUDA graph (as the engine runs it); NaN with
    the reason printed if capture fails."""
    try:
        graph = capture(fn)
    except RuntimeError as err:
        print(f"  (CUDA graph capture failed: {err})")
        return float("nan")
    return bench_us(graph.replay, torch.device("cuda"))


def warm_up_gpu(seconds: float = 2.0) -> None:
    """Keep the GPU busy until its clocks are up: without this the first rows of the table
    measured ~50 µs for a kernel that takes ~5 µs later in the same run."""
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            x @ x
        torch.cuda.synchronize()


def random_parents(bs: int, n: int, g: torch.Generator) -> torch.Tensor:
    parents = (torch.rand(bs, n, generator=g) * torch.arange(n)).long()
    parents[:, 0] = -1
    return parents


def sampling_configs(arg: str) -> list[str]:
    """The chunked verify's launch shapes that ``--sampling-configs`` names ("default": the one the
    engine picks for each cell's rows, alone or beside named shapes)."""
    if arg == "sweep":
        return list(CONFIGS)
    names = arg.split(",")
    unknown = [n for n in names if n not in CONFIGS and n != "default"]
    if unknown:
        raise ValueError(f"unknown --sampling-configs {unknown}; use default, sweep or some of {sorted(CONFIGS)}")
    return names


# The sampling cells' cuts by name (--sampling-cuts; the profile's --cuts): (top_k, top_p).
CUTS = {"temperature": (0, 1.0), "top-k": (50, 1.0), "top-k-top-p": (50, 0.9), "top-p": (0, 0.9)}
TABLE_CUTS = "temperature,top-k-top-p,top-p"  # the sampling table's, unless --sampling-cuts names others


def sampling_cuts(arg: str) -> list[tuple[int, float]]:
    """The (top_k, top_p) of each cut that ``arg`` names, joined by commas, of ``CUTS``."""
    names = arg.split(",")
    unknown = [n for n in names if n not in CUTS]
    if unknown:
        raise ValueError(f"unknown cuts {unknown}; some of {', '.join(CUTS)}, joined by commas")
    return [CUTS[n] for n in names]


def cuts_label(top_k: int, top_p: float) -> str:
    """How the tables name a sampling cell's cuts: "temperature", "top-k 50", "top-k 50, top-p 0.9"."""
    return ", ".join([f"top-k {top_k}"] * (top_k > 0) + [f"top-p {top_p:g}"] * (top_p < 1)) or "temperature"


def sampling_case(bs: int, n: int, vocab: int, dtype: torch.dtype, g: torch.Generator):
    """A sampling verify's inputs on the GPU as the benchmarks time it: random trees and logits
    (``dtype``), the coins' seed and nonces, temperature 0.8. Returns (tree, logits, seed, nonces,
    temperatures)."""
    device = torch.device("cuda")
    parents = random_parents(bs, n, g).to(device)
    tokens = torch.randint(0, vocab, (bs, n), generator=g).to(device)
    tree = DraftTree.from_parents(tokens, parents, torch.zeros(bs, n, device=device),
                                  torch.randint(0, 4096, (bs,), generator=g).to(device))
    logits = (torch.randn(bs, n, vocab, generator=g) * 2).to(device, dtype)
    return (tree, logits, torch.zeros(1, dtype=torch.long, device=device), torch.arange(bs, device=device),
            torch.full((bs,), 0.8, device=device))


# Two float32 computations of a 128k-token CDF may put one boundary this far apart: the sums of
# float32 probabilities in different orders, about 1e-7 of the mass before it.
CDF_ROUNDING = 1e-6


def decision_match(got, want) -> str:
    """"True" where ``got`` makes ``want``'s decision; "rounding" where only bonus tokens differ and
    each lies where the two CDFs place the boundary between the tokens within ``CDF_ROUNDING`` of
    each other (the coin fell between two roundings of one boundary); else "False"."""
    if not all(torch.equal(getattr(got, f), getattr(want, f)) for f in ("status", "accept_path", "target_argmax")):
        return "False"
    differ = got.bonus != want.bonus
    if not differ.any():
        return "True"
    # The lower token's interval ends where the other's begins (tokens between them hold no mass).
    low_is_got = (got.bonus < want.bonus)[differ]
    g, w = got.bonus_cdf[differ].double(), want.bonus_cdf[differ].double()
    gap = torch.where(low_is_got, (g[:, 0] + g[:, 1]) - w[:, 0], (w[:, 0] + w[:, 1]) - g[:, 0]).abs()
    return "rounding" if bool((gap < CDF_ROUNDING).all()) else "False"


def sampling_table(configs: list[str], g: torch.Generator, done=None, batches: tuple[int, ...] = (1, 64),
                   cuts: list[tuple[int, float]] | None = None,
                   dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> list[dict]:
    """Graphed µs per sampling verify (coins kernel included) of the torch, fused and chunked verifies,
    for each dtype, batch and cut (default: temperature, top-k 50 + top-p 0.9, top-p 0.9); ``done(rows)``
    after each row, so a run stopped at a time limit keeps the rows it finished."""
    vocab, n = 128256, 16
    rows = []
    print(f"\nsampling verify in a CUDA graph (µs per iteration, N {n}, V {vocab}, coins included; "
          "same = the torch verify's decision on the same coins; rounding = but bonus tokens whose coin fell "
          "between two float32 roundings of one CDF boundary)")
    print(f"{'dtype':>9} {'bs':>4} {'cuts':>17} {'torch':>9} {'fused':>9} {'config':>16} {'chunked':>9} "
          f"{'vs torch':>9} {'same':>8}")
    for dtype in dtypes:
        for bs in batches:
            tree, logits, seed, nonces, temps = sampling_case(bs, n, vocab, dtype, g)
            coins = sampling_coins(seed, nonces, tree.seq_lens, n)
            for k, p in cuts or sampling_cuts(TABLE_CUTS):
                def step(verify, k=k, p=p, tree=tree, logits=logits, seed=seed, nonces=nonces, temps=temps, **kw):
                    c = sampling_coins(seed, nonces, tree.seq_lens, n)
                    return verify(tree, logits, temps, k, p, coins=c, **kw)

                want = verify_sampling(tree, logits, temps, k, p, coins=coins)
                torch_us = graphed_us(lambda step=step: step(verify_sampling))
                fused_us = graphed_us(lambda step=step: step(verify_sampling_fused))
                cuts = cuts_label(k, p)
                for name in (default_config(bs * n) if c == "default" else c for c in configs):
                    got = verify_sampling_chunked(tree, logits, temps, k, p, coins, name)
                    same = decision_match(got, want)
                    us = graphed_us(lambda step=step, name=name: step(verify_sampling_chunked, config=name))
                    row = {"dtype": str(dtype).removeprefix("torch."), "bs": bs, "N": n, "V": vocab, "top_k": k,
                           "top_p": p, "cuts": cuts, "torch_graphed_us": torch_us, "fused_graphed_us": fused_us,
                           "config": name, "chunked_graphed_us": us, "same_decision": same}
                    rows.append(row)
                    if done is not None:
                        done(rows)
                    print(f"{row['dtype']:>9} {bs:>4} {cuts:>17} {torch_us:>9.1f} {fused_us:>9.1f} {name:>16} "
                          f"{us:>9.1f} {torch_us / us:>8.1f}x {same:>8}")
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    code = run_profile("tree_kernels", argv)
    if code is not None:
        return code
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", metavar="KIND", help=profile_help("tree_kernels"))
    parser.add_argument("--sampling-configs", default=None,
                        help="also the chunked sampling verify table over these launch shapes: default, sweep "
                             "or names joined by commas")
    parser.add_argument("--sampling-batches", default="1,64",
                        help="batch sizes of the sampling verify table, joined by commas")
    parser.add_argument("--sampling-cuts", default=TABLE_CUTS,
                        help=f"cuts of the sampling verify table, joined by commas, of {', '.join(CUTS)}")
    parser.add_argument("--sampling-dtypes", default="float32,bfloat16",
                        help="logits' dtypes of the sampling verify table: float32, bfloat16 or both")
    parser.add_argument("--sampling-only", action="store_true",
                        help="only the chunked sampling verify table (default launch shape unless given)")
    args = parser.parse_args(argv)
    try:
        configs = sampling_configs(args.sampling_configs or "default")
        cuts = sampling_cuts(args.sampling_cuts)
        dtypes = tuple(getattr(torch, d) for d in args.sampling_dtypes.split(","))
        if any(d not in (torch.float32, torch.bfloat16) for d in dtypes):
            raise ValueError(f"--sampling-dtypes takes float32 and bfloat16, got {args.sampling_dtypes!r}")
    except (ValueError, AttributeError) as err:
        parser.error(str(err))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "meta": provenance("tree_kernels", None, str(device)),
               "index": [], "verify": [], "sampling": []}

    if device.type == "cuda":
        warm_up_gpu()
        if args.sampling_configs or args.sampling_only:
            batches = tuple(int(b) for b in args.sampling_batches.split(","))
            results["sampling"] = sampling_table(configs, g, lambda rows: write({**results, "sampling": rows}), batches,
                                                 cuts, dtypes)
    if args.sampling_only:
        write(results)
        return 0
    # The reference is ~20 small torch ops, so its eager time is the host's launch speed, which
    # drifts within a run and between machines (250-420 µs at 256 x 64 on H200 hosts). Kernel and
    # reference are therefore timed in interleaved rounds and the ratio is taken per round.
    rounds = 5 if device.type == "cuda" else 1
    print(f"index kernel on {results['device']} (µs per call, median of {rounds} interleaved rounds; "
          "speedup = median of the per-round ratios; graphed = replayed from a CUDA graph)")
    print(f"{'bs':>5} {'N':>4} {'triton':>10} {'torch ref':>10} {'speedup':>8} {'min..max':>12} "
          f"{'triton graphed':>15} {'ref graphed':>12}")
    for bs in (1, 64, 256):
        for n in (8, 16, 64):
            mask = parents_to_mask(random_parents(bs, n, g)).to(device)
            seq_lens = torch.randint(0, 4096, (bs,), generator=g).to(device)
            refs, tris = [], []
            for _ in range(rounds):
                refs.append(bench_us(lambda m=mask, s=seq_lens: reconstruct_indices_torch(m, s), device))
                tris.append(bench_us(lambda m=mask, s=seq_lens: reconstruct_indices_triton(m, s), device)
                            if device.type == "cuda" else float("nan"))
            ratios = [r / t for r, t in zip(refs, tris)]
            graphed = [float("nan")] * 2
            if device.type == "cuda":
                graphed = [graphed_us(lambda m=mask, s=seq_lens: reconstruct_indices_triton(m, s)),
                           graphed_us(lambda m=mask, s=seq_lens: reconstruct_indices_torch(m, s))]
            row = {"bs": bs, "N": n, "triton_us": statistics.median(tris), "torch_us": statistics.median(refs),
                   "speedup": statistics.median(ratios), "speedup_rounds": ratios,
                   "triton_graphed_us": graphed[0], "torch_graphed_us": graphed[1]}
            results["index"].append(row)
            spread = f"{min(ratios):.1f}..{max(ratios):.1f}"
            print(f"{bs:>5} {n:>4} {row['triton_us']:>10.1f} {row['torch_us']:>10.1f} {row['speedup']:>7.1f}x "
                  f"{spread:>12} {graphed[0]:>15.1f} {graphed[1]:>12.1f}")

    vocab = 128256
    print(f"\nverify outside the forward (µs per iteration, V={vocab})")
    print(f"{'bs':>5} {'N':>4} {'greedy':>10} {'sampling':>10} {'greedy graphed':>15} "
          f"{'sampling graphed':>17} {'top-k 50 top-p 0.9 gr.':>21} {'fused gr.':>10} {'fused k50 p0.9 gr.':>19}")
    for bs, n in ((1, 16), (64, 16)):
        parents = random_parents(bs, n, g).to(device)
        tokens = torch.randint(0, vocab, (bs, n), generator=g).to(device)
        tree = DraftTree.from_parents(tokens, parents, torch.zeros(bs, n, device=device),
                                      torch.zeros(bs, dtype=torch.long, device=device))
        logits = torch.randn(bs, n, vocab, generator=g).to(device)
        gen = torch.Generator(device.type).manual_seed(0)
        greedy = bench_us(lambda t=tree, lg=logits: verify_greedy(t, lg), device)
        sampling = bench_us(lambda t=tree, lg=logits, gn=gen: verify_sampling(t, lg, 0.8, 0, 1.0, gn), device)
        graphed = [float("nan")] * 5
        if device.type == "cuda":
            # As the engine's sampling step runs it: the coins kernel, a [B] temperature input.
            seed = torch.zeros(1, dtype=torch.long, device=device)
            nonces = torch.arange(bs, device=device)
            temps = torch.full((bs,), 0.8, device=device)

            def engine_sampling(t=tree, lg=logits, k=0, p=1.0, seed=seed, nonces=nonces, temps=temps):
                coins = sampling_coins(seed, nonces, t.seq_lens, t.num_nodes)
                return verify_sampling(t, lg, temps, k, p, None, coins)

            bf16 = logits.bfloat16()

            def fused_sampling(t=tree, lg=bf16, k=0, p=1.0, seed=seed, nonces=nonces, temps=temps):
                coins = sampling_coins(seed, nonces, t.seq_lens, t.num_nodes)
                return verify_sampling_fused(t, lg, temps, k, p, coins)
            graphed = [graphed_us(lambda t=tree, lg=logits: verify_greedy(t, lg)), graphed_us(engine_sampling),
                       graphed_us(lambda f=engine_sampling: f(k=50, p=0.9)), graphed_us(fused_sampling),
                       graphed_us(lambda f=fused_sampling: f(k=50, p=0.9))]
        results["verify"].append({"bs": bs, "N": n, "greedy_us": greedy, "sampling_us": sampling,
                                  "greedy_graphed_us": graphed[0], "sampling_graphed_us": graphed[1],
                                  "sampling_topk_topp_graphed_us": graphed[2], "fused_graphed_us": graphed[3],
                                  "fused_topk_topp_graphed_us": graphed[4]})
        print(f"{bs:>5} {n:>4} {greedy:>10.1f} {sampling:>10.1f} {graphed[0]:>15.1f} {graphed[1]:>17.1f} "
              f"{graphed[2]:>21.1f} {graphed[3]:>10.1f} {graphed[4]:>19.1f}")

    # The drafters' selections: softmax + top-k of the head's logits per frontier node, and the
    # best k of k*k path scores (bf16 logits as the draft head writes them).
    print("\ndraft top-k (µs per call; torch = softmax then topk, as the drafters ran before)")
    print(f"{'rows':>9} {'V':>6} {'k':>3} {'softmax':>8} {'row_topk':>9} {'torch':>8} {'row_topk graphed':>17} "
          f"{'torch graphed':>14}")
    results["topk"] = []
    for lead, v, k, softmax in (((1, 4), 4096, 4, True), ((16, 4), 4096, 4, True), ((1, 1), 4096, 1, True),
                                ((1,), 16, 4, False), ((16,), 16, 4, False)):
        x = torch.randn(*lead, v, generator=g).to(device, torch.bfloat16 if softmax else torch.float32)

        def ours(x=x, k=k, softmax=softmax):
            return row_topk(x, k, softmax)

        def theirs(x=x, k=k, softmax=softmax):
            return (torch.softmax(x, -1, dtype=torch.float32) if softmax else x).topk(k, dim=-1)
        row = {"rows": list(lead), "V": v, "k": k, "softmax": softmax, "row_topk_us": bench_us(ours, device),
               "torch_us": bench_us(theirs, device), "row_topk_graphed_us": float("nan"),
               "torch_graphed_us": float("nan")}
        if device.type == "cuda":
            row["row_topk_graphed_us"], row["torch_graphed_us"] = graphed_us(ours), graphed_us(theirs)
        results["topk"].append(row)
        print(f"{'x'.join(map(str, lead)):>9} {v:>6} {k:>3} {str(softmax):>8} {row['row_topk_us']:>9.1f} "
              f"{row['torch_us']:>8.1f} {row['row_topk_graphed_us']:>17.1f} {row['torch_graphed_us']:>14.1f}")

    write(results)
    return 0


def write(results: dict) -> None:
    """$OUT/tree_kernels.json, when $OUT is set."""
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "tree_kernels.json"), "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    raise SystemExit(main())
