"""Bad input: a clear ValueError before any work, and the engine stays usable; draft
configs that cannot work fail at construction; NaN/inf in a draft layer never
produces an invalid tree and never changes greedy output."""

from __future__ import annotations

import dataclasses
import shutil
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_support import cut_prompts, demo_token_streams

import spectool as st
from spectool.draft.tree import validate_tree
from spectool.model.config import ModelConfig
from spectool.model.draft_layer import DraftModel, save_draft
from spectool.trace.check import check_trace

MAX_SEQ = 48


@pytest.fixture(scope="module")
def prompts(target, demo_model_dir):
    return cut_prompts(demo_token_streams(target, demo_model_dir), 6, seed=7, min_len=8, max_len=24)


@contextmanager
def count_forwards(model):
    """Yields a one-element list counting ``model``'s forward calls inside the block."""
    calls = [0]
    handle = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        yield calls
    finally:
        handle.remove()


BAD_CALLS = {
    "too_long": (lambda p, v: [p[0], list(range(1, MAX_SEQ - 2))], dict(max_new_tokens=4),
                 "max_seq_len"),
    "empty_list": (lambda p, v: [p[0], []], {}, "empty"),
    "empty_text": (lambda p, v: [""], {}, "empty"),
    "id_too_large": (lambda p, v: [p[0], p[1] + [v]], {}, "outside"),
    "id_negative": (lambda p, v: [[-1] + p[0]], {}, "outside"),
    "max_new_zero": (lambda p, v: p[:2], dict(max_new_tokens=0), "max_new_tokens"),
    "max_new_negative": (lambda p, v: p[:2], dict(max_new_tokens=-3), "max_new_tokens"),
    "temperature_negative": (lambda p, v: p[:2], dict(temperature=-0.5), "temperature"),
    "top_p_zero": (lambda p, v: p[:2], dict(temperature=1.0, top_p=0.0), "top_p"),
    "top_k_negative": (lambda p, v: p[:2], dict(temperature=1.0, top_k=-1), "top_k"),
}


@pytest.mark.parametrize("method", ["none", "ngram", "eagle", "multi_layer_eagle"])
def test_bad_requests_raise_before_any_work_and_engine_stays_usable(target, demo_model_dir, prompts, method):
    draft = {"none": None, "ngram": st.NgramConfig(num_draft_tokens=6),
             "eagle": st.EagleConfig(demo_model_dir / "eagle", num_steps=3, topk=2, num_draft_tokens=6),
             "multi_layer_eagle": st.MultiLayerEagleConfig(demo_model_dir / "multi_layer_eagle", num_steps=2),
             }[method]
    max_new = 8
    want = st.Engine(target, draft=draft, max_batch_size=2, max_seq_len=MAX_SEQ).generate(
        prompts, max_new_tokens=max_new, record=False, ignore_eos=True).token_ids
    engine = st.Engine(target, draft=draft, max_batch_size=2, max_seq_len=MAX_SEQ)
    vocab = target.config.vocab_size
    with count_forwards(target.model) as forwards:
        for name, (make, kwargs, words) in BAD_CALLS.items():
            args = {"max_new_tokens": max_new, "record": False, **kwargs}
            with pytest.raises(ValueError, match=words):
                engine.generate(make(prompts, vocab), **args)
            with pytest.raises(ValueError, match=words):  # stream raises on its first step, before any event
                next(iter(engine.stream(make(prompts, vocab), **args)))
            assert forwards[0] == 0, f"{name}: the target ran before the error"
    # A prompt that exactly fills max_seq_len with its max_new_tokens is fine.
    edge = (list(prompts[0]) * 8)[:MAX_SEQ - max_new]
    out = engine.generate([edge], max_new_tokens=max_new, ignore_eos=True, record=False).token_ids[0]
    assert len(out) == max_new
    # The engine decodes as a fresh one does (for ngram the trie now holds more, which
    # changes drafts but not greedy output).
    assert engine.generate(prompts, max_new_tokens=max_new, record=False, ignore_eos=True).token_ids == want


def test_prompts_as_arrays_tensors_or_tuples_decode_as_lists_do(target, prompts):
    import numpy as np

    engine = st.Engine(target, max_batch_size=2, max_seq_len=MAX_SEQ)
    want = engine.generate(prompts[:2], max_new_tokens=4, record=False, ignore_eos=True).token_ids
    forms = [[np.asarray(p, dtype=np.int32) for p in prompts[:2]], [torch.tensor(p) for p in prompts[:2]],
             [tuple(p) for p in prompts[:2]], [[np.int64(t) for t in p] for p in prompts[:2]],
             [iter(p) for p in prompts[:2]]]
    for form in forms:
        assert engine.generate(form, max_new_tokens=4, record=False, ignore_eos=True).token_ids == want
    vocab = target.config.vocab_size
    with pytest.raises(ValueError, match=rf"outside \[0, {vocab}\): \[{vocab}, -2\]"):
        engine.generate([np.asarray([1, vocab, 2, -2], dtype=np.int64)], max_new_tokens=2, record=False)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([np.asarray([], dtype=np.int64)], max_new_tokens=2, record=False)


