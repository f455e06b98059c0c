"""spectool.native.NgramCorpus against the pure-Python reference and the tree invariants."""

from __future__ import annotations

import random
import re
import sysconfig
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ngram_reference import ReferenceCorpus

from spectool.native import NgramCorpus, NgramDraft

FIELDS = ("tokens", "parents", "mask", "valid", "scores", "match_len", "breadth")


@pytest.fixture(scope="session")
def stdlib_tokens() -> list[int]:
    """~60k tokens of real Python source (stdlib), split into words, numbers, symbols."""
    vocab: dict[str, int] = {}
    out: list[int] = []
    lib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "heapq.py", "bisect.py", "fnmatch.py", "string.py", "shlex.py", "glob.py"):
        text = (lib / name).read_text()
        out += [vocab.setdefault(t, len(vocab)) for t in re.findall(r"\w+|\s+|[^\w\s]", text)]
    return out


def assert_same(native, ref, where=""):
    for name, got, want in zip(FIELDS, native, ref):
        np.testing.assert_array_equal(got, want, err_msg=f"{where}: field {name}")


def check_tree(d, n, min_b=None, max_b=None, match="bfs"):
    """Tree invariants of every row: topological, mask = ancestors, padding after the nodes."""
    bs = d.tokens.shape[0]
    assert d.tokens.shape == (bs, n) and d.tokens.dtype == np.int32
    assert d.mask.shape == (bs, n, n) and d.mask.dtype == np.bool_
    assert d.scores.dtype == np.float32 and d.match_len.shape == (bs,)
    for b in range(bs):
        parents, valid = d.parents[b], d.valid[b]
        assert parents[0] == -1 and valid[0]
        k = int(valid.sum())
        assert valid[:k].all() and not valid[k:].any(), "padding must come last"
        assert (parents[k:] == 0).all(), "padding hangs off the root"
        for i in range(1, n):
            assert 0 <= parents[i] < i, "topological order"
            expect = np.zeros(n, bool)
            j = i
            while j >= 0:
                expect[j] = True
                j = parents[j] if j > 0 else -1
            np.testing.assert_array_equal(d.mask[b, i], expect)
        assert d.mask[b, 0].sum() == 1 and d.mask[b, 0, 0]
        kids = np.bincount(parents[1:k], minlength=n) if k > 1 else np.zeros(n, int)
        if match == "bfs" and max_b is not None:
            assert kids.max() <= max_b
            if d.match_len[b] > 0:
                assert min_b <= d.breadth[b] <= max_b
        if match == "prob":
            assert d.breadth[b] == kids.max()
        if d.match_len[b] == 0:
            assert k == 1 or d.breadth[b] >= 0


def paths(d, b):
    """Token path (root excluded) of every valid node of row b."""
    out = []
    for i in range(1, int(d.valid[b].sum())):
        path, j = [], i
        while j > 0:
            path.append(int(d.tokens[b, j]))
            j = d.parents[b, j]
        out.append(path[::-1])
    return out


def occurs(seq, streams) -> bool:
    k = len(seq)
    return any(list(s[i:i + k]) == seq for s in streams for i in range(len(s) - k + 1))


# ----- native == reference -----

@st.composite
def scenarios(draw):
    depth = draw(st.integers(1, 6))
    min_b = draw(st.integers(1, 3))
    params = dict(
        max_trie_depth=depth, min_bfs_breadth=min_b, max_bfs_breadth=draw(st.integers(min_b, 5)),
        num_draft_tokens=draw(st.integers(2, 10)), match=draw(st.sampled_from(["bfs", "prob"])),
        capacity=draw(st.one_of(st.integers(depth, 40), st.just(10_000))))
    vocab = draw(st.integers(2, 6))
    ops = draw(st.lists(st.tuples(st.sampled_from(["put", "req", "get", "erase"]), st.integers(0, 2),
                                  st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12)),
                        min_size=1, max_size=25))
    return params, ops


