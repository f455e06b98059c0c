"""Training on the GPU: bf16 autocast forward/backward through the model's ops, checkpoints that load."""

from __future__ import annotations

import math

import pytest
import torch

import spectool as st
from spectool.model.draft_layer import load_draft
from spectool.train import data
from spectool.train.draft import DraftRecipe, train_draft
from spectool.train.target import TargetRecipe, train_target

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n\n".join(p.read_text(encoding="utf-8") for p in data.stdlib_files()[:20]))
    return path


def test_target_and_drafts_train_on_cuda(corpus, tmp_path):
    recipe = TargetRecipe(vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                          intermediate_size=256, steps=40, batch_size=16, seq_len=128, warmup=4,
                          checkpoint_every=20, eval_windows=4)
    result = train_target(corpus, tmp_path / "target", recipe, device="cuda", progress=False)
    history = [loss for _, loss in result["loss_history"]]
    assert all(math.isfinite(x) for x in history) and history[-1] < history[0]
    assert result["heldout_loss"] < math.log(512)

    target = st.load(tmp_path / "target", device="cuda", dtype=torch.bfloat16)
    small = {"steps": 6, "batch_size": 8, "seq_len": 128, "checkpoint_every": 3, "eval_windows": 2,
             "gen_prompts": 4, "gen_tokens": 16}
    for method, layers in (("eagle", 1), ("multi_layer_eagle", 3)):
        out = tmp_path / method
        r = train_draft(tmp_path / "target", corpus, out, DraftRecipe(method=method, layers=layers, **small),
                        device="cuda", progress=False)
        assert all(0 <= a <= 1 for a in r["agreement"])
        draft = load_draft(out, target)
        assert draft.num_layers == layers and draft.kind == method
