"""Sampling through the engine is lossless for every draft method, end to end.

A tiny random Llama target (vocabulary 8, made with transformers) decodes one prompt
many times in one ``generate`` call (every copy in its own slot) with
``max_new_tokens=3``: the output (t0, t1, t2) is the prefill token, then the first
speculative iteration's tokens (t1 always, t2 when a draft was accepted, else the
next iteration's). Lossless sampling means the joint distribution of (t0, t1, t2) is
exactly p(t0 | prompt) p(t1 | prompt, t0) p(t2 | prompt, t0, t1), computed here from
transformers' logits of the same weights, with temperature, top-k and top-p applied
by a small numpy oracle. The drafts are random or deliberately bad (overconfident
garbage, NaN), so acceptance must come from the verifier, not from good drafts.

Statistic: Pearson chi-square over the 512 cells (cells expected below 5 pooled), each
case rejected at p < ALPHA = 1e-3: with the 11 cases below the false-alarm rate of the
file is about 1 % (the seeds are fixed, so a run is deterministic). A control shows
the same statistic rejects a plausible bug: on rejection, drawing the bonus from the
full target distribution instead of the residual.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_model_support import save_hf_model
from test_verify import chi_square_pvalue

import spectool as st
from spectool import engine as engine_module
from spectool.model.config import ModelConfig
from spectool.model.draft_layer import DraftModel, save_draft
from spectool.model.eagle3 import new_eagle3, save_eagle3

VOCAB = 8
COPIES = 4000
ALPHA = 1e-3
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers model, spectool target, directory of draft checkpoints)."""
    root = tmp_path_factory.mktemp("engine_sampling")
    hf = save_hf_model("llama", root / "target", seed=21, vocab_size=VOCAB, hidden_size=32,
                       intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)
    target = st.load(root / "target", device="cpu", dtype=torch.float32)
    cfg = ModelConfig.from_json(root / "target" / "config.json")
    torch.manual_seed(3)
    save_draft(DraftModel(cfg, 1, "eagle"), root / "eagle")
    save_draft(DraftModel(cfg, 3, "multi_layer_eagle"), root / "multi_layer_eagle")
    # Overconfident garbage: every weight scaled up, so drafts are near-deterministic and mostly wrong.
    shutil.copytree(root / "eagle", root / "eagle_garbage")
    tensors = {n: t * 25 for n, t in load_file(root / "eagle" / "model.safetensors").items()}
    save_file(tensors, root / "eagle_garbage" / "model.safetensors")
    # NaN draft logits everywhere.
    shutil.copytree(root / "eagle", root / "eagle_nan")
    tensors = load_file(root / "eagle" / "model.safetensors")
    tensors["layers.0.norm.weight"] = torch.full_like(tensors["layers.0.norm.weight"], float("nan"))
    save_file(tensors, root / "eagle_nan" / "model.safetensors")
    # EAGLE-3 over 6 of the 8 tokens, reading both target layers; a draft model that is the target
    # itself (drafts mostly accepted) and an unrelated one.
    draft3 = new_eagle3(target.config, draft_vocab_size=6, aux_layers=(0, 1, 1))
    draft3.layer.d2t.copy_(torch.tensor([0, 0, 1, 1, 2, 2]))
    save_eagle3(draft3, root / "eagle3")
    shutil.copytree(root / "target", root / "draft_same")
    save_hf_model("llama", root / "draft_other", seed=22, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                  intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)
    return hf, target, root