def garbage_out(bs: int, n: int, seed: int = 0) -> NgramDraft:
    """Output arrays for ``batch_get(out=...)`` filled with random bytes."""
    rng = np.random.default_rng(seed)
    shapes = dict(tokens=(bs, n), parents=(bs, n), mask=(bs, n, n), valid=(bs, n), scores=(bs, n),
                  match_len=(bs,), breadth=(bs,))
    dtypes = dict(tokens=np.int32, parents=np.int32, mask=np.bool_, valid=np.bool_, scores=np.float32,
                  match_len=np.int32, breadth=np.int32)
    return NgramDraft(**{k: rng.integers(0, 256, np.prod(shapes[k]) * np.dtype(dtypes[k]).itemsize, np.uint8)
                         .view(dtypes[k]).reshape(shapes[k]) for k in shapes})


def run_scenario(params, ops, check_every_get=True):
    native, ref = NgramCorpus(**params), ReferenceCorpus(**params)
    streams: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for step, (op, rid, toks) in enumerate(ops):
        if op == "put":  # plain put: counts the whole window again
            for c in (native, ref):
                c.batch_put([toks])
        elif op == "req":  # request grows by toks; re-put a window covering old and new tokens
            streams[rid] += toks
            window = streams[rid][-(len(toks) + 3):]
            for c in (native, ref):
                c.batch_put([np.array(window, np.int64)], [rid], [len(streams[rid])])
        elif op == "erase":
            streams[rid] = []
            for c in (native, ref):
                c.erase_match_state([rid, 99])
        else:
            native.synchronize()
            tails = [toks] + [s[-7:] for s in streams.values() if s]
            ids = [7] + [r for r, s in streams.items() if s]
            lens = [len(toks)] + [len(s) for s in streams.values() if s]
            got = native.batch_get(ids, tails, lens)
            want = ref.batch_get(ids, tails, lens)
            assert_same(got, want, f"step {step}")
            # Written into caller-owned arrays holding garbage: every field is overwritten.
            out = garbage_out(len(ids), params["num_draft_tokens"], seed=step)
            assert native.batch_get(ids, tails, lens, out=out) is not None
            assert_same(out, want, f"step {step}, out=")
            check_tree(got, params["num_draft_tokens"], params["min_bfs_breadth"], params["max_bfs_breadth"],
                       params["match"])
    native.synchronize()
    stats = native.stats()
    assert stats["nodes"] == ref.nodes <= params["capacity"]
    assert stats["evictions"] == ref.evictions
    return native, ref


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_native_matches_reference_on_random_streams(scenario):
    run_scenario(*scenario)


