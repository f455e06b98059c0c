"""Multi-layer EAGLE in the engine drafts exactly what its layers were trained to draft.

Oracle: training's own teacher-forced forward (``spectool.train.draft.draft_chain``: every
draft layer over the whole final sequence at once, no cache), run on the engine's greedy
output. Layer k at index i reads (emb(x[i+k+1]), h[i]) and predicts x[i+k+2], so at an
iteration whose cache holds L tokens (root x[L]) the engine's k-th draft must equal the
oracle's layer-k prediction at index L-1, as long as the drafts before it were right (past
a wrong draft the engine's layer reads that draft, the oracle the true token).

That also pins the accept lengths: walking the final sequence the way the engine does
(start at the prompt's end, accept the leading matching layers, jump accept + 1) over the
oracle's predictions must give the engine's per-iteration accept lengths, hence its mean.
Any misalignment of the draft-extend (shift, hidden state fed after a verify, cache
positions after commit, stale entries of rejected drafts, window, RoPE position) breaks one.

Both wirings are checked: unchained (every layer reads h[i]) and chained (layer k > 0 reads
layer k-1's feature at i); the same weights serve both, only the checkpoint's flag differs.

Argmax ties: the engine computes a layer's logits in a short cached window, the oracle in a
full forward; in float32 they agree to ~1e-5, so a disagreement is allowed only where the
oracle's top-2 logit gap is below ``TIE``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_engine_support import cut_prompts, demo_token_streams

import spectool as st
from spectool.model.draft_layer import load_draft
from spectool.train.draft import draft_chain, target_view

TIE = 1e-3
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="needs a GPU"))]


@pytest.fixture(scope="module")
def demo():
    return st.demo_model()


def mle_checkpoint(demo: Path, chained: bool, tmp_path: Path) -> Path:
    """The bundled multi-layer checkpoint, wired chained or not."""
    out = tmp_path / f"mle_chained_{chained}"
    shutil.copytree(demo / "multi_layer_eagle", out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"chained": chained}))
    return out


def teacher_forced(target, draft, seq: list[int], steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([steps, T] predictions, [steps, T] top-2 logit gaps); row k, index i predicts x[i+k+2].

    Indices a layer cannot reach (i >= T-k-1) hold -1 and a gap of +inf.
    """
    tokens = torch.tensor([seq], device=target.device)
    T = len(seq)
    preds = torch.full((steps, T), -1, dtype=torch.long)
    gaps = torch.full((steps, T), float("inf"))
    with torch.no_grad():
        for k, _, logits in draft_chain(draft, target, target_view(target, tokens), steps):
            top = logits[0].topk(2, dim=-1)
            preds[k, : T - k - 1] = top.indices[:, 0].cpu()
            gaps[k, : T - k - 1] = (top.values[:, 0] - top.values[:, 1]).cpu()
    return preds, gaps


def spy_on_drafts(engine) -> list[tuple[int, int, list[int]]]:
    """Record (request id, seq_len, chain d1..dK) of every row at every ``draft()`` call."""
    drafts: list[tuple[int, int, list[int]]] = []
    draft = engine.drafter.draft

    def spy(batch, timer):
        tree, why = draft(batch, timer)
        for rid, seq_len, chain in zip(batch.request_ids, batch.seq_lens_host, tree.tokens[:, 1:].tolist()):
            drafts.append((rid, seq_len, chain))
        return tree, why

    engine.drafter.draft = spy
    return drafts


def walk(preds: torch.Tensor, seq: list[int], prompt_len: int, max_new: int) -> list[int]:
    """Accept lengths of the engine's iterations, derived from teacher-forced predictions.

    ``seq`` = prompt + greedy continuation, long enough for the last iteration's drafts.
    """
    steps = preds.shape[0]
    out, L = [], prompt_len
    while L + 1 - prompt_len < max_new:  # the output holds x[P..L]; the engine stops at max_new
        a = 0
        while a < steps and preds[a, L - 1] == seq[L + a + 1]:
            a += 1
        out.append(a)
        L += a + 1
    return out


def compare_with_teacher(result, reference, prompts, drafts, steps: int, max_new: int, oracle,
                         what: str) -> tuple[int, int]:
    """Each request's output equals plain greedy (``reference``), each drafted token of the engine's
    chains (``drafts``, from ``spy_on_drafts``) equals its teacher-forced prediction ``oracle(seq)`` or
    is a near-tie, and the engine's accept lengths are the oracle's walk. Returns the drafted tokens
    compared and how many of them were past the root."""
    checked = deep = 0
    for rid, prompt in enumerate(prompts):
        assert result.token_ids[rid] == reference[rid][:max_new], "greedy output must equal plain greedy"
        seq = prompt + reference[rid]
        preds, gaps = oracle(seq)
        for r, L, chain in drafts:
            if r != rid:
                continue
            for k in range(steps):
                if chain[k] != preds[k, L - 1]:
                    assert gaps[k, L - 1] < TIE, (
                        f"request {rid}, seq_len {L}: {what} {k} drafted {chain[k]}, its teacher-forced "
                        f"prediction is {int(preds[k, L - 1])} (engine chain {chain})")
                checked += 1
                deep += k > 0
                if chain[k] != seq[L + k + 1]:
                    break  # later ones read this wrong draft; the oracle reads the true token
        engine_accepts = [a for r, a in zip(result.stats.columns["request_id"],
                                            result.stats.columns["accept_length"]) if r == rid]
        assert engine_accepts == walk(preds, seq, len(prompt), max_new)
    return checked, deep


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chained", [False, True])
@pytest.mark.parametrize("steps,batch_size", [(4, 1), (3, 2)])
def test_engine_drafts_what_training_teaches(demo, device, steps, batch_size, chained, tmp_path):
    dtype = torch.float32
    target = st.load(demo / "target", device=device, dtype=dtype)
    path = mle_checkpoint(demo, chained, tmp_path)
    draft = load_draft(path, target)
    assert draft.chained == chained
    # Three prompts of different lengths (the last repeats a chunk: deep acceptance); with a
    # batch of 2 the third waits and takes a freed slot, whose draft caches hold the old request.
    prompts = cut_prompts(demo_token_streams(target, demo), 3, seed=steps, min_len=30, max_len=120,
                          repetitive_every=3)
    max_new = 40
    plain = st.Engine(target, draft=None, max_batch_size=1, max_seq_len=512, cuda_graphs=device == "cuda")
    # Plain greedy a little past max_new: the last iteration drafts beyond the output's end.
    reference = plain.generate(prompts, max_new_tokens=max_new + steps + 1, ignore_eos=True,
                               record=False).token_ids
    engine = st.Engine(target, draft=st.MultiLayerEagleConfig(path, num_steps=steps),
                       max_batch_size=batch_size, max_seq_len=512, cuda_graphs=device == "cuda")
    drafts = spy_on_drafts(engine)
    result = engine.generate(prompts, max_new_tokens=max_new, ignore_eos=True, record=False)

    checked, _ = compare_with_teacher(result, reference, prompts, drafts, steps, max_new,
                                      lambda seq: teacher_forced(target, draft, seq, steps), "layer")
    # Every iteration drafted, and the drafts went deep enough to test every layer: an accept
    # length of steps - 1 means the last layer's draft was compared with the oracle.
    assert len(drafts) == len(result.stats.columns["accept_length"])
    assert max(result.stats.columns["accept_length"]) >= steps - 1
    assert checked > len(drafts)
