"""The checker on CUDA in bf16, the default (fast) mode.

There the verify, decode and prefill forwards run different kernels, so an argmax whose
top two logits are within bf16 rounding may flip between them. The checker must tell such
near-ties from bugs: every divergence of speculative greedy from plain greedy, and every
node where `check --replay`'s plain causal forwards disagree with the recorded target view,
must be a near-tie (a logit gap of at most NEAR_TIE_ULPS bf16 units at that magnitude), and
clean traces of every method, greedy and sampled, must pass `check` and `check --replay`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from test_engine_gpu import draft_config  # noqa: E402
from test_engine_support import cut_prompts, demo_token_streams  # noqa: E402

import spectool as st  # noqa: E402
from spectool.trace.audit import greedy_audit  # noqa: E402
from spectool.trace.check import check_trace  # noqa: E402
from spectool.trace.replay import replay  # noqa: E402

METHODS = ["ngram", "eagle", "multi_layer_eagle", "eagle3"]



@pytest.fixture(scope="module")
def target(demo_model_dir):
    return st.load(demo_model_dir / "target", device="cuda", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def prompts(target, demo_model_dir):
    return cut_prompts(demo_token_streams(target, demo_model_dir), 64, seed=7)


@pytest.mark.parametrize("batch_size", [1, 16])
@pytest.mark.parametrize("method", METHODS)
def test_every_default_mode_divergence_is_a_near_tie(target, prompts, demo_model_dir, method, batch_size):
    plain = st.Engine(target, draft=None, max_batch_size=batch_size, max_seq_len=512)
    spec = st.Engine(target, draft=draft_config(method, demo_model_dir), max_batch_size=batch_size, max_seq_len=512)
    report = greedy_audit(plain, spec, prompts, max_new_tokens=64)
    assert not report.failures, "\n".join(map(str, report.failures))
    print(f"{method} bs {batch_size}: {len(report.greedy)} of {len(prompts)} prompts diverge, all near-ties")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("method", METHODS)
def test_clean_bf16_traces_pass_check_and_replay(target, prompts, demo_model_dir, method, temperature):
    engine = st.Engine(target, draft=draft_config(method, demo_model_dir), max_batch_size=8, max_seq_len=512)
    trace = engine.generate(prompts[:16], max_new_tokens=48, temperature=temperature).trace
    assert check_trace(trace) is None
    report = replay(trace, str(demo_model_dir / "target"), "cuda")
    assert report.fault is None, str(report.fault)
    assert all(d.near_tie for d in report.divergences)
    print(f"{method} T={temperature}: {trace.steps.num_rows} records, {len(report.divergences)} near-ties")
