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
    # 16 prompts of 300 tokens pad to 320: all 16 in one graph (16 x 320 < PREFILL_GRAPH_TOKENS).
    groups = engine._prefill_groups([engine._make_request(i, [1] * 300, 8) for i in range(16)])
    assert [len(g) for g in groups] == [16]
    assert engine.prefill_length(16, 300) == (320, True)
    # 600 tokens pad to 640: eight per graph, sixteen past a graph's tokens (eager, unpadded).
    assert engine.prefill_length(8, 600) == (640, True) and engine.prefill_length(16, 600) == (600, False)
    groups = engine._prefill_groups([engine._make_request(i, [1] * 600, 8) for i in range(16)])
    assert [len(g) for g in groups] == [8, 8]
    # The demo target's 2,048 positions, less a tree after the prompt, end the lengths at 2,045.
    assert target.config.max_position_embeddings == 2048 and engine._prefill_lengths[-1] == 2045
    assert engine.prefill_length(4, 1600) == (2045, True) and engine.prefill_length(8, 1600) == (1600, False)
    # Prompts no padded length serves are grouped by the eager budget, unpadded: at most 13 of 600
    # tokens when the lengths stop at 512, so two forwards.
    engine._prefill_lengths = tuple(t for t in PREFILL_LENGTHS if t <= 512)
    groups = engine._prefill_groups([engine._make_request(i, [1] * 600, 8) for i in range(16)])
    assert len(groups) == 2 and max(len(g) for g in groups) <= engine.prefill_budget // 600 == 13
    assert sorted(r.request_id for g in groups for r in g) == list(range(16))


def partitions(items: list[int]):
    """Every partition of ``items`` into groups (Bell(n) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1:]]


@pytest.mark.parametrize("seed", range(6))
def test_prompts_are_grouped_into_the_fewest_padded_tokens(target, seed):
    # Oracle: every partition of the prompts into groups that fit a graph, costed as the engine pads
    # them (the batch bucket times the padded length) plus PREFILL_FORWARD_TOKENS per forward; the
    # engine's grouping costs the least of them.
    import random

    from spectool.draft import PREFILL_FORWARD_TOKENS

    rng = random.Random(seed)
    engine = st.Engine(target, max_batch_size=8, max_seq_len=2048)
    engine._pads_prefill = engine.cuda_graphs = True  # as on CUDA: a group's rows pad to its batch bucket
    lengths = [rng.choice([rng.randint(10, 200), rng.randint(300, 1100)]) for _ in range(7)]
    reqs = [engine._make_request(i, [1] * n, 8) for i, n in enumerate(lengths)]

    def cost(groups: list[list[int]]) -> int | None:
        total = 0
        for g in groups:
            t, graphed = engine.prefill_length(len(g), max(lengths[i] for i in g))
            if not graphed:
                return None
            total += engine._prefill_runner.bucket_for(len(g)) * t + PREFILL_FORWARD_TOKENS
        return total

    got = [[r.request_id for r in g] for g in engine._prefill_groups(reqs)]
    assert sorted(i for g in got for i in g) == list(range(7))
    assert got == sorted(got) and all(g == sorted(g) for g in got)
    best = min(c for part in partitions(list(range(7))) if (c := cost(part)) is not None)
    assert cost(got) == best
    # Mixed lengths pad less than in the order given, eight to a graph as far as they fit.
    in_order = [list(range(i, min(i + 8, 7))) for i in range(0, 7, 8)]
    assert cost(in_order) is None or cost(got) <= cost(in_order)


def test_a_cache_shorter_than_a_padded_length_pads_to_its_own_length(target):
    # A 700-token cache has no room for 768 padded tokens: a 680-token prompt pads to 700 instead
    # of prefilling eagerly, and a 400-token one still to 448.
    engine = st.Engine(target, max_batch_size=4, max_seq_len=700)
    engine._pads_prefill = True
    assert engine._prefill_lengths == (*[t for t in PREFILL_LENGTHS if t <= 640], 700)
    assert engine.prefill_length(1, 680) == (700, True) and engine.prefill_length(4, 400) == (448, True)


def test_warmup_prefills_every_padded_length_at_every_bucket_a_graph_takes(target, monkeypatch):
    engine = st.Engine(target, max_batch_size=8, max_seq_len=700)
    engine._pads_prefill = engine.cuda_graphs = True  # as on CUDA
    seen = []
    monkeypatch.setattr(engine, "_prefill", lambda reqs, *args: seen.append((len(reqs), len(reqs[0].prompt))))
    engine._warm_prefills()
    want = [(b, min(t, 699)) for t in engine._prefill_lengths for b in engine.graph_buckets
            if b * t <= PREFILL_GRAPH_TOKENS]
    assert sorted(seen) == sorted(want) and (4, 699) in seen and (8, 512) in seen
