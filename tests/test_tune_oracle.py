"""The what-if tuner against its oracle: real engine runs of the same configurations on the
same prompts. Greedy accept lengths must be equal iteration by iteration, request by request,
and the predicted run as a trace must be the engine's trace (trees, masks, decisions).

The recorded trace decodes a few tokens more than the runs compared (``max_new_tokens`` is
cut in the tuner), so the tokens a last iteration verifies past the output are known and
every prediction is exact, not a lower bound.
"""

from __future__ import annotations

import json

import pytest

import spectool as st
from spectool.tune.recommend import tune

MAX_NEW = 16
EXTRA = 10


@pytest.fixture(scope="module")
def prompts(target, demo_model_dir):
    lines = [json.loads(x) for x in (demo_model_dir / "prompts.jsonl").read_text().splitlines() if x.strip()]
    editing = [x["prompt"] for x in lines if x["kind"] == "editing"]
    completion = [x["prompt"] for x in lines if x["kind"] == "completion"]
    # Short tails: an editing prompt repeats itself (deep N-gram matches), a completion does not.
    return [target.encode(p)[-40:] for p in (editing[:2] + completion[:1])]


TREE_FIELDS = ("iteration", "request_id", "seq_len", "num_nodes", "tokens", "parents", "valid", "mask_packed",
               "positions", "status", "accept_path", "accept_length", "bonus_token")


def _engine_trace(target, config, prompts, bs: int, max_new: int):
    return st.Engine(target, draft=config, max_batch_size=bs, max_seq_len=256).generate(
        prompts, max_new_tokens=max_new, ignore_eos=True).trace


def _rows(trace):
    s = trace.steps
    return list(zip(s.column("iteration").to_pylist(), s.column("request_id").to_pylist(),
                    s.column("accept_length").to_pylist()))


def _check_same_run(pred, recorded, engine_trace) -> None:
    """Accept lengths equal, iteration by iteration; and the prediction as a trace is the engine's
    trace of that run (trees, masks, decisions), and passes the trace checker."""
    from spectool.trace.check import check_trace

    assert pred.exact
    assert _predicted_rows(pred) == _rows(engine_trace), pred.config
    as_trace = pred.to_trace(recorded)
    assert check_trace(as_trace) is None
    assert as_trace.steps.select(TREE_FIELDS).to_pylist() == engine_trace.steps.select(TREE_FIELDS).to_pylist()


def _predicted_rows(pred):
    return list(zip(pred.iteration.tolist(), pred.request_id.tolist(), pred.accept_length.tolist()))


NGRAM_CONFIGS = [
    st.NgramConfig(),
    st.NgramConfig(num_draft_tokens=2),
    st.NgramConfig(num_draft_tokens=4, max_bfs_breadth=1),
    st.NgramConfig(num_draft_tokens=6, max_bfs_breadth=2, min_bfs_breadth=2),
    st.NgramConfig(num_draft_tokens=8, max_bfs_breadth=4),
    st.NgramConfig(num_draft_tokens=16, max_bfs_breadth=8, min_bfs_breadth=2),
    st.NgramConfig(num_draft_tokens=24, max_bfs_breadth=16),
    st.NgramConfig(max_trie_depth=3, num_draft_tokens=8),
    st.NgramConfig(max_trie_depth=6, max_bfs_breadth=3, num_draft_tokens=10),
    st.NgramConfig(match="prob", num_draft_tokens=8),
    st.NgramConfig(match="prob", num_draft_tokens=16, max_trie_depth=8),
    st.NgramConfig(capacity=64, num_draft_tokens=8, max_trie_depth=4),
]


@pytest.mark.parametrize("bs", [1, 4])
def test_ngram_whatif_equals_engine_runs(target, prompts, bs):
    recorded = st.Engine(target, draft=st.NgramConfig(), max_batch_size=bs, max_seq_len=256).generate(
        prompts, max_new_tokens=MAX_NEW + EXTRA, ignore_eos=True).trace
    result = tune(recorded, grid=NGRAM_CONFIGS, max_new_tokens=MAX_NEW, progress=False)
    assert len(result.predictions) == len(NGRAM_CONFIGS) >= 12
    for config, pred in zip(NGRAM_CONFIGS, result.predictions):
        _check_same_run(pred, recorded, _engine_trace(target, config, prompts, bs, MAX_NEW))
    # The configurations really decode differently (else equality would say little).
    assert len({tuple(p.accept_length.tolist()) for p in result.predictions}) >= 4


EAGLE_CONFIGS = [
    dict(num_steps=1, topk=1, num_draft_tokens=2),
    dict(num_steps=3, topk=1, num_draft_tokens=4),
    dict(num_steps=5, topk=1, num_draft_tokens=6),
    dict(num_steps=2, topk=2, num_draft_tokens=4),
    dict(num_steps=4, topk=2, num_draft_tokens=8),
    dict(num_steps=3, topk=3, num_draft_tokens=6),
    dict(num_steps=5, topk=4, num_draft_tokens=16),
    dict(num_steps=4, topk=4, num_draft_tokens=10),
]


@pytest.mark.parametrize("method", ["eagle", "multi_layer_eagle"])
def test_eagle_whatif_equals_engine_runs(target, prompts, demo_model_dir, method):
    path = demo_model_dir / method
    if method == "eagle":
        runs = [(st.EagleConfig(path, **c), 2) for c in EAGLE_CONFIGS]
    else:  # the checkpoint has four layers: every step count, at two batch sizes
        runs = [(st.MultiLayerEagleConfig(path, num_steps=s), bs) for bs in (1, 3) for s in (1, 2, 3, 4)]
    assert len(runs) >= 8
    recorded = st.Engine(target, draft=runs[-1][0], max_batch_size=2, max_seq_len=256).generate(
        prompts, max_new_tokens=MAX_NEW + EXTRA, ignore_eos=True).trace
    for bs in sorted({bs for _, bs in runs}):
        configs = [c for c, b in runs if b == bs]
        result = tune(recorded, grid=configs, max_new_tokens=MAX_NEW, batch_size=bs, target=target, progress=False)
        for config, pred in zip(configs, result.predictions):
            _check_same_run(pred, recorded, _engine_trace(target, config, prompts, bs, MAX_NEW))
    distinct = {tuple(p.accept_length.tolist()) for p in result.predictions}
    assert len(distinct) >= 3
