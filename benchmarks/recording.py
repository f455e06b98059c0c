"""What recording costs: the recorder alone, then the engine's tokens/s with record on vs off.

Figure: docs/BENCHMARKS.md "Recording". Time: 1 to 3 minutes on an H200.

    python benchmarks/recording.py [--device cuda] [--quick] [--part recorder|host|engine|both]
    python benchmarks/recording.py --device cuda --quick --part engine --shape 8B   # or 1B
    python benchmarks/recording.py --device cuda --part engine --shape 8B --batches 1,64

(a) Recorder microbenchmark. For bs 1 and 16 and tree size N 16 and 64 it records
synthetic iterations shaped like the engine's (every trace field, mask [B,N,N]
bool, target top-5, EAGLE step top-k; on --device cuda the tensors live on the
GPU) and reports, per iteration:
- record_us: median time of `Recorder.record_batch` on the calling (engine) thread;
- writer_us: CPU time of the background writer thread (Linux thread clock);
- bytes: file bytes per iteration (whole batch) and per record (one request).
(h) Host cost (``--part host``, bs 1, each method, demo model): what recording adds to the
engine's thread per iteration, as medians over a greedy run: record_us, the recorder's calls
(`record_batch` and `record_timings`); step_extra_us, the greedy step with record=True minus
the same step without (re-run on the run's last inputs; on CUDA with a sync each, so it is the
record graph's extra GPU time).
(b) Engine. tokens/s of `Engine.generate` on the bundled demo model with
record=True vs record=False, at bs 1 and 16, for each method (none, ngram, eagle,
multi_layer_eagle); on and off runs alternate ``--repeats`` times (which goes first
alternates too) and the table shows the medians and their ratio (on / off, 1.0 = free).
Every run does the same work: one engine per cell, warmed up once (``Engine.warmup``), whose
N-gram trie is emptied before each run (else each run would draft from the prompts and outputs
of the runs before it); a cell whose runs captured a graph or ran a step eagerly is refused. ``--shape 8B|1B`` runs the
engine part on a target of one of decode.py's shapes (Llama-3-8B, Llama-3.2-1B, the 107M
trained target's) with random weights (bf16 on CUDA) instead, and random draft layers of that
shape, prompts of random token ids; there a fixed per-iteration recording cost weighs as much
as it would on a real model.
Prints tables and writes recording.json (recording_<shape>.json) to $OUT when it is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from decode import SHAPES, random_drafts, random_target
from speculative import draft_config, provenance, refused, region_faults, timed_region

from spectool.trace.recorder import Recorder

METHODS = ("none", "ngram", "eagle", "multi_layer_eagle")


def synthetic_fields(batch: int, n: int, device: str, gen: torch.Generator) -> dict:
    """One iteration's record_batch fields for random valid trees (engine dtypes)."""
    parents = torch.full((batch, n), -1)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (batch,), generator=gen)
    mask = torch.zeros(batch, n, n, dtype=torch.bool)
    mask[:, torch.arange(n), torch.arange(n)] = True
    rows = torch.arange(batch)
    for i in range(1, n):
        mask[rows, i] |= mask[rows, parents[:, i]]
    depth = mask.sum(-1) - 1

    def ids(*shape):
        return torch.randint(0, 32000, shape, generator=gen)

    f = {
        "request_id": torch.arange(batch, dtype=torch.int32), "seq_len": torch.full((batch,), 500),
        "num_nodes": torch.full((batch,), n, dtype=torch.int32), "tokens": ids(batch, n), "parents": parents,
        "depth": depth, "scores": torch.rand(batch, n, generator=gen),
        "valid": torch.ones(batch, n, dtype=torch.bool), "mask": mask, "positions": 500 + depth,
        "retrieve_index": ids(batch, n), "retrieve_next_token": ids(batch, n),
        "retrieve_next_sibling": ids(batch, n), "target_argmax": ids(batch, n),
        "target_argmax_prob": torch.rand(batch, n), "target_topk_tokens": ids(batch, n, 5),
        "target_topk_probs": torch.rand(batch, n, 5), "step_topk_tokens": ids(batch, 5, 4),
        "step_topk_probs": torch.rand(batch, 5, 4), "bonus_token": ids(batch),
        "status": torch.randint(0, 3, (batch, n), dtype=torch.int8),
        "accept_path": torch.cat([torch.zeros(batch, 1, dtype=torch.long), torch.full((batch, 4), -1)], 1),
        "accept_length": torch.zeros(batch, dtype=torch.long),
    }
    return {k: v.to(device) for k, v in f.items()}


