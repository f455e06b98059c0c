"""Large traces: lazy reading, damage in the middle, selective recording, SQL, checking in parts."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from trace_factory import as_stored, make_trace, record_synthetic, run_info_for, tiny_tokenizer_json

from spectool.cli import check as check_cli
from spectool.cli import query as query_cli
from spectool.cli import report as report_cli
from spectool.trace import check
from spectool.trace.format import TraceFormatError
from spectool.trace.parts import check_in_parts
from spectool.trace.reader import Trace
from spectool.trace.recorder import Recorder
from spectool.trace.select import Record
from spectool.trace.stats import summarize

RUN = dict(num_requests=9, batch_size=3, max_new_tokens=30, num_draft_tokens=8, seed=3)


@pytest.fixture(scope="module")
def many_batches(tmp_path_factory):
    """An eagle run flushed every 4 rows (many batches) and the same run held in memory."""
    path = tmp_path_factory.mktemp("lazy") / "run.sptrace"
    make_trace("eagle", path=path, flush_every=4, **RUN)
    return path, make_trace("eagle", flush_every=4, **RUN)


def _batch_offsets(path, body: bool = False) -> list:
    """Byte offset of every record-batch message (with ``body``: and its body's (start, end)), found by
    Arrow's own message reader."""
    with pa.memory_map(str(path)) as mm:
        reader = pa.ipc.MessageReader.open_stream(mm)
        reader.read_next_message()  # the schema
        offsets = []
        while True:
            at = mm.tell()
            try:
                msg = reader.read_next_message()
            except StopIteration:
                return offsets
            offsets.append((at, mm.tell() - msg.body.size, mm.tell()) if body else at)


def test_lazy_access_equals_the_whole_table(many_batches):
    path, memory = many_batches
    trace = Trace.load(path)
    whole = as_stored(memory.steps)
    assert trace._steps is None and len(trace) == whole.num_rows  # counted without reading the records
    df = whole.to_pandas()
    for k in np.random.default_rng(0).choice(whole.num_rows, 12, replace=False):
        it, rid = int(df.iteration[k]), int(df.request_id[k])
        got = trace.iteration(it, rid)
        assert got.tokens.tolist() == list(df.tokens[k]) and got.accept_length == df.accept_length[k]
        assert got.target_argmax.tolist() == list(df.target_argmax[k])  # derived back from the top-1
    for rid in (0, 4, 8):
        want = whole.filter(pa.compute.equal(whole["request_id"], rid)).sort_by("iteration")
        assert trace.request_steps(rid).equals(want)
    cols = ["iteration", "accept_length", "depth"]
    assert pa.concat_tables(trace.iter_batches(cols)).equals(whole.select(cols))
    assert trace.summary() == summarize(whole) | {"kept_fraction": 1.0, "selection": None}
    assert trace.steps.equals(whole)


def test_corrupt_framing_in_the_middle_keeps_earlier_batches(many_batches, tmp_path):
    path, memory = many_batches
    offsets = _batch_offsets(path)
    k = len(offsets) // 2
    data = bytearray(path.read_bytes())
    data[offsets[k]:offsets[k] + 8] = b"\x13" * 8  # the message's continuation marker and length
    bad = tmp_path / "bad.sptrace"
    bad.write_bytes(bytes(data))
    trace = Trace.load(bad)
    assert trace.truncated and f"byte offset {offsets[k]}" in trace.damage
    before = Trace.load(path)._file.batch_start[k]
    assert len(trace) == before
    assert trace.steps.equals(as_stored(memory.steps).slice(0, before))


def test_corrupt_body_in_the_middle_names_its_offset(many_batches, tmp_path, capsys):
    path, memory = many_batches
    where = _batch_offsets(path, body=True)
    offsets = [w[0] for w in where]
    k = len(offsets) // 2
    data = bytearray(path.read_bytes())
    _, start, end = where[k]
    third = (end - start) // 3
    data[start + third:end - third] = b"\xff" * (end - start - 2 * third)  # the middle columns' buffers
    bad = tmp_path / "body.sptrace"
    bad.write_bytes(bytes(data))
    trace = Trace.load(bad)  # the index columns (first and last in a batch) are intact
    assert not trace.truncated and len(trace) == memory.steps.num_rows
    its, reqs = trace.keys()
    row = int(trace._file.batch_start[k])
    with pytest.raises(TraceFormatError, match=f"byte offset {offsets[k]}"):
        trace.iteration(int(its[row]), int(reqs[row]))
    for r in (0, row - 1, int(trace._file.batch_start[k + 1])):  # records before and after it read back
        assert trace.iteration(int(its[r]), int(reqs[r])).tokens.tolist() == memory.steps["tokens"][r].as_py()
    assert check_cli.main([str(bad)]) == 2
    assert f"byte offset {offsets[k]}" in capsys.readouterr().err


def _selected(select: Record, tmp_path, name: str) -> Trace:
    rec = Recorder(tmp_path / f"{name}.sptrace", run_info_for("ngram", 8, 0.0), tiny_tokenizer_json(),
                   flush_every=5, select=select)
    with rec:
        record_synthetic(rec, "ngram", **RUN)
    return rec.close()


@pytest.mark.parametrize("name, select, keep", [
    ("every", Record(every=3), lambda df: df.iteration % 3 == 0),
    ("requests", Record(requests=[1, 4, 7]), lambda df: df.request_id.isin([1, 4, 7])),
    ("where", Record(where="accept_length == 0"), lambda df: df.accept_length == 0),
    ("both", Record(every=2, where="accept_length >= 2"), lambda df: (df.iteration % 2 == 0) & (df.accept_length >= 2)),
])
def test_selective_recording_keeps_what_was_asked_and_says_how_much(tmp_path, name, select, keep):
    full = make_trace("ngram", **RUN).steps.to_pandas()
    got = _selected(select, tmp_path, name)
    want = full[keep(full)]
    cols = ["iteration", "request_id", "accept_length"]
    assert got.steps.select(cols).to_pandas().reset_index(drop=True).equals(want[cols].reset_index(drop=True))
    loaded = Trace.load(tmp_path / f"{name}.sptrace")
    record = loaded.run_info["record"]
    assert record["seen_records"] == len(full) and record["kept_records"] == len(want)
    assert record["kept_fraction"] == pytest.approx(len(want) / len(full))
    assert loaded.summary()["kept_fraction"] == pytest.approx(len(want) / len(full))
    assert loaded.summary()["selection"] and got.summary()["kept_fraction"] == record["kept_fraction"]
    assert check.check_trace(loaded) is None


def test_slowest_keeps_whole_iterations_above_the_running_quantile(tmp_path):
    got = _selected(Record(slowest=0.25), tmp_path, "slow").steps.to_pandas()
    full = make_trace("ngram", **RUN).steps.to_pandas()
    per_it = full.groupby("iteration").iteration_us.first()
    kept = sorted(set(got.iteration))
    assert kept and len(kept) < len(per_it)
    for it in kept:  # every kept iteration was at least as slow as the (1 - p) quantile of those before it
        assert per_it[it] >= np.quantile(per_it[per_it.index <= it], 0.75)
    assert len(got) == full.iteration.isin(kept).sum()


def test_bad_record_options_are_refused():
    for bad in (dict(every=0), dict(slowest=0.0), dict(where="tokens == 3"), dict(where="drop table")):
        with pytest.raises(ValueError):
            Record(**bad)


def test_sql_answers_equal_pandas(many_batches, capsys):
    pytest.importorskip("duckdb")
    path, memory = many_batches
    trace = Trace.load(path)
    df = as_stored(memory.steps).to_pandas()
    got = trace.sql("""
        select iteration, request_id, count(*) filter (where status = 2 and score > 0.3) as confident_rejected
        from nodes group by 1, 2 order by confident_rejected desc, iteration, request_id limit 20""")
    df["confident_rejected"] = [int(((np.asarray(s) == 2) & (np.asarray(p) > np.float32(0.3))).sum())
                                for s, p in zip(df.status, df.scores)]
    want = df.sort_values(["confident_rejected", "iteration", "request_id"], ascending=[False, True, True]).head(20)
    assert got.confident_rejected.tolist() == want.confident_rejected.tolist()
    assert got.iteration.tolist() == want.iteration.tolist()

    by_depth = trace.sql("""select request_id, depth, avg(case when status = 1 then 1.0 else 0.0 end) as rate
                            from nodes where depth > 0 group by 1, 2 order by 1, 2""")
    nodes = df[["request_id", "depth", "status"]].explode(["depth", "status"])
    nodes = nodes[nodes.depth > 0].astype(int)
    want = nodes.assign(rate=(nodes.status == 1).astype(float)).groupby(["request_id", "depth"]).rate.mean()
    assert np.allclose(by_depth.rate, want.values)
    assert list(zip(by_depth.request_id, by_depth.depth)) == list(want.index)

    assert query_cli.main([str(path), "select count(*) as n from steps", "--format", "csv"]) == 0
    assert capsys.readouterr().out.split() == ["n", str(len(df))]
    assert query_cli.main([str(path), "select nothing from nowhere"]) == 2
    assert "SQL error" in capsys.readouterr().err


def test_checking_in_parts_finds_the_same_first_fault(many_batches):
    _, memory = many_batches
    steps = memory.steps.to_pylist()
    for k in (5, 40):  # a wrong token on the accepted path, then a wrong seq_len
        rows = [dict(r) for r in steps]
        if k == 5:
            path = rows[k]["accept_path"]
            rows[k]["tokens"] = list(rows[k]["tokens"])
            rows[k]["tokens"][path[-1]] += 1
        else:
            rows[k]["seq_len"] += 1
        bad = Trace(pa.Table.from_pylist(rows, schema=memory.steps.schema), memory.requests, memory.run_info)
        whole = check._Checker(bad).run()
        parts = check_in_parts(bad, lambda t: check._Checker(t).run(), rows_per_part=7, progress=False)
        assert whole is not None and parts == whole
    assert check_in_parts(memory, lambda t: check._Checker(t).run(), rows_per_part=7, progress=False) is None


def test_aggregates_are_downsampled_means_with_their_envelope(many_batches):
    path, memory = many_batches
    df = memory.steps.to_pandas()
    per_it = df.groupby("iteration").accept_length.mean()
    full = Trace.load(path).aggregates(max_points=10_000)
    assert full["bucket_size"] == 1 and np.allclose(full["accept_length"]["mean"], per_it.values)
    small = Trace.load(path).aggregates(max_points=4)
    size = small["bucket_size"]
    assert len(small["iteration"]) <= 4
    for b, first in enumerate(small["iteration"]):
        chunk = per_it.values[b * size:(b + 1) * size]
        assert first == per_it.index[b * size]
        assert small["accept_length"]["mean"][b] == pytest.approx(chunk.mean())
        assert small["accept_length"]["max"][b] == pytest.approx(chunk.max())
    reqs = small["requests"]
    assert reqs["records"] == df.groupby("request_id").size().tolist()


def test_report_of_some_requests_and_iterations(many_batches, tmp_path):
    path, memory = many_batches
    part = Trace.load(path).select(requests=[2, 5], iterations=(3, 9))
    df = memory.steps.to_pandas()
    want = df[df.request_id.isin([2, 5]) & (df.iteration >= 3) & (df.iteration < 9)]
    assert sorted(zip(part.steps["iteration"].to_pylist(), part.steps["request_id"].to_pylist())) == \
        sorted(zip(want.iteration, want.request_id))
    assert part.summary()["kept_fraction"] == pytest.approx(len(want) / len(df))
    assert part.parent is not None and len(part.parent) == len(df)
    out = tmp_path / "part.html"
    assert report_cli.main([str(path), "-o", str(out), "--requests", "2,5", "--iterations", "3:9"]) == 0
    assert out.exists() and out.stat().st_size > 0
    assert report_cli.main([str(path), "--iterations", "oops"]) == 2


def test_pandas_is_the_same_through_the_lazy_property(many_batches):
    path, memory = many_batches
    lazy = Trace.load(path).to_pandas()
    assert isinstance(lazy, pd.DataFrame) and len(lazy) == memory.steps.num_rows


def test_engine_records_what_record_selects(target):
    import spectool as st

    def run(record):  # a fresh engine each time: the N-gram corpus learns from every run
        engine = st.Engine(target, draft=st.NgramConfig(num_draft_tokens=8), max_batch_size=2, max_seq_len=512)
        return engine.generate(prompts, max_new_tokens=24, ignore_eos=True, record=record)

    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10, 11, 9, 10]]
    full, part = run(True), run(st.Record(every=2, requests=[1]))
    assert part.token_ids == full.token_ids  # what is recorded never changes what is decoded
    df = full.trace.steps.to_pandas()
    want = df[(df.iteration % 2 == 0) & (df.request_id == 1)]
    got = part.trace.steps.to_pandas()
    assert list(zip(got.iteration, got.request_id)) == list(zip(want.iteration, want.request_id))
    assert [list(t) for t in got.tokens] == [list(t) for t in want.tokens]
    assert part.trace.requests["request_id"].to_pylist() == [1]
    info = part.trace.run_info["record"]
    assert info["every"] == 2 and info["requests"] == [1] and info["seen_records"] == len(df)
    assert part.trace.summary()["kept_fraction"] == pytest.approx(len(want) / len(df))


