"""Measuring a cost profile on the current device (``spectool bench --calibrate``).

Each part of an iteration is timed through the engine's own step functions (and their
CUDA graphs), on synthetic trees after ``context`` cached tokens: the greedy verify step
per (batch size, N); the N-gram drafter's get + upload + put per (batch size, N) over a
repetitive token stream (so trees are full); the EAGLE drafters' per-iteration extend
(and draft) graph per (batch size, top-k, steps) or (batch size, steps); and the
engine's remaining host work per iteration from plain decoding. Every timing is the
median of ``repeats`` calls, each followed by a device sync, as the engine syncs once per
iteration. See ``spectool.tune.cost_profile`` for the JSON it produces.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from spectool.config import EagleConfig, MultiLayerEagleConfig, NgramConfig
from spectool.tune.cost_profile import FORMAT, VERSION, CostProfile


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


@torch.no_grad()
def calibrate(target, eagle_path=None, multi_layer_path=None, batch_sizes: Sequence[int] = (1, 2, 4, 8),
              num_nodes: Sequence[int] = (1, 2, 4, 8, 12, 16, 24, 32), topks: Sequence[int] = (1, 2, 4, 8),
              eagle_steps: Sequence[int] = (1, 3, 5, 7), ngram: bool = True, context: int = 256,
              repeats: int = 20, progress: bool = True) -> CostProfile:
    """Measure the cost profile of ``target`` (and the given draft checkpoints) on its device."""
    from spectool.draft.tree import chain_tree
    from spectool.engine import Engine

    dev = torch.device(target.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    bss, ns = sorted(set(batch_sizes)), sorted(set(num_nodes))
    top_b = max(bss)
    seq_len = context + max(ns) + 8
    gen = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size

    def rand_tokens(*shape: int) -> torch.Tensor:
        return torch.randint(1, vocab, shape, generator=gen).to(dev)

    # --- verify step per (B, N), and the host overhead of plain decoding per B
    plain = Engine(target, draft=None, max_batch_size=top_b, max_seq_len=seq_len)
    verify = [[0.0] * len(ns) for _ in bss]
    bar = _bar(len(bss) * len(ns), progress, "verify")
    for i, b in enumerate(bss):
        slots = torch.arange(b, device=dev)
        lens = torch.full((b,), context, dtype=torch.long, device=dev)
        for j, n in enumerate(ns):
            tree = chain_tree(rand_tokens(b, n), torch.ones(b, n, device=dev), lens)
            plain._kv_len = None if plain.on_cuda else context + n

            def step(tree=tree, slots=slots, b=b):
                out = plain._greedy_runner(b, slots=slots, **tree.as_inputs())
                return out[7].tolist()  # the engine's one host sync per iteration

            verify[i][j] = _median_us(step, repeats, sync)
            bar.update(1)
    bar.close()
    overhead = []
    for b in bss:
        prompts = rand_tokens(b, context).tolist()
        plain.generate(prompts, max_new_tokens=4, record=False, ignore_eos=True)
        stats = plain.generate(prompts, max_new_tokens=max(repeats, 8), record=False, ignore_eos=True).stats
        cols = stats.columns
        phases = ("draft_us", "index_us", "verify_us", "commit_us", "trie_get_us", "trie_put_us")
        rest = [it - sum(cols[p][k] for p in phases) for k, it in enumerate(cols["iteration_us"])]
        overhead.append(max(0.0, float(statistics.median(rest))))

    draft: dict = {}
    if ngram:
        draft["ngram"] = _ngram_costs(target, bss, [n for n in ns if n >= 2], context, repeats, sync, progress)
    if eagle_path is not None:
        draft["eagle"] = _eagle_costs(target, eagle_path, bss, topks, eagle_steps, context, repeats, sync, progress)
    if multi_layer_path is not None:
        draft["multi_layer_eagle"] = _multi_layer_costs(target, multi_layer_path, bss, context, repeats, sync,
                                                        progress)
    cfg = target.config
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    data = {
        "format": FORMAT, "version": VERSION, "device": device_name,
        "dtype": str(target.dtype).replace("torch.", ""), "context": context,
        "torch": torch.__version__, "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": {"name": target.name, "hash": target.model_hash,
                  "shape": {"hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers,
                            "vocab_size": cfg.vocab_size}},
        "verify_us": {"batch_sizes": bss, "num_nodes": ns, "us": verify},
        "overhead_us": {"batch_sizes": bss, "us": overhead},
        "draft_us": draft,
    }
    return CostProfile(data, "calibration")


def _ngram_costs(target, bss, ns, context, repeats, sync, progress) -> dict:
    """The N-gram drafter's draft (trie get, tree upload) + put per iteration, on full trees."""
    from spectool.draft import Batch
    from spectool.engine import Engine
    from spectool.timing import PhaseTimer

    dev = torch.device(target.device)
    rng = np.random.default_rng(0)
    chunk = rng.integers(1, target.config.vocab_size, 64).tolist()
    us = [[0.0] * len(ns) for _ in bss]
    bar = _bar(len(bss) * len(ns), progress, "ngram")
    for j, n in enumerate(ns):
        engine = Engine(target, draft=NgramConfig(num_draft_tokens=n, max_bfs_breadth=4), max_batch_size=max(bss),
                        max_seq_len=context + 64)
        drafter = engine.drafter
        for i, b in enumerate(bss):
            drafter.corpus.reset()
            histories = [(chunk * (context // len(chunk) + 1))[:context] for _ in range(b)]
            lens = torch.full((b,), context - 1, dtype=torch.long, device=dev)
            batch = Batch(list(range(b)), torch.arange(b, device=dev), lens, torch.tensor(
                [h[-1] for h in histories], device=dev), histories, [context - 1] * b)
            drafter.on_prefill(batch, [])
            timer = PhaseTimer(dev)
            step_no = [0]

            def step(batch=batch, b=b, drafter=drafter, timer=timer, step_no=step_no):
                tree, _ = drafter.draft(batch, timer)
                k = step_no[0] % len(chunk)
                step_no[0] += 1
                accepted = [[chunk[k]] for _ in range(b)]
                drafter.on_verify(batch, tree, None, None, accepted, timer)
                for h, a in zip(batch.histories, accepted):
                    h.extend(a)
                timer.end_iteration()
                timer.micros()
                return tree

            us[i][j] = _median_us(step, repeats, sync)
            bar.update(1)
    bar.close()
    return {"batch_sizes": bss, "num_nodes": ns, "us": us}


def _verify_outputs(b: int, n: int, width: int, hidden_size: int, dtype, dev):
    """Synthetic verify results (nothing accepted) of the shapes the drafters' extend reads."""
    path = torch.full((b, width), -1, dtype=torch.long, device=dev)
    path[:, 0] = 0
    return dict(tree_tokens=torch.ones(b, n, dtype=torch.long, device=dev), path=path,
                length=torch.zeros(b, dtype=torch.long, device=dev),
                bonus=torch.ones(b, dtype=torch.long, device=dev),
                hidden=torch.zeros(b, n, hidden_size, dtype=dtype, device=dev))


def _eagle_costs(target, path, bss, topks, steps, context, repeats, sync, progress) -> dict:
    """EAGLE's extend-and-draft graph (what runs after every verify) per (B, top-k, steps)."""
    from spectool.engine import Engine

    dev = torch.device(target.device)
    topks, steps = sorted(set(topks)), sorted(set(steps))
    us = [[[0.0] * len(steps) for _ in topks] for _ in bss]
    bar = _bar(len(bss) * len(topks) * len(steps), progress, "eagle")
    for t, k in enumerate(topks):
        for s, S in enumerate(steps):
            n = min(16, 1 + k + (S - 1) * k * k)
            engine = Engine(target, draft=EagleConfig(path, num_steps=S, topk=k, num_draft_tokens=n),
                            max_batch_size=max(bss), max_seq_len=context + 64)
            d = engine.drafter
            for i, b in enumerate(bss):
                lens = torch.full((b,), context, dtype=torch.long, device=dev)
                inputs = _verify_outputs(b, n, S + 1, target.config.hidden_size, target.dtype, dev)

                def step(d=d, b=b, lens=lens, inputs=inputs, on_cuda=engine.on_cuda):
                    d._kv_len = None if on_cuda else context
                    return d._extend_runner(b, slots=torch.arange(b, device=dev), starts=lens, **inputs)

                us[i][t][s] = _median_us(step, repeats, sync)
                bar.update(1)
    bar.close()
    return {"path": str(path), "batch_sizes": bss, "topk": topks, "num_steps": steps, "us": us}


def _multi_layer_costs(target, path, bss, context, repeats, sync, progress) -> dict:
    """Multi-layer EAGLE's extend graph (every layer, the next chain) per (B, steps)."""
    from spectool.engine import Engine
    from spectool.model.draft_layer import load_draft

    dev = torch.device(target.device)
    layers = load_draft(path, target).num_layers
    steps = list(range(1, layers + 1))
    us = [[0.0] * len(steps) for _ in bss]
    bar = _bar(len(bss) * len(steps), progress, "multi_layer_eagle")
    for s, S in enumerate(steps):
        engine = Engine(target, draft=MultiLayerEagleConfig(path, num_steps=S), max_batch_size=max(bss),
                        max_seq_len=context + 64)
        d = engine.drafter
        for i, b in enumerate(bss):
            lens = torch.full((b,), context, dtype=torch.long, device=dev)
            inputs = _verify_outputs(b, S + 1, S + 1, target.config.hidden_size, target.dtype, dev)

            def step(d=d, b=b, lens=lens, inputs=inputs, S=S, on_cuda=engine.on_cuda):
                d._kv_len = None if on_cuda else context + S + 1
                return d._extend_runner(b, slots=torch.arange(b, device=dev), old_lens=lens, **inputs)

            us[i][s] = _median_us(step, repeats, sync)
            bar.update(1)
    bar.close()
    return {"path": str(path), "batch_sizes": bss, "num_steps": steps, "us": us}


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
    p.add_argument("--context", type=int, default=256, help="cached tokens before each timed tree")
    p.add_argument("--repeats", type=int, default=20)
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
    v = profile.data["verify_us"]
    print(f"wrote {args.out}: {profile.device}, verify {v['us'][0][0]:.0f} us at B=1 N=1 .. "
          f"{v['us'][-1][-1]:.0f} us at B={v['batch_sizes'][-1]} N={v['num_nodes'][-1]}")
    return 0
