"""Engine behaviour a user relies on, for every draft method: stop tokens, exact
max_new_tokens, slot reuse, stream events, request_stop from another thread, stats
equal to the trace summary, record=False.

Oracle for tokens: plain greedy decoding of the same prompts (lossless greedy is
tested at scale in test_engine_lossless.py); for stats: ``Trace.summary()`` of the
recorded trace.
"""

from __future__ import annotations

import threading

import pytest
import torch
from test_engine_support import cut_prompts, demo_token_streams

import spectool as st

MAX_NEW = 14
MAX_SEQ = 80
METHODS = ["none", "ngram", "eagle", "multi_layer_eagle"]


@pytest.fixture(scope="module")
def prompts(target, demo_model_dir):
    """Seven prompts of different lengths (more than the engines' two slots)."""
    return cut_prompts(demo_token_streams(target, demo_model_dir), 7, seed=3, min_len=6, max_len=40,
                       repetitive_every=3)


@pytest.fixture(scope="module")
def plain(target, prompts):
    engine = st.Engine(target, max_batch_size=4, max_seq_len=MAX_SEQ)
    return engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=False).token_ids


def make_engine(target, demo_dir, method: str, max_batch_size: int = 2) -> st.Engine:
    draft = {"none": None,
             "ngram": st.NgramConfig(num_draft_tokens=8, max_bfs_breadth=3),
             "eagle": st.EagleConfig(demo_dir / "eagle", num_steps=3, topk=3, num_draft_tokens=8),
             "multi_layer_eagle": st.MultiLayerEagleConfig(demo_dir / "multi_layer_eagle", num_steps=3),
             }[method]
    return st.Engine(target, draft=draft, max_batch_size=max_batch_size, max_seq_len=MAX_SEQ)


@pytest.mark.parametrize("method", METHODS)
def test_stop_tokens_max_new_tokens_and_slot_reuse(target, demo_model_dir, prompts, plain, method):
    # A stop token that occurs mid-output in some requests (their third token) and not in others.
    stop = plain[0][2]
    engine = make_engine(target, demo_model_dir, method)
    cache_ptr = engine.cache.k.data_ptr()
    result = engine.generate(prompts, max_new_tokens=MAX_NEW, stop_token_ids=[stop], record=True)
    assert len(result.token_ids) == len(prompts)
    for want, got, reason in zip(plain, result.token_ids, result.finish_reasons):
        if stop in want:
            cut = want.index(stop) + 1
            assert (got, reason) == (want[:cut], "stop")  # nothing after the stop token
        else:
            assert (got, reason) == (want, "length")
    assert "stop" in result.finish_reasons and "length" in result.finish_reasons
    # Seven requests went through two slots, each freed and reused as requests finished.
    requests = result.trace.requests.to_pylist()
    assert sorted(r["request_id"] for r in requests) == list(range(len(prompts)))
    assert engine.cache.k.data_ptr() == cache_ptr  # the static cache was never reallocated

    # max_new_tokens honoured exactly, including 1 (the prefill token alone) and 2.
    for n in (1, 2, 5):
        out = engine.generate(prompts, max_new_tokens=n, ignore_eos=True, record=False).token_ids
        assert out == [w[:n] for w in plain]


@pytest.mark.parametrize("method", METHODS)
def test_stream_events_concatenate_to_the_output(target, demo_model_dir, prompts, plain, method):
    engine = make_engine(target, demo_model_dir, method)
    pieces: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    events = list(engine.stream(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=True))
    finished = []
    for k, event in enumerate(events):
        assert event.iteration == k  # one event per iteration, in order
        for rid, first in event.prefill_tokens.items():
            assert pieces[rid] == []  # the prefill token comes before any iteration's tokens
            pieces[rid].append(first)
        assert 1 <= len(event.new_tokens) <= engine.max_batch_size
        for rid, new in event.new_tokens.items():
            assert 1 <= len(new) <= event.accept_lengths[rid] + 1
            pieces[rid].extend(new)
        # Every record of the event belongs to this iteration and a request it advanced.
        assert {r.request_id for r in event.records} == set(event.new_tokens)
        assert all(r.iteration == event.iteration for r in event.records)
        finished += event.finished
    assert [pieces[i] for i in range(len(prompts))] == plain
    assert sorted(finished) == list(range(len(prompts)))