def test_impossible_draft_configs_fail_at_construction(target, demo_model_dir, tmp_path):
    eagle, multi = demo_model_dir / "eagle", demo_model_dir / "multi_layer_eagle"
    vocab = target.config.vocab_size
    with pytest.raises(ValueError, match="num_draft_tokens"):
        st.NgramConfig(num_draft_tokens=1)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        st.EagleConfig(eagle, num_draft_tokens=1)
    with pytest.raises(ValueError, match="can hold"):  # 2 steps of top-2 hold 1 + 2 + 4 nodes
        st.EagleConfig(eagle, num_steps=2, topk=2, num_draft_tokens=8)
    with pytest.raises(ValueError, match="num_steps"):
        st.MultiLayerEagleConfig(multi, num_steps=0)
    layers = len(list(load_draft_layers(multi, target)))
    with pytest.raises(ValueError, match="num_steps"):
        st.Engine(target, draft=st.MultiLayerEagleConfig(multi, num_steps=layers + 1), max_seq_len=MAX_SEQ)
    with pytest.raises(ValueError, match="topk"):
        st.Engine(target, draft=st.EagleConfig(eagle, num_steps=1, topk=vocab + 1, num_draft_tokens=4),
                  max_seq_len=MAX_SEQ)
    with pytest.raises(ValueError):
        st.Engine(target, draft=st.EagleConfig(tmp_path / "missing"), max_seq_len=MAX_SEQ)

    # Checkpoints that do not fit the target: other hidden size, other vocabulary.
    cfg = ModelConfig.from_json(demo_model_dir / "target" / "config.json")
    for field, value in (("hidden_size", cfg.hidden_size // 2), ("vocab_size", cfg.vocab_size + 8)):
        bad = dataclasses.replace(cfg, **{field: value})
        for kind in ("eagle", "multi_layer_eagle"):
            path = tmp_path / f"{field}_{kind}"
            save_draft(DraftModel(bad, 2, kind), path)
            config = (st.EagleConfig(path, num_steps=2, topk=2, num_draft_tokens=4) if kind == "eagle"
                      else st.MultiLayerEagleConfig(path, num_steps=2))
            with pytest.raises(ValueError, match=field):
                st.Engine(target, draft=config, max_seq_len=MAX_SEQ)
    # The target still decodes after all of that.
    assert len(st.Engine(target, max_seq_len=MAX_SEQ).generate([[1, 2, 3]], max_new_tokens=3,
                                                                ignore_eos=True).token_ids[0]) == 3


def load_draft_layers(path, target):
    from spectool.model.draft_layer import load_draft

    return load_draft(path, target).layers


def poisoned_copy(src, dst, layer: int, how: str):
    """Copy a draft checkpoint and poison draft layer ``layer`` so its logits are NaN or +-inf."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    norm = f"layers.{layer}.norm.weight"
    w = tensors[norm].clone()
    if how == "nan":
        w[::3] = float("nan")  # every logit NaN
    else:
        w[0] = float("inf")  # logits of +inf, -inf and NaN (inf * 0)
    tensors[norm] = w
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("how", ["nan", "inf"])
@pytest.mark.parametrize("method", ["eagle", "multi_layer_eagle"])
def test_nan_and_inf_draft_logits_give_valid_trees_and_lossless_output(target, demo_model_dir, prompts,
                                                                       tmp_path, method, how):
    if method == "eagle":
        path = poisoned_copy(demo_model_dir / "eagle", tmp_path / "eagle", 0, how)
        draft = st.EagleConfig(path, num_steps=3, topk=3, num_draft_tokens=8)
    else:  # poison the second layer only: the chain's first draft stays sane
        path = poisoned_copy(demo_model_dir / "multi_layer_eagle", tmp_path / "mle", 1, how)
        draft = st.MultiLayerEagleConfig(path, num_steps=3)
    max_new = 10
    want = st.Engine(target, max_batch_size=4, max_seq_len=MAX_SEQ).generate(
        prompts, max_new_tokens=max_new, record=False, ignore_eos=True).token_ids
    result = st.Engine(target, draft=draft, max_batch_size=4, max_seq_len=MAX_SEQ).generate(
        prompts, max_new_tokens=max_new, record=True, ignore_eos=True)
    assert result.token_ids == want
    trace = result.trace
    checked = 0
    for rid in trace.request_ids:
        for it in trace.iterations(rid):
            view = trace.iteration(it, rid)
            validate_tree(torch.from_numpy(view.parents).long(), valid=torch.from_numpy(view.valid),
                          scores=torch.from_numpy(view.scores))
            validate_tree(mask=torch.from_numpy(view.mask))
            checked += 1
    assert checked > 0
    assert check_trace(trace) is None
