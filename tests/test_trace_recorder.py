"""Recorder -> Trace: what goes in comes out, sliced, packed and derived as documented."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch
from trace_factory import METHODS, VOCAB, ancestors_mask, as_stored, make_trace, tiny_tokenizer_json

from spectool.trace.reader import Trace
from spectool.trace.recorder import Recorder, pack_rows


def _batch(rng, widths=(5, 3), width=7):
    """Two rows with different num_nodes padded to a batch-wide width (junk beyond)."""
    b = len(widths)
    parents = np.full((b, width), 99)
    tokens = rng.integers(2, len(VOCAB), (b, width))
    mask = np.ones((b, width, width), bool)
    for r, n in enumerate(widths):
        p = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
        parents[r, :n] = p
        mask[r, :n, :n] = ancestors_mask(np.array(p))
    path = np.full((b, 4), -1)
    path[0, :2] = [0, 1]
    path[1, :1] = [0]
    return {"iteration": 4, "request_id": torch.tensor([3, 8]), "method": "ngram",
            "seq_len": np.array([10, 20]), "num_nodes": np.array(widths), "tokens": torch.from_numpy(tokens),
            "parents": parents, "mask": torch.from_numpy(mask), "accept_path": path,
            "scores": torch.rand(b, width, dtype=torch.bfloat16),
            "target_topk_tokens": rng.integers(0, 9, (b, width, 3)),
            "step_topk_tokens": rng.integers(0, 9, (b, 2, 4)), "draft_us": 12.5}, parents, tokens, mask


def test_record_batch_slices_packs_and_derives():
    rng = np.random.default_rng(0)
    fields, parents, tokens, mask = _batch(rng)
    rec = Recorder(None, {"method": "ngram"}, tiny_tokenizer_json())
    rec.record_batch(fields)
    trace = rec.close()
    for row, (rid, n) in enumerate([(3, 5), (8, 3)]):
        v = trace.iteration(4, rid)
        assert v.num_nodes == n and v.method == "ngram" and v.seq_len == [10, 20][row]
        np.testing.assert_array_equal(v.tokens, tokens[row, :n])
        np.testing.assert_array_equal(v.parents, parents[row, :n])
        np.testing.assert_array_equal(v.mask, mask[row, :n, :n])
        np.testing.assert_array_equal(v.depth, ancestors_mask(parents[row, :n]).sum(1) - 1)
        np.testing.assert_array_equal(v.target_topk_tokens, fields["target_topk_tokens"][row, :n])
        np.testing.assert_array_equal(v.step_topk_tokens, fields["step_topk_tokens"][row])
        np.testing.assert_allclose(v.scores, fields["scores"][row, :n].float().numpy())
        assert v.timings["draft_us"] == 12.5
        assert v.token_texts == [VOCAB[t] for t in tokens[row, :n]]
        assert v.ngram_match_len == -1 and v.coins.size == 0
    assert trace.iteration(4, 3).accept_path.tolist() == [0, 1]
    assert trace.iteration(4, 3).accept_length == 1
    assert trace.iteration(4, 8).accept_length == 0


def test_packed_rows_record_the_same_trace_as_separate_fields():
    """The engine's graph packs per-request fields into one byte table and the writer stacks
    runs of such iterations at once; the trace must equal the one recorded field by field."""
    rng = np.random.default_rng(1)
    one = Recorder(None, {"method": "ngram"}, tiny_tokenizer_json(), flush_every=1000)
    two = Recorder(None, {"method": "ngram"}, tiny_tokenizer_json(), flush_every=1000)
    for it, widths in enumerate([(5, 3), (4, 4), (2, 6), (1, 1)]):
        fields, *_ = _batch(rng, widths=widths)
        fields["iteration"] = it
        fields["request_id"] = np.array([3, 8]) + it
        as_tensors = {k: torch.as_tensor(v) for k, v in fields.items() if not np.isscalar(v)}
        as_tensors.pop("request_id")
        as_tensors["positions"] = torch.arange(14).view(2, 7).t().contiguous().t()  # non-contiguous
        as_tensors["bonus_token"] = torch.tensor([5, 6]).view(2, 1)[:, 0]  # a strided [B] view
        plain = {k: v for k, v in fields.items() if k not in as_tensors}
        one.record_batch({**plain, **as_tensors})
        two.record_batch(plain, pack_rows(list(as_tensors.items())))
    expected, got = one.close().steps.to_pylist(), two.close().steps.to_pylist()
    assert got == expected and len(got) == 8
    with pytest.raises(ValueError, match="both in fields and in packed"):
        Recorder(None, {}).record_batch(fields, pack_rows([("tokens", as_tensors["tokens"])]))


def test_engine_buffers_may_be_reused_after_record_batch():
    rng = np.random.default_rng(1)
    fields, _, tokens, _ = _batch(rng)
    before = fields["tokens"].clone()
    with Recorder(None, {}) as rec:
        rec.record_batch(fields)
        fields["tokens"].fill_(0)  # the engine overwrites its static buffer for the next iteration
    np.testing.assert_array_equal(rec.close().iteration(4, 3).tokens, before[0, :5].numpy())


def test_bad_fields_raise_clear_errors():
    rec = Recorder(None, {})
    with pytest.raises(ValueError, match="unknown trace field"):
        rec.record_batch({"iteration": 0, "request_id": [0], "tokenz": [[1]]})
    with pytest.raises(ValueError, match="leading dim"):
        rec.record_batch({"iteration": 0, "request_id": [0, 1], "tokens": torch.zeros(3, 4)})
    with pytest.raises(ValueError, match="request_id"):
        rec.record_batch({"iteration": 0})
    rec.close()
    with pytest.raises(ValueError, match="closed"):
        rec.record_batch({"iteration": 0, "request_id": [0]})
    with pytest.raises(ValueError, match="flush_every"):
        Recorder(None, {}, flush_every=0)


def test_writer_errors_surface_on_the_engine_thread():
    rec = Recorder(None, {})
    rec.record_batch({"iteration": 0, "request_id": [0], "num_nodes": [9], "tokens": torch.ones(1, 2)})
    with pytest.raises(ValueError, match="trace writer failed"):
        rec.close()


@pytest.mark.parametrize("on_file, flush_every", [(False, 1000), (True, 1000), (True, 2), (True, 3)])
def test_iteration_rows_hands_out_each_row_once(tmp_path, on_file, flush_every):
    """Live rows come out once each, also when a recorder writing to a file lets written rows go."""
    rng = np.random.default_rng(2)
    rec = Recorder(tmp_path / "live.sptrace" if on_file else None, {}, flush_every=flush_every)
    fields, *_ = _batch(rng)
    rec.record_batch(fields)
    first = rec.iteration_rows()
    assert [(v.iteration, v.request_id) for v in first] == [(4, 3), (4, 8)]
    assert rec.iteration_rows() == []
    fields["iteration"] = 5
    rec.record_batch(fields)
    assert [v.iteration for v in rec.iteration_rows()] == [5, 5]
    for it in (6, 7, 8):
        fields["iteration"] = it
        rec.record_batch(fields)
        assert [v.iteration for v in rec.iteration_rows()] == [it, it]
    trace = rec.close()
    assert trace.keys()[0].tolist() == [4, 4, 5, 5, 6, 6, 7, 7, 8, 8]


@pytest.mark.parametrize("method", METHODS)
def test_file_and_memory_round_trip(tmp_path, method):
    path = tmp_path / "run.sptrace"
    trace = make_trace(method, flush_every=3, num_requests=4, batch_size=3)  # in memory
    on_file = make_trace(method, path=path, flush_every=3, num_requests=4, batch_size=3)
    assert on_file._file is not None  # a recorder with a file hands back the file, opened lazily
    loaded = Trace.load(path)
    assert loaded.steps.equals(as_stored(trace.steps)) and loaded.requests.equals(trace.requests)
    assert on_file.steps.equals(loaded.steps)
    assert loaded.run_info.keys() == trace.run_info.keys() and not loaded.truncated
    assert loaded.run_info["draft"] == trace.run_info["draft"]
    loaded.save(tmp_path / "copy.sptrace")
    again = Trace.load(tmp_path / "copy.sptrace")
    assert again.steps.equals(as_stored(trace.steps)) and again.requests.equals(trace.requests)
    assert again.token_text([2, 3]) == ["def", "return"]
    assert set(trace.request_ids) == {0, 1, 2, 3}
    df = trace.to_pandas()
    for rid in trace.request_ids:
        assert trace.iterations(rid) == sorted(df[df.request_id == rid].iteration)
    rebuilt = Trace.from_tables(trace.steps, trace.requests, trace.run_info, trace.tokenizer_json)
    assert rebuilt.iteration(0, 0).token_texts == trace.iteration(0, 0).token_texts


def test_token_text_without_tokenizer_is_the_id():
    trace = Trace.from_tables(make_trace("ngram", num_requests=1).steps, None, {})
    assert trace.token_text([5, 17]) == ["5", "17"]


def test_summary_matches_formulas_on_the_dataframe():
    trace = make_trace("eagle", num_requests=5, batch_size=2, temperature=0.7)
    s = trace.summary()
    df = trace.to_pandas()
    assert s["mean_accept_length"] == pytest.approx(df.accept_length.mean())
    assert s["tokens"] == int((df.accept_length + 1).sum())
    assert s["accept_length_histogram"] == [int((df.accept_length == a).sum())
                                            for a in range(df.accept_length.max() + 1)]
    tree_depth = df.depth.map(max)
    for d, rate in enumerate(s["accept_rate_by_depth"], start=1):
        reach = df[tree_depth >= d]
        assert rate == pytest.approx((reach.accept_length >= d).mean())
    per_iteration = df.groupby("iteration").first()
    assert s["tokens_per_s"] == pytest.approx(s["tokens"] / per_iteration.iteration_us.sum() * 1e6, rel=1e-5)
    assert s["phase_us"]["verify_us"] == pytest.approx(per_iteration.verify_us.mean(), rel=1e-5)
    assert "trie_get_us" not in s["phase_us"]
    assert isinstance(df, pd.DataFrame)


def _held_bytes(path, num_requests: int) -> int:
    """Arrow memory a recorder still holds once every record of a run is written (before close)."""
    from trace_factory import record_synthetic, run_info_for

    before = pa.total_allocated_bytes()
    rec = Recorder(path, run_info_for("eagle", 8, 0.0), tiny_tokenizer_json(), flush_every=8)
    record_synthetic(rec, "eagle", num_requests=num_requests, batch_size=4, max_new_tokens=20)
    rec._send()
    rec._queue.join()  # the writer has converted (and, with a file, written) what it was handed
    held = pa.total_allocated_bytes() - before
    rec.close()
    return held


def test_recording_to_a_file_holds_about_one_flush_whatever_the_run_length(tmp_path):
    memory = [_held_bytes(None, n) for n in (8, 32)]
    on_file = [_held_bytes(tmp_path / f"run{n}.sptrace", n) for n in (8, 32)]
    assert memory[1] > 3 * memory[0] > 0  # held in memory, the trace grows with the run
    assert on_file[1] < memory[0] / 2  # on file, a run 4x as long holds far less than the short one in memory
    assert len(Trace.load(tmp_path / "run32.sptrace")) > 3 * len(Trace.load(tmp_path / "run8.sptrace"))
