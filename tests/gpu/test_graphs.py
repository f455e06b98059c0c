"""GraphRunner: graph replay gives the same tokens as eager decoding; fallbacks are counted."""

from __future__ import annotations

import threading

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from spectool.graphs import GraphRunner  # noqa: E402
from spectool.kernels.fused import argmax_triton  # noqa: E402
from spectool.model.config import ModelConfig  # noqa: E402
from spectool.model.kv_cache import KVCache  # noqa: E402
from spectool.model.llama import Transformer  # noqa: E402


def small_model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=8,
                      num_kv_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True)
    with torch.device("cuda"):
        model = Transformer(cfg).bfloat16().eval()
    return cfg, model


def greedy(model, cfg, prompts: torch.Tensor, steps: int, graphs: bool, scratch: int):
    B, L = prompts.shape
    cache = KVCache.for_model(cfg, scratch + 1, 256, torch.bfloat16, "cuda")
    slots = torch.arange(B, device="cuda")

    def step(tokens, positions, slots, starts):
        hidden = model(tokens, positions, cache=cache, slots=slots, starts=starts)
        return argmax_triton(model.logits(hidden)[:, -1])

    runner = GraphRunner(step, buckets=(1, 4), enabled=graphs, pad_values={"slots": scratch})
    with torch.inference_mode():
        pos = torch.arange(L, device="cuda").expand(B, L)
        hidden = model(prompts, pos, cache=cache, slots=slots, starts=torch.zeros_like(slots), kv_len=L)
        token = model.logits(hidden)[:, -1].argmax(-1)
        starts = torch.full((B,), L, device="cuda")
        out = [token]
        for _ in range(steps):
            token = runner(B, tokens=token[:, None], positions=starts[:, None], slots=slots,
                           starts=starts).clone()
            starts += 1
            out.append(token)
    return torch.stack(out, 1), runner.stats


@pytest.mark.parametrize("batch", [1, 3, 6])
def test_graph_replay_equals_eager(batch):
    cfg, model = small_model()
    prompts = torch.randint(0, cfg.vocab_size, (batch, 20), device="cuda")
    eager, eager_stats = greedy(model, cfg, prompts, 24, graphs=False, scratch=7)
    graphed, stats = greedy(model, cfg, prompts, 24, graphs=True, scratch=7)
    assert torch.equal(eager, graphed)
    assert eager_stats["replays"] == 0
    if batch <= 4:  # fits a bucket (3 is padded to 4, the padding row writing to the scratch slot)
        assert stats == {"replays": 24, "eager": 0, "captures": 1}
    else:  # larger than every bucket: eager, visibly
        assert stats == {"replays": 0, "eager": 24, "captures": 0}


def test_outputs_are_sliced_and_padding_uses_pad_values():
    seen = []

    def fn(x, slots):
        seen.append(slots.clone())
        return {"y": x * 2, "s": slots + 0}

    runner = GraphRunner(fn, buckets=(4,), pad_values={"slots": 9})
    x = torch.arange(6.0, device="cuda").view(3, 2)
    out = runner(3, x=x, slots=torch.tensor([0, 1, 2], device="cuda"))
    assert torch.equal(out["y"], x * 2) and out["s"].tolist() == [0, 1, 2]
    out = runner(2, x=x[:2] + 1, slots=torch.tensor([5, 6], device="cuda"))
    assert torch.equal(out["y"], (x[:2] + 1) * 2) and out["s"].tolist() == [5, 6]
    assert seen[0].tolist() == [0, 1, 2, 9]  # warm-up already sees the padding value
    assert runner.stats == {"replays": 2, "eager": 0, "captures": 1}


def test_an_input_passed_again_is_copied_only_when_it_changed():
    """The runner skips copying an input that is the very same, unmodified tensor as in the last
    call at that batch size; an in-place change or another batch size must still reach the graph."""
    runner = GraphRunner(lambda x, y: x * 2 + y, buckets=(4,))
    x = torch.arange(3.0, device="cuda")
    y = torch.ones(3, device="cuda")
    assert runner(3, x=x, y=y).tolist() == [1.0, 3.0, 5.0]
    assert runner(3, x=x, y=y).tolist() == [1.0, 3.0, 5.0]
    x.add_(10)  # in place: same object, new version
    assert runner(3, x=x, y=y).tolist() == [21.0, 23.0, 25.0]
    assert runner(2, x=x[:2], y=y[:2]).tolist() == [21.0, 23.0]
    assert runner(3, x=x, y=torch.zeros(3, device="cuda")).tolist() == [20.0, 22.0, 24.0]
    assert runner.stats["captures"] == 1 and runner.stats["replays"] == 5


def test_capture_survives_another_thread_waiting_on_an_event():
    """The trace writer thread synchronizes CUDA events while the engine captures graphs."""
    cfg, model = small_model()
    event = torch.cuda.Event()
    event.record()
    stop = threading.Event()

    def writer():  # what the recorder's writer thread does for every page it receives
        while not stop.is_set():
            event.synchronize()

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        prompts = torch.randint(0, cfg.vocab_size, (3, 8), device="cuda")
        graphed, stats = greedy(model, cfg, prompts, 6, graphs=True, scratch=4)
    finally:
        stop.set()
        thread.join()
    assert stats == {"replays": 6, "eager": 0, "captures": 1}
    assert torch.equal(graphed, greedy(model, cfg, prompts, 6, graphs=False, scratch=4)[0])