def _thread_cpu_s(thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def measure_recorder(batch: int, n: int, iterations: int, device: str) -> dict:
    fields = synthetic_fields(batch, n, device, torch.Generator().manual_seed(0))
    timings = {f"{p}_us": 10.0 for p in ("draft", "index", "verify", "commit", "iteration")}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.sptrace"
        rec = Recorder(path, {"method": "eagle", "benchmark": True}, flush_every=64)
        record_s = []
        for it in range(iterations):
            if device == "cuda":
                fields["tokens"].add_(1)  # GPU work in flight ahead of the copies, as in the engine
            t = time.perf_counter()
            rec.record_batch({"iteration": it, "method": "eagle", "temperature": 0.0, **timings, **fields})
            record_s.append(time.perf_counter() - t)
        rec._queue.join()  # everything received and converted up to the last full flush
        writer_s = _thread_cpu_s(rec._thread)
        rec.close()
        size = path.stat().st_size
    return {"batch": batch, "N": n, "device": device, "iterations": iterations,
            "record_us": statistics.median(record_s) * 1e6, "record_mean_us": statistics.fmean(record_s) * 1e6,
            "writer_us": writer_s / iterations * 1e6,
            "bytes_per_iteration": size / iterations, "bytes_per_record": size / (iterations * batch)}


def _timed(fn, samples: list[float]):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        samples.append(time.perf_counter() - t)
        return out
    return wrapper


def _keeping_inputs(runner, last: dict):
    def wrapper(batch_size, **tensors):
        last.update(tensors, batch_size=batch_size)
        return runner(batch_size, **tensors)
    wrapper.stats = runner.stats  # the engine sums its runners' stats
    return wrapper


def _step_us(runner, inputs: dict, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    runner(**inputs)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def measure_host(device: str, new_tokens: int, steps: int) -> list[dict]:
    """Per method at bs 1: the recorder's calls and the record step's extra cost, µs per iteration."""
    import spectool as st
    from spectool.prompts import load_prompts

    demo = Path(st.demo_model())
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target = st.load(str(demo / "target"), device=device, dtype=dtype)
    prompt = load_prompts(demo / "prompts.jsonl")[0]
    results = []
    for method in METHODS:
        engine = st.Engine(target, draft=_draft_config(method, demo), max_batch_size=1, max_seq_len=2048)
        engine.warmup(sampling=False)  # captures, JIT
        calls: dict[str, list[float]] = {}
        last: dict = {}
        record_runner = engine._greedy_record_runner

        engine._greedy_record_runner = _keeping_inputs(record_runner, last)
        originals = {name: getattr(Recorder, name) for name in ("record_batch", "record_timings")
                     if hasattr(Recorder, name)}
        for name, fn in originals.items():
            setattr(Recorder, name, _timed(fn, calls.setdefault(name, [])))
        try:
            res = engine.generate([prompt], max_new_tokens=new_tokens, ignore_eos=True)
        finally:
            for name, fn in originals.items():
                setattr(Recorder, name, fn)
            engine._greedy_record_runner = record_runner
        iterations = len(calls["record_batch"])
        record_us = sum(statistics.median(v) for v in calls.values()) * 1e6
        with torch.inference_mode():  # the engine's step runs under no_grad; re-running it is idempotent
            times = {False: [], True: []}
            for _ in range(steps):
                for record, runner in ((False, engine._greedy_runner), (True, record_runner)):
                    times[record].append(_step_us(runner, last, device))
        plain, with_record = (statistics.median(times[r]) * 1e6 for r in (False, True))
        row = {"method": method, "device": device, "iterations": iterations,
               "record_us": record_us, **{f"{k}_us": statistics.median(v) * 1e6 for k, v in calls.items()},
               "step_us": plain, "step_record_us": with_record, "step_extra_us": with_record - plain,
               "tokens_per_s": res.stats.tokens_per_s}
        results.append(row)
        print(f"{method:>18} {iterations:>5} {record_us:>10.1f} {plain:>9.1f} {with_record - plain:>14.1f}",
              flush=True)
    return results


def _draft_config(method: str, demo: Path):
    """The draft of ``method`` (this benchmark says "none" where speculative.py says "plain")."""
    return draft_config("plain" if method == "none" else method, demo)


def measure_engine(device: str, batches: tuple[int, ...], repeats: int, max_new_tokens: int,
                   shape: str = "demo") -> list[dict]:
    import spectool as st
    from spectool.prompts import load_prompts

    demo = Path(st.demo_model())
    if shape == "demo":
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        target = st.load(str(demo / "target"), device=device, dtype=dtype)
        prompts, methods = load_prompts(demo / "prompts.jsonl"), METHODS
    else:
        prompt_len = 256
        target = random_target(shape, device, prompt_len + max_new_tokens + 64)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, target.config.vocab_size, (prompt_len,), generator=gen).tolist()
                   for _ in range(max(batches))]
        methods = METHODS
        # Random draft layers of the target's shape: acceptance means nothing, but every graph has
        # its real size, so what recording adds per iteration is what a trained draft pays.
        drafts_dir = tempfile.TemporaryDirectory()  # removed when this function returns
        demo = random_drafts(target, Path(drafts_dir.name))
    results = []
    for method in methods:
        for bs in batches:
            row = {"method": method, "batch": bs, "device": device, "shape": shape}
            try:
                engine = st.Engine(target, draft=_draft_config(method, demo), max_batch_size=bs,
                                   max_seq_len=1024 if shape != "demo" else 2048)
                engine.warmup(sampling=False)
                batch_prompts = [prompts[i % len(prompts)] for i in range(bs)]
                speed = {True: [], False: []}
                before = None
                for rep in range(repeats + 1):  # run 0 warms up the rest: Triton JIT of prefill shapes, allocator
                    if rep == 1:
                        before = timed_region(engine)
                    for record in (False, True) if rep % 2 else (True, False):
                        _empty_trie(engine)
                        res = engine.generate(batch_prompts, max_new_tokens=max_new_tokens, record=record,
                                              ignore_eos=True)
                        if rep:
                            speed[record].append(res.stats.tokens_per_s)
                row.update(region_faults(engine, before))
                row["refused"] = refused(row, device)
                if not row["refused"]:
                    off, on = statistics.median(speed[False]), statistics.median(speed[True])
                    row.update(tokens_per_s_off=off, tokens_per_s_on=on, ratio=on / off,
                               runs_off=speed[False], runs_on=speed[True])
            except Exception as e:  # one broken method must not hide the others' figures
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            results.append(row)
            print(_engine_line(row), flush=True)
    return results


