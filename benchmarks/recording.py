"""What recording costs: the engine thread's time per record_batch, writer throughput, bytes.

    python benchmarks/recording.py [--device cuda] [--iterations 300]

For each batch size (1, 16) and tree size N (16, 64) it records synthetic
iterations shaped like the engine's (every STEP_FIELDS entry, mask [B,N,N] bool,
target top-5, EAGLE step top-k) and reports:
- record_us: time of `Recorder.record_batch` on the calling thread (the cost the
  engine pays per iteration; on CUDA it must not wait for the GPU);
- total_us: wall time per iteration including the writer thread's work (close()
  waits for it), i.e. the throughput bound of the background writer;
- bytes_per_iteration: file bytes / iterations (the whole batch), and per record.
Prints a table and writes recording.json to $OUT when it is set.
Tokens/s with recording on vs off through the engine: `spectool bench` runs with
record=True and record=False (the lead's engine benchmark).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from spectool.trace.recorder import Recorder


def _fields(batch: int, n: int, device: str, gen: torch.Generator) -> dict:
    parents = torch.cat([torch.full((batch, 1), -1), torch.randint(0, 1, (batch, n - 1))], 1)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (batch,), generator=gen)
    mask = torch.zeros(batch, n, n, dtype=torch.bool)
    mask[:, torch.arange(n), torch.arange(n)] = True
    for i in range(1, n):
        mask[torch.arange(batch), i] |= mask[torch.arange(batch), parents[:, i]]
    ids = lambda *shape: torch.randint(0, 32000, shape, generator=gen)  # noqa: E731
    depth = mask.sum(-1) - 1
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
    }
    return {k: v.to(device) for k, v in f.items()}


def measure(batch: int, n: int, iterations: int, device: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    fields = _fields(batch, n, device, gen)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.sptrace"
        rec = Recorder(path, {"method": "eagle", "benchmark": True}, flush_every=64)
        record_s = 0.0
        start = time.perf_counter()
        for it in range(iterations):
            if device == "cuda":
                fields["tokens"].add_(1)  # some GPU work in flight, as in the engine
            t = time.perf_counter()
            rec.record_batch({"iteration": it, "method": "eagle", "temperature": 0.0, "draft_us": 1.0,
                              **fields})
            record_s += time.perf_counter() - t
        rec.close()
        total_s = time.perf_counter() - start
        size = path.stat().st_size
    return {"batch": batch, "N": n, "device": device, "iterations": iterations,
            "record_us": record_s / iterations * 1e6, "total_us": total_s / iterations * 1e6,
            "bytes_per_iteration": size / iterations, "bytes_per_record": size / (iterations * batch)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iterations", type=int, default=300)
    args = parser.parse_args()
    results = [measure(b, n, args.iterations, args.device) for b in (1, 16) for n in (16, 64)]
    print(f"{'batch':>5} {'N':>3} {'record_us':>10} {'total_us':>9} {'bytes/iter':>11} {'bytes/record':>12}")
    for r in results:
        print(f"{r['batch']:>5} {r['N']:>3} {r['record_us']:>10.1f} {r['total_us']:>9.1f} "
              f"{r['bytes_per_iteration']:>11.0f} {r['bytes_per_record']:>12.0f}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "recording.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
