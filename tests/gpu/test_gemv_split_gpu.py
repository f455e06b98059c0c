"""The split-K product of several sequences (kernels/gemv_split.py) on CUDA at the 8B projections'
shapes: against cuBLAS (bf16, float32 sums in another order, so equal to the last bit almost
everywhere), a row the same bits whatever the other rows and however many pad the batch, and a
CUDA graph's replay the same bits as the eager call; and the engine with every projection of
the demo model sent to it: graphed tokens equal eager ones, greedy speculative equals plain."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spectool as st
from spectool.kernels import gemv_split as split_module
from spectool.kernels.gemv_split import DEFAULT_CONFIG, config_for, gemv_split

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_split_product_matches_cublas_and_pads_alike(n, k):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    dt = torch.bfloat16
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dt)
    x = torch.randn(16, 1, k, device="cuda", generator=gen).to(dt)
    y = gemv_split(x, w)
    want = F.linear(x, w)
    torch.testing.assert_close(y.float(), want.float(), atol=3e-2, rtol=3e-2)
    assert (y == want).float().mean() > 0.9
    for rows in (2, 8):  # a batch inside its padded bucket: the same bits
        assert torch.equal(gemv_split(x[:rows], w), y[:rows])
    for _ in range(3):  # the slab counts reset themselves: repeated calls agree
        assert torch.equal(gemv_split(x, w), y)
    # A whole K in one span (no partials, no counts) rounds like the split product to bf16 closeness.
    block_n, block_k, _, warps, stages = config_for(n, k) or DEFAULT_CONFIG
    one_span = gemv_split(x, w, config=(block_n, block_k, 1, warps, stages))
    torch.testing.assert_close(one_span.float(), y.float(), atol=3e-2, rtol=3e-2)


def test_graph_replay_equals_eager():
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(4096, 4096, device="cuda", generator=gen) / 64).to(torch.bfloat16)
    x = torch.randn(8, 1, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    gemv_split(x, w)  # the first call, eager, zeroes the slab counts and compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv_split(x, w)
    x2 = torch.randn(8, 1, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gemv_split(x2, w))


def test_engine_with_every_projection_split(monkeypatch, demo_model_dir):
    """The engine takes the kernel at the 8B's shapes only; here every weight shape takes it, so the
    demo model's decode steps and draft steps at batch 4 run through it (float32: exact)."""
    from test_engine_gpu import MAX_NEW, MAX_SEQ, METHODS, draft_config
    from test_engine_support import cut_prompts, demo_token_streams

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return gemv_split(*args, **kwargs)

    monkeypatch.setattr(split_module, "config_for", lambda n, k: DEFAULT_CONFIG)
    monkeypatch.setattr(split_module, "gemv_split", counted)
    target = st.load(demo_model_dir / "target", device="cuda", dtype=torch.float32)
    prompts = cut_prompts(demo_token_streams(target, demo_model_dir), 8, seed=5, min_len=16,
                          max_len=MAX_SEQ - MAX_NEW)
    tokens = {}
    for method in ["none", *METHODS]:
        for graphs in (False, True):
            calls.clear()
            engine = st.Engine(target, draft=None if method == "none" else draft_config(method, demo_model_dir),
                               max_batch_size=4, max_seq_len=MAX_SEQ, cuda_graphs=graphs)
            tokens[method, graphs] = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True,
                                                     record=False).token_ids
            assert calls, f"{method}: no projection took the split kernel"
        assert tokens[method, True] == tokens[method, False], method
        assert tokens[method, False] == tokens["none", False], method
