"""A trace of a real workload's size: write 1,000,000 records, then time what a user does with it.

Figure: docs/BENCHMARKS.md "Traces of a million records". Time: about 15 minutes on the CPU.

    python benchmarks/trace_scale.py [--records 1000000] [--batch 64] [--nodes 16] [--keep FILE]

Writes a synthetic trace through the real Recorder straight to the file (batch ``--batch`` requests, EAGLE-like
trees of ``--nodes`` nodes: a top-k tree grown by path score, greedy decisions consistent
with the target's argmax, continuity of seq_len / root token / outputs per request, target
top-5, per-step top-k, phase timings), so `spectool check` passes on it; the recording's peak
resident set is reported (the recorder lets written rows go). Then, each in a fresh process so
resident memory is its own:
- open: `Trace.load` wall time, resident set (VmRSS) after it, and where its index came from
  (the file's trailer, or its batches for a file without one);
- summary: `trace.summary()` wall time and peak RSS;
- iteration: `trace.iteration(i, request)` for 50 random records (median and max ms);
- request: `trace.request_steps(r)` for 10 random requests (median ms);
- aggregates: `trace.aggregates()` (the views' downsampled plots) wall time;
- sql: one `trace.sql` query over accept lengths (when duckdb is installed);
- cli: `spectool summary`, `export-perfetto` and `report` (its default: the first requests, with
  aggregate plots over all) wall time and peak RSS;
- check: `spectool check` wall time and peak RSS (streaming).
The machine's load average is recorded before and after. Prints a table and writes
trace_scale.json to --out (default $OUT) when given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

VOCAB = 32000
TOPK = 5


def _tree(rng: np.random.Generator, b: int, n: int, topk: int = 4) -> np.ndarray:
    """[b, n] parents of EAGLE-like trees: each node hangs under one of the ``topk`` most recent
    frontier nodes, so trees are bushy near the root and thin out with depth."""
    parents = np.full((b, n), -1, np.int64)
    for i in range(1, n):
        lo = np.maximum(0, i - topk - (i // topk))
        parents[:, i] = lo + (rng.random(b) * (i - lo)).astype(np.int64)
    return parents


def _indices(parents: np.ndarray, seq_len: np.ndarray) -> dict[str, np.ndarray]:
    b, n = parents.shape
    rows = np.arange(b)
    depth = np.zeros((b, n), np.int64)
    mask = np.zeros((b, n, n), bool)
    mask[:, np.arange(n), np.arange(n)] = True
    for i in range(1, n):
        depth[:, i] = depth[rows, parents[:, i]] + 1
        mask[:, i] |= mask[rows, parents[:, i]]
    next_token = np.full((b, n), -1, np.int64)
    next_sibling = np.full((b, n), -1, np.int64)
    for i in range(n - 1, 0, -1):  # walking down from the last node leaves the smallest child / next sibling
        p = parents[:, i]
        next_token[rows, p] = i
    last_child = np.full((b, n), -1, np.int64)
    for i in range(1, n):
        p = parents[:, i]
        prev = last_child[rows, p]
        has = prev >= 0
        next_sibling[rows[has], prev[has]] = i
        last_child[rows, p] = i
    return {"depth": depth, "mask": mask, "positions": seq_len[:, None] + depth,
            "retrieve_index": rows[:, None] * n + np.arange(n)[None, :],
            "retrieve_next_token": next_token, "retrieve_next_sibling": next_sibling}


def synthesize(path: Path, records: int, batch: int, n: int, seed: int = 0) -> int:
    """Record ``records`` step rows (whole iterations of ``batch`` requests) into ``path``."""
    from tqdm import tqdm

    from spectool.trace.recorder import Recorder

    rng = np.random.default_rng(seed)
    rec = Recorder(path, {"method": "eagle", "draft": {"method": "eagle", "num_draft_tokens": n},
                          "synthetic": True}, None, flush_every=1024)
    prompt_len = 200
    max_new = 400
    next_id = 0
    slots: list[dict] = []

    def admit() -> dict:
        nonlocal next_id
        prompt = rng.integers(VOCAB // 2, VOCAB, prompt_len).tolist()
        first = int(rng.integers(VOCAB // 2, VOCAB))
        req = {"id": next_id, "prompt": prompt, "out": [first], "seq_len": prompt_len, "root": first}
        next_id += 1
        return req

    slots = [admit() for _ in range(batch)]
    iterations = -(-records // batch)
    for it in tqdm(range(iterations), desc="recording", unit="it", mininterval=2):
        b = len(slots)
        seq_len = np.array([s["seq_len"] for s in slots])
        parents = _tree(rng, b, n)
        f = _indices(parents, seq_len)
        tokens = rng.integers(0, VOCAB // 2, (b, n))
        tokens[:, 0] = [s["root"] for s in slots]
        # Accept length: geometric, walked down the tree along a node of that depth.
        want = np.minimum(rng.geometric(0.35, b) - 1, f["depth"].max(1))
        target = np.argmax(f["depth"] == want[:, None], axis=1)
        on_path = f["mask"][np.arange(b), target]  # the ancestors of the target node
        status = np.where(on_path, 1, 0).astype(np.int8)
        rows = np.arange(b)[:, None]
        visited_parent = on_path[rows, np.maximum(parents, 0)] & (parents >= 0)
        # Rejected: the visited parent's children before the one it took (all of them when it took none);
        # the siblings after the taken child are not visited (the verifier's rule).
        taken = np.full((b, n), n)
        r, j = np.nonzero(on_path & (parents >= 0))
        taken[r, parents[r, j]] = j
        before_taken = np.arange(n)[None, :] < taken[rows, np.maximum(parents, 0)]
        status[visited_parent & ~on_path & before_taken] = 2
        argmax = rng.integers(0, VOCAB // 2, (b, n))
        bonus = rng.integers(VOCAB // 2, VOCAB, b)
        paths = []
        for r in range(b):
            path = np.flatnonzero(on_path[r])  # topological order = root first
            argmax[r, path[:-1]] = tokens[r, path[1:]]
            argmax[r, path[-1]] = bonus[r]
            paths.append(path)
        width = f["depth"].max() + 1
        accept_path = np.full((b, width), -1, np.int64)
        for r, path in enumerate(paths):
            accept_path[r, :len(path)] = path
        top_tokens = rng.integers(0, VOCAB, (b, n, TOPK))
        top_tokens[:, :, 0] = argmax
        top_probs = -np.sort(-rng.dirichlet(np.ones(TOPK * 4), (b, n))[:, :, :TOPK], axis=-1)
        scores = np.cumprod(rng.uniform(0.3, 1.0, (b, n)), axis=1)
        scores[:, 0] = 1.0
        rec.record_batch({
            "iteration": it, "request_id": np.array([s["id"] for s in slots], np.int32), "method": "eagle",
            "seq_len": seq_len, "num_nodes": n, "tokens": tokens, "parents": parents, "scores": scores,
            "valid": np.ones((b, n), bool), "target_topk_tokens": top_tokens, "target_topk_probs": top_probs,
            "status": status, "accept_path": accept_path, "bonus_token": bonus, "temperature": 0.0,
            "step_topk_tokens": rng.integers(0, VOCAB, (b, 5, 4)), "step_topk_probs": rng.random((b, 5, 4)),
            **f})
        verify = float(rng.normal(9000, 400))
        rec.record_timings({"draft_us": float(rng.normal(2500, 100)), "index_us": 40.0, "verify_us": verify,
                            "commit_us": 120.0, "iteration_us": verify + 3000.0})
        for r, s in enumerate(slots):
            gained = tokens[r, paths[r][1:]].tolist() + [int(bonus[r])]
            s["out"] += gained
            s["seq_len"] += len(gained)
            s["root"] = int(bonus[r])
            if len(s["out"]) >= max_new:
                rec.record_request(s["id"], s["prompt"], s["out"], "length")
                slots[r] = admit()
    for s in slots:
        rec.record_request(s["id"], s["prompt"], s["out"], "aborted")
    rec.close()
    return iterations * batch


_MEASURE = r"""
import json, sys, time, numpy as np
sys.path.insert(0, {root!r})
def rss_mb(peak=False):
    key = "VmHWM:" if peak else "VmRSS:"
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
from spectool.trace.reader import Trace
what = {what!r}
t0 = time.perf_counter()
trace = Trace.load({path!r})
out = {{"open_s": time.perf_counter() - t0, "open_rss_mb": rss_mb(), "records": len(trace),
       "indexed_from": trace._file.indexed_from}}
