"""Engine.warmup and the drafters' batched prefill, on the CPU.

``warmup`` runs dummy requests through every path of the iteration so that no graph is
captured inside a user's call (tests/gpu/test_warmup_gpu.py checks the captures). What a
user relies on here: it changes nothing they can see. Oracle: an engine that never warmed
up, decoding the same prompts (greedy and seeded sampling), and a fresh N-gram trie.

The EAGLE drafters extend their layers over all prompts of a prefill at once, right-padded.
Oracle: the same prompts prefilled one at a time (an engine of batch size 1): the first
draft tree of every request must be the same.
"""

from __future__ import annotations

import pytest
from test_engine_support import cut_prompts, demo_token_streams

import spectool as st

METHODS = ["none", "ngram", "eagle", "multi_layer_eagle"]


@pytest.fixture(scope="module")
def prompts(target, demo_model_dir):
    return cut_prompts(demo_token_streams(target, demo_model_dir), 3, seed=5, min_len=6, max_len=40,
                       repetitive_every=2)


def draft_config(demo_dir, method: str):
    return {"none": None,
            "ngram": st.NgramConfig(num_draft_tokens=6, max_bfs_breadth=2),
            "eagle": st.EagleConfig(demo_dir / "eagle", num_steps=2, topk=2, num_draft_tokens=5),
            "multi_layer_eagle": st.MultiLayerEagleConfig(demo_dir / "multi_layer_eagle", num_steps=2),
            }[method]


@pytest.mark.parametrize("method", METHODS)
def test_warmup_changes_no_output(target, demo_model_dir, prompts, method):
    runs = []
    for warm in (False, True):
        engine = st.Engine(target, draft=draft_config(demo_model_dir, method), max_batch_size=3, max_seq_len=64)
        if warm:
            report = engine.warmup()
            assert set(report) == {"seconds", "captures"} and report["seconds"] > 0
        greedy = engine.generate(prompts, max_new_tokens=10, ignore_eos=True, record=True).token_ids
        sampled = engine.generate(prompts, max_new_tokens=10, ignore_eos=True, record=False, temperature=0.9,
                                  seed=4).token_ids
        runs.append((greedy, sampled))
    assert runs[1] == runs[0]


def test_warmup_leaves_the_trie_empty(target):
    engine = st.Engine(target, draft=st.NgramConfig(num_draft_tokens=6), max_batch_size=4, max_seq_len=64)
    fresh = engine.drafter.corpus.stats()
    engine.warmup(sampling=False, record=False)
    after = engine.drafter.corpus.stats()
    assert after["nodes"] == fresh["nodes"] == 0
    assert after["puts"] == fresh["puts"]


def test_warmup_runs_every_bucket_and_mode(target, demo_model_dir):
    engine = st.Engine(target, draft=draft_config(demo_model_dir, "eagle"), max_batch_size=3, max_seq_len=64)
    seen = []
    iteration = engine._iteration

    def logged(began, it, running, batch, lens_roots, sampling, generator, stats, recorder, *args):
        seen.append((batch.size, sampling["temperature"] > 0, recorder is not None, sampling["top_k"],
                     sampling["top_p"]))
        return iteration(began, it, running, batch, lens_roots, sampling, generator, stats, recorder, *args)

    engine._iteration = logged
    engine.warmup(top_k=5, top_p=0.9)
    # Buckets 1, 2, 4 (4 holds the largest batch, 3); greedy and sampling (with the cuts asked for);
    # recording off and on.
    assert sorted(seen) == sorted((b, s, r, *((5, 0.9) if s else (0, 1.0)))
                                  for b in (1, 2, 3) for s in (False, True) for r in (False, True))


@pytest.mark.parametrize("cuts, match", [({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"),
                                         ({"top_p": 1.5}, "top_p")])
def test_warmup_rejects_cuts_generate_would_reject(target, cuts, match):
    engine = st.Engine(target, max_batch_size=2, max_seq_len=64)
    with pytest.raises(ValueError, match=match):
        engine.warmup(**cuts)


@pytest.mark.parametrize("method", ["eagle", "multi_layer_eagle"])
def test_batched_draft_prefill_equals_one_prompt_at_a_time(target, demo_model_dir, prompts, method):
    assert len({len(p) for p in prompts}) > 1, "prompts of different lengths exercise the padding"
    first_trees = []
    for batch in (1, len(prompts)):
        engine = st.Engine(target, draft=draft_config(demo_model_dir, method), max_batch_size=batch,
                           max_seq_len=64)
        trace = engine.generate(prompts, max_new_tokens=2, ignore_eos=True, record=True).trace
        first_trees.append([trace.iteration(trace.iterations(r)[0], r).tokens.tolist()
                            for r in range(len(prompts))])
    assert first_trees[1] == first_trees[0]


def test_ngram_prefill_puts_what_one_put_of_each_history_would(target, prompts):
    """The trie takes the prompts before the target's prefill and the first tokens after it; its
    content must equal that of one put of every history (prompt + first token). Oracle: a
    corpus fed that way, compared by the drafts both give for every suffix of the histories."""
    from spectool.native import NgramCorpus

    config = st.NgramConfig(num_draft_tokens=6, max_bfs_breadth=3, max_trie_depth=5, match="prob")
    engine = st.Engine(target, draft=config, max_batch_size=2, max_seq_len=64)  # two prefills
    first = [out[0] for out in engine.generate(prompts, max_new_tokens=1, record=False).token_ids]
    histories = [p + [t] for p, t in zip(prompts, first)]
    oracle = NgramCorpus(max_trie_depth=5, min_bfs_breadth=1, max_bfs_breadth=3, num_draft_tokens=6, match="prob")
    oracle.batch_put(histories, req_ids=list(range(len(histories))), total_lens=[len(h) for h in histories])
    oracle.synchronize()
    corpus = engine.drafter.corpus
    assert corpus.stats()["nodes"] == oracle.stats()["nodes"] > 0
    tails = [h[max(0, i - 4):i] for h in histories for i in range(1, len(h) + 1)]
    got, want = corpus.batch_get(None, tails, None), oracle.batch_get(None, tails, None)
    for field in ("tokens", "parents", "scores", "valid"):
        assert (getattr(got, field) == getattr(want, field)).all(), field
