"""The row-gather kernels (token embedding, KV commit) on CUDA against their torch references,
eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_kernels_gather import commit_by_loop, random_paths  # noqa: E402

from spectool.kernels import gather, ops  # noqa: E402
from spectool.verify import commit_kv  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab,hidden", [(32000, 768), (128256, 4096), (1000, 200)])
def test_embedding_on_cuda_matches_torch(dtype, vocab, hidden):
    g = torch.Generator().manual_seed(hidden)
    weight = torch.randn(vocab, hidden, device="cuda", generator=torch.Generator("cuda").manual_seed(0)).to(dtype)
    for shape in [(1, 1), (1, 16), (4, 7), (64, 1)]:
        ids = torch.randint(0, vocab, shape, generator=g)
        ids.view(-1)[-1] = ids.view(-1)[0]
        ids = ids.cuda()
        assert torch.equal(gather.embedding_triton(ids, weight), F.embedding(ids, weight)), shape
    with torch.no_grad():
        assert torch.equal(ops.embedding(ids, weight), F.embedding(ids, weight))
    clamped = gather.embedding_triton(torch.tensor([-5, vocab + 3], device="cuda"), weight)
    assert torch.equal(clamped, weight[[0, vocab - 1]])


def test_embedding_in_a_cuda_graph_follows_its_ids():
    weight = torch.randn(32000, 768, device="cuda").bfloat16()
    ids = torch.zeros(1, 16, dtype=torch.long, device="cuda")
    gather.embedding_triton(ids, weight)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gather.embedding_triton(ids, weight)
    for seed in range(3):
        ids.copy_(torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, weight[ids])


def test_embedding_keeps_autograd_for_a_trained_table():
    weight = torch.randn(50, 64, device="cuda", requires_grad=True)
    ids = torch.tensor([[1, 1, 7]], device="cuda")
    ops.embedding(ids, weight).sum().backward()  # the torch path: the kernel has no backward
    assert weight.grad[1].eq(2).all() and weight.grad[7].eq(1).all() and weight.grad[0].eq(0).all()
    frozen = weight.detach()
    assert torch.equal(ops.embedding(ids, frozen), frozen[ids])  # grad enabled, frozen table: Triton


def commit_case(layers, heads, dim, n, width, bs, max_batch, seq, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, max_batch, heads, seq, dim, generator=g).to(dtype).cuda()
    v = torch.randn(layers, max_batch, heads, seq, dim, generator=g).to(dtype).cuda()
    slots = torch.randperm(max_batch, generator=g)[:bs]
    lengths = [i % width for i in range(bs)]
    path, length = random_paths(bs, n, width, g, lengths)
    seq_lens = torch.randint(0, seq - n + 1, (bs,), generator=g)
    seq_lens[0] = seq - n  # a tree that ends at the cache's last index
    return k, v, slots.cuda(), seq_lens.cuda(), path.cuda(), length.cuda()


@pytest.mark.parametrize("layers,heads,dim,n,width,bs", [(12, 4, 64, 16, 6, 1), (32, 8, 128, 64, 9, 3),
                                                         (1, 8, 128, 32, 32, 8), (2, 2, 80, 48, 40, 5)])
def test_commit_on_cuda_matches_torch(layers, heads, dim, n, width, bs):
    k, v, slots, seq_lens, path, length = commit_case(layers, heads, dim, n, width, bs, 8, 256, seed=n + bs)
    want_k, want_v = k.clone(), v.clone()
    gather.commit_kv_torch(want_k, want_v, slots, seq_lens, path, length)
    commit_kv(k, v, slots, seq_lens, path, length)  # dispatches to Triton on CUDA
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_commit_overlapping_path_on_cuda():
    k = torch.arange(12.0, device="cuda").view(1, 1, 1, 12, 1).expand(2, 1, 3, 12, 128).contiguous()
    v = -k
    path, length = torch.tensor([[0, 2, 3, -1]], device="cuda"), torch.tensor([2], device="cuda")
    one, four = torch.tensor([0], device="cuda"), torch.tensor([4], device="cuda")
    want_k, want_v = k.cpu().clone(), v.cpu().clone()
    commit_by_loop(want_k, want_v, one.cpu(), four.cpu(), path.cpu(), length.cpu())
    commit_kv(k, v, one, four, path, length)
    assert torch.equal(k.cpu(), want_k) and torch.equal(v.cpu(), want_v)
    assert k[0, 0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 6, 7, 7, 8, 9, 10, 11]


def test_commit_in_a_cuda_graph_follows_its_inputs():
    layers, heads, dim, n, width, bs = 12, 4, 64, 16, 6, 4
    k, v, slots, seq_lens, path, length = commit_case(layers, heads, dim, n, width, bs, 4, 128, seed=0)
    commit_kv(k.clone(), v.clone(), slots, seq_lens, path, length)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        commit_kv(k, v, slots, seq_lens, path, length)
    for seed in range(1, 4):
        fresh = commit_case(layers, heads, dim, n, width, bs, 4, 128, seed=seed)
        for static, new in zip((k, v, slots, seq_lens, path, length), fresh):
            static.copy_(new)
        want_k, want_v = k.clone(), v.clone()
        gather.commit_kv_torch(want_k, want_v, slots, seq_lens, path, length)
        graph.replay()
        assert torch.equal(k, want_k) and torch.equal(v, want_v), seed