def test_engine_records_straight_to_a_file(target, tmp_path):
    import spectool as st

    def run(record):
        engine = st.Engine(target, draft=st.NgramConfig(num_draft_tokens=8), max_batch_size=2, max_seq_len=512)
        return engine.generate(prompts, max_new_tokens=24, ignore_eos=True, record=record)

    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10, 11, 9, 10]]
    path = tmp_path / "run.sptrace"
    memory, on_file = run(True), run(st.Record(path=path, flush_every=4))
    assert on_file.token_ids == memory.token_ids
    assert on_file.trace._file is not None and on_file.trace._file.path == path  # the file, opened lazily
    cols = ["iteration", "request_id", "tokens", "parents", "accept_path", "target_topk_tokens", "mask_packed"]
    assert on_file.trace.steps.select(cols).equals(memory.trace.steps.select(cols))
    assert on_file.trace.requests.select(["request_id", "output_tokens"]).equals(
        memory.trace.requests.select(["request_id", "output_tokens"]))
    assert len(on_file.trace._file.batches) > 3 and check.check_trace(on_file.trace) is None


def test_record_command_keeps_a_selection_that_summary_states(tmp_path, demo_model_dir, capsys):
    import json

    from spectool.cli import main
    from spectool.prompts import load_prompts

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"kind": "completion", "prompt": p[:200]}) + "\n"
                               for p in load_prompts(demo_model_dir / "prompts.jsonl")[:2]))
    out = tmp_path / "every2.sptrace"
    base = ["record", "--model", str(demo_model_dir / "target"), "--draft", "ngram", "--prompts", str(prompts),
            "--max-new-tokens", "16", "--device", "cpu", "--out", str(out)]
    assert main([*base, "--record-every", "2"]) == 0
    trace = Trace.load(out)
    assert trace.run_info["record"]["every"] == 2 and set(np.unique(trace.keys()[0] % 2)) == {0}
    capsys.readouterr()
    assert main(["summary", str(out)]) == 0
    assert "records kept" in capsys.readouterr().out
    assert main(["check", str(out)]) == 0
    assert main([*base, "--record-where", "tokens > 3"]) == 2
    assert "not a per-record trace column" in capsys.readouterr().err
