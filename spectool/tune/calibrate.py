"""Measuring a cost profile on the current device (``spectool bench --calibrate``).

What an iteration costs is measured as the engine runs it: per grid point the real engine
(its CUDA graphs, its one host sync per iteration, the host's launches overlapping the
device's work, the next draft started before the iteration ends) decodes synthetic
prompts, and the mean of its own ``iteration_us`` is kept (a workload's tokens/s is its tokens over
the sum of its iterations, so a mean, not a median, predicts it). Plain decoding gives the
iteration per batch size; each draft method gives it per (batch size, N) for N-gram, per
(batch size, top-k, steps) at one tree size each for EAGLE, and per (batch size, steps)
for multi-layer EAGLE. The verify step is also timed alone per (batch size, N), through
the engine's graphed step with a host sync after each call: only its growth with N is
used, to carry an iteration measured at one tree size to another.

The prompts repeat a random chunk of tokens, and every N-gram run starts from a corpus that
holds every token of the vocabulary once and nothing an earlier run left, so its trees are full
whatever the target outputs and every pass times the same work (N-gram iterations whose tree
was the roots alone are left out of its timings). The first iterations of every run (graph
captures, a first draft made inside its iteration) are left out. What one iteration costs
moves over the minutes a calibration takes (the same verify graph's GPU time between runs,
the host's sync, trie and launches), so every engine point is timed in PASSES passes over
the whole grid, one run per point and pass, and keeps the median of its passes: a slow or
fast stretch then moves one of a point's samples, not the point, and neighbouring points
are not each left in one stretch. See ``spectool.tune.cost_profile`` for the JSON it produces.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from spectool.config import EagleConfig, MultiLayerEagleConfig, NgramConfig
from spectool.tune.cost_profile import FORMAT, VERSION, CostProfile

WARM_ITERATIONS = 3  # left out of each run's timings
SEARCH = 4  # N-gram: full-tree iterations are looked for over this many times the iterations timed
PASSES = 3  # runs per engine grid point, each in its own pass over the grid; the median is kept
CHUNK = 64  # most tokens of the random chunk the synthetic prompts repeat (at least 4 times)


def _median_us(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    for _ in range(3):  # warm-up (and graph capture)
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e6)
    return float(statistics.median(times))


def _bar(total: int, enabled: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, leave=False)


def _free(dev: torch.device) -> None:
    """Let a finished engine's cache and graph pools go before the next one allocates its own."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


