"""The what-if tuner on CUDA in bf16: N-gram predictions stay exact (no float in them); from a
deterministic trace EAGLE and multi-layer EAGLE predictions equal real deterministic graphed
runs iteration by iteration; from a default-mode trace their means agree within a few percent
(over the requests whose text the engine decoded again); and a calibration measures the engine's graphed steps."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

import spectool as st  # noqa: E402
from spectool.tune.calibrate import calibrate  # noqa: E402
from spectool.tune.recommend import tune  # noqa: E402

NEW = 64


@pytest.fixture(scope="module")
def target():
    return st.load(st.demo_model() / "target", device="cuda", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def prompts(target):
    lines = [json.loads(x) for x in (st.demo_model() / "prompts.jsonl").read_text().splitlines() if x.strip()]
    return [target.encode(x["prompt"])[-128:] for x in lines if x["kind"] == "completion"][:8]


def _run(target, config, prompts, new, deterministic=False):
    return st.Engine(target, draft=config, max_batch_size=4, max_seq_len=1024, deterministic=deterministic).generate(
        prompts, max_new_tokens=new, ignore_eos=True)


def _eagle_configs(method):
    path = st.demo_model() / method
    if method == "eagle":
        return [st.EagleConfig(path, num_steps=s, topk=k, num_draft_tokens=n)
                for s, k, n in ((2, 1, 3), (3, 1, 4), (3, 2, 6), (4, 2, 8), (4, 4, 12), (5, 4, 16), (5, 2, 8),
                                (5, 4, 8))]
    return [st.MultiLayerEagleConfig(path, num_steps=s) for s in (1, 2, 3, 4)]


def _rows(steps):
    return list(zip(steps.column("iteration").to_pylist(), steps.column("request_id").to_pylist(),
                    steps.column("accept_length").to_pylist()))


@pytest.mark.parametrize("method", ["eagle", "multi_layer_eagle"])
def test_eagle_whatif_exact_from_a_deterministic_bf16_trace(target, prompts, method):
    # Recorded with the batch-invariant kernels, the trace is replayed with them (target and draft
    # layers): each iteration's accept length is the deterministic engine's, value for value.
    configs = _eagle_configs(method)
    recorded = _run(target, configs[-1], prompts, NEW + 16, deterministic=True).trace
    assert recorded.run_info["engine"]["deterministic"]
    result = tune(recorded, grid=configs, max_new_tokens=NEW, target=target, progress=False)
    for config, pred in zip(configs, result.predictions):
        measured = _run(target, config, prompts, NEW, deterministic=True).trace.steps
        assert pred.exact, config
        predicted = list(zip(pred.iteration.tolist(), pred.request_id.tolist(), pred.accept_length.tolist()))
        assert predicted == _rows(measured), config


def test_ngram_whatif_exact_on_cuda(target, prompts):
    recorded = _run(target, st.NgramConfig(), prompts, NEW + 16).trace
    configs = [st.NgramConfig(num_draft_tokens=n, max_bfs_breadth=b) for n, b in ((4, 1), (8, 4), (16, 8))]
    result = tune(recorded, grid=configs, max_new_tokens=NEW, progress=False)
    for config, pred in zip(configs, result.predictions):
        s = _run(target, config, prompts, NEW).trace.steps
        assert pred.accept_length.tolist() == s.column("accept_length").to_pylist()


# From a default-mode trace the what-if is exact up to rounding: in bf16 the teacher-forced forward
# (one prefill per request) and the engine's (prefills, then tree verifies and draft extends at its
# batch size) take different GEMM / attention reductions, so a near-tie between draft tokens can
# flip. Another tree shape can also flip a near-tie of the target's own argmax, and then the engine
# decodes another text than the recorded one, which no prediction from that text can follow: the
# means are compared over the requests whose text the engine decoded again, and most must be those.
@pytest.mark.parametrize("method", ["eagle", "multi_layer_eagle"])
def test_eagle_whatif_mean_within_two_percent_in_bf16(target, prompts, method):
    path = st.demo_model() / method
    if method == "eagle":
        configs = [st.EagleConfig(path, num_steps=s, topk=k, num_draft_tokens=n)
                   for s, k, n in ((3, 1, 4), (4, 2, 8), (5, 4, 16))]
    else:
        configs = [st.MultiLayerEagleConfig(path, num_steps=s) for s in (2, 3, 4)]
    recorded = _run(target, configs[-1], prompts, NEW + 16)
    result = tune(recorded.trace, grid=configs, max_new_tokens=NEW, target=target, progress=False)
    for config, pred in zip(configs, result.predictions):
        measured = _run(target, config, prompts, NEW)
        same = [rid for rid, (a, b) in enumerate(zip(measured.token_ids, recorded.token_ids)) if a == b[:NEW]]
        assert len(same) >= 0.75 * len(prompts), (config, same)
        steps = measured.trace.steps.to_pandas()
        engine_mean = steps[steps.request_id.isin(same)].accept_length.mean()
        predicted_mean = pred.accept_length[np.isin(pred.request_id, same)].mean()
        assert predicted_mean == pytest.approx(engine_mean, rel=0.02), config


def test_calibration_on_cuda(target):
    profile = calibrate(target, eagle_path=st.demo_model() / "eagle", batch_sizes=(1, 4), num_nodes=(1, 8),
                        topks=(1, 4), eagle_steps=(1, 3), repeats=5, progress=False)
    assert profile.device == torch.cuda.get_device_name()
    v = profile.data["verify_us"]["us"]
    assert all(x > 0 for row in v for x in row) and all(x > 0 for x in profile.data["plain_us"]["us"])
    eagle = profile.data["draft_us"]["eagle"]
    assert eagle["num_nodes"] == [[2, 4], [5, 16]]  # the full tree of each (top-k, steps), at most 16 nodes
    config = st.EagleConfig(st.demo_model() / "eagle", num_steps=3, topk=4, num_draft_tokens=16)
    assert profile.iteration_us(config, 4, 16) == pytest.approx(eagle["iteration_us"][1][1][1])
    assert profile.iteration_us(config, 4, 16) > profile.iteration_us(None, 4, 1)
