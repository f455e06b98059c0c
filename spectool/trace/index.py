"""The index trailer of a `.sptrace` file: what `Trace.load` needs, stored once at the end.

Opening a trace needs, for every record, its iteration and request (and the two scalars
whole-trace plots draw: accept_length, iteration_us), and for every batch its row counts.
Reading those from the batches costs a decompression per batch (over a second for a
million records); a closed file therefore carries them after its Arrow stream:

    [Arrow IPC stream: schema, batches, end-of-stream] [index: Arrow IPC stream] [u64 length] [u32 crc32]
    [b"SPTINDEX"]

The index stream holds one row per step record (INDEX_SCHEMA, zstd) and, in its schema
metadata, JSON with each batch's end offset, row counts, the request id of every request row
(so one request's prompt and output are read from the one batch holding them) and the last
selection counts; the CRC-32 of the index stream guards it. Its rows also carry SUMMARY_SCHEMA
(each record's deepest node and the phase timings), read only by `Trace.summary`, so that a
summary of a closed file decodes no batch either. A trailer written before the request ids and
SUMMARY_SCHEMA existed still indexes its file (its summary reads the batches, a request's row is
found by reading every request row). Arrow readers stop at the end-of-stream marker, so the
trailer changes nothing for them (the format version stays). A file without a valid trailer
(a recording killed before it closed, a file cut short, a damaged trailer) is indexed by
reading its batches instead, as is a file whose batches do not frame as the trailer says.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from spectool.trace.schema import PHASE_FIELDS
from spectool.trace.stats import summary_columns

INDEX_MAGIC = b"SPTINDEX"
_TAIL = struct.Struct("<QI8s")
_KEY = b"spectool.index"
INDEX_SCHEMA = pa.schema([("iteration", pa.int32()), ("request_id", pa.int32()),
                          ("accept_length", pa.int16()), ("iteration_us", pa.float32())])
# What `summarize` reads beyond the index columns, as `summary_columns` reduces it (nulls kept).
SUMMARY_SCHEMA = pa.schema([("max_depth", pa.int16()), *((name, pa.float32()) for name in PHASE_FIELDS)])
# The value a null reads as in the index arrays.
INDEX_NULLS = {"iteration": 0, "request_id": 0, "accept_length": -1, "iteration_us": np.nan}


def column_values(col: pa.Array, null) -> np.ndarray:
    """A numeric column's values buffer as numpy with ``null`` where it is null (to_numpy with nulls
    goes through a slow path, too slow for every batch of a large file)."""
    width = col.type.bit_width // 8
    kind = "f" if pa.types.is_floating(col.type) else "i"
    values = np.frombuffer(col.buffers()[1], np.dtype(f"{kind}{width}"), len(col), col.offset * width)
    if col.null_count:
        valid = np.unpackbits(np.frombuffer(col.buffers()[0], np.uint8), bitorder="little")[col.offset:][:len(col)]
        values = np.where(valid.astype(bool), values, null)
    return values


@dataclass
class FileIndex:
    """The index of a file's batches (file order): step rows first in every batch, then request rows."""

    ends: np.ndarray        # byte offset just past each batch's message
    rows: np.ndarray        # rows per batch (of every kind)
    steps: np.ndarray       # step rows per batch
    requests: np.ndarray    # request rows per batch
    columns: dict[str, np.ndarray]  # INDEX_SCHEMA's columns, one entry per step row
    stats: dict | None      # the last selection counts written
    request_ids: np.ndarray | None = None  # of every request row, file order (None: written without them)
    stream: pa.Buffer | None = None  # the index stream (memory-mapped), when it holds SUMMARY_SCHEMA too

    def summary_columns(self) -> pa.Table | None:
        """SUMMARY_SCHEMA's columns of every step row (decoded now, not at open), None when the trailer
        was written without them."""
        if self.stream is None:
            return None
        fields = [i for i, name in enumerate(_stream_schema(self.stream).names) if name in SUMMARY_SCHEMA.names]
        options = pa.ipc.IpcReadOptions(included_fields=fields, use_threads=False)
        return pa.Table.from_batches([pa.ipc.open_stream(self.stream, options=options).read_next_batch()])


