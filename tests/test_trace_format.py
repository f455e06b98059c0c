"""The .sptrace file: crash-safe (SIGKILL, truncation), versioned, and refused cleanly when bad."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from trace_factory import make_trace

from spectool.cli import check as check_cli
from spectool.trace import check
from spectool.trace.format import DISK_FIELDS, TraceFormatError, disk_schema
from spectool.trace.reader import Trace
from spectool.trace.schema import FORMAT_VERSION, REQUEST_SCHEMA, STEP_SCHEMA

TESTS = Path(__file__).parent

_RECORD_FOREVER = """
import sys
sys.path.insert(0, {tests!r})
from trace_factory import record_synthetic, run_info_for, tiny_tokenizer_json
from spectool.trace.recorder import Recorder
rec = Recorder({path!r}, run_info_for("eagle", 8, 0.0), tiny_tokenizer_json(), flush_every=3)
record_synthetic(rec, "eagle", num_requests=100000, batch_size=4, max_new_tokens=20)
"""


def test_sigkill_mid_run_leaves_a_loadable_consistent_file(tmp_path):
    path = tmp_path / "killed.sptrace"
    proc = subprocess.Popen([sys.executable, "-c", _RECORD_FOREVER.format(tests=str(TESTS), path=str(path))])
    try:
        deadline = time.monotonic() + 60
        while (not path.exists() or path.stat().st_size < 200_000) and time.monotonic() < deadline:
            assert proc.poll() is None, "the recording process died on its own"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    trace = Trace.load(path)
    assert trace.steps.num_rows > 50 and trace.requests.num_rows > 0
    assert check.check_trace(trace) is None
    assert check_cli.main([str(path)]) == 0


def test_truncated_file_reads_back_a_prefix_of_complete_batches(tmp_path):
    path = tmp_path / "run.sptrace"
    make_trace("ngram", path=path, flush_every=4, num_requests=3)
    full = Trace.load(path)
    data = path.read_bytes()
    seen = 0
    for cut in range(len(data) // 2, len(data), max(1, len(data) // 40)):
        (tmp_path / "cut.sptrace").write_bytes(data[:cut])
        part = Trace.load(tmp_path / "cut.sptrace")
        rows = part.steps.num_rows
        assert rows >= seen  # more bytes never read back less
        assert part.steps.equals(full.steps.slice(0, rows))
        seen = rows
    assert 0 < seen <= full.steps.num_rows


def _write_with_metadata(path: Path, fields, metadata: dict[bytes, bytes]) -> None:
    schema = pa.schema(fields, metadata=metadata)
    with pa.ipc.new_stream(str(path), schema) as w:
        w.write_batch(pa.RecordBatch.from_pylist([], schema=schema))


def _good_metadata() -> dict[bytes, bytes]:
    return dict(disk_schema({"method": "ngram"}, None).metadata)


def test_a_version_1_file_loads_as_recorded(tmp_path):
    """Version 1 stored every column in its reader type, uncompressed, without run_stats."""
    trace = make_trace("eagle", num_requests=3, batch_size=2)
    request_only = [f for f in REQUEST_SCHEMA if f.name not in STEP_SCHEMA.names]
    fields = [pa.field("kind", pa.string()), *STEP_SCHEMA, *request_only]
    meta = _good_metadata() | {b"spectool.format_version": b"1"}
    schema = pa.schema(fields, metadata=meta)
    steps = trace.steps.to_pylist()
    rows = [{"kind": "step", **r} for r in steps] + [{"kind": "request", **r} for r in trace.requests.to_pylist()]
    with pa.ipc.new_stream(str(tmp_path / "v1.sptrace"), schema) as w:
        w.write_batch(pa.RecordBatch.from_pylist(rows[:5], schema=schema))
        w.write_batch(pa.RecordBatch.from_pylist(rows[5:], schema=schema))
    loaded = Trace.load(tmp_path / "v1.sptrace")
    assert loaded.steps.equals(trace.steps) and loaded.requests.equals(trace.requests)
    assert check.check_trace(loaded) is None


@pytest.mark.parametrize("version", [0, FORMAT_VERSION + 1])
def test_other_format_versions_are_refused_naming_both(tmp_path, version):
    meta = _good_metadata() | {b"spectool.format_version": str(version).encode()}
    _write_with_metadata(tmp_path / "v.sptrace", DISK_FIELDS, meta)
    with pytest.raises(TraceFormatError) as err:
        Trace.load(tmp_path / "v.sptrace")
    assert f"version {version}" in str(err.value) and f"version {FORMAT_VERSION}" in str(err.value)


def _bad_files(tmp_path: Path) -> dict[str, Path]:
    good = tmp_path / "good.sptrace"
    make_trace("eagle", path=good, num_requests=1)
    files = {"random bytes": os.urandom(4096), "truncated header": good.read_bytes()[:40], "empty": b"",
             "json": json.dumps({"not": "a trace"}).encode()}
    out = {name: tmp_path / f"{i}.sptrace" for i, name in enumerate(files)}
    for name, data in files.items():
        out[name].write_bytes(data)
    out["wrong version"] = tmp_path / "v.sptrace"
    _write_with_metadata(out["wrong version"], DISK_FIELDS,
                         _good_metadata() | {b"spectool.format_version": b"999"})
    out["missing column"] = tmp_path / "m.sptrace"
    without_parents = [f for f in DISK_FIELDS if f.name != "parents"]
    _write_with_metadata(out["missing column"], without_parents, _good_metadata())
    out["no magic"] = tmp_path / "plain.sptrace"
    _write_with_metadata(out["no magic"], DISK_FIELDS, {})
    out["missing file"] = tmp_path / "nowhere.sptrace"
    return out


@pytest.mark.parametrize("command", ["check", "summary", "perfetto"])
def test_unreadable_input_exits_2_with_one_line(tmp_path, capsys, command):
    from spectool.cli import export_perfetto as perfetto
    from spectool.cli import summary

    main = {"check": check_cli.main, "summary": summary.main, "perfetto": perfetto.main}[command]
    for name, path in _bad_files(tmp_path).items():
        assert main([str(path)]) == 2, name
        out = capsys.readouterr()
        lines = out.err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in out.err and out.out == "", (name, out)
        if name == "missing column":
            assert "parents" in lines[0]
        if name == "wrong version":
            assert "999" in lines[0] and str(FORMAT_VERSION) in lines[0]


def test_empty_run_is_a_valid_trace(tmp_path):
    from spectool.trace.recorder import Recorder

    Recorder(tmp_path / "empty.sptrace", {"method": "ngram"}).close()
    trace = Trace.load(tmp_path / "empty.sptrace")
    assert trace.steps.num_rows == 0 and trace.run_info["method"] == "ngram"
    assert "start_time" in trace.run_info and "versions" in trace.run_info
    assert check_cli.main([str(tmp_path / "empty.sptrace")]) == 0


def _trailer_start(data: bytes) -> int:
    """Where the index trailer begins (its layout: index stream, u64 length, u32 CRC, magic)."""
    length, _, magic = struct.unpack("<QI8s", data[-20:])
    assert magic == b"SPTINDEX"
    return len(data) - 20 - length


def test_the_index_trailer_agrees_with_arrows_own_reading(tmp_path):
    from trace_factory import record_synthetic, run_info_for, tiny_tokenizer_json

    from spectool.trace.recorder import Recorder
    from spectool.trace.select import Record

    path = tmp_path / "run.sptrace"
    # Flushes of 5 rows mix step, request and selection-count rows in one batch.
    rec = Recorder(path, run_info_for("ngram", 8, 0.0), tiny_tokenizer_json(), flush_every=5,
                   select=Record(every=2))
    with rec:
        record_synthetic(rec, "ngram", num_requests=6, batch_size=3, max_new_tokens=20)
    data = path.read_bytes()
    start = _trailer_start(data)
    # The oracle: Arrow's stream reader, which stops at the end-of-stream marker before the trailer.
    batches = list(pa.ipc.open_stream(data))
    table = pa.Table.from_batches(batches)
    steps = table.filter(pc.equal(table["kind"], "step"))
    want = {"iteration": steps["iteration"].to_numpy(), "request_id": steps["request_id"].to_numpy(),
            "accept_length": steps["accept_length"].fill_null(-1).to_numpy(),
            "iteration_us": steps["iteration_us"].to_numpy(zero_copy_only=False)}
    per_batch = [pc.sum(pc.equal(b.column(0), "step")).as_py() or 0 for b in batches]
    request_rows = table.filter(pc.equal(table["kind"], "request")).select(REQUEST_SCHEMA.names).to_pylist()
    want_requests = {r["request_id"]: r for r in request_rows}  # the last row of each id
    counts = json.loads([s for s in table["run_stats"].to_pylist() if s][-1])
    bare, damaged = tmp_path / "bare.sptrace", tmp_path / "damaged.sptrace"
    bare.write_bytes(data[:start])  # no trailer: a recording killed at its end
    flipped = bytearray(data)
    flipped[(start + len(data)) // 2] ^= 0x55  # one bit pattern inside the index stream
    damaged.write_bytes(bytes(flipped))
    for name, source in ((path, "trailer"), (bare, "batches"), (damaged, "batches")):
        trace = Trace.load(name)
        assert trace._file.indexed_from == source and not trace.truncated, name
        for rid in range(6):  # one request's row: from the one batch the trailer names, else from all of them
            assert trace.request(rid) == want_requests[rid], (name, rid)
        assert (trace._requests is None) == (source == "trailer"), name
        got = trace.scalars()
        for key, values in want.items():
            np.testing.assert_array_equal(got[key], values.astype(got[key].dtype), err_msg=f"{name} {key}")
        assert np.diff(trace._file.batch_start).tolist() == per_batch
        assert {k: trace.run_info["record"][k] for k in counts} == counts
        assert trace.steps.equals(Trace.from_disk_table(table, {}).steps)
        assert trace.requests.num_rows == 6 and check.check_trace(trace) is None



def _without_summary_columns(data: bytes, start: int) -> bytes:
    """The file with its trailer rewritten as a writer before the stored summary columns and the request
    rows' ids wrote it."""
    index = pa.ipc.open_stream(data[start:-20])
    table = pa.Table.from_batches(list(index))
    meta = json.loads(index.schema.metadata[b"spectool.index"])
    del meta["request_ids"]
    old = pa.schema([index.schema.field(n) for n in ("iteration", "request_id", "accept_length", "iteration_us")],
                    metadata={b"spectool.index": json.dumps(meta).encode()})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, old, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(table.select(old.names).cast(old))
    stream = sink.getvalue().to_pybytes()
    return data[:start] + stream + struct.pack("<QI8s", len(stream), zlib.crc32(stream), b"SPTINDEX")


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_summary_from_the_trailer_equals_the_summary_of_the_records(tmp_path, method):
    """A closed file's summary comes from its trailer without decoding a batch, and equals the summary
    of the records as Arrow reads them; a trailer without those columns and a file without a trailer
    summarise the same from the batches."""
    from trace_factory import record_synthetic, run_info_for, tiny_tokenizer_json

    from spectool.trace.recorder import Recorder
    from spectool.trace.stats import summarize

    path = tmp_path / "run.sptrace"
    with Recorder(path, run_info_for(method, 8, 0.0), tiny_tokenizer_json(), flush_every=7) as rec:
        record_synthetic(rec, method, num_requests=8, batch_size=3, max_new_tokens=30)
    data = path.read_bytes()
    start = _trailer_start(data)
    table = pa.Table.from_batches(list(pa.ipc.open_stream(data)))
    want = summarize(table.filter(pc.equal(table["kind"], "step")))
    requests = {r["request_id"]: r for r in table.filter(pc.equal(table["kind"], "request"))
                .select(REQUEST_SCHEMA.names).to_pylist()}
    assert want["records"] > 40 and want["accept_rate_by_depth"] and want["phase_us"]["draft_us"] > 0
    assert ("trie_get_us" in want["phase_us"]) == (method == "ngram")  # eagle records no trie phases
    older, bare = tmp_path / "older.sptrace", tmp_path / "bare.sptrace"
    older.write_bytes(_without_summary_columns(data, start))
    bare.write_bytes(data[:start])
    for name, source, stored in ((path, "trailer", True), (older, "trailer", False), (bare, "batches", False)):
        trace = Trace.load(name)
        assert trace._file.indexed_from == source and (trace._file.stored_summary_columns() is not None) == stored
        if stored:
            trace._file.iter_steps = None  # reading a batch would fail: the summary must not need one
        got = trace.summary()
        assert {k: got[k] for k in want} == want, name
        assert trace._file.indexes_requests == stored and trace.request(5) == requests[5], name


