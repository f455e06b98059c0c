"""Greedy decoding with an EAGLE-3 draft or a standalone draft model is lossless: the output equals
plain greedy decoding (``draft=None``) token for token, for every setting below.

Oracle: one plain greedy run of a tiny random target (float32, CPU) over 200 seeded prompts per
method. The drafts are random too: an EAGLE-3 layer over a reduced vocabulary (d2t maps it to
scattered target ids), and as draft models both the target's own weights (most drafts accepted,
so long accepted paths and the rollback after them are exercised) and an unrelated random model
(most drafts rejected). The vocabulary is small, so even random drafts are often accepted.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from test_model_support import save_hf_model

import spectool as st
from spectool.model.eagle3 import new_eagle3, save_eagle3
from spectool.trace.check import check_trace

VOCAB, LAYERS, NUM_PROMPTS, MAX_NEW, MAX_PROMPT = 24, 6, 200, 10, 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lossless_drafts")
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                 num_key_value_heads=2)
    save_hf_model("llama", root / "target", seed=7, num_hidden_layers=LAYERS, **shape)
    save_hf_model("llama", root / "small", seed=8, num_hidden_layers=2, **shape)
    shutil.copytree(root / "target", root / "same")
    target = st.load(root / "target", device="cpu", dtype=torch.float32)
    torch.manual_seed(9)
    draft = new_eagle3(target.config, draft_vocab_size=16)  # the default target layers (1, 2, 2)
    with torch.no_grad():
        draft.layer.d2t.copy_(torch.randperm(VOCAB)[:16].sort().values - torch.arange(16))
    save_eagle3(draft, root / "eagle3")
    aux = new_eagle3(target.config, draft_vocab_size=VOCAB, aux_layers=(0, 3, 5))
    save_eagle3(aux, root / "eagle3_aux")
    return target, root


def eagle3(name="eagle3", **kw):
    return lambda root: st.Eagle3Config(root / name, **kw)


def draft_model(name, **kw):
    return lambda root: st.DraftModelConfig(root / name, **kw)


# method -> (name, config factory, max_batch_size, max_new_tokens, stop tokens?, prompts)
GRID = {
    "eagle3": [
        ("default", eagle3(), 4, MAX_NEW, False, 50),
        ("one_step_top1", eagle3(num_steps=1, topk=1, num_draft_tokens=2), 4, MAX_NEW, True, 30),
        ("wide_bs1", eagle3(num_steps=3, topk=6, num_draft_tokens=24), 1, 8, False, 10),
        ("deep_narrow", eagle3(num_steps=6, topk=2, num_draft_tokens=8), 3, 9, True, 40),
        ("own_layers", eagle3("eagle3_aux", num_steps=3, topk=3, num_draft_tokens=10), 4, MAX_NEW, False, 40),
        ("chain_bs1", eagle3(num_steps=4, topk=1, num_draft_tokens=5), 1, MAX_NEW, True, 30),
    ],
    "draft_model": [
        ("same_chain", draft_model("same", num_steps=4), 4, MAX_NEW, False, 50),
        ("same_tree", draft_model("same", num_steps=3, topk=3, num_draft_tokens=10), 4, MAX_NEW, True, 30),
        ("small_chain", draft_model("small", num_steps=5, num_draft_tokens=6), 4, 9, True, 40),
        ("small_tree_bs1", draft_model("small", num_steps=2, topk=4, num_draft_tokens=12), 1, 8, False, 10),
        ("same_one_step", draft_model("same", num_steps=1, num_draft_tokens=2), 3, MAX_NEW, False, 40),
        ("small_deep", draft_model("small", num_steps=6, topk=2, num_draft_tokens=9), 4, MAX_NEW, True, 30),
    ],
}


def _cases():
    for method, settings in GRID.items():
        start = 0
        for i, (name, make, bs, max_new, stop, count) in enumerate(settings):
            yield pytest.param(make, bs, max_new, stop, i == 0, slice(start, start + count), id=f"{method}-{name}")
            start += count
        assert start == NUM_PROMPTS, f"{method}'s settings cover {start} prompts, not {NUM_PROMPTS}"


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(2025)
    out = []
    for i in range(NUM_PROMPTS):
        n = rng.randint(2, MAX_PROMPT)
        if i % 5 == 0:  # repetitive: long accepted paths for a draft that learnt nothing but copying
            motif = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))]
            out.append((motif * MAX_PROMPT)[:n])
        else:
            out.append([rng.randrange(VOCAB) for _ in range(n)])
    return out


@pytest.fixture(scope="module")
def plain(models, prompts):
    target, _ = models
    engine = st.Engine(target, draft=None, max_batch_size=8, max_seq_len=MAX_PROMPT + MAX_NEW)
    outputs = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=False).token_ids
    counts: dict[int, int] = {}
    for o in outputs:
        for t in o[1:]:
            counts[t] = counts.get(t, 0) + 1
    return outputs, max(counts, key=counts.get)


@pytest.mark.parametrize("make, batch, max_new, use_stop, record, part", list(_cases()))
def test_greedy_with_new_drafts_equals_plain(models, prompts, plain, make, batch, max_new, use_stop, record, part):
    target, root = models
    plain_out, stop_token = plain
    stops = {stop_token} if use_stop else set()
    engine = st.Engine(target, draft=make(root), max_batch_size=batch, max_seq_len=MAX_PROMPT + MAX_NEW)
    result = engine.generate(prompts[part], max_new_tokens=max_new, record=record, stop_token_ids=sorted(stops))
    for k, (got, want) in enumerate(zip(result.token_ids, plain_out[part])):
        want = want[:max_new]
        cut = next((i for i, t in enumerate(want) if t in stops), None)
        want = want if cut is None else want[:cut + 1]
        assert got == want, f"prompt {part.start + k}: speculative output differs from plain greedy"
    assert result.stats.mean_accept_length > 0.05  # drafts were accepted: the tree paths really ran
    if record:
        assert check_trace(result.trace) is None
