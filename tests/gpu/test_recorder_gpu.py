"""The recorder's CUDA path (pinned pages, one event per hand-off) records what the CPU path records,
even when the engine overwrites its device buffers right after each record_batch."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from spectool.trace.recorder import PAGE_BYTES, Recorder, pack_rows  # noqa: E402


def _record(device: str, iterations: int, rows: int, n: int) -> object:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.empty(rows, n, dtype=torch.long, device=device)  # reused like a graph's static output
    step_topk = torch.empty(rows, 3, 4, dtype=torch.long, device=device)
    mask = torch.ones(rows, n, n, dtype=torch.bool, device=device).tril()
    rec = Recorder(None, {}, flush_every=16)
    for it in range(iterations):
        tokens.copy_(torch.randint(0, 1000, (rows, n), generator=gen))
        step_topk.copy_(torch.randint(0, 1000, (rows, 3, 4), generator=gen))
        parents = torch.arange(-1, n - 1, device=device).expand(rows, n)
        rec.record_batch({"iteration": it, "request_id": torch.arange(rows, device=device).int(),
                          "step_topk_tokens": step_topk},
                         pack_rows([("tokens", tokens), ("mask", mask), ("parents", parents)]))
        rec.record_timings({"verify_us": float(it)})
        tokens.fill_(-7)  # the next replay overwrites the buffers before the copies are read
        step_topk.fill_(-7)
    return rec.close()


@pytest.mark.parametrize("n", [16, 256])  # n=256: an iteration is 1/4 of a page, so pages fill and roll over
def test_cuda_recording_equals_cpu_recording(n):
    rows = 4
    assert rows * n * n < PAGE_BYTES
    on_gpu, on_cpu = _record("cuda", 40, rows, n), _record("cpu", 40, rows, n)
    assert on_gpu.steps.equals(on_cpu.steps)
    assert on_gpu.steps.num_rows == 40 * rows