class _Runs:
    """Runs engines over synthetic prompts and reads back the iteration times they record."""

    def __init__(self, target, context: int, iterations: int, max_batch_size: int) -> None:
        rng = np.random.default_rng(0)
        vocab = target.config.vocab_size
        self.target, self.context, self.iterations = target, context, max(1, iterations)
        self.max_batch_size = max_batch_size
        # One chunk per request, repeated: what the prompts hold recurs, as in the text a drafter meets.
        chunk = max(1, min(CHUNK, context // 4))
        self.prompts = [(rng.integers(1, vocab, chunk).tolist() * (context // chunk + 1))[:context]
                        for _ in range(max_batch_size)]

    @staticmethod
    def room_for(draft) -> tuple[int, int]:
        """(most tokens one iteration of ``draft`` gains per request, its tree size)."""
        if draft is None:
            return 1, 1
        if isinstance(draft, NgramConfig):
            return min(draft.num_draft_tokens - 1, draft.max_trie_depth) + 1, draft.num_draft_tokens
        if isinstance(draft, MultiLayerEagleConfig):
            return draft.num_steps + 1, draft.num_steps + 1
        return draft.num_steps + 1, draft.num_draft_tokens

    def engine(self, draft):
        """An engine for ``draft`` and an output length that no request reaches before its runs end."""
        from spectool.engine import Engine

        most_tokens_per_iteration, num_nodes = self.room_for(draft)
        runs = WARM_ITERATIONS + self.iterations * (SEARCH if isinstance(draft, NgramConfig) else 1)
        room = self.target.config.max_position_embeddings - self.context - num_nodes - 8
        if room < 2:
            raise ValueError(f"--context {self.context} leaves no room for decoding within the model's "
                             f"{self.target.config.max_position_embeddings} positions")
        # Past the room a run ends early (its last iterations, with part of the batch, are not timed).
        new_tokens = min(room, (runs + 2) * most_tokens_per_iteration + 1)
        engine = Engine(self.target, draft=draft, max_batch_size=self.max_batch_size,
                        max_seq_len=self.context + new_tokens + num_nodes + 8)
        return engine, new_tokens

    def start_corpus(self, engine) -> None:
        """An N-gram engine's corpus as every run starts from it: every token of the vocabulary once.
        The trie outlives a run and learns its prompts and outputs; a later run would then draft
        from what the earlier ones left (on a target that continues the repeated prompts, whole
        trees accepted where the first run accepted nothing) and its passes would time other work."""
        corpus = engine.drafter.corpus
        corpus.reset()
        every_token = np.random.default_rng(1).permutation(self.target.config.vocab_size).tolist()
        corpus.batch_put([every_token], req_ids=None, total_lens=None)

    def point_us(self, engine, new_tokens: int, batch_size: int, full_trees: bool = False) -> float:
        """Median over PASSES runs of the engine's mean ``iteration_us`` at this batch size (see
        ``run_mean_us``), the runs one after another: one point timed as calibrate times each."""
        return float(statistics.median(self.run_mean_us(engine, new_tokens, batch_size, full_trees)
                                       for _ in range(PASSES)))

    def run_mean_us(self, engine, new_tokens: int, batch_size: int, full_trees: bool) -> float:
        """One run: the mean ``iteration_us`` of ``iterations`` of the engine's iterations at this batch
        size, after the warm ones; ``full_trees`` (N-gram): only iterations that verified a drafted tree
        (not the roots alone), looked for over at most SEARCH times as many. An N-gram run starts from
        a corpus that holds every token of the vocabulary once, in a random order (``start_corpus``):
        each token then has a continuation, so a tree is drafted whatever the target outputs (a
        random-weight target's outputs take long to repeat)."""
        if engine.method == "ngram":
            self.start_corpus(engine)
        state: dict = {}
        times: list[float] = []
        stream = engine.stream(self.prompts[:batch_size], max_new_tokens=new_tokens, record=False,
                               ignore_eos=True, _state=state)
        with contextlib.closing(stream):
            for k, event in enumerate(stream):
                cols = state["stats"].columns
                rows = len(event.accept_lengths)
                drafted = any(d[0] > 0 for d in cols["depth"][-rows:])
                if k >= WARM_ITERATIONS and rows == batch_size and (drafted or not full_trees):
                    times.append(cols["iteration_us"][-1])
                if len(times) == self.iterations or k + 1 >= WARM_ITERATIONS + SEARCH * self.iterations:
                    break
        if not times:
            why = (" verified a drafted tree (the target does not continue the repeated prompts)" if full_trees
                   else " ran with the whole batch (too few positions left past --context)")
            raise ValueError(f"calibration of {engine.method} at batch {batch_size}: no iteration{why}")
        return float(statistics.fmean(times))


@torch.no_grad()
def time_iterations(target, draft, batch_size: int, context: int = 256, iterations: int = 20) -> float:
    """µs of an iteration of ``draft`` (None: plain decoding) at ``batch_size``, timed as ``calibrate``
    times a grid point (a fresh engine over the synthetic prompts, the mean of ``iterations`` after
    the warm ones, N-gram's those that verified a drafted tree; the median of PASSES runs)."""
    runs = _Runs(target, context, iterations, batch_size)
    engine, new_tokens = runs.engine(draft)
    try:
        return runs.point_us(engine, new_tokens, batch_size, full_trees=isinstance(draft, NgramConfig))
    finally:
        del engine
        _free(torch.device(target.device))


@torch.no_grad()
def calibrate(target, eagle_path=None, multi_layer_path=None, batch_sizes: Sequence[int] = (1, 2, 4, 8),
              num_nodes: Sequence[int] = (1, 2, 4, 8, 12, 16, 24, 32), topks: Sequence[int] = (1, 2, 4, 8),
              eagle_steps: Sequence[int] = (1, 3, 5, 7), ngram: bool = True, context: int = 256,
              repeats: int = 20, progress: bool = True,
              eagle_num_nodes: Mapping[tuple[int, int], int] | None = None,
              ngram_num_nodes: Sequence[int] | None = None) -> CostProfile:
    """Measure the cost profile of ``target`` (and the given draft checkpoints) on its device.

    ``repeats`` is the number of timed calls per verify point and of timed engine iterations per
    draft point. ``eagle_num_nodes`` maps (top-k, steps) to the tree size EAGLE is run with there
    (default: the full tree, at most 16 nodes); ``ngram_num_nodes``: the N-gram tree sizes to run
    (default: those of ``num_nodes`` from 2). N-gram is always run at N 2 as well: an N-gram
    iteration in which no request matched verifies the roots alone and is predicted from the
    smallest tree's draft share, which holds the same host work (a trie get and put per request,
    the trees' copy) with the least of it spent on the tree.
    """
    from spectool.draft.tree import chain_tree
    from spectool.engine import Engine
    from spectool.model.draft_layer import load_draft

    dev = torch.device(target.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    bss, ns = sorted(set(batch_sizes)), sorted(set(num_nodes) | {1} | ({2} if ngram else set()))
    top_b = max(bss)
    gen = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    runs = _Runs(target, context, repeats, top_b)

    def rand_tokens(*shape: int) -> torch.Tensor:
        return torch.randint(1, vocab, shape, generator=gen).to(dev)

    # --- the verify step alone per (B, N): how an iteration's cost grows with its tree
    plain = Engine(target, draft=None, max_batch_size=top_b, max_seq_len=context + max(ns) + 8)
    verify = [[0.0] * len(ns) for _ in bss]
    bar = _bar(len(bss) * len(ns), progress, "verify")
    for i, b in enumerate(bss):
        slots = torch.arange(b, device=dev)
        lens = torch.full((b,), context, dtype=torch.long, device=dev)
        for j, n in enumerate(ns):
            tree = chain_tree(rand_tokens(b, n), torch.ones(b, n, device=dev), lens)
            plain._kv_len = None if plain.on_cuda else context + n

            def step(tree=tree, slots=slots, b=b, plain=plain):
                out = plain._greedy_runner(b, slots=slots, **tree.as_inputs())
                return out[7].tolist()  # the engine's one host sync per iteration

            verify[i][j] = _median_us(step, repeats, sync)
            bar.update(1)
    bar.close()
    del plain, step
    _free(dev)
    # --- every engine point (plain decoding, then each draft configuration) in interleaved passes
    ngram_sizes = sorted({2} | {n for n in (ngram_num_nodes or ns) if n >= 2}) if ngram else []
    topks, eagle_steps = sorted(set(topks)), sorted(set(eagle_steps))
    # EAGLE's tree size per [top-k][steps]: the full tree, at most 16 nodes, unless given.
    eagle_nodes = ([[(eagle_num_nodes or {}).get((k, S), min(16, 1 + k + (S - 1) * k * k)) for S in eagle_steps]
                    for k in topks] if eagle_path is not None else [])
    layers = list(range(1, load_draft(multi_layer_path, target).num_layers + 1)) if multi_layer_path else []
    configs = ([None] + [NgramConfig(num_draft_tokens=n) for n in ngram_sizes]
               + [EagleConfig(eagle_path, num_steps=S, topk=k, num_draft_tokens=n)
                  for k, sizes in zip(topks, eagle_nodes) for S, n in zip(eagle_steps, sizes)]
               + [MultiLayerEagleConfig(multi_layer_path, num_steps=S) for S in layers])
    us = iter(_interleaved(runs, configs, bss, progress))
    plain_us = next(us)
    draft: dict = {}
    if ngram:
        draft["ngram"] = {"batch_sizes": bss, "num_nodes": ngram_sizes,
                          "iteration_us": _by_batch([next(us) for _ in ngram_sizes], len(bss))}
    if eagle_path is not None:
        per_k = [[next(us) for _ in eagle_steps] for _ in topks]  # [top-k][steps][batch]
        draft["eagle"] = {"path": str(eagle_path), "batch_sizes": bss, "topk": topks, "num_steps": eagle_steps,
                          "num_nodes": eagle_nodes,
                          "iteration_us": [[[per_b[i] for per_b in per_s] for per_s in per_k] for i in range(len(bss))]}
    if multi_layer_path is not None:
        draft["multi_layer_eagle"] = {"path": str(multi_layer_path), "batch_sizes": bss, "num_steps": layers,
                                      "iteration_us": _by_batch([next(us) for _ in layers], len(bss))}
    cfg = target.config
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    data = {
        "format": FORMAT, "version": VERSION, "device": device_name,
        "dtype": str(target.dtype).replace("torch.", ""), "context": context, "iterations": runs.iterations,
        "torch": torch.__version__, "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": {"name": target.name, "hash": target.model_hash,
                  "shape": {"hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers,
                            "vocab_size": cfg.vocab_size}},
        "plain_us": {"batch_sizes": bss, "us": plain_us},
        "verify_us": {"batch_sizes": bss, "num_nodes": ns, "us": verify},
        "draft_us": draft,
    }
    return CostProfile(data, "calibration")


def _interleaved(runs: _Runs, configs: list, bss: Sequence[int], progress: bool) -> list[list[float]]:
    """Per configuration (None: plain decoding), per batch size: the median over PASSES passes of one
    run's mean iteration. Each pass times every (configuration, batch size) once, in order; the
    engines are made once and kept through the passes (their graphs captured in the first)."""
    engines = [runs.engine(c) for c in configs]
    samples = [[[] for _ in bss] for _ in configs]
    bar = _bar(PASSES * len(configs) * len(bss), progress, "engine points")
    for _ in range(PASSES):
        for (engine, new_tokens), config, per_b in zip(engines, configs, samples):
            for b, out in zip(bss, per_b):
                out.append(runs.run_mean_us(engine, new_tokens, b, full_trees=isinstance(config, NgramConfig)))
                bar.update(1)
    bar.close()
    del engines
    _free(torch.device(runs.target.device))
    return [[float(statistics.median(x)) for x in per_b] for per_b in samples]


def _by_batch(per_config: list[list[float]], num_batches: int) -> list[list[float]]:
    """[config][batch] -> [batch][config], the profile's layout."""
    return [[c[i] for c in per_config] for i in range(num_batches)]


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def calibrate_cli(argv: list[str]) -> int:
    """``spectool bench --calibrate``: measure a cost profile and write it as JSON."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="spectool bench --calibrate",
                                description="measure a cost profile for spectool tune on this device")
    p.add_argument("--model", required=True, help="target directory (Hugging Face format) or hub id")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--eagle-path", help="EAGLE draft checkpoint to time (else EAGLE is left out)")
    p.add_argument("--multi-layer-path", help="multi-layer EAGLE checkpoint to time (else left out)")
    p.add_argument("--no-ngram", action="store_true", help="leave the N-gram drafter out")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 2, 4, 8])
    p.add_argument("--num-nodes", type=_int_list, default=[1, 2, 4, 8, 12, 16, 24, 32])
    p.add_argument("--topk", type=_int_list, default=[1, 2, 4, 8])
    p.add_argument("--num-steps", type=_int_list, default=[1, 3, 5, 7], help="EAGLE steps to time")
    p.add_argument("--context", type=int, default=256, help="tokens of each synthetic prompt")
    p.add_argument("--repeats", type=int, default=20, help="timed calls / engine iterations per grid point")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args(argv)
    import spectool as st

    try:
        dtype = getattr(torch, args.dtype) if args.dtype else (
            torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
        target = st.load(args.model, device=args.device, dtype=dtype)
        profile = calibrate(target, eagle_path=args.eagle_path, multi_layer_path=args.multi_layer_path,
                            batch_sizes=args.batch_sizes, num_nodes=args.num_nodes, topks=args.topk,
                            eagle_steps=args.num_steps, ngram=not args.no_ngram, context=args.context,
                            repeats=args.repeats, progress=sys.stderr.isatty())
    except (ValueError, OSError) as e:
        print(f"spectool bench --calibrate: {e}", file=sys.stderr)
        return 2
    profile.save(args.out)
    pl = profile.data["plain_us"]
    print(f"wrote {args.out}: {profile.device}, plain decoding {pl['us'][0]:.0f} us per iteration at "
          f"B={pl['batch_sizes'][0]} .. {pl['us'][-1]:.0f} us at B={pl['batch_sizes'][-1]}")
    return 0
