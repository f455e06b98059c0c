"""The running batch the engine keeps on the device between iterations.

The engine builds a ``Batch`` only when requests join or leave and otherwise advances its
seq_lens and roots on the device from the verify step's output. Every drafter must still see,
at every ``draft`` call, exactly the state the host knows. Oracle: each request's history
rebuilt from the stream's own events (prompt, then the prefill token, then every event's new
tokens), independent of the engine's device tensors. Requests join and leave mid-run (more
prompts than slots, a stop token that ends some early, different max_new_tokens via stop).
"""

from __future__ import annotations

import pytest
import torch
from test_engine_support import cut_prompts, demo_token_streams

import spectool as st
from spectool.trace.stats import summarize

MAX_NEW = 12
METHODS = ["none", "ngram", "eagle", "multi_layer_eagle"]


@pytest.fixture(scope="module")
def prompts(target, demo_model_dir):
    return cut_prompts(demo_token_streams(target, demo_model_dir), 5, seed=11, min_len=5, max_len=30,
                       repetitive_every=2)


def make_engine(target, demo_dir, method: str) -> st.Engine:
    draft = {"none": None,
             "ngram": st.NgramConfig(num_draft_tokens=6, max_bfs_breadth=2),
             "eagle": st.EagleConfig(demo_dir / "eagle", num_steps=2, topk=2, num_draft_tokens=5),
             "multi_layer_eagle": st.MultiLayerEagleConfig(demo_dir / "multi_layer_eagle", num_steps=2),
             }[method]
    return st.Engine(target, draft=draft, max_batch_size=2, max_seq_len=64)


def _seen_batches(engine: st.Engine) -> list[dict]:
    """Wrap the engine's draft step so it logs what each iteration's Batch said."""
    seen: list[dict] = []

    def log(batch) -> None:
        seen.append({"request_ids": list(batch.request_ids), "seq_lens": batch.seq_lens.tolist(),
                     "roots": batch.roots.tolist(), "seq_lens_host": list(batch.seq_lens_host),
                     "histories": [list(h) for h in batch.histories], "slots": batch.slots.tolist()})

    if engine.drafter is None:  # plain decoding has no draft step: log at the iteration's start
        iteration = engine._iteration

        def logged_iteration(began, it, running, batch, *args):
            log(batch)
            return iteration(began, it, running, batch, *args)
        engine._iteration = logged_iteration
    else:
        draft = engine.drafter.draft

        def logged_draft(batch, timer):
            log(batch)
            return draft(batch, timer)
        engine.drafter.draft = logged_draft
    return seen


@pytest.mark.parametrize("method", METHODS)
def test_every_draft_sees_the_host_state(target, demo_model_dir, prompts, method):
    engine = make_engine(target, demo_model_dir, method)
    plain = st.Engine(target, max_batch_size=4, max_seq_len=64).generate(
        prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=False).token_ids
    stop = plain[1][3]  # ends some requests early, so slots free up mid-run and new ones join
    seen = _seen_batches(engine)
    history = {rid: list(p) for rid, p in enumerate(prompts)}
    checked = iterations = 0
    for event in engine.stream(prompts, max_new_tokens=MAX_NEW, stop_token_ids=[stop], record=False):
        for rid, first in event.prefill_tokens.items():
            history[rid].append(first)
        batch = seen[event.iteration]
        assert sorted(batch["request_ids"]) == sorted(event.new_tokens)
        for b, rid in enumerate(batch["request_ids"]):
            want = history[rid]
            assert batch["histories"][b] == want
            assert batch["roots"][b] == want[-1]
            # The root is not in the cache yet: seq_len counts every token before it.
            assert batch["seq_lens"][b] == batch["seq_lens_host"][b] == len(want) - 1
            checked += 1
        assert len(set(batch["slots"])) == len(batch["slots"])
        for rid, new in event.new_tokens.items():
            history[rid].extend(new)
        iterations += 1
    # One draft per iteration: a draft made early (at the end of the last iteration, when no
    # request finished) is the one used, and none is made for a batch about to change.
    assert len(seen) == iterations
    assert checked > len(prompts)  # requests were drafted for over several iterations
    assert len({rid for b in seen for rid in b["request_ids"]}) == len(prompts)
    # The stream's histories end in the outputs a plain run gives (cut at the stop token).
    for rid, p in enumerate(prompts):
        out = plain[rid][:plain[rid].index(stop) + 1] if stop in plain[rid] else plain[rid]
        assert history[rid] == list(p) + out


def test_live_stats_follow_their_columns(target, demo_model_dir, prompts):
    engine = make_engine(target, demo_model_dir, "ngram")
    result = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=False)
    stats, cols = result.stats, result.stats.columns
    assert stats.mean_accept_length == pytest.approx(sum(cols["accept_length"]) / len(cols["accept_length"]))
    assert stats.tokens_per_s == pytest.approx(summarize(cols)["tokens_per_s"])
    lengths = {len(col) for col in cols.values()}
    assert lengths == {len(cols["iteration"])}  # one value per record in every column
    # Phase timings are per batch: every record of an iteration carries the same values.
    for name in ("iteration_us", "draft_us", "verify_us", "trie_get_us"):
        per_iteration: dict[int, set] = {}
        for it, v in zip(cols["iteration"], cols[name]):
            per_iteration.setdefault(it, set()).add(v)
        assert all(len(v) == 1 for v in per_iteration.values())
    assert sum(cols["trie_get_us"]) > 0


