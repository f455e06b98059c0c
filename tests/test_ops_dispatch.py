"""Which kernel a projection takes must not change when a CUDA graph pads the batch: the graphed
step and the eager one would round differently, and the engine's graphed tokens would stop
matching its eager ones. The oracle is the engine's own padding: ``engine.graph_buckets`` and the
graph runner's rule (the smallest bucket at or above the batch). Decided on the CPU with the CUDA
check answered yes, on meta tensors (no kernel runs)."""

from __future__ import annotations

import pytest
import torch

from spectool.engine import graph_buckets
from spectool.kernels import ops
from spectool.kernels.gemv import MAX_ROWS

H = 4096
WEIGHTS = [(6144, H), (4096, H), (28672, H), (128256, H), (1024, 256)]  # listed, cuBLAS-kept, small


def decisions(batch: int, tokens: int, n: int, k: int) -> tuple[bool, bool]:
    x = torch.empty(batch, tokens, k, dtype=torch.bfloat16, device="meta")
    w = torch.empty(n, k, dtype=torch.bfloat16, device="meta")
    return ops._fused(x, w), ops._split(x, w)


@pytest.mark.parametrize("n,k", WEIGHTS)
def test_a_padded_batch_takes_the_eager_batch_kernel(monkeypatch, n, k):
    monkeypatch.setattr(ops, "_triton", lambda x: True)
    monkeypatch.setattr(ops, "SPLIT_GEMV", True)
    buckets = graph_buckets(64)
    for batch in range(1, buckets[-1] + 1):
        bucket = min(b for b in buckets if b >= batch)
        for tokens in range(1, 2 * MAX_ROWS + 1):  # a decode step, a draft window, a tree verify
            assert decisions(batch, tokens, n, k) == decisions(bucket, tokens, n, k), (batch, bucket, tokens)


def test_several_sequences_take_the_split_kernel_only_one_token_each(monkeypatch):
    monkeypatch.setattr(ops, "_triton", lambda x: True)
    monkeypatch.setattr(ops, "SPLIT_GEMV", True)
    assert decisions(8, 1, 4096, H) == (False, True)
    assert decisions(16, 1, 4096, H) == (False, True)
    assert decisions(32, 1, 4096, H) == (False, False)  # past MAX_ROWS: cuBLAS
    assert decisions(2, 5, 4096, H) == (False, False)  # several tokens a sequence: cuBLAS
    assert decisions(8, 1, 28672, H) == (False, False)  # a shape where cuBLAS was faster
    assert decisions(8, 1, 3072, 2048) == (False, False)  # a shape never timed (the 1B's qkv): cuBLAS
    assert decisions(1, 1, 4096, H) == (True, False)  # one row: the fused GEMV
    monkeypatch.setattr(ops, "SPLIT_GEMV", False)
    assert decisions(8, 1, 4096, H) == (False, False)