@st.composite
def wide_prob_scenarios(draw):
    """PROB with trees wider than the nodes' children lists are long and a frequent token (0) whose
    contexts have dozens of children, many of equal count, so expansions keep only the children a
    tree node can still reach, at ties, under evictions. Tokens come from a seeded generator:
    hypothesis's own integers stay too small to grow such nodes."""
    depth = draw(st.integers(2, 5))
    params = dict(max_trie_depth=depth, min_bfs_breadth=1, max_bfs_breadth=10,
                  num_draft_tokens=draw(st.integers(8, 40)), match="prob",
                  capacity=draw(st.one_of(st.integers(60, 300), st.just(10_000))))
    vocab = draw(st.integers(8, 80))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    ops = []
    for _ in range(draw(st.integers(4, 24))):
        toks = [0 if rng.random() < 0.4 else rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        ops.append((rng.choice(["put", "put", "req", "get", "get"]), rng.randrange(3), toks))
    return params, ops


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(wide_prob_scenarios())
def test_prob_matches_reference_on_wide_trees(scenario):
    run_scenario(*scenario)


@pytest.mark.parametrize("match", ["bfs", "prob"])
@pytest.mark.parametrize("capacity", [300, 10_000_000])
def test_native_matches_reference_on_real_text(stdlib_tokens, match, capacity):
    """Four requests decode through real source 1-3 tokens at a time, re-putting an 18-token window."""
    params = dict(max_trie_depth=8, min_bfs_breadth=1, max_bfs_breadth=6, num_draft_tokens=12, match=match,
                  capacity=capacity)
    native, ref = NgramCorpus(**params), ReferenceCorpus(**params)
    seed_text = stdlib_tokens[:1500]
    for c in (native, ref):
        c.batch_put([seed_text[i:i + 50] for i in range(0, len(seed_text), 50)])
    rng = random.Random(0)
    starts = [2000, 2600, 3200, 3800]
    lens = [20, 20, 20, 20]
    for _ in range(40):
        lens = [n + rng.randint(1, 3) for n in lens]
        seqs = [stdlib_tokens[s:s + n] for s, n in zip(starts, lens)]
        tails = [np.array(q[-12:], np.int32) for q in seqs]
        native.synchronize()
        assert_same(native.batch_get([0, 1, 2, 3], tails, lens), ref.batch_get([0, 1, 2, 3], tails, lens))
        windows = np.array([q[-18:] for q in seqs], np.int64)
        for c in (native, ref):
            c.batch_put(windows, [0, 1, 2, 3], lens)
    native.synchronize()
    assert native.stats()["nodes"] == ref.nodes <= capacity
    assert native.stats()["evictions"] == ref.evictions
    if capacity == 300:
        assert ref.evictions > 0


@pytest.mark.parametrize("capacity", [900, 10_000_000])
def test_prob_matches_reference_on_nodes_with_many_children(capacity):
    """PROB needs the count sum and top children of a node it expands; a node with many (here the
    context "0", which is followed by up to 150 different tokens) has them ranked by the trie, which
    must follow every count, creation and eviction of its children between and within gets. Gets of several rows sharing
    that node alternate with puts that change its children and (at the small capacity) puts of
    text without a 0, which leave its children alone or evict some of them."""
    params = dict(max_trie_depth=4, num_draft_tokens=12, match="prob", capacity=capacity)
    native, ref = NgramCorpus(**params), ReferenceCorpus(**params)
    rng = random.Random(1)

    def follower() -> int:  # skewed, so counts differ and some tie
        return min(150, 1 + int(rng.expovariate(1 / 30)))

    seed = [t for _ in range(300) for t in (0, follower())]
    for c in (native, ref):
        c.batch_put([seed[i:i + 40] for i in range(0, len(seed), 40)])
    streams = {r: [0, follower(), 0] for r in range(4)}
    evicted_quietly = 0  # far puts that evicted children of a node 0 of >= 32 children
    for step in range(60):
        native.synchronize()
        ids = [0, 1, 2, 3, 9]
        tails = [streams[r][-3:] for r in range(4)] + [[follower(), 0]]
        lens = [len(streams[r]) for r in range(4)] + [2]
        assert_same(native.batch_get(ids, tails, lens), ref.batch_get(ids, tails, lens), f"step {step}")
        if step % 2 == 0:  # a token after 0: one of node 0's children is counted or created
            r = step // 2 % 4
            streams[r] += [follower(), 0]
            for c in (native, ref):
                c.batch_put([streams[r][-6:]], [r], [len(streams[r])])
        else:  # text without a 0: node 0's children stay as they were, unless evicted
            before = len(ref.root.children[0].children)
            far = [151 + rng.randrange(300) for _ in range(40)]
            for c in (native, ref):
                c.batch_put([far])
            evicted_quietly += before >= 32 and len(ref.root.children[0].children) < before
    native.synchronize()
    assert native.stats()["nodes"] == ref.nodes
    assert native.stats()["evictions"] == ref.evictions
    assert len(ref.root.children[0].children) >= 32 or capacity < 10_000_000
    if capacity < 10_000_000:
        assert evicted_quietly >= 3, "evictions must remove children of the many-children node between gets"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=15), min_size=1, max_size=4),
       st.lists(st.integers(0, 4), min_size=1, max_size=10), st.lists(st.integers(0, 4), max_size=10),
       st.sampled_from(["bfs", "prob"]), st.integers(2, 12), st.integers(1, 60))
def test_external_corpus_matches_reference(chunks, tail, trie_text, match, n, max_tokens):
    params = dict(max_trie_depth=5, min_bfs_breadth=1, max_bfs_breadth=3, num_draft_tokens=n, match=match)
    native, ref = NgramCorpus(**params), ReferenceCorpus(**params)
    for c in (native, ref):
        if trie_text:
            c.batch_put([trie_text])
        c.add_external_corpus("a", chunks, max_tokens)
        c.add_external_corpus("b", [list(reversed(x)) for x in chunks], max_tokens)
    native.synchronize()
    got = native.batch_get(None, [tail], None)
    assert_same(got, ref.batch_get(None, [tail], None))
    check_tree(got, n, 1, 3, match)
    # Every drafted path, after the tail's last token, occurs in what was put or in a corpus.
    streams = [trie_text] + [list(x) for x in ref.external["a"] + ref.external["b"]]
    for p in paths(got, 0):
        assert occurs([tail[-1]] + p, streams)