rng = np.random.default_rng(1)
its, reqs = trace.keys()
if what == "summary":
    t0 = time.perf_counter(); s = trace.summary()
    out.update(summary_s=time.perf_counter() - t0, summary_peak_rss_mb=rss_mb(True),
               mean_accept_length=s["mean_accept_length"])
elif what == "access":
    times = []
    for row in rng.integers(0, len(its), 50):
        t0 = time.perf_counter(); trace.iteration(int(its[row]), int(reqs[row])); times.append(time.perf_counter() - t0)
    out.update(iteration_ms_median=1e3 * float(np.median(times)), iteration_ms_max=1e3 * max(times))
    times = []
    for r in rng.choice(np.unique(reqs), 10):
        t0 = time.perf_counter(); trace.request_steps(int(r)); times.append(time.perf_counter() - t0)
    out.update(request_ms_median=1e3 * float(np.median(times)), access_peak_rss_mb=rss_mb(True))
    t0 = time.perf_counter(); trace.aggregates(); out["aggregates_s"] = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        trace.sql("select accept_length, count(*) from steps group by 1 order by 1")
        out["sql_s"] = time.perf_counter() - t0
    except ImportError:
        pass
print(json.dumps(out))
"""


def measure(path: Path, what: str) -> dict:
    code = _MEASURE.format(root=str(Path(__file__).resolve().parents[1]), path=str(path), what=what)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def timed_cli(path: Path, command: str, *extra: str) -> dict:
    """Wall time, exit code and peak RSS of one `spectool COMMAND TRACE` in a fresh process."""
    code = (f"import sys, resource; from spectool.cli import {command.replace('-', '_')} as cmd; "
            "rc = cmd.main(sys.argv[1:]); "
            "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024); sys.exit(rc)")
    key = "cli_" + command.replace("-", "_")  # apart from the API's figures (summary_s is trace.summary())
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, str(path), *extra], capture_output=True, text=True)
    peak = next((float(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("PEAK")), None)
    text = (out.stdout + out.stderr).strip().splitlines()
    return {f"{key}_s": time.perf_counter() - t0, f"{key}_rc": out.returncode, f"{key}_peak_rss_mb": peak,
            f"{key}_output": text[0] if text else ""}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--keep", help="write the trace here (and keep it) instead of a temporary file")
    p.add_argument("--no-check", action="store_true", help="skip the spectool check run")
    p.add_argument("--no-cli", action="store_true", help="skip the summary / export-perfetto / report runs")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for trace_scale.json (default: $OUT)")
    args = p.parse_args(argv)
    res = {"nodes": args.nodes, "batch": args.batch, "load_average_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.keep) if args.keep else Path(tmp) / "scale.sptrace"
        if not path.exists():
            import resource

            t0 = time.perf_counter()
            synthesize(path, args.records, args.batch, args.nodes)
            res["record_s"] = time.perf_counter() - t0
            res["record_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        res["file_mb"] = path.stat().st_size / 2**20
        res.update(measure(path, "summary"))
        res.update(measure(path, "access"))
        res["bytes_per_record"] = path.stat().st_size / res["records"]
        if not args.no_cli:
            res.update(timed_cli(path, "summary"))
            res.update(timed_cli(path, "export-perfetto", "-o", str(Path(tmp) / "scale.perfetto.json")))
            res.update(timed_cli(path, "report", "-o", str(Path(tmp) / "scale.html")))
        if not args.no_check:
            res.update(timed_cli(path, "check"))
    res["load_average_after"] = os.getloadavg()[0]
    width = max(map(len, res))
    for k, v in res.items():
        print(f"{k:<{width}}  {v:.3f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    if args.out:
        Path(args.out, "trace_scale.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