@pytest.mark.parametrize("method", METHODS)
def test_stats_equal_trace_summary_and_record_false_same_tokens(target, demo_model_dir, prompts, plain,
                                                                method):
    result = make_engine(target, demo_model_dir, method, max_batch_size=3).generate(
        prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=True)
    assert result.token_ids == plain
    live, recorded = result.stats.summary(), result.trace.summary()
    for key in ("records", "iterations", "tokens", "mean_accept_length", "accept_length_histogram",
                "accept_rate_by_depth"):
        assert live[key] == pytest.approx(recorded[key]), key
        # The same number under the same name as an attribute of the live stats.
        assert getattr(result.stats, key) == pytest.approx(recorded[key]), key
    assert set(result.stats.phase_us) == set(recorded["phase_us"])
    # The live tokens/s (running totals) is the recorded summary's formula.
    assert result.stats.tokens_per_s == pytest.approx(recorded["tokens_per_s"], rel=1e-6)
    # Tokens gained per record = accept length + 1; all of them plus the prefill tokens are the output.
    accept = result.trace.steps.column("accept_length").to_pylist()
    assert sum(a + 1 for a in accept) >= sum(len(t) - 1 for t in plain)
    if method == "none":
        assert set(accept) == {0}

    again = make_engine(target, demo_model_dir, method, max_batch_size=3).generate(
        prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=False)
    assert again.token_ids == plain
    assert again.trace is None
    assert again.stats.mean_accept_length == pytest.approx(result.stats.mean_accept_length)


@pytest.mark.parametrize("method", ["none", "eagle"])
def test_request_stop_from_another_thread_ends_cleanly(target, demo_model_dir, prompts, plain, method):
    engine = make_engine(target, demo_model_dir, method)
    first_event, stop_requested = threading.Event(), threading.Event()
    events = []

    def consume():
        for event in engine.stream(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=False):
            events.append(event)
            first_event.set()
            stop_requested.wait(60)  # hold the stream here until the other thread asked to stop

    worker = threading.Thread(target=consume)
    worker.start()
    assert first_event.wait(120)
    engine.request_stop()
    stop_requested.set()
    worker.join(120)
    assert not worker.is_alive()
    assert len(events) == 1  # the stop landed before the next iteration
    # What was streamed so far is a prefix of the full greedy output.
    for rid, new in events[0].new_tokens.items():
        got = [events[0].prefill_tokens[rid], *new]
        assert got == plain[rid][:len(got)]
    # The engine is usable afterwards (the stop does not stick) and decodes as before.
    out = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=False)
    assert out.token_ids == plain
    assert set(out.finish_reasons) == {"length"}


def test_a_call_sets_the_heap_before_it_aside_from_the_cycle_collector(target, demo_model_dir, prompts):
    """While a stream runs, what existed before it is frozen (a full collection inside an iteration
    scans only what the call made); the heap is thawed when the stream ends or is closed early."""
    import gc

    engine = make_engine(target, demo_model_dir, "eagle")
    assert gc.get_freeze_count() == 0
    before = [[] for _ in range(100)]  # tracked objects that exist before the call
    stream = engine.stream(prompts[:2], max_new_tokens=MAX_NEW, ignore_eos=True, record=False)
    next(stream)
    assert gc.get_freeze_count() >= len(before)
    for _ in stream:
        pass
    assert gc.get_freeze_count() == 0
    stream = engine.stream(prompts[:2], max_new_tokens=MAX_NEW, ignore_eos=True, record=False)
    next(stream)
    stream.close()
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("method", ["ngram", "eagle", "multi_layer_eagle"])
def test_a_drafter_is_fed_each_prefill_group_as_its_kind_needs(target, demo_model_dir, prompts, plain, method):
    # A drafter that works on the device is fed before the engine reads the first tokens on the host
    # (its prefill is queued behind the target's), so the requests' histories hold just their prompts
    # then; the N-gram trie learns on the host, after that read, the first token in each history, and
    # waits for the prompts' insertion after the last group alone. Either way the output is plain's.
    engine = make_engine(target, demo_model_dir, method, max_batch_size=4)
    engine.prefill_budget = 48  # several prefill groups per admission
    seen = []  # per call: (tokens each history holds past its prompt, with_first() right per row, last group)
    feeding = []  # non-empty while a spied on_prefill runs
    drafter = engine.drafter
    on_prefill = drafter.on_prefill

    def spy(prefill):
        first = prefill.first.tolist()
        rows = list(zip(prefill.histories, prefill.lens))
        seen.append(([len(h) - n for h, n in rows],
                     [prefill.with_first()[b, :n + 1].tolist() == h[:n] + [first[b]] for b, (h, n) in enumerate(rows)],
                     prefill.last_group))
        feeding.append(True)
        on_prefill(prefill)
        feeding.pop()

    drafter.on_prefill = spy
    waits = []  # the index of the on_prefill call each wait for the trie happened in
    if method == "ngram":
        corpus = drafter.corpus

        class Counting:
            def __getattr__(self, name):
                return getattr(corpus, name)

            def synchronize(self):
                if feeding:
                    waits.append(len(seen) - 1)
                corpus.synchronize()

        drafter.corpus = Counting()
    got = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=False).token_ids
    assert got == plain
    assert len(seen) > 2
    for gained, with_first, _ in seen:
        # N-gram is fed after the host read (each history gained its first token), the others before.
        assert gained == [1 if method == "ngram" else 0] * len(gained)
        assert all(with_first)  # each prompt, then its first token
    assert any(not last for *_, last in seen)  # some admissions had more than one group
    if method == "ngram":  # one wait per admission, in its last group's call
        assert waits == [i for i, (*_, last) in enumerate(seen) if last]