# ----- properties without the reference -----

@pytest.mark.parametrize("match", ["bfs", "prob"])
def test_every_path_continues_the_tail_with_inserted_text(stdlib_tokens, match):
    corpus = NgramCorpus(max_trie_depth=10, num_draft_tokens=16, match=match)
    docs = [stdlib_tokens[i:i + 300] for i in range(0, 6000, 300)]
    corpus.batch_put(docs)
    corpus.synchronize()
    rng = random.Random(1)
    tails = []
    for _ in range(30):
        s = rng.randrange(0, 12000)
        tails.append(stdlib_tokens[s:s + rng.randint(1, 15)])
    d = corpus.batch_get(None, tails, None)
    check_tree(d, 16, 1, 10, match)
    for b, tail in enumerate(tails):
        for p in paths(d, b):
            assert occurs([tail[-1]] + p, docs), f"row {b}: {p} never follows {tail[-1]}"
        if d.match_len[b] > 0:
            m = int(d.match_len[b])
            assert occurs(tail[-m:], docs)


def test_request_ids_give_true_counts(stdlib_tokens):
    """Re-putting overlapping windows with request ids counts each n-gram once: the
    probability tree equals that of one plain put of the whole stream."""
    text = stdlib_tokens[:800]
    once = NgramCorpus(max_trie_depth=6, num_draft_tokens=10, match="prob")
    once.batch_put([text])
    slid = NgramCorpus(max_trie_depth=6, num_draft_tokens=10, match="prob")
    for end in range(1, len(text) + 1):
        slid.batch_put([text[max(0, end - 18):end]], [5], [end])
        if end % 50 == 0:  # the same window again adds nothing
            slid.batch_put([text[max(0, end - 18):end]], [5], [end])
    for c in (once, slid):
        c.synchronize()
    assert once.stats()["nodes"] == slid.stats()["nodes"]
    tails = [text[i:i + 4] for i in range(0, 700, 23)]
    a, b = once.batch_get(None, tails, None), slid.batch_get(None, tails, None)
    for r in range(len(tails)):
        score_a = {tuple(p): s for p, s in zip(paths(a, r), a.scores[r, 1:])}
        score_b = {tuple(p): s for p, s in zip(paths(b, r), b.scores[r, 1:])}
        # Same counts give the same path probabilities (ties may pick different siblings).
        common = score_a.keys() & score_b.keys()
        assert all(score_a[p] == score_b[p] for p in common)
        assert sorted(score_a.values()) == sorted(score_b.values())


def test_bfs_breadth_shrinks_with_match_length():
    corpus = NgramCorpus(max_trie_depth=6, min_bfs_breadth=1, max_bfs_breadth=9, num_draft_tokens=40)
    # token 0 followed by 9 different tokens; 1 2 3 4 0 followed by 9 different tokens too
    corpus.batch_put([[1, 2, 3, 4, 0, 10 + k] for k in range(9)])
    corpus.synchronize()
    short = corpus.batch_get(None, [[7, 0]], None)   # matches "0" only
    long = corpus.batch_get(None, [[1, 2, 3, 4, 0]], None)  # matches 5 tokens = depth-1
    assert (short.match_len[0], short.breadth[0]) == (1, 9)
    assert (long.match_len[0], long.breadth[0]) == (5, 1)
    root_kids = lambda d: int((d.parents[0, 1:][d.valid[0, 1:]] == 0).sum())  # noqa: E731
    assert root_kids(short) == 9
    # the 5-token match keeps only its most recent child (the last window put: ... 0 18)
    assert int(long.tokens[0, 1]) == 18 and long.parents[0, 1] == 0


def test_eviction_keeps_nodes_within_capacity(stdlib_tokens):
    corpus = NgramCorpus(max_trie_depth=18, capacity=500)
    for i in range(0, 5000, 18):
        corpus.batch_put([stdlib_tokens[i:i + 18]])
        if i % 360 == 0:
            corpus.synchronize()
            assert corpus.stats()["nodes"] <= 500
    corpus.synchronize()
    s = corpus.stats()
    assert s["nodes"] <= 500 and s["evictions"] > 0
    # the most recent window is still fully there
    last = stdlib_tokens[4986:5004]
    d = corpus.batch_get(None, [last[:10]], None)
    assert d.match_len[0] >= 9


