"""The engine on CUDA with the demo model: greedy speculative decoding equals plain greedy
for every method, and CUDA-graph replay gives the same tokens as eager runs.

How argmax ties are handled: plain decoding and speculative verify take the same
``torch.argmax`` (first maximum) over float32 logits. But the verify forward runs N
tokens through the model at once while plain decoding runs one, so in bfloat16 the
matmuls accumulate in a different order and a logit can round differently: where the
top two logits are within bf16 rounding of each other, the two paths may pick
different tokens, and from then on decode different texts. So:

- float32 on CUDA: exact equality, token for token, for every prompt and method;
- bfloat16 on CUDA: every prompt must agree up to its first difference, and each
  difference must be a near-tie (the two tokens' logits, from a plain bf16 forward
  over the agreed prefix, within ``BF16_TIE`` of each other); most prompts must agree
  completely.

Graph replay and eager use the same kernels on the same shapes (batch sizes 1 and 4
are exact bucket sizes, so no padding rows change the matmul shapes): identical tokens.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from test_engine_support import cut_prompts, demo_token_streams  # noqa: E402

import spectool as st  # noqa: E402

METHODS = ["ngram", "eagle", "multi_layer_eagle"]
MAX_NEW = 48
MAX_SEQ = 256
BF16_TIE = 0.25  # logits of the demo model are O(10); bf16 keeps ~3 significant digits


def draft_config(method: str, demo_dir):
    """The default settings of each method on the demo model (none: plain decoding)."""
    return {
        "none": None,
        "ngram": st.NgramConfig(num_draft_tokens=12),
        "eagle": st.EagleConfig(demo_dir / "eagle", num_steps=5, topk=4, num_draft_tokens=16),
        "multi_layer_eagle": st.MultiLayerEagleConfig(demo_dir / "multi_layer_eagle", num_steps=4),
        "eagle3": st.Eagle3Config(demo_dir / "eagle3", num_steps=5, topk=4, num_draft_tokens=16),
    }[method]


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def target(request, demo_model_dir):
    return st.load(demo_model_dir / "target", device="cuda", dtype=request.param)


@pytest.fixture(scope="module")
def prompts(target, demo_model_dir):
    return cut_prompts(demo_token_streams(target, demo_model_dir), 24, seed=99, min_len=16,
                       max_len=MAX_SEQ - MAX_NEW)


@pytest.fixture(scope="module")
def plain(target, prompts):
    engine = st.Engine(target, draft=None, max_batch_size=4, max_seq_len=MAX_SEQ, cuda_graphs=True)
    return engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=False).token_ids


def last_logits(target, tokens: list[int]) -> torch.Tensor:
    """float32 logits after ``tokens`` from a plain forward without cache."""
    ids = torch.tensor([tokens], device="cuda")
    with torch.no_grad():
        hidden = target.model(ids, torch.arange(len(tokens), device="cuda")[None])
        return target.model.logits(hidden)[0, -1].float()


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_speculative_equals_plain_on_cuda(target, demo_model_dir, prompts, plain, method, batch):
    engine = st.Engine(target, draft=draft_config(method, demo_model_dir), max_batch_size=batch,
                       max_seq_len=MAX_SEQ, cuda_graphs=True)
    got = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=False).token_ids
    if target.dtype == torch.float32:
        assert got == plain
        return
    identical = 0
    for prompt, want, out in zip(prompts, plain, got):
        j = next((i for i, (a, b) in enumerate(zip(want, out)) if a != b), None)
        if j is None:
            identical += 1
            continue
        logits = last_logits(target, prompt + want[:j])
        gap = float((logits[want[j]] - logits[out[j]]).abs())
        assert gap <= BF16_TIE, f"{method}: first difference at token {j} is not a near-tie (gap {gap:.3f})"
    assert identical >= 0.75 * len(prompts), f"only {identical}/{len(prompts)} prompts identical in bf16"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("method", ["none", *METHODS])
def test_cuda_graphs_give_the_same_tokens_as_eager(target, demo_model_dir, prompts, method, batch, temperature):
    draft = None if method == "none" else draft_config(method, demo_model_dir)
    runs = {}
    for graphs in (False, True):
        engine = st.Engine(target, draft=draft, max_batch_size=batch, max_seq_len=MAX_SEQ, cuda_graphs=graphs)
        result = engine.generate(prompts[:8], max_new_tokens=MAX_NEW, temperature=temperature, seed=3,
                                 ignore_eos=True, record=False)
        runs[graphs] = (result.token_ids, engine.graph_stats())
    (eager, eager_stats), (graphed, graph_stats) = runs[False], runs[True]
    assert graphed == eager
    assert eager_stats["replays"] == 0 and eager_stats["captures"] == 0
    assert graph_stats["replays"] > 0 and graph_stats["captures"] > 0
