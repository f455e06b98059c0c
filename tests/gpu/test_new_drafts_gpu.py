"""EAGLE-3 and standalone draft models on CUDA with CUDA graphs: greedy output equals plain greedy
(float32: token for token), every draft step replays from a graph, and graphs give the same tokens
as eager runs when sampling.

The EAGLE-3 draft is the bundled one when the demo has it, else a random layer over the demo
target (losslessness does not depend on draft quality); the draft model is the demo target
itself (every draft accepted: long paths and their rollback) and, as a weaker one, the target
with its last layers cut off.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from safetensors.torch import load_file, save_file  # noqa: E402
from test_engine_support import cut_prompts, demo_token_streams  # noqa: E402

import spectool as st  # noqa: E402
from spectool.model.eagle3 import new_eagle3, save_eagle3  # noqa: E402

MAX_NEW, MAX_SEQ = 48, 256


@pytest.fixture(scope="module")
def target(demo_model_dir):
    return st.load(demo_model_dir / "target", device="cuda", dtype=torch.float32)


@pytest.fixture(scope="module")
def drafts(demo_model_dir, target, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_drafts")
    eagle3 = demo_model_dir / "eagle3"
    if not eagle3.is_dir():
        torch.manual_seed(0)
        save_eagle3(new_eagle3(target.config, draft_vocab_size=2048, aux_layers=(0, 2, 4)), root / "eagle3")
        eagle3 = root / "eagle3"
    # A two-layer draft model: the target's first two layers, its embedding, norm and head.
    small = root / "small"
    shutil.copytree(demo_model_dir / "target", small)
    meta = json.loads((small / "config.json").read_text())
    meta["num_hidden_layers"] = 2
    (small / "config.json").write_text(json.dumps(meta))
    tensors = {n: t for n, t in load_file(small / "model.safetensors").items()
               if not n.startswith("model.layers.") or int(n.split(".")[2]) < 2}
    save_file(tensors, str(small / "model.safetensors"))
    return {
        "eagle3": st.Eagle3Config(eagle3, num_steps=5, topk=4, num_draft_tokens=16),
        "eagle3_chain": st.Eagle3Config(eagle3, num_steps=4, topk=1, num_draft_tokens=5),
        "draft_model_same": st.DraftModelConfig(demo_model_dir / "target", num_steps=4),
        "draft_model_small_tree": st.DraftModelConfig(small, num_steps=3, topk=3, num_draft_tokens=10),
    }


@pytest.fixture(scope="module")
def prompts(target, demo_model_dir):
    return cut_prompts(demo_token_streams(target, demo_model_dir), 16, seed=7, min_len=16, max_len=MAX_SEQ - MAX_NEW)


@pytest.fixture(scope="module")
def plain(target, prompts):
    engine = st.Engine(target, draft=None, max_batch_size=4, max_seq_len=MAX_SEQ, cuda_graphs=True)
    return engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=False).token_ids


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", ["eagle3", "eagle3_chain", "draft_model_same", "draft_model_small_tree"])
def test_greedy_equals_plain_with_graphs(target, drafts, prompts, plain, name, batch):
    engine = st.Engine(target, draft=drafts[name], max_batch_size=batch, max_seq_len=MAX_SEQ, cuda_graphs=True)
    result = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=True)
    assert result.token_ids == plain
    drafter = {k: 0 for k in ("replays", "eager", "captures")}
    for runner in engine.drafter.graph_runners:
        for k in drafter:
            drafter[k] += runner.stats[k]
    assert drafter["replays"] > 0 and drafter["eager"] == 0  # every draft step ran from a graph
    if name == "draft_model_same":
        assert result.stats.mean_accept_length > 3.5
    from spectool.trace.check import check_trace

    assert check_trace(result.trace) is None


@pytest.mark.parametrize("name", ["eagle3", "draft_model_small_tree"])
def test_graphs_give_the_same_tokens_as_eager_when_sampling(target, drafts, prompts, name):
    runs = {}
    for graphs in (False, True):
        engine = st.Engine(target, draft=drafts[name], max_batch_size=4, max_seq_len=MAX_SEQ, cuda_graphs=graphs)
        runs[graphs] = engine.generate(prompts[:8], max_new_tokens=MAX_NEW, temperature=0.8, seed=3,
                                       ignore_eos=True, record=False).token_ids
    assert runs[True] == runs[False]
