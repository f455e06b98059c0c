"""Per-request cost of NgramCorpus.batch_get + batch_put, against the Python reference.

Figure: docs/BENCHMARKS.md "N-gram corpus". Time: about 2 minutes on the CPU.

Trains a byte-level BPE (vocab 4096) on Python standard-library source, puts >= 1M of its
tokens into the corpus, then decodes `bs` requests through held-out modules one token
per iteration: batch_get of the last 18 tokens (N=12, depth 18), then batch_put of the
18-token window with request ids (so only the new token is counted). Puts run on the
worker thread; `synchronize()` after each put keeps them inside the timing. Pinned to
one core. The pure-Python reference (tests/ngram_reference.py) runs the same loop on a
smaller trie (it needs ~0.5 KB per node), in the same run, for the ratio.

    python benchmarks/ngram_corpus.py [--tokens 1000000] [--iters 200] [--capacity 10000000] [--match both]

1M tokens of source need more than the default capacity (10M nodes; a token adds up to
18 n-grams), so eviction runs in every timed put; pass e.g. --capacity 20000000 to time
a trie that never evicts. Native timings are the median of --repeats runs.

``--match both`` (the default) builds a BFS and a PROB corpus of the same tokens (about 1 GB
together) and runs each timed stretch on the two in turn, so drift in the machine's speed weighs on
both alike; it prints PROB's get and get+put over BFS's per batch size (the median of the repeats'
ratios).

Prints a table and writes ngram_corpus.json to $OUT if set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ngram_reference import ReferenceCorpus  # noqa: E402

from spectool.native import NgramCorpus  # noqa: E402

DEPTH, N, WINDOW = 18, 12, 18
CHUNK = 4096  # tokens per window when the training tokens are put


def stdlib_texts(max_bytes: int) -> list[str]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(lib.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=4096, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def load_tokens(n_train: int) -> tuple[np.ndarray, np.ndarray]:
    """The benchmark's tokens: ``n_train`` BPE tokens of standard-library source to put, and at
    least 200,000 held-out tokens after them to decode."""
    t0 = time.perf_counter()
    texts = stdlib_texts(max_bytes=int(n_train * 4.5) + 2_000_000)
    tok = train_tokenizer(texts)
    ids = np.concatenate([np.asarray(e.ids, np.int32) for e in tok.encode_batch(texts)])
    assert len(ids) >= n_train + 200_000, f"only {len(ids)} tokens of stdlib source"
    print(f"tokenizer + {len(ids)} tokens in {time.perf_counter() - t0:.1f}s")
    return ids[:n_train], ids[n_train:]


def decode_loop(corpus, streams: list[np.ndarray], start: int, iters: int,
                sync: bool, convert=None) -> tuple[float, float, float, float]:
    """Wall seconds in get, in put (+synchronize), process CPU seconds (all threads) of the loop,
    and CPU seconds of the calling thread in get (what a busy machine's other load leaves alone).

    The batches are cut from the streams before the clocks start, so neither clock
    counts the loop's own array building (about 1 µs per request at bs=64). ``convert``, if
    given, turns each batch's (tails, lens, windows, put lens) into what ``corpus`` takes, also
    before the clocks start.
    """
    bs = len(streams)
    ids = list(range(bs))
    batches = []
    for it in range(iters):
        total = start + it
        tails = np.stack([s[total - WINDOW:total] for s in streams])
        windows = np.stack([s[total + 1 - WINDOW:total + 1] for s in streams])  # + the "accepted" token
        batch = (tails, [total] * bs, windows, [total + 1] * bs)
        batches.append(batch if convert is None else convert(*batch))
    t_get = t_put = c_get = 0.0
    cpu0 = time.process_time()
    for tails, lens, windows, put_lens in batches:
        c0 = time.thread_time()
        t0 = time.perf_counter()
        corpus.batch_get(ids, tails, lens)
        t1 = time.perf_counter()
        c_get += time.thread_time() - c0
        corpus.batch_put(windows, ids, put_lens)
        if sync:
            corpus.synchronize()
        t2 = time.perf_counter()
        t_get += t1 - t0
        t_put += t2 - t1
    return t_get, t_put, time.process_time() - cpu0, c_get


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1_000_000, help="tokens put before timing")
    ap.add_argument("--ref-tokens", type=int, default=50_000, help="tokens put into the Python reference")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--match", default="both", choices=["bfs", "prob", "both"])
    ap.add_argument("--repeats", type=int, default=5, help="native timing runs per batch size (median)")
    ap.add_argument("--capacity", type=int, default=10_000_000, help="trie capacity in nodes")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

    train, held = load_tokens(args.tokens)

    matches = ("bfs", "prob") if args.match == "both" else (args.match,)
    corpora = {m: build(m, train, args) for m in matches}
    runs = time_native({m: c for m, (c, _) in corpora.items()}, held, args)
    results = {m: summarize(m, corpora[m][0], corpora[m][1], runs[m], train, held, args) for m in matches}
    out: dict = results[matches[0]] if len(matches) == 1 else {"matches": results}
    if len(matches) == 2:
        print("\nPROB over BFS per request (same tokens, streams and run, the two in turn on each stretch: "
              "median of the repeats' ratios; get cpu = the calling thread's CPU time in get)")
        print(f"{'bs':>4} {'get':>6} {'get cpu':>8} {'get+put':>8}")
        ratios = []
        for i, bs in enumerate(BATCHES):
            pairs = list(zip(runs["bfs"][i], runs["prob"][i]))
            per = {"get": [p[0] / b[0] for b, p in pairs], "get_cpu": [p[3] / b[3] for b, p in pairs],
                   "total": [(p[0] + p[1]) / (b[0] + b[1]) for b, p in pairs]}
            ratio = {"bs": bs, **{k: float(np.median(v)) for k, v in per.items()}, "get_runs": per["get"]}
            ratios.append(ratio)
            print(f"{bs:>4} {ratio['get']:>5.2f}x {ratio['get_cpu']:>7.2f}x {ratio['total']:>7.2f}x")
        out["prob_over_bfs"] = ratios
    from speculative import provenance  # after the timing: it imports torch

    out["meta"] = provenance("ngram_corpus", None, "cpu")
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "ngram_corpus.json"
        path.write_text(json.dumps(out, indent=2))
        print(f"wrote {path}")


BATCHES = (1, 8, 64)


def build(match: str, train: np.ndarray, args: argparse.Namespace) -> tuple[NgramCorpus, dict]:
    """A corpus of ``train`` with this match type, and how its build went."""
    corpus = NgramCorpus(max_trie_depth=DEPTH, num_draft_tokens=N, match=match, capacity=args.capacity)
    t0 = time.perf_counter()
    corpus.batch_put([train[i:i + CHUNK] for i in range(0, len(train), CHUNK)])
    corpus.synchronize()
    stats = corpus.stats()
    info = dict(build_s=time.perf_counter() - t0, stats=stats)
    print(f"{match}: put {len(train)} tokens in {info['build_s']:.1f}s: {stats['nodes']} nodes (capacity "
          f"{args.capacity}, {stats['evictions']} evictions), {stats['bytes_per_node']:.0f} bytes/node")
    return corpus, info


def time_native(corpora: dict[str, NgramCorpus], held: np.ndarray, args: argparse.Namespace) -> dict:
    """The decode loop at each batch size, --repeats times on fresh stretches of held-out source
    (each request its own unseen stretch); every corpus runs each stretch in turn, in an order that
    reverses from one repeat to the next, so a change of the machine's speed during the run weighs
    on all of them alike.
    Returns, per match and batch size, the (get, put, cpu, get cpu) seconds of each repeat."""
    runs = {m: [] for m in corpora}
    order = list(corpora)
    stretch = args.iters + WINDOW + 1
    next_stretch = 0
    for bs in BATCHES:
        for m in order:
            runs[m].append([])
        for k in range(args.repeats):
            streams = [held[(next_stretch + r) * stretch:(next_stretch + r + 1) * stretch] for r in range(bs)]
            next_stretch += bs
            for m in order if k % 2 == 0 else order[::-1]:
                corpora[m].erase_match_state(list(range(bs)))
                runs[m][-1].append(decode_loop(corpora[m], streams, WINDOW + 1, args.iters, sync=True))
    return runs


def summarize(match: str, corpus: NgramCorpus, info: dict, runs: list, train: np.ndarray, held: np.ndarray,
              args: argparse.Namespace) -> dict:
    """The medians of the native runs against the pure-Python reference's loop (on the first stretches
    of each batch size, for fewer iterations: it is far slower)."""
    stats = info["stats"]
    ref = ReferenceCorpus(max_trie_depth=DEPTH, num_draft_tokens=N, match=match)
    ref.batch_put([train[i:i + CHUNK] for i in range(0, args.ref_tokens, CHUNK)])
    rows = []
    stretch = args.iters + WINDOW + 1
    for bs, bs_runs in zip(BATCHES, runs):
        g, p, cpu, gcpu = (float(np.median(x)) for x in zip(*bs_runs))
        n = args.iters * bs
        ref_iters = max(3, args.iters // bs // 4)
        streams = [held[r * stretch:(r + 1) * stretch] for r in range(bs)]
        rg, rp, rcpu, _ = decode_loop(ref, streams, WINDOW + 1, ref_iters, sync=False)
        rn = ref_iters * bs
        rows.append(dict(bs=bs, get_us=g / n * 1e6, get_cpu_us=gcpu / n * 1e6, put_us=p / n * 1e6,
                         total_us=(g + p) / n * 1e6,
                         cpu_us=cpu / n * 1e6, cpu_us_runs=[r[2] / n * 1e6 for r in bs_runs],
                         ref_total_us=(rg + rp) / rn * 1e6, ref_cpu_us=rcpu / rn * 1e6,
                         speedup=((rg + rp) / rn) / ((g + p) / n), cpu_speedup=(rcpu / rn) / (cpu / n)))
    after = corpus.stats()  # PROB's rankings of wide nodes are made by the gets
    timed_evictions = after["evictions"] - stats["evictions"]

    print(f"\nNgramCorpus ({match}, N={N}, depth {DEPTH}, {len(train)} tokens put, capacity "
          f"{args.capacity}, {timed_evictions} evictions while timed, {after['bytes_per_node']:.1f} bytes/node "
          "after), µs per request, one core")
    print("(wall: get, put+synchronize, both; cpu: process CPU time of get+put, all threads; "
          "native: median of runs)")
    print(f"{'bs':>4} {'get':>8} {'get cpu':>8} {'put+sync':>9} {'get+put':>8} {'cpu':>8} {'ref wall':>9} "
          f"{'ref cpu':>8} {'speedup':>8} {'cpu spd':>8}")
    for r in rows:
        print(f"{r['bs']:>4} {r['get_us']:>8.2f} {r['get_cpu_us']:>8.2f} {r['put_us']:>9.2f} {r['total_us']:>8.2f} "
              f"{r['cpu_us']:>8.2f} {r['ref_total_us']:>9.1f} {r['ref_cpu_us']:>8.1f} "
              f"{r['speedup']:>7.1f}x {r['cpu_speedup']:>7.1f}x")
    return dict(match=match, tokens=len(train), capacity=args.capacity, nodes=stats["nodes"],
                evictions=stats["evictions"], timed_evictions=timed_evictions,
                bytes_per_node=stats["bytes_per_node"], bytes_per_node_after=after["bytes_per_node"],
                build_s=info["build_s"], rows=rows)


if __name__ == "__main__":
    main()