class IndexBuilder:
    """Collects the index while a file is written (a few bytes per record) and serialises the trailer."""

    def __init__(self) -> None:
        self._ends: list[int] = []
        self._rows: list[int] = []
        self._steps: list[int] = []
        self._requests: list[int] = []
        self._request_ids: list[int] = []
        self._columns: dict[str, list[np.ndarray]] = {name: [] for name in INDEX_SCHEMA.names}
        # SUMMARY_SCHEMA's columns as (values, valid) numpy parts: Arrow tables per batch would hold
        # an allocation each for the whole run.
        self._summary: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {name: [] for name in SUMMARY_SCHEMA.names}
        self._stats: dict | None = None

    def add(self, end: int, batch: pa.RecordBatch, steps: int, requests: int, stats: dict | None) -> None:
        """One written batch: its end offset, its first ``steps`` rows being step records."""
        self._ends.append(end)
        self._rows.append(batch.num_rows)
        self._steps.append(steps)
        self._requests.append(requests)
        if stats is not None:
            self._stats = stats
        if requests:
            ids = batch.column(batch.schema.get_field_index("request_id")).slice(steps, requests)
            self._request_ids += column_values(ids, -1).tolist()
        if not steps:
            return
        for fl in INDEX_SCHEMA:
            col = batch.column(batch.schema.get_field_index(fl.name)).slice(0, steps)
            values = column_values(col, INDEX_NULLS[fl.name])
            self._columns[fl.name].append(values.astype(fl.type.to_pandas_dtype(), copy=False))
        rows = pa.Table.from_batches([batch.slice(0, steps)]).select(["depth", *PHASE_FIELDS])
        reduced = summary_columns(rows)
        for fl in SUMMARY_SCHEMA:
            col = reduced.column(fl.name).combine_chunks()
            valid = np.ones(len(col), bool) if col.null_count == 0 else np.asarray(col.is_valid())
            values = column_values(col, 0).astype(fl.type.to_pandas_dtype())
            self._summary[fl.name].append((values, valid))

    def trailer(self) -> bytes:
        """The index stream, its length and the magic, to append after the Arrow stream's end."""
        meta = {"ends": self._ends, "rows": self._rows, "steps": self._steps, "requests": self._requests,
                "request_ids": self._request_ids, "stats": self._stats}
        arrays = [pa.array(np.concatenate(parts) if parts else np.zeros(0, fl.type.to_pandas_dtype()), fl.type)
                  for fl, parts in zip(INDEX_SCHEMA, self._columns.values())]
        for fl in SUMMARY_SCHEMA:
            parts = self._summary[fl.name]
            values = np.concatenate([v for v, _ in parts]) if parts else np.zeros(0, fl.type.to_pandas_dtype())
            valid = np.concatenate([m for _, m in parts]) if parts else np.zeros(0, bool)
            arrays.append(pa.array(values, fl.type, mask=None if valid.all() else ~valid))
        schema = pa.schema([*INDEX_SCHEMA, *SUMMARY_SCHEMA], metadata={_KEY: json.dumps(meta).encode()})
        sink = pa.BufferOutputStream()
        options = pa.ipc.IpcWriteOptions(compression=pa.Codec("zstd", 1))
        with pa.ipc.new_stream(sink, schema, options=options) as writer:
            writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=schema))
        data = sink.getvalue().to_pybytes()
        return data + _TAIL.pack(len(data), zlib.crc32(data), INDEX_MAGIC)


def read_index(mm: pa.MemoryMappedFile, size: int, head_end: int) -> FileIndex | None:
    """The trailer's index, or None when the file has none or it does not hold together (the caller
    then indexes the batches themselves)."""
    if size < head_end + _TAIL.size:
        return None
    length, crc, magic = _TAIL.unpack(bytes(mm.read_at(_TAIL.size, size - _TAIL.size)))
    start = size - _TAIL.size - length
    if magic != INDEX_MAGIC or start < head_end:
        return None
    data = mm.read_at(length, start)
    if zlib.crc32(data) != crc:
        return None
    try:
        names = _stream_schema(data).names
        # At open only the index columns are decompressed: the summary's are read when asked for.
        fields = [i for i, name in enumerate(names) if name in INDEX_SCHEMA.names]
        reader = pa.ipc.open_stream(data, options=pa.ipc.IpcReadOptions(included_fields=fields, use_threads=False))
        table = reader.read_next_batch()
        table.validate()
        meta = json.loads(reader.schema.metadata[_KEY])
        ends, rows, steps, requests = (np.asarray(meta[k], np.int64) for k in ("ends", "rows", "steps", "requests"))
        columns = {fl.name: column_values(table.column(fl.name), INDEX_NULLS[fl.name]) for fl in INDEX_SCHEMA}
    except (pa.ArrowException, OSError, ValueError, KeyError, TypeError, StopIteration):
        return None
    eos = 8  # the end-of-stream marker between the last batch and the trailer
    ordered = len(ends) > 0 and ends[0] > head_end and bool((np.diff(ends) > 0).all()) and ends[-1] + eos == start
    if not (ordered and len(rows) == len(steps) == len(ends) == len(requests) and table.num_rows == int(steps.sum())
            and (steps >= 0).all() and (requests >= 0).all() and (steps + requests <= rows).all()):
        return None
    stats = meta.get("stats")
    ids = meta.get("request_ids")
    ids = np.asarray(ids, np.int64) if isinstance(ids, list) and len(ids) == int(requests.sum()) else None
    summary = data if all(name in names for name in SUMMARY_SCHEMA.names) else None
    return FileIndex(ends, rows, steps, requests, columns, stats if isinstance(stats, dict) else None, ids, summary)


def _stream_schema(data: pa.Buffer) -> pa.Schema:
    return pa.ipc.read_schema(pa.ipc.MessageReader.open_stream(data).read_next_message())