def _empty_trie(engine) -> None:
    """Start a run from an empty N-gram trie, as the first run did (other drafters keep no state
    across calls: their per-slot tables are rewritten at prefill)."""
    corpus = getattr(engine.drafter, "corpus", None)
    if corpus is not None:
        corpus.reset()


def _engine_line(r: dict) -> str:
    if "error" in r:
        return f"{r['method']:>18} {r['batch']:>5}  error: {r['error']}"
    if r.get("refused"):
        return f"{r['method']:>18} {r['batch']:>5}  refused: {r['refused']}"
    return (f"{r['method']:>18} {r['batch']:>5} {r['tokens_per_s_off']:>10.1f} {r['tokens_per_s_on']:>10.1f} "
            f"{r['ratio']:>6.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--part", choices=("recorder", "host", "engine", "both"), default="both")
    parser.add_argument("--iterations", type=int, default=None, help="recorder iterations per shape")
    parser.add_argument("--repeats", type=int, default=None, help="on/off engine run pairs")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="fewer iterations and runs (<= 90 s on the GPU)")
    parser.add_argument("--shape", choices=("demo", *SHAPES), default="demo",
                        help="engine part's target: the demo model, or random weights of a decode.py shape")
    parser.add_argument("--batches", default="1,16", help="batch sizes, comma-separated (e.g. 1,64)")
    args = parser.parse_args()
    batches = tuple(int(b) for b in args.batches.split(","))
    cpu = args.device == "cpu"
    iterations = args.iterations or (128 if args.quick else 512)
    repeats = args.repeats or (3 if args.quick else 5)
    max_new = args.max_new_tokens or (16 if cpu else 64 if args.quick else 256)
    out: dict = {"meta": {"torch": torch.__version__, **provenance("recording", None, args.device)},
                 "device": args.device, "iterations": iterations, "repeats": repeats, "max_new_tokens": max_new,
                 "shape": args.shape}
    if args.part in ("recorder", "both"):
        out["recorder"] = [measure_recorder(b, n, iterations, args.device) for b in batches for n in (16, 64)]
        print(f"{'batch':>5} {'N':>3} {'record_us':>10} {'writer_us':>10} {'bytes/iter':>11} {'bytes/record':>12}")
        for r in out["recorder"]:
            print(f"{r['batch']:>5} {r['N']:>3} {r['record_us']:>10.1f} {r['writer_us']:>10.1f} "
                  f"{r['bytes_per_iteration']:>11.0f} {r['bytes_per_record']:>12.0f}")
    if args.part == "host":
        print(f"{'method':>18} {'iters':>5} {'record_us':>10} {'step_us':>9} {'step_extra_us':>14}")
        out["host"] = measure_host(args.device, 128 if args.quick else 512, iterations)
    if args.part in ("engine", "both"):
        print(f"{'method':>18} {'batch':>5} {'tok/s off':>10} {'tok/s on':>10} {'on/off':>6}")
        out["engine"] = measure_engine(args.device, batches, repeats, max_new, args.shape)
    if os.environ.get("OUT"):
        name = "recording.json" if args.shape == "demo" else f"recording_{args.shape}.json"
        Path(os.environ["OUT"], name).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