def test_a_prefill_of_several_groups_reads_the_device_once(target, prompts, plain, monkeypatch):
    # The first tokens of every group are read together after the last group's launch: a read per
    # group would make each next group's launch wait for the GPU to finish the one before.
    engine = st.Engine(target, max_batch_size=4, max_seq_len=MAX_SEQ)
    engine.prefill_budget = 48  # several prefill groups per admission
    reads, groups = [], []
    tolist, prefill_groups, prefill = torch.Tensor.tolist, engine._prefill_groups, engine._prefill

    def counted_tolist(self):
        reads[-1] += 1
        return tolist(self)

    def counted_groups(reqs):
        groups.append(prefill_groups(reqs))
        return groups[-1]

    def counted_prefill(*args):
        reads.append(0)
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "tolist", counted_tolist)
            prefill(*args)

    monkeypatch.setattr(engine, "_prefill_groups", counted_groups)
    monkeypatch.setattr(engine, "_prefill", counted_prefill)
    got = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=False).token_ids
    assert got == plain
    assert any(len(g) > 1 for g in groups)
    assert reads == [1] * len(groups)


def test_a_calls_time_splits_into_prefill_decode_and_between(target, demo_model_dir, prompts):
    # decode_s is what tokens_per_s divides by: the iterations' own times, each counted once however
    # many requests it ran; the call's elapsed time holds it, the prefills and the time between.
    stats = make_engine(target, demo_model_dir, "eagle").generate(prompts, max_new_tokens=MAX_NEW, record=False).stats
    per_iteration = dict(zip(stats.columns["iteration"], stats.columns["iteration_us"]))
    assert stats.decode_s == pytest.approx(sum(per_iteration.values()) / 1e6)
    gained = sum(stats.columns["accept_length"]) + len(stats.columns["accept_length"])
    assert stats.tokens_per_s * stats.decode_s == pytest.approx(gained)
    assert stats.prefill_s + stats.decode_s <= stats.elapsed_s
    assert stats.to_dict()["decode_s"] == stats.decode_s


@pytest.mark.parametrize("method", ["none", "eagle"])
def test_a_one_token_call_reports_its_prefill_and_no_iteration(target, demo_model_dir, prompts, plain, method):
    # max_new_tokens=1 is the prefill alone (how benchmarks time a prefill): its stats and trace
    # summarise no iteration instead of failing on columns that hold nothing.
    result = make_engine(target, demo_model_dir, method).generate(prompts, max_new_tokens=1, ignore_eos=True)
    assert result.token_ids == [p[:1] for p in plain]
    stats = result.stats.to_dict()
    assert (stats["iterations"], stats["records"], stats["tokens"]) == (0, 0, 0)
    assert stats["generated_tokens"] == len(prompts) and stats["decode_s"] == 0.0
    assert stats["mean_accept_length"] == 0.0 and stats["accept_length_histogram"] == []
    assert result.trace.summary()["iterations"] == 0