def test_put_and_get_on_two_threads(stdlib_tokens):
    """Puts from one thread while another gets: no crash, valid trees, same final trie."""
    params = dict(max_trie_depth=12, num_draft_tokens=12, capacity=3000)
    corpus = NgramCorpus(**params)
    # 16 requests, each advancing 7 tokens per put through its own stretch of text
    totals = [18 + 7 * step for step in range(150)]
    batches = [[stdlib_tokens[r * 1200 + t - 18:r * 1200 + t] for r in range(16)] for t in totals]
    errors: list[BaseException] = []

    def putter():
        try:
            for t, windows in zip(totals, batches):
                corpus.batch_put(windows, list(range(16)), [t] * 16)
        except BaseException as e:  # surfaced below
            errors.append(e)

    t = threading.Thread(target=putter)
    t.start()
    rng = random.Random(2)
    while t.is_alive():
        tails = [stdlib_tokens[s:s + 10] for s in (rng.randrange(20000) for _ in range(8))]
        check_tree(corpus.batch_get(list(range(8)), tails, [10 + k for k in range(8)]), 12)
    t.join()
    corpus.synchronize()
    assert not errors
    sequential = NgramCorpus(**params)
    for t, windows in zip(totals, batches):
        sequential.batch_put(windows, list(range(16)), [t] * 16)
    sequential.synchronize()
    assert corpus.stats()["nodes"] == sequential.stats()["nodes"]
    tails = [stdlib_tokens[s:s + 10] for s in range(0, 20000, 997)]
    assert_same(corpus.batch_get(None, tails, None), sequential.batch_get(None, tails, None))


@pytest.mark.parametrize("capacity", [120, 10_000_000])
def test_match_state_never_changes_results(stdlib_tokens, capacity):
    """Gets that start from a request's put state (0 to 8 tokens behind the tail, its
    suffix nodes possibly evicted by other puts) equal stateless gets."""
    corpus = NgramCorpus(max_trie_depth=10, num_draft_tokens=12, capacity=capacity)
    corpus.batch_put([stdlib_tokens[:3000]])
    corpus.synchronize()
    rng = random.Random(3)
    for n in range(3000, 3200):
        seq = stdlib_tokens[:n]
        with_state = corpus.batch_get([1], [seq[-12:]], [n])
        assert_same(with_state, corpus.batch_get(None, [seq[-12:]], None), f"len {n}")
        if n % 9 == 0:
            corpus.batch_put([seq[-18:]], [1], [n])
        if n % 4 == 0:  # another request's put moves other nodes up the LRU order
            s = rng.randrange(5000, 20000)
            corpus.batch_put([stdlib_tokens[s:s + 10]])
        corpus.synchronize()
    corpus.erase_match_state([1, 12345])  # unknown ids are a no-op


def test_reset_and_external_corpus_management():
    corpus = NgramCorpus(max_trie_depth=4, num_draft_tokens=4)
    corpus.batch_put([[1, 2, 3]])
    corpus.add_external_corpus("doc", [[1, 2, 9, 9]], max_tokens=100)
    assert corpus.list_external_corpora() == [{"corpus_id": "doc", "tokens": 4}]
    with pytest.raises(ValueError, match="already exists"):
        corpus.add_external_corpus("doc", [[1]])
    corpus.reset()
    assert corpus.stats()["nodes"] == 0
    d = corpus.batch_get(None, [[1, 2]], None)  # only the corpus is left: 1 2 -> 9 9
    assert d.tokens[0, :3].tolist() == [2, 9, 9] and d.valid[0].tolist() == [True, True, True, False]
    corpus.remove_external_corpus("doc")
    assert corpus.list_external_corpora() == []
    with pytest.raises(ValueError, match="no external corpus"):
        corpus.remove_external_corpus("doc")
    d = corpus.batch_get(None, [[1, 2]], None)
    assert d.match_len[0] == 0 and d.valid[0].tolist() == [True, False, False, False]


def test_external_corpus_budget_truncates():
    corpus = NgramCorpus(max_trie_depth=4, num_draft_tokens=6)
    corpus.add_external_corpus("c", [[1, 2, 3, 4], [5, 6, 7, 8]], max_tokens=6)
    assert corpus.list_external_corpora()[0]["tokens"] == 6
    assert corpus.batch_get(None, [[6]], None).match_len[0] == 0  # 5 6 7 8 was cut to 5 6