def test_ngram_feeds_the_trie_each_requests_latest_tokens(target, demo_model_dir, prompts):
    """After every verify the N-gram drafter puts, per request, the last max_trie_depth tokens
    it had plus the ones it gained (and the new history length). Oracle: the histories rebuilt
    from the stream's events."""
    engine = make_engine(target, demo_model_dir, "ngram")
    depth = engine.drafter.config.max_trie_depth
    puts: list[tuple[list[list[int]], list[int], list[int]]] = []

    class SpyCorpus:
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def batch_put(self, windows, req_ids, total_lens):
            puts.append(([list(w) for w in windows], list(req_ids), list(total_lens)))
            return self._inner.batch_put(windows, req_ids=req_ids, total_lens=total_lens)

    engine.drafter.corpus = SpyCorpus(engine.drafter.corpus)
    history = {rid: list(p) for rid, p in enumerate(prompts)}
    checked = 0
    for event in engine.stream(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=False):
        for rid, first in event.prefill_tokens.items():
            history[rid].append(first)
        windows, req_ids, total_lens = puts[-1]  # this iteration's on_verify
        assert sorted(req_ids) == sorted(event.new_tokens)
        for window, rid, total in zip(windows, req_ids, total_lens):
            new = event.new_tokens[rid]
            if rid not in event.finished:  # a finishing request's output may be cut short of what it gained
                assert window == (history[rid] + new)[-(depth + len(new)):]
                assert total == len(history[rid]) + len(new)
                checked += 1
        for rid, new in event.new_tokens.items():
            history[rid].extend(new)
    assert checked >= len(prompts)


@pytest.mark.parametrize("method", ["eagle", "multi_layer_eagle"])
def test_the_extend_graphs_draft_equals_a_fresh_draft(target, demo_model_dir, prompts, method):
    """After a verify each EAGLE's extend step also drafts the next iteration's tree (one graph
    on the GPU). Outputs stay lossless even with a wrong tree, so compare the tree itself: at
    every draft served that way, the drafter's own draft for the same batch state (the draft
    graph, or the chain from its buffers) must give the same tree."""
    from spectool.draft.tree import TREE_TENSORS

    engine = make_engine(target, demo_model_dir, method)
    drafter = engine.drafter
    draft = drafter.draft
    compared = 0

    def checked_draft(batch, timer):
        nonlocal compared
        stored = drafter._next is not None and drafter._next[0] is batch
        tree, why = draft(batch, timer)
        if stored:
            drafter._next = None  # the fresh path: drafted from the batch alone
            fresh, fresh_why = draft(batch, timer)
            assert fresh.max_depth == tree.max_depth
            for name in TREE_TENSORS:
                got, want = getattr(tree, name), getattr(fresh, name)
                if want.is_floating_point():
                    assert torch.allclose(got, want, atol=1e-5), name
                else:
                    assert torch.equal(got, want), name
            assert torch.equal(tree.tokens[:, 0], batch.roots)
            assert torch.equal(tree.seq_lens, batch.seq_lens)
            for key in why:
                assert torch.allclose(why[key].float(), fresh_why[key].float(), atol=1e-5), key
            compared += 1
        return tree, why

    drafter.draft = checked_draft
    engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=False)
    assert compared >= len(prompts)


def test_the_greedy_step_completes_an_ngram_mask_tree_as_from_mask_does(target, demo_model_dir, prompts):
    """N-gram drafts leave the tree's index arrays to the greedy verify step (inside its graph
    on the GPU). The step on a MaskTree must equal the step on that tree completed eagerly by
    DraftTree.from_mask (the step is idempotent on the same inputs: it rewrites the tree's K/V)."""
    from spectool.draft.tree import MaskTree

    engine = make_engine(target, demo_model_dir, "ngram")
    draft = engine.drafter.draft
    compared = 0

    def checked_draft(batch, timer):
        nonlocal compared
        tree, why = draft(batch, timer)
        assert isinstance(tree, MaskTree)
        full = tree.build()
        lazy = engine._greedy_step(batch.slots, **tree.as_inputs())
        eager = engine._greedy_step(batch.slots, **full.as_inputs())
        for got, want in zip(lazy, eager, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # coins are NaN when unused
        compared += int(bool(full.valid[:, 1:].any()))  # a real tree, not the root alone
        return tree, why

    engine.drafter.draft = checked_draft
    engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=False)
    assert compared >= len(prompts)


def test_ngram_verifies_the_roots_alone_when_nothing_matched(target, demo_model_dir, prompts):
    """An iteration where no row's tail matched the trie (the trie's own match length 0 for every
    row) verifies a one-node tree, a plain decoding step; every other keeps N nodes. Output stays
    plain greedy decoding's."""
    plain = st.Engine(target, max_batch_size=2, max_seq_len=64).generate(
        prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=False).token_ids
    engine = make_engine(target, demo_model_dir, "ngram")
    result = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=True)
    assert result.token_ids == plain
    steps = result.trace.steps.select(["iteration", "num_nodes", "ngram_match_len"]).to_pylist()
    by_iteration: dict[int, list[dict]] = {}
    for row in steps:
        by_iteration.setdefault(row["iteration"], []).append(row)
    sizes = set()
    for rows in by_iteration.values():
        if rows[0]["iteration"] == 0 or rows[0]["ngram_match_len"] is None:
            continue  # the prefill's first token: no draft
        size = {r["num_nodes"] for r in rows}
        assert len(size) == 1
        nothing = all(r["ngram_match_len"] == 0 for r in rows)
        assert size == ({1} if nothing else {engine.drafter.num_draft_tokens}), rows
        sizes |= size
    assert sizes == {1, engine.drafter.num_draft_tokens}  # both kinds of iteration happened