def oracle_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """softmax(logits / T) cut to the top_k largest and renormalised (as transformers' warpers
    do), then cut to the smallest most-likely set whose mass reaches top_p, renormalised."""
    x = logits.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    order = np.argsort(-p, kind="stable")
    if top_k:
        p[order[top_k:]] = 0.0
    p /= p.sum()
    keep = np.zeros_like(p, dtype=bool)
    mass = 0.0
    for t in order:
        if mass >= top_p:
            break
        keep[t] = True
        mass += p[t]
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def exact_joint(hf, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """P(t0, t1, t2 | PROMPT) as a [V, V, V] array, from transformers' logits."""
    seqs = [PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]
    with torch.no_grad():
        logits = hf(torch.tensor(seqs)).logits.double().numpy()  # causal: every prefix at once
    n = len(PROMPT)

    def probs(row: int, pos: int) -> np.ndarray:
        return oracle_probs(logits[row, pos], temperature, top_k, top_p)

    joint = np.zeros((VOCAB, VOCAB, VOCAB))
    p0 = probs(0, n - 1)
    for a in range(VOCAB):
        p1 = probs(a * VOCAB, n)
        for b in range(VOCAB):
            joint[a, b] = p0[a] * p1[b] * probs(a * VOCAB + b, n + 1)
    return joint


def draft_config(method: str, root):
    return {
        "ngram": st.NgramConfig(num_draft_tokens=6, max_bfs_breadth=3, max_trie_depth=4),
        "eagle": st.EagleConfig(root / "eagle", num_steps=2, topk=3, num_draft_tokens=7),
        "eagle_garbage": st.EagleConfig(root / "eagle_garbage", num_steps=3, topk=2, num_draft_tokens=8),
        "eagle_nan": st.EagleConfig(root / "eagle_nan", num_steps=2, topk=2, num_draft_tokens=5),
        "multi_layer_eagle": st.MultiLayerEagleConfig(root / "multi_layer_eagle", num_steps=2),
        "eagle3": st.Eagle3Config(root / "eagle3", num_steps=2, topk=3, num_draft_tokens=7),
        "draft_model_same": st.DraftModelConfig(root / "draft_same", num_steps=2, topk=2, num_draft_tokens=5),
        "draft_model_other": st.DraftModelConfig(root / "draft_other", num_steps=3, num_draft_tokens=4),
    }[method]


def sample_outputs(target, draft, temperature: float, top_k: int, top_p: float, seed: int):
    engine = st.Engine(target, draft=draft, max_batch_size=COPIES, max_seq_len=len(PROMPT) + 4)
    result = engine.generate([PROMPT] * COPIES, max_new_tokens=3, temperature=temperature, top_k=top_k,
                             top_p=top_p, seed=seed, ignore_eos=True, record=False)
    out = np.array(result.token_ids)
    assert out.shape == (COPIES, 3)
    return out, result.stats


def pvalue(out: np.ndarray, joint: np.ndarray) -> float:
    cells = out[:, 0] * VOCAB * VOCAB + out[:, 1] * VOCAB + out[:, 2]
    counts = np.bincount(cells, minlength=VOCAB ** 3).astype(np.float64)
    return chi_square_pvalue(counts, joint.ravel() * len(out))


CASES = [
    ("ngram", 1.0, 0, 1.0), ("ngram", 0.7, 5, 0.9),
    ("eagle", 1.0, 0, 1.0), ("eagle", 0.7, 5, 0.9),
    ("eagle_garbage", 1.0, 0, 1.0), ("eagle_nan", 1.0, 0, 1.0),
    ("multi_layer_eagle", 1.3, 6, 0.95),
    ("eagle3", 1.0, 0, 1.0), ("eagle3", 0.7, 5, 0.9),
    ("draft_model_same", 1.0, 0, 1.0), ("draft_model_other", 0.8, 0, 0.9),
]


@pytest.mark.parametrize("method, temperature, top_k, top_p", CASES)
def test_engine_sampling_matches_exact_target_distribution(models, method, temperature, top_k, top_p):
    hf, target, root = models
    out, stats = sample_outputs(target, draft_config(method, root), temperature, top_k, top_p, seed=11)
    assert pvalue(out, exact_joint(hf, temperature, top_k, top_p)) > ALPHA
    if method != "eagle_nan":  # drafts were accepted, so the tree part of sampling really ran
        assert stats.mean_accept_length > 0.05


def test_the_statistic_rejects_a_biased_sampler(models, monkeypatch):
    """Control: on a rejected first draft, draw the bonus from the full target
    distribution rather than the residual (drafted tokens get too much mass)."""
    hf, target, root = models
    real = engine_module.verify_sampling
    gen = torch.Generator().manual_seed(5)

    def biased(tree, logits, temperature, top_k, top_p, *args):
        res = real(tree, logits, temperature, top_k, top_p, *args)
        drafted = (tree.parents == 0).any(-1) & (res.accept_length == 0)
        scale = temperature[:, None] if isinstance(temperature, torch.Tensor) else temperature
        probs = torch.softmax(logits[:, 0].float() / scale, dim=-1)
        redraw = torch.multinomial(probs, 1, generator=gen)[:, 0]
        res.bonus = torch.where(drafted, redraw, res.bonus)
        return res

    monkeypatch.setattr(engine_module, "verify_sampling", biased)
    out, _ = sample_outputs(target, draft_config("eagle_garbage", root), 1.0, 0, 1.0, seed=11)
    assert pvalue(out, exact_joint(hf, 1.0, 0, 1.0)) < ALPHA
