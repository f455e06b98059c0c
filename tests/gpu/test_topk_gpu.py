"""row_topk on CUDA: the Triton kernel against the torch reference, eagerly and inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from spectool.kernels.topk import row_topk, row_topk_torch  # noqa: E402


@pytest.mark.parametrize("lead,v,k,softmax,dtype", [
    ((1, 4), 4096, 4, True, torch.bfloat16), ((16, 4), 4096, 4, True, torch.bfloat16),
    ((3, 1), 4096, 1, True, torch.bfloat16), ((2, 5), 9000, 8, True, torch.float32),
    ((7,), 16, 4, False, torch.float32), ((64,), 53, 16, False, torch.float32),
])
def test_triton_matches_reference_on_cuda(lead, v, k, softmax, dtype):
    g = torch.Generator().manual_seed(v + k)
    x = torch.randn(*lead, v, generator=g).to("cuda", dtype)
    if not softmax:
        x = x.round()  # ties: the smaller index first in both
    want_v, want_i = row_topk_torch(x, k, softmax)
    got_v, got_i = row_topk(x, k, softmax)
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_v, want_v, rtol=1e-5, atol=1e-7)


def test_inside_a_cuda_graph_with_out_views():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 4096, generator=g).to("cuda", torch.bfloat16)
    tokens = torch.full((2, 40), -1, dtype=torch.long, device="cuda")
    probs = torch.empty(2, 4, 4, device="cuda")
    row_topk(x, 4, softmax=True, out=(probs, tokens[:, 3:19].view(2, 4, 4)))  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        row_topk(x, 4, softmax=True, out=(probs, tokens[:, 3:19].view(2, 4, 4)))
    x.copy_(torch.randn(2, 4, 4096, generator=g).to("cuda", torch.bfloat16))
    graph.replay()
    want_v, want_i = row_topk_torch(x, 4, softmax=True)
    assert torch.equal(tokens[:, 3:19].view(2, 4, 4), want_i)
    assert (tokens[:, :3] == -1).all() and (tokens[:, 19:] == -1).all()
    torch.testing.assert_close(probs, want_v, rtol=1e-5, atol=1e-7)
