"""The model on CUDA: logits match transformers, the cached forward never syncs, and it graph-captures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_model_support import FAMILIES, random_tree, root_path, save_hf_model  # noqa: E402

import spectool  # noqa: E402
from spectool.model.kv_cache import KVCache  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model(request.param, out)
    return hf, spectool.load(out, device="cuda")


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_cuda_tree_verify_matches_transformers(pair):
    hf, target = pair
    model, V = target.model, target.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prefix, N = torch.randint(0, V, (7,), generator=gen).tolist(), 6
    cache = KVCache.for_model(target.config, 2, 32, torch.float32, "cuda")
    slot, dev = torch.tensor([1], device="cuda"), "cuda"
    with torch.no_grad():
        model(torch.tensor([prefix], device=dev), torch.arange(7, device=dev)[None], cache, slot,
              torch.tensor([0], device=dev), kv_len=7)
        parents, mask, depth = random_tree(N, gen)
        toks = torch.randint(0, V, (1, N), generator=gen)
        logits = model.logits(model(toks.cuda(), (7 + torch.tensor(depth))[None].cuda(), cache, slot,
                                    torch.tensor([7], device=dev), tree_mask=mask[None].cuda()))
    for i in range(N):
        want = hf_logits(hf, prefix + toks[0, root_path(parents, i)].tolist())[-1]
        torch.testing.assert_close(logits[0, i].cpu(), want, atol=2e-3, rtol=0)


def test_decode_has_no_host_sync_and_graph_replays(pair):
    _, target = pair
    model, cfg = target.model, target.config
    cache = KVCache.for_model(cfg, 4, 64, torch.float32, "cuda")
    B = 4
    slots = torch.arange(B, device="cuda")
    prompt = torch.randint(0, cfg.vocab_size, (B, 10), device="cuda")
    with torch.no_grad():
        model(prompt, torch.arange(10, device="cuda").expand(B, 10), cache, slots,
              torch.zeros(B, dtype=torch.long, device="cuda"), kv_len=10)
        tokens = torch.randint(0, cfg.vocab_size, (B, 1), device="cuda")
        starts = torch.tensor([10, 7, 9, 3], device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = model.logits(model(tokens, starts[:, None], cache, slots, starts))
        finally:
            torch.cuda.set_sync_debug_mode("default")

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (Triton compiles) outside the capture
            model.logits(model(tokens, starts[:, None], cache, slots, starts))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model.logits(model(tokens, starts[:, None], cache, slots, starts))
        graph.replay()
        torch.testing.assert_close(out, eager, atol=1e-5, rtol=0)
        # New inputs copied into the static buffers replay to what eager gives for them.
        tokens.copy_(torch.randint(0, cfg.vocab_size, (B, 1), device="cuda"))
        starts.copy_(torch.tensor([11, 8, 10, 4]))
        graph.replay()
        torch.testing.assert_close(out, model.logits(model(tokens, starts[:, None], cache, slots, starts)),
                                   atol=1e-5, rtol=0)


def test_bf16_greedy_agrees_mostly_with_fp32(tmp_path):
    save_hf_model("llama", tmp_path, seed=2)
    ref = spectool.load(tmp_path, device="cuda")
    half = spectool.load(tmp_path, device="cuda", dtype="bfloat16")
    tokens = torch.randint(0, ref.config.vocab_size, (2, 16), device="cuda")
    pos = torch.arange(16, device="cuda").expand(2, 16)
    with torch.no_grad():
        a = ref.model.logits(ref.model(tokens, pos)).argmax(-1)
        b = half.model.logits(half.model(tokens, pos)).argmax(-1)
    assert (a == b).float().mean() > 0.8
