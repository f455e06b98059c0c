"""Programmatic dependent launch changes no result: the decode step's logits are the same bits with
and without it, eager and replayed from a CUDA graph, at batch 1 (the one-row projections) and for a
batch-1 tree of 16 tokens (the few-row ones)."""

from __future__ import annotations

import pytest
import torch

from spectool.graphs import GraphRunner
from spectool.kernels import pdl
from spectool.model.config import ModelConfig
from spectool.model.kv_cache import KVCache
from spectool.model.llama import Transformer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=4, head_dim=64, intermediate_size=2816,
                      vocab_size=8192, max_position_embeddings=256)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            return Transformer(cfg).eval()
    finally:
        torch.set_default_dtype(old)


def decode_logits(model, tokens: int, graphed: bool, enabled: bool) -> torch.Tensor:
    """Logits of a 40-token prompt's next ``tokens`` inputs [1, tokens] fed in one step, then of 8
    greedy one-token steps after it, with PDL on or off."""
    pdl.ENABLED = enabled
    try:
        cfg = model.config
        cache = KVCache.for_model(cfg, 1, 128, torch.bfloat16, "cuda")
        gen = torch.Generator(device="cuda").manual_seed(1)
        prompt = torch.randint(0, cfg.vocab_size, (1, 40), device="cuda", generator=gen)
        slots, zero = torch.zeros(1, dtype=torch.long, device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda")

        def step(ids, positions, starts):
            return model.logits(model(ids, positions, cache=cache, slots=slots, starts=starts))

        runner = GraphRunner(step, buckets=(1,), enabled=graphed)
        out = []
        with torch.inference_mode():
            model(prompt, torch.arange(40, device="cuda")[None], cache=cache, slots=slots, starts=zero, kv_len=40)
            starts = torch.full((1,), 40, device="cuda")
            ids = torch.randint(0, cfg.vocab_size, (1, tokens), device="cuda", generator=gen)
            logits = step(ids, (40 + torch.arange(tokens, device="cuda"))[None], starts)
            out.append(logits)
            starts = starts + tokens
            token = logits[:, -1].argmax(-1)
            for _ in range(8):
                logits = runner(1, ids=token[:, None], positions=starts[:, None], starts=starts).clone()
                out.append(logits)
                token = logits[:, -1].argmax(-1)
                starts = starts + 1
        return torch.cat(out, dim=1)
    finally:
        pdl.ENABLED = True


@pytest.mark.parametrize("graphed", [False, True])
@pytest.mark.parametrize("tokens", [1, 16])
def test_pdl_changes_no_bit(model, graphed, tokens):
    assert pdl.use_pdl(next(model.parameters())), "an H100/H200 launches with PDL"
    with_pdl = decode_logits(model, tokens, graphed, enabled=True)
    without = decode_logits(model, tokens, graphed, enabled=False)
    assert torch.equal(with_pdl, without)
