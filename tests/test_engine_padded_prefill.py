"""On CUDA a prefill is right-padded to one of ``PREFILL_LENGTHS`` (a CUDA graph per batch bucket and
padded length, the drafters' prefills padded alike); the padding must change nothing a user sees.

Oracle: the same engine on the CPU with padding off (how the CPU prefills). With it forced on, every
method gives the same tokens and the same accept length at every iteration: greedy decoding is
lossless whatever the drafts, so only equal accept lengths show that the drafters' padded prefills
(their caches, features and first drafts) equal the unpadded ones.
"""

from __future__ import annotations

import pytest
from test_engine_support import cut_prompts, demo_token_streams

import spectool as st
from spectool.engine import PREFILL_GRAPH_TOKENS, PREFILL_LENGTHS

MAX_NEW = 16


def draft(method: str, demo_dir):
    return {"none": None, "ngram": st.NgramConfig(), "eagle": st.EagleConfig(demo_dir / "eagle"),
            "multi_layer_eagle": st.MultiLayerEagleConfig(demo_dir / "multi_layer_eagle"),
            "eagle3": st.Eagle3Config(demo_dir / "eagle3")}[method]


@pytest.fixture(scope="module")
def prompts(target, demo_model_dir):
    # Lengths between padded lengths, so every prompt is padded (a group to its longest's length).
    streams = demo_token_streams(target, demo_model_dir)
    return [p[:n] for p, n in zip(cut_prompts(streams, 3, seed=5, min_len=140, max_len=200), (23, 70, 141))]


def run(engine, prompts):
    result = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=False)
    cols = result.stats.columns
    return result.token_ids, list(zip(cols["iteration"], cols["request_id"], cols["accept_length"]))


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("method", ["none", "ngram", "eagle", "multi_layer_eagle", "eagle3"])
def test_a_padded_prefill_changes_no_token_and_no_accept_length(target, demo_model_dir, prompts, method, batch):
    engines = [st.Engine(target, draft=draft(method, demo_model_dir), max_batch_size=batch, max_seq_len=512)
               for _ in range(2)]
    engines[1]._pads_prefill = True
    assert engines[0].prefill_length(1, 70) == (70, False)
    assert engines[1].prefill_length(1, 70) == (128, True) and 128 in PREFILL_LENGTHS
    (tokens, accepts), (padded_tokens, padded_accepts) = (run(e, prompts) for e in engines)
    assert padded_tokens == tokens
    assert padded_accepts == accepts
    if method != "none":
        assert sum(a for *_, a in accepts) > 0, "no draft accepted: the drafts' equality would say nothing"


def test_prompts_are_grouped_by_their_padded_size(target):
    engine = st.Engine(target, max_batch_size=16, max_seq_len=4096)
    engine._pads_prefill = True
    # 16 prompts of 300 tokens pad to 512: all 16 in one graph (16 x 512 = PREFILL_GRAPH_TOKENS).
    groups = engine._prefill_groups([engine._make_request(i, [1] * 300, 8) for i in range(16)])
    assert [len(g) for g in groups] == [16]
    assert engine.prefill_length(16, 300) == (512, True)
    # 600 tokens pad to 768: eight per graph, sixteen past a graph's tokens (eager, unpadded).
    assert engine.prefill_length(8, 600) == (768, True) and engine.prefill_length(16, 600) == (600, False)
    groups = engine._prefill_groups([engine._make_request(i, [1] * 600, 8) for i in range(16)])
    assert [len(g) for g in groups] == [8, 8]
    # The demo target's 2,048 positions, less a tree after the prompt, end the lengths at 2,045.
    assert target.config.max_position_embeddings == 2048 and engine._prefill_lengths[-1] == 2045
    assert engine.prefill_length(4, 1600) == (2045, True) and engine.prefill_length(8, 1600) == (1600, False)
    # Prompts no padded length serves are grouped by the eager budget, unpadded: 13 of 600 tokens
    # when the lengths stop at 512.
    engine._prefill_lengths = tuple(t for t in PREFILL_LENGTHS if t <= 512)
    groups = engine._prefill_groups([engine._make_request(i, [1] * 600, 8) for i in range(16)])
    assert [len(g) for g in groups] == [13, 3] and engine.prefill_budget // 600 == 13


def test_a_cache_shorter_than_a_padded_length_pads_to_its_own_length(target):
    # A 700-token cache has no room for 768 padded tokens: a 600-token prompt pads to 700 instead
    # of prefilling eagerly, and a 400-token one still to 512.
    engine = st.Engine(target, max_batch_size=4, max_seq_len=700)
    engine._pads_prefill = True
    assert engine._prefill_lengths == (*[t for t in PREFILL_LENGTHS if t <= 512], 700)
    assert engine.prefill_length(1, 600) == (700, True) and engine.prefill_length(4, 400) == (512, True)


def test_warmup_prefills_every_padded_length_at_every_bucket_a_graph_takes(target, monkeypatch):
    engine = st.Engine(target, max_batch_size=8, max_seq_len=700)
    engine._pads_prefill = engine.cuda_graphs = True  # as on CUDA
    seen = []
    monkeypatch.setattr(engine, "_prefill", lambda reqs, *args: seen.append((len(reqs), len(reqs[0].prompt))))
    engine._warm_prefills()
    want = [(b, min(t, 699)) for t in engine._prefill_lengths for b in engine.graph_buckets
            if b * t <= PREFILL_GRAPH_TOKENS]
    assert sorted(seen) == sorted(want) and (4, 699) in seen and (8, 512) in seen