def test_a_file_that_grows_while_it_is_opened_reads_as_it_was_mapped(tmp_path, monkeypatch):
    """A live recording appends between the open's map and its reads: the open must read the mapped bytes
    alone, never an offset past them (which pyarrow refuses with an OSError)."""
    import spectool.trace.format as fmt

    path = tmp_path / "live.sptrace"
    make_trace(path=path, num_requests=3, max_new_tokens=20)
    want = len(Trace.load(path))
    real_map = fmt.pa.memory_map

    def map_then_grow(where, *args):
        mm = real_map(where, *args)
        with open(where, "ab") as f:  # the recorder's next flush, landing after the map
            f.write(os.urandom(8000))
        return mm

    monkeypatch.setattr(fmt.pa, "memory_map", map_then_grow)
    trace = Trace.load(path)
    assert len(trace) == want and trace._file.indexed_from == "trailer"


_RECORD_ENGINE_FOREVER = """
import sys
sys.path.insert(0, {tests!r})
import spectool as st
from test_engine_support import load_demo_target
engine = st.Engine(load_demo_target(st.demo_model()), draft=st.NgramConfig(num_draft_tokens=8), max_batch_size=4,
                   max_seq_len=2048)
prompts = [[5, 6, 7, 8, 5, 6, 7, 9 + i] for i in range(64)]
engine.generate(prompts, max_new_tokens=1500, ignore_eos=True, record=st.Record(path={path!r}, flush_every=8))
"""


def _records_so_far(path: Path) -> int:
    """The records a live recording's file holds now: 0 until its header is whole (the writer's first
    flush may be on its way)."""
    try:
        return len(Trace.load(path)) if path.exists() else 0
    except TraceFormatError:
        return 0


def test_sigkill_of_an_engine_recording_straight_to_a_file(tmp_path):
    """Engine.generate(record=st.Record(path=...)): the file grows batch by batch and a kill keeps them."""
    path = tmp_path / "engine.sptrace"
    proc = subprocess.Popen([sys.executable, "-c", _RECORD_ENGINE_FOREVER.format(tests=str(TESTS), path=str(path))])
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the recording process died on its own"
            if _records_so_far(path) >= 40:
                break
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    trace = Trace.load(path)
    assert len(trace) >= 40 and trace._file.indexed_from == "batches"
    assert check.check_trace(trace) is None
    assert check_cli.main([str(path)]) == 0
