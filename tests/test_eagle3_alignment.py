"""EAGLE-3 in the engine drafts exactly what training teaches it (the training-time test).

Oracle: training's teacher-forced forward (``spectool.train.draft.draft_chain``: the draft over
the whole final sequence at once, no cache), run on the engine's greedy output. In the engine,
draft step k > 0 attends to the committed prefix (cache entries the root step wrote from the
target's layers) and to the draft path it extends; training must show step k the same context,
or what it learns is not what the engine runs. So at an iteration whose cache holds L tokens
the engine's top-1 chain draft k must equal the oracle's step-k prediction at index L-1, as
long as the drafts before it were right, and walking the oracle's predictions the way the
engine iterates must give the engine's accept lengths (hence the greedy estimate of eval.json
is the engine's chain figure). Checked on the bundled EAGLE-3 layer, whose drafts are accepted
deep enough to reach every step.

Argmax ties: the engine computes the logits in a cached step, the oracle in a full forward; in
float32 they agree to ~1e-5, so a disagreement is allowed only where the oracle's top-2 logit
gap is below ``TIE`` (test_mle_alignment.py).
"""

from __future__ import annotations

import pytest
import torch
from test_engine_support import cut_prompts, demo_token_streams
from test_mle_alignment import compare_with_teacher, spy_on_drafts

import spectool as st
from spectool.model.eagle3 import load_eagle3
from spectool.train.draft import draft_chain, greedy_accept_estimate, predicted_ids, target_view

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="needs a GPU"))]


def teacher_forced(target, draft, seq: list[int], steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([steps, T] predicted target ids, [steps, T] top-2 logit gaps); row k, index i predicts x[i+k+2]."""
    tokens = torch.tensor([seq], device=target.device)
    T = len(seq)
    preds = torch.full((steps, T), -1, dtype=torch.long)
    gaps = torch.full((steps, T), float("inf"))
    with torch.no_grad():
        view = target_view(target, tokens, draft.aux_layers)
        for k, _, logits in draft_chain(draft, target, view, steps):
            top = logits[0].topk(2, dim=-1)
            preds[k, : T - k - 1] = predicted_ids(draft, logits)[0].cpu()
            gaps[k, : T - k - 1] = (top.values[:, 0] - top.values[:, 1]).cpu()
    return preds, gaps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("steps,batch_size", [(5, 1), (3, 2)])
def test_engine_chain_is_the_teacher_forced_chain(demo_model_dir, device, steps, batch_size):
    target = st.load(demo_model_dir / "target", device=device, dtype=torch.float32)
    path = demo_model_dir / "eagle3"
    draft = load_eagle3(path, target)
    prompts = cut_prompts(demo_token_streams(target, demo_model_dir), 3, seed=steps, min_len=30, max_len=120,
                          repetitive_every=3)
    max_new = 40
    plain = st.Engine(target, draft=None, max_batch_size=1, max_seq_len=512, cuda_graphs=device == "cuda")
    reference = plain.generate(prompts, max_new_tokens=max_new + steps + 1, ignore_eos=True,
                               record=False).token_ids
    engine = st.Engine(target, draft=st.Eagle3Config(path, num_steps=steps, topk=1, num_draft_tokens=steps + 1),
                       max_batch_size=batch_size, max_seq_len=512, cuda_graphs=device == "cuda")
    drafts = spy_on_drafts(engine)
    result = engine.generate(prompts, max_new_tokens=max_new, ignore_eos=True, record=False)

    _, deep = compare_with_teacher(result, reference, prompts, drafts, steps, max_new,
                                   lambda seq: teacher_forced(target, draft, seq, steps), "step")
    assert len(drafts) == len(result.stats.columns["accept_length"])
    # Steps past the root were compared (the training-time test is about them), the last one too.
    assert max(result.stats.columns["accept_length"]) >= steps - 1
    assert deep > len(drafts) // 2


def test_greedy_estimate_is_the_engine_chain(demo_model_dir):
    """eval.json's greedy accept length for EAGLE-3 is what the engine's top-1 chain accepts."""
    target = st.load(demo_model_dir / "target", device="cpu", dtype=torch.float32)
    path = demo_model_dir / "eagle3"
    steps, new = 5, 40
    prompts = [p[-160:] for p in demo_token_streams(target, demo_model_dir)[:3]]
    est = greedy_accept_estimate(load_eagle3(path, target), target, prompts, new, steps, torch.device("cpu"))
    engine = st.Engine(target, draft=st.Eagle3Config(path, num_steps=steps, topk=1, num_draft_tokens=steps + 1),
                       max_batch_size=len(prompts), max_seq_len=512, cuda_graphs=False)
    accepts = engine.generate(prompts, max_new_tokens=new, ignore_eos=True, record=False).stats.columns["accept_length"]
    assert est["greedy_accept_length"] == pytest.approx(sum(accepts) / len(accepts), abs=0.1)
