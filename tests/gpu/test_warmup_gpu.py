"""Engine.warmup on CUDA: after it, no generate call captures a graph or runs a step eagerly,
whatever batch sizes its requests fall through (greedy with and without recording, sampling),
and its outputs equal those of an engine that never warmed up."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from test_engine_gpu import draft_config  # noqa: E402
from test_engine_support import cut_prompts, demo_token_streams  # noqa: E402

import spectool as st  # noqa: E402

METHODS = ["none", "ngram", "eagle", "multi_layer_eagle"]
MAX_NEW = 40



@pytest.fixture(scope="module")
def target(demo_model_dir):
    return st.load(demo_model_dir / "target", device="cuda", dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(target, demo_model_dir):
    return cut_prompts(demo_token_streams(target, demo_model_dir), 7, seed=21, min_len=16, max_len=120,
                       repetitive_every=2)


def calls(engine, prompts):
    """Calls whose batches take every size from 1 to 4 (7 prompts over 4 slots shrink as they finish)."""
    out = []
    for count in (1, 2, 3, 7):
        for kwargs in ({"record": True}, {"record": False}, {"record": True, "temperature": 0.8, "seed": 3}):
            result = engine.generate(prompts[:count], max_new_tokens=MAX_NEW, ignore_eos=True, **kwargs)
            out.append((count, kwargs, result.token_ids, dict(result.stats.graphs)))
    return out


@pytest.mark.parametrize("method", METHODS)
def test_no_capture_after_warmup_and_the_same_outputs(target, demo_model_dir, prompts, method):
    warm = st.Engine(target, draft=draft_config(method, demo_model_dir), max_batch_size=4, max_seq_len=256)
    report = warm.warmup()
    assert report["captures"] > 0
    assert warm.warmup()["captures"] == 0, "a second warmup must find every graph captured"
    cold = st.Engine(target, draft=draft_config(method, demo_model_dir), max_batch_size=4, max_seq_len=256)
    warm_runs, cold_runs = calls(warm, prompts), calls(cold, prompts)
    for (count, kwargs, tokens, graphs), (_, _, cold_tokens, _) in zip(warm_runs, cold_runs):
        assert graphs["captures"] == 0 and graphs["eager"] == 0, (count, kwargs, graphs)
        assert graphs["replays"] > 0
        assert tokens == cold_tokens, (count, kwargs)
    assert sum(g["captures"] for *_, g in cold_runs) > 0, "the cold engine must capture lazily (else no test)"


def test_engines_made_in_a_loop_capture_while_earlier_ones_are_collected(target, demo_model_dir, prompts):
    """A fresh engine per prompt (as a benchmark or a notebook cell re-run makes them): the earlier
    engines' graphs, left in reference cycles, are freed by the cycle collector; a collection that
    ran while the next engine captures used to destroy a graph mid-capture and invalidate it."""
    import gc

    reference = None
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)  # collect on nearly every allocation, so one lands inside a capture
    try:
        for i in range(3):
            engine = st.Engine(target, draft=draft_config("eagle", demo_model_dir), max_batch_size=4, max_seq_len=256)
            engine.cycle = engine  # garbage only the cycle collector frees
            result = engine.generate(prompts[:2], max_new_tokens=12, ignore_eos=True)
            assert result.stats.graphs["captures"] > 0
            reference = reference or result.token_ids
            assert result.token_ids == reference, i
            del engine
    finally:
        gc.set_threshold(*thresholds)
        gc.collect()
