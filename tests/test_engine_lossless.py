"""Greedy speculative decoding is lossless: for every draft method and setting, the
output equals plain greedy decoding (``draft=None``) token for token.

Oracle: one plain greedy run of the demo target (float32, CPU) over 200 seeded prompts
cut from its held-out prompts (every fifth one repetitive). Each setting of the grid
below decodes a slice of those prompts; the slices of one method cover all 200. A
setting with a smaller ``max_new_tokens`` expects the plain output's prefix (greedy is
causal), one with stop tokens expects it cut just after the first stop token, so
requests in one batch finish at different times and waiting prompts take their slots.

Exact equality relies on float32 forwards giving the same argmax whether a position
is computed in a 1-token decode or inside an N-token tree verify, and whatever the
batch holds; on these model sizes the logit gaps are far above float32 rounding.
"""

from __future__ import annotations

from collections import Counter

import pytest
from test_engine_support import cut_prompts, demo_token_streams

import spectool as st
from spectool.trace.check import check_trace

NUM_PROMPTS = 200
MAX_NEW = 12
MAX_PROMPT = 64


def ngram(**kw):
    return lambda d: st.NgramConfig(**kw)


def eagle(**kw):
    return lambda d: st.EagleConfig(d / "eagle", **kw)


def multi(**kw):
    return lambda d: st.MultiLayerEagleConfig(d / "multi_layer_eagle", **kw)


# method -> settings: (name, config factory, max_batch_size, max_new_tokens, stop tokens?, prompts)
GRID = {
    "ngram": [
        ("default_bfs", ngram(), 4, MAX_NEW, False, 50),
        ("prob_shallow", ngram(num_draft_tokens=4, max_bfs_breadth=2, max_trie_depth=4, match="prob"),
         4, MAX_NEW, True, 40),
        ("wide_bfs_bs1", ngram(num_draft_tokens=24, min_bfs_breadth=3, max_bfs_breadth=6, max_trie_depth=8),
         1, 8, False, 12),
        ("chain_prob", ngram(num_draft_tokens=8, max_bfs_breadth=1, max_trie_depth=2, match="prob"),
         4, 9, True, 46),
        ("two_nodes", ngram(num_draft_tokens=2, max_trie_depth=3), 4, MAX_NEW, False, 40),
        ("deep_bfs_bs1", ngram(num_draft_tokens=16, min_bfs_breadth=2, max_bfs_breadth=4, max_trie_depth=30,
                               match="bfs"), 1, MAX_NEW, True, 12),
    ],
    "eagle": [
        ("default", eagle(), 4, MAX_NEW, False, 50),
        ("one_step_top1", eagle(num_steps=1, topk=1, num_draft_tokens=2), 4, MAX_NEW, True, 40),
        ("wide_bs1", eagle(num_steps=3, topk=8, num_draft_tokens=32), 1, 8, False, 12),
        ("deep_narrow", eagle(num_steps=6, topk=2, num_draft_tokens=8), 4, 9, True, 46),
        ("full_tree", eagle(num_steps=2, topk=3, num_draft_tokens=13), 4, MAX_NEW, False, 40),
        ("top1_chain_bs1", eagle(num_steps=4, topk=1, num_draft_tokens=5), 1, MAX_NEW, True, 12),
    ],
    "multi_layer_eagle": [
        ("steps4", multi(num_steps=4), 4, MAX_NEW, False, 50),
        ("steps1", multi(num_steps=1), 4, MAX_NEW, True, 40),
        ("steps2_bs1", multi(num_steps=2), 1, 8, False, 12),
        ("steps3", multi(num_steps=3), 4, 9, True, 46),
        ("steps4_stop", multi(num_steps=4), 4, MAX_NEW, True, 40),
        ("steps3_bs1", multi(num_steps=3), 1, MAX_NEW, False, 12),
    ],
}


def _cases():
    for method, settings in GRID.items():
        start = 0
        for i, (name, make, bs, max_new, stop, count) in enumerate(settings):
            # The first setting of each method records its trace, which is then checked.
            yield pytest.param(make, bs, max_new, stop, i == 0, slice(start, start + count),
                               id=f"{method}-{name}")
            start += count
        assert start == NUM_PROMPTS, f"{method}'s settings cover {start} prompts, not {NUM_PROMPTS}"


@pytest.fixture(scope="module")
def prompts(target, demo_model_dir):
    streams = demo_token_streams(target, demo_model_dir)
    return cut_prompts(streams, NUM_PROMPTS, seed=2024, max_len=MAX_PROMPT)


@pytest.fixture(scope="module")
def plain(target, prompts):
    """Plain greedy outputs (the oracle) and a frequent output token to use as a stop token."""
    engine = st.Engine(target, draft=None, max_batch_size=8, max_seq_len=MAX_PROMPT + MAX_NEW)
    outputs = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=False).token_ids
    assert all(len(o) == MAX_NEW for o in outputs)
    counts = Counter(t for o in outputs for t in o[1:])  # not the first: some requests must run
    return outputs, counts.most_common(1)[0][0]


def expected(plain_out: list[int], max_new: int, stops: set[int]) -> tuple[list[int], str]:
    out = plain_out[:max_new]
    for i, t in enumerate(out):
        if t in stops:
            return out[:i + 1], "stop"
    return out, "length"


@pytest.mark.parametrize("make, batch, max_new, use_stop, record, part", list(_cases()))
def test_greedy_speculative_equals_plain(target, demo_model_dir, prompts, plain, make, batch, max_new,
                                         use_stop, record, part):
    plain_out, stop_token = plain
    stops = {stop_token} if use_stop else set()
    engine = st.Engine(target, draft=make(demo_model_dir), max_batch_size=batch,
                       max_seq_len=MAX_PROMPT + MAX_NEW)
    result = engine.generate(prompts[part], max_new_tokens=max_new, temperature=0.0, record=record,
                             stop_token_ids=sorted(stops))
    want = [expected(o, max_new, stops) for o in plain_out[part]]
    for k, (got, reason, (tokens, why)) in enumerate(zip(result.token_ids, result.finish_reasons, want)):
        assert got == tokens, f"prompt {part.start + k}: speculative output differs from plain greedy"
        assert reason == why, f"prompt {part.start + k}"
    if use_stop:  # the setting really had requests ending early
        assert "stop" in result.finish_reasons
    if record:
        assert check_trace(result.trace) is None