# ----- bad input -----

@pytest.mark.parametrize("kwargs, message", [
    (dict(num_draft_tokens=1), "num_draft_tokens"),
    (dict(min_bfs_breadth=5, max_bfs_breadth=2), "min_bfs_breadth"),
    (dict(min_bfs_breadth=0), "min_bfs_breadth"),
    (dict(max_trie_depth=0), "max_trie_depth"),
    (dict(capacity=5), "capacity"),
    (dict(match="greedy"), "match"),
    (dict(num_draft_tokens=2.5), "num_draft_tokens"),
])
def test_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NgramCorpus(**kwargs)


@pytest.mark.parametrize("tails, message", [
    ([[1, -2]], "negative"),
    ([[2**31]], "int32"),
    ([np.array([2**40], np.int64)], "int32"),
    ([[]], "empty"),
    ([[1.5]], "int"),
    ([np.array([1.0, 2.0])], "float64"),
    ([np.array(["a"], object)], "dtype"),
    ([np.arange(10, dtype=np.int64)[::2]], "contiguous"),
    ([np.zeros((2, 2), np.int32)], "1-D"),
    (np.zeros(3, np.int32), "2-D"),
    ("abc", "list"),
    ([None], "list"),
])
def test_bad_tails(tails, message):
    corpus = NgramCorpus()
    with pytest.raises(ValueError, match=message):
        corpus.batch_get(None, tails, None)


def test_bad_out_arrays():
    corpus = NgramCorpus(num_draft_tokens=4)
    corpus.batch_put([[1, 2, 3, 1, 2, 4]])
    corpus.synchronize()
    good = garbage_out(2, 4)
    got = corpus.batch_get(None, [[1, 2], [5]], None, out=good)
    assert got.tokens is good.tokens and good.tokens[0, 0] == 2 and good.valid[1, 1:].sum() == 0
    read_only = good.scores.copy()
    read_only.flags.writeable = False
    for field, value, message in [
            ("tokens", np.zeros((2, 4), np.int64), "out.tokens must have dtype int32"),
            ("mask", np.zeros((2, 4, 5), np.bool_), "out.mask has the wrong shape"),
            ("match_len", np.zeros(3, np.int32), "out.match_len has the wrong shape"),
            ("parents", np.zeros((4, 2), np.int32).T, "out.parents must be C-contiguous"),
            ("scores", read_only, "out.scores must be writeable"),
            ("valid", [[True] * 4] * 2, "out.valid must be a numpy array")]:
        with pytest.raises(ValueError, match=message):
            corpus.batch_get(None, [[1, 2], [5]], None, out=good._replace(**{field: value}))
    with pytest.raises(ValueError, match="tuple of 7 arrays"):
        corpus._c.batch_get(None, [[1, 2], [5]], None, tuple(good)[:6])


def test_bad_request_arguments():
    corpus = NgramCorpus()
    with pytest.raises(ValueError, match="entries for 2 rows"):
        corpus.batch_get([1], [[1], [2]], [1, 1])
    with pytest.raises(ValueError, match="together"):
        corpus.batch_get([1], [[1]], None)
    with pytest.raises(ValueError, match="shorter than"):
        corpus.batch_get([1], [[1, 2, 3]], [2])
    with pytest.raises(ValueError, match="negative"):
        corpus.batch_put([[1]], [1], [-1])
    with pytest.raises(ValueError, match="entries for 1 rows"):
        corpus.batch_put([[1]], [1, 2], [1, 1])
    with pytest.raises(ValueError, match="windows\\[1\\]"):
        corpus.batch_put([[1], [2, -3]])
    with pytest.raises(ValueError, match="max_tokens"):
        corpus.add_external_corpus("x", [[1]], max_tokens=0)
    with pytest.raises(ValueError, match="token_chunks"):
        corpus.add_external_corpus("x", [[1, -1]])
    corpus.erase_match_state([])  # nothing to erase is fine
    corpus.erase_match_state(np.array([3, 4]))
    # a good call after all the bad ones still works
    corpus.batch_put([[1, 2, 3]])
    corpus.synchronize()
    assert corpus.batch_get(None, [[1, 2]], None).tokens[0, 1] == 3
