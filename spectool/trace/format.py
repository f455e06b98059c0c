"""The `.sptrace` file: one Arrow IPC stream, appended one compressed record batch per flush.

Layout. A single stream keeps the file self-describing and crash-safe: the schema
message at the head carries the metadata (MAGIC, FORMAT_VERSION, run_info JSON and
the tokenizer JSON), and every later message is a complete record batch. Step rows,
request rows and selection counts share that one stream: the disk schema is a
``kind`` column ("step" | "request" | "stats") followed by the step columns (in their
DISK_TYPES), the request-only columns and ``run_stats`` (JSON counts of a selective
recording, see `spectool.trace.select`); the columns a row's kind does not use are
null. A reader splits on ``kind``.

Size. Version 2 compresses every buffer with zstd (level 1: on the demo workloads it
stores 40-45 % less than lz4 for the same CPU, see docs/BENCHMARKS.md), stores the
narrow DISK_TYPES, and leaves ``target_argmax`` / ``target_argmax_prob`` null on rows
where they equal the target's top-1 (the reader derives them back, as the recorder
does when they are not given).

Durability. Each flush writes one batch and flushes the file to the OS, so a process
killed at any moment leaves a file whose complete batches all read back. `TraceFile`
stops at the first batch it cannot frame or decode and reports it with its byte offset
(``truncated``, ``damage``); every batch before it stays readable.

Reading lazily. `TraceFile` memory-maps the file and, at open, reads only the message
headers and the small index columns (kind, iteration, request_id, run_stats). Any
batch is then decoded on demand, all columns or a subset (the other columns' buffers
are neither decompressed nor paged in).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from spectool.trace.index import FileIndex, IndexBuilder, column_values, read_index
from spectool.trace.schema import DISK_TYPES, FORMAT_VERSION, MAGIC, READABLE_VERSIONS, REQUEST_SCHEMA, STEP_SCHEMA

_KEY_MAGIC = b"spectool.magic"
_KEY_VERSION = b"spectool.format_version"
_KEY_RUN_INFO = b"spectool.run_info"
_KEY_TOKENIZER = b"spectool.tokenizer_json"

COMPRESSION = "zstd"
COMPRESSION_LEVEL = 1
_REQUEST_ONLY = [f for f in REQUEST_SCHEMA if f.name not in STEP_SCHEMA.names]
DISK_FIELDS = [pa.field("kind", pa.string()),
               *(pa.field(f.name, DISK_TYPES.get(f.name, f.type)) for f in STEP_SCHEMA),
               *_REQUEST_ONLY, pa.field("run_stats", pa.string())]
# Columns every readable file has; a column added to the schema later reads as null from older files.
_REQUIRED = frozenset(
    "kind iteration request_id method seq_len num_nodes tokens parents depth scores valid mask_packed positions "
    "retrieve_index retrieve_next_token retrieve_next_sibling ngram_match_len ngram_breadth step_topk_tokens "
    "step_topk_probs step_topk_shape target_argmax target_argmax_prob target_topk_tokens target_topk_probs "
    "status accept_path accept_length bonus_token coins temperature draft_us index_us verify_us commit_us "
    "trie_get_us trie_put_us iteration_us prompt_tokens output_tokens finish_reason prompt_text".split())
# Read for every row at open: the index, plus the two scalars whole-trace plots need (`scalars`).
_INDEX_COLUMNS = ("kind", "iteration", "request_id", "accept_length", "iteration_us", "run_stats")
# A derived column needs its source columns decoded with it.
_NEEDS = {"target_argmax": ("target_topk_tokens", "num_nodes"),
          "target_argmax_prob": ("target_topk_probs", "num_nodes")}
_ARGMAX = (("target_argmax", "target_topk_tokens"), ("target_argmax_prob", "target_topk_probs"))


class TraceFormatError(ValueError):
    """The file is not a readable spectool trace (bad bytes, wrong version, missing column)."""


def disk_schema(run_info: dict, tokenizer_json: str | None) -> pa.Schema:
    """The on-disk schema with the run's metadata attached."""
    meta = {
        _KEY_MAGIC: MAGIC.encode(),
        _KEY_VERSION: str(FORMAT_VERSION).encode(),
        _KEY_RUN_INFO: json.dumps(run_info, default=str).encode(),
    }
    if tokenizer_json:
        meta[_KEY_TOKENIZER] = tokenizer_json.encode()
    return pa.schema(DISK_FIELDS, metadata=meta)


# -- list columns as numpy ------------------------------------------------------------

def list_parts(col: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A list column as (flat values, offsets [rows + 1] from 0, valid [rows])."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    offsets = np.asarray(col.offsets.to_numpy(), dtype=np.int64)
    values = col.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]
    valid = np.ones(len(col), bool) if col.null_count == 0 else ~np.asarray(col.is_null().to_numpy(False))
    return values, offsets - offsets[0], valid


def _top1_index(n: np.ndarray, topk_offsets: np.ndarray, rows: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For ``rows`` (whose top-k holds k >= 1 entries per node): the flat index of every node's top-1
    in the top-k values, the position in ``rows`` it belongs to, and its node index."""
    k = np.diff(topk_offsets)[rows] // n[rows]
    node_row = np.repeat(np.arange(len(rows)), n[rows])
    starts = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(n[rows], out=starts[1:])
    j = np.arange(len(node_row)) - starts[node_row]
    return topk_offsets[rows][node_row] + j * k[node_row], node_row, j


def _topk_rows(n: np.ndarray, topk_offsets: np.ndarray, topk_valid: np.ndarray) -> np.ndarray:
    lengths = np.diff(topk_offsets)
    return topk_valid & (n > 0) & (lengths > 0) & (lengths % np.maximum(n, 1) == 0)


def _drop_derivable_argmax(steps: pa.Table) -> pa.Table:
    """Null target_argmax(_prob) on the rows where both equal the top-1 of the target's top-k."""
    n = np.asarray(steps["num_nodes"].fill_null(0).to_numpy(), dtype=np.int64)
    tv, to, tvalid = list_parts(steps["target_topk_tokens"])
    pv, po, pvalid = list_parts(steps["target_topk_probs"])
    av, ao, avalid = list_parts(steps["target_argmax"])
    bv, bo, bvalid = list_parts(steps["target_argmax_prob"])
    ok = (_topk_rows(n, to, tvalid) & avalid & (np.diff(ao) == n) & bvalid & (np.diff(bo) == n)
          & (np.diff(po) == np.diff(to)) & pvalid)
    rows = np.flatnonzero(ok)
    if not rows.size:
        return steps
    idx, node_row, j = _top1_index(n, to, rows)
    flat = ao[rows][node_row] + j
    same = (av[flat] == tv[idx]) & ((bv[flat] == pv[idx]) | (np.isnan(bv[flat]) & np.isnan(pv[idx])))
    bad = np.bincount(node_row, weights=~same, minlength=len(rows)) > 0
    drop = np.zeros(len(n), bool)
    drop[rows[~bad]] = True
    if not drop.any():
        return steps
    for name, (values, offsets, valid) in ((_ARGMAX[0][0], (av, ao, avalid)), (_ARGMAX[1][0], (bv, bo, bvalid))):
        lengths = np.where(drop, 0, np.diff(offsets))
        kept = np.zeros(len(n) + 1, np.int64)
        np.cumsum(lengths, out=kept[1:])
        values = values[np.repeat(~drop, np.diff(offsets))]
        typ = steps.schema.field(name).type
        arr = pa.ListArray.from_arrays(pa.array(kept.astype(np.int32)), pa.array(values, typ.value_type),
                                       mask=pa.array(drop | ~valid))
        steps = steps.set_column(steps.schema.get_field_index(name), name, arr)
    return steps


def _to_float16_lists(col: pa.ChunkedArray | pa.Array, typ: pa.ListType) -> pa.Array:
    """A list<float32> column as list<float16> through numpy (Arrow's half-float cast is many times slower)."""
    values, offsets, valid = list_parts(col)
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                    pa.array(np.asarray(values, np.float32).astype(np.float16), typ.value_type),
                                    mask=None if valid.all() else pa.array(~valid))


def _derive_argmax(steps: pa.Table) -> pa.Table:
    """Fill null target_argmax(_prob) rows from the top-1 of the target's top-k (the writer's inverse)."""
    n = np.asarray(steps["num_nodes"].fill_null(0).to_numpy(), dtype=np.int64)
    for name, source in _ARGMAX:
        if name not in steps.column_names or source not in steps.column_names:
            continue
        col = steps[name]
        if col.null_count == 0:
            continue
        sv, so, svalid = list_parts(steps[source])
        av, ao, avalid = list_parts(col)
        derive = ~avalid & _topk_rows(n, so, svalid)
        if not derive.any():
            continue
        lengths = np.where(derive, n, np.diff(ao))
        offsets = np.zeros(len(n) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        elem_row = np.repeat(np.arange(len(n)), lengths)
        t = np.arange(offsets[-1]) - offsets[elem_row]
        k = np.diff(so) // np.maximum(n, 1)
        src = np.where(derive[elem_row], len(av) + so[elem_row] + t * k[elem_row], ao[elem_row] + t)
        values = np.concatenate([av, sv.astype(av.dtype, copy=False)])[src]
        typ = STEP_SCHEMA.field(name).type
        mask = pa.array(~(avalid | derive))
        arr = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, typ.value_type), mask=mask)
        steps = steps.set_column(steps.schema.get_field_index(name), name, arr)
    return steps


# -- writing ----------------------------------------------------------------------------

def to_disk_batch(steps: pa.Table, requests: pa.Table, schema: pa.Schema,
                  stats: dict | None = None) -> pa.RecordBatch:
    """Stack step rows, request rows and (optionally) one stats row into one batch of the disk schema."""
    if steps.num_rows and "target_topk_tokens" in steps.column_names:
        steps = _drop_derivable_argmax(steps)
    stats_rows = pa.table({"run_stats": [json.dumps(stats)]}) if stats is not None else pa.table({})
    parts = [(kind, t) for kind, t in (("step", steps), ("request", requests), ("stats", stats_rows))
             if t.num_rows]
    columns = []
    for fl in schema:
        chunks = []
        for kind, table in parts:
            n = table.num_rows
            if fl.name == "kind":
                chunks.append(pa.array([kind] * n, pa.string()))
            elif fl.name in table.column_names:
                column = table.column(fl.name)
                try:
                    if column.type == fl.type:
                        chunks += column.chunks
                    elif pa.types.is_list(fl.type) and fl.type.value_type == pa.float16() and len(column):
                        chunks.append(_to_float16_lists(column, fl.type))
                    else:
                        chunks += column.cast(fl.type).chunks
                except (pa.ArrowInvalid, OverflowError) as e:
                    raise ValueError(f"trace column {fl.name!r} holds a value that does not fit its on-disk "
                                     f"type {fl.type}: {e}") from None
            else:
                chunks.append(pa.nulls(n, fl.type))
        columns.append(chunks[0] if len(chunks) == 1 else pa.concat_arrays(chunks) if chunks else
                       pa.array([], fl.type))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


class TraceFileWriter:
    """Appends compressed disk batches to a `.sptrace` file, flushing each to the OS.

    Compression runs inside Arrow with the GIL released, on the recorder's writer thread.
    ``compression`` = (codec, level): zstd level 1 by default; (None, None) writes uncompressed.
    """

    def __init__(self, path: str | Path, run_info: dict, tokenizer_json: str | None,
                 compression: tuple[str | None, int | None] = (COMPRESSION, COMPRESSION_LEVEL)):
        self.schema = disk_schema(run_info, tokenizer_json)
        self._file = open(path, "wb")
        codec, level = compression
        options = pa.ipc.IpcWriteOptions(compression=None if codec is None else pa.Codec(codec, level))
        self._writer = pa.ipc.new_stream(self._file, self.schema, options=options)
        self._index = IndexBuilder()
        # Arrow writes the schema with the first batch: an empty one puts it on disk now, so a run killed
        # before its first flush still leaves a valid, empty trace.
        self._append(pa.RecordBatch.from_pylist([], schema=self.schema), 0, 0, None)

    def write(self, steps: pa.Table, requests: pa.Table, stats: dict | None = None) -> None:
        if steps.num_rows == 0 and requests.num_rows == 0 and stats is None:
            return
        self._append(to_disk_batch(steps, requests, self.schema, stats), steps.num_rows, requests.num_rows, stats)

    def _append(self, batch: pa.RecordBatch, steps: int, requests: int, stats: dict | None) -> None:
        self._writer.write_batch(batch)
        self._file.flush()
        self._index.add(self._file.tell(), batch, steps, requests, stats)

    def close(self) -> None:
        """End the stream and append the index trailer (see `spectool.trace.index`)."""
        if self._file.closed:
            return
        try:
            self._writer.close()
            self._file.write(self._index.trailer())
        finally:
            self._file.close()


def write_trace_file(path: str | Path, steps: pa.Table | Iterable[pa.Table], requests: pa.Table, run_info: dict,
                     tokenizer_json: str | None, rows_per_batch: int = 4096) -> None:
    """Write a whole trace at once (via a temporary file, so a crash never leaves half a save).

    ``steps`` may be one table or an iterable of tables (a lazily loaded trace saves batch by batch)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    writer = TraceFileWriter(tmp, run_info, tokenizer_json)
    try:
        for table in [steps] if isinstance(steps, pa.Table) else steps:
            for start in range(0, table.num_rows, rows_per_batch):
                writer.write(table.slice(start, rows_per_batch), requests.slice(0, 0))
        writer.write(STEP_SCHEMA.empty_table(), requests)
    finally:
        writer.close()
    os.replace(tmp, path)


# -- reading ----------------------------------------------------------------------------

def _check_metadata(meta: dict[bytes, bytes] | None) -> tuple[int, dict, str | None]:
    meta = meta or {}
    if meta.get(_KEY_MAGIC) != MAGIC.encode():
        raise TraceFormatError("not a spectool trace (the Arrow schema has no spectool-trace marker)")
    try:
        version = int(meta.get(_KEY_VERSION, b""))
    except ValueError:
        raise TraceFormatError(f"unreadable format version {meta.get(_KEY_VERSION)!r}") from None
    if version > FORMAT_VERSION:
        raise TraceFormatError(f"trace format version {version} is newer than this spectool reads "
                               f"(version {FORMAT_VERSION}); upgrade spectool")
    if version not in READABLE_VERSIONS:
        raise TraceFormatError(f"trace format version {version} is older than this spectool reads "
                               f"(version {FORMAT_VERSION}, and versions {', '.join(map(str, READABLE_VERSIONS))})"
                               " and cannot be migrated")
    try:
        run_info = json.loads(meta.get(_KEY_RUN_INFO, b"{}"))
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"run_info metadata is not JSON: {e}") from None
    tok = meta.get(_KEY_TOKENIZER)
    return version, run_info, (tok.decode() if tok else None)


def _logical(table: pa.Table, schema: pa.Schema, columns: list[str] | None) -> pa.Table:
    """Rows of one kind with ``columns`` (default all) of ``schema`` in their reader types."""
    names = schema.names if columns is None else [c for c in schema.names if c in columns]
    out = []
    for name in names:
        typ = schema.field(name).type
        if name in table.column_names:
            try:
                col = table.column(name)
                out.append(col if col.type == typ else col.cast(typ))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise TraceFormatError(f"trace column {name!r} has an unexpected type: {e}") from None
        else:
            out.append(pa.nulls(table.num_rows, typ))
    return pa.table(out, schema=pa.schema([schema.field(n) for n in names]))


def disk_steps(table: pa.Table, columns: list[str] | None = None) -> pa.Table:
    """Step rows of the disk layout (every row of ``table`` one) in the STEP_SCHEMA reader types (only
    ``columns`` when given)."""
    if "target_topk_tokens" in table.column_names and "target_argmax" in table.column_names:
        table = _derive_argmax(table)
    return _logical(table, STEP_SCHEMA, columns)


def disk_requests(table: pa.Table, columns: list[str] | None = None) -> pa.Table:
    """The request rows of a disk table in the REQUEST_SCHEMA reader types (only ``columns`` when given)."""
    return _logical(table.filter(pc.equal(table.column("kind"), "request")), REQUEST_SCHEMA, columns)


def split_disk_table(table: pa.Table, columns: list[str] | None = None) -> tuple[pa.Table, pa.Table]:
    """Split a disk table into (steps, requests) with the STEP_SCHEMA / REQUEST_SCHEMA reader types
    (only ``columns`` of each when given)."""
    return disk_steps(table.filter(pc.equal(table.column("kind"), "step")), columns), disk_requests(table, columns)


@dataclass
class _Batch:
    offset: int                       # byte offset of the batch's message in the file
    message: pa.ipc.Message
    step_rows: np.ndarray | None      # positions of its step rows (None: its first num_steps rows)
    num_steps: int
    has_requests: bool


@dataclass
class TraceFile:
    """A `.sptrace` file opened lazily (see the module docstring). Made by `open_trace_file`."""

    path: Path
    version: int
    run_info: dict
    tokenizer_json: str | None
    schema: pa.Schema
    batches: list[_Batch]
    iteration: np.ndarray             # per step row, in file order
    request_id: np.ndarray
    accept_length: np.ndarray         # per step row (-1 where null)
    iteration_us: np.ndarray          # per step row (NaN where null)
    batch_start: np.ndarray           # first global step row of each batch, plus the total
    stats: dict | None                # the last recorded selection counts
    truncated: bool = False
    damage: str | None = None         # why reading stopped early, with the byte offset
    indexed_from: str = "trailer"     # where the index came from: "trailer" or "batches" (see open_trace_file)
    _schema_message: bytes = b""
    _mmap: pa.MemoryMappedFile | None = None
    _cache: OrderedDict = field(default_factory=OrderedDict)
    _trailer: FileIndex | None = None

    def stored_summary_columns(self) -> pa.Table | None:
        """Every step row's `summary_columns` less the index's (max_depth and the phase timings), as the
        trailer stores them; None when the file has no such trailer (the caller reads the batches)."""
        return None if self._trailer is None else self._trailer.summary_columns()

    @property
    def num_steps(self) -> int:
        return int(self.batch_start[-1])

    def _field_indices(self, columns: Iterable[str]) -> list[int]:
        want = {"kind", *columns}
        for name in list(want):
            want.update(_NEEDS.get(name, ()))
        return [i for i, name in enumerate(self.schema.names) if name in want]

    def _raw(self, k: int, columns: list[str] | None = None) -> pa.RecordBatch:
        """Batch ``k`` decoded as stored (disk types, every kind of row), cached for a few batches."""
        key = (k, None if columns is None else tuple(columns))
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        b = self.batches[k]
        try:
            if columns is None:
                batch = pa.ipc.read_record_batch(b.message, self.schema)
            else:
                data = self._schema_message + b.message.serialize().to_pybytes()
                options = pa.ipc.IpcReadOptions(included_fields=self._field_indices(columns))
                batch = pa.ipc.open_stream(pa.py_buffer(data), options=options).read_next_batch()
            batch.validate()
        except (pa.ArrowException, OSError, ValueError) as e:
            raise TraceFormatError(f"{self.path}: batch {k} at byte offset {b.offset} is corrupt: {e}") from None
        self._cache[key] = batch
        if len(self._cache) > 8:
            self._cache.popitem(last=False)
        return batch

    def read_batch(self, k: int, columns: list[str] | None = None) -> tuple[pa.Table, pa.Table]:
        """Batch ``k`` as (step rows, request rows) in reader types; only ``columns`` when given."""
        return split_disk_table(pa.Table.from_batches([self._raw(k, columns)]), columns)

    def iter_steps(self, columns: list[str] | None = None) -> Iterator[pa.Table]:
        """Every batch's step rows in file order (batches without step rows are skipped).
        With ``columns``, one sequential pass decodes only those columns' buffers."""
        if columns is None:
            for k, b in enumerate(self.batches):
                if b.num_steps:
                    yield self.read_batch(k)[0]
            return
        for b, batch in self._stream(columns, lambda b: b.num_steps > 0):
            if b.step_rows is None:  # its step rows come first: a slice, where splitting on kind copies them
                yield disk_steps(pa.Table.from_batches([batch.slice(0, b.num_steps)]), columns)
            else:
                yield split_disk_table(pa.Table.from_batches([batch]), columns)[0]

    def _stream(self, columns: list[str], wanted) -> Iterator[tuple[_Batch, pa.RecordBatch]]:
        """(batch, its ``columns`` decoded) for every batch ``wanted(batch)`` accepts, in one sequential pass
        over the file (one reader: reading a batch on its own re-parses the schema and copies its message)."""
        with pa.memory_map(str(self.path)) as mm:
            options = pa.ipc.IpcReadOptions(included_fields=self._field_indices(columns), use_threads=False)
            reader = pa.ipc.open_stream(mm, options=options)
            for k, b in enumerate(self.batches):
                try:
                    batch = reader.read_next_batch()
                    if not wanted(b):
                        continue
                    batch.validate()
                except (pa.ArrowException, OSError, StopIteration) as e:
                    raise TraceFormatError(f"{self.path}: batch {k} at byte offset {b.offset} is corrupt: {e}"
                                           ) from None
                yield b, batch

    def requests(self) -> pa.Table:
        """Every request row, in file order."""
        parts = [disk_requests(pa.Table.from_batches([batch]), REQUEST_SCHEMA.names)
                 for _, batch in self._stream(REQUEST_SCHEMA.names, lambda b: b.has_requests)]
        return pa.concat_tables(parts) if parts else REQUEST_SCHEMA.empty_table()

    @property
    def indexes_requests(self) -> bool:
        """Whether `request_rows` finds a request's rows without reading every batch."""
        return self._trailer is not None and self._trailer.request_ids is not None

    def request_rows(self, request_id: int) -> pa.Table | None:
        """The request rows of ``request_id`` from the one batch that holds its last one (a few
        milliseconds, where `requests` reads every batch); None when the file's trailer does not list
        its request rows' ids (the caller reads them all)."""
        if not self.indexes_requests:
            return None
        hits = np.flatnonzero(self._trailer.request_ids == int(request_id))
        if not hits.size:
            return REQUEST_SCHEMA.empty_table()
        first = np.zeros(len(self.batches) + 1, np.int64)  # first request row of each batch, in file order
        np.cumsum(self._trailer.requests, out=first[1:])
        k = int(np.searchsorted(first, hits[-1], side="right") - 1)
        rows = disk_requests(pa.Table.from_batches([self._raw(k, REQUEST_SCHEMA.names)]), REQUEST_SCHEMA.names)
        return rows.filter(pc.equal(rows["request_id"], int(request_id)))

    def take(self, rows: np.ndarray, columns: list[str] | None = None) -> pa.Table:
        """Step rows by global index (file order), in the order given."""
        rows = np.asarray(rows, dtype=np.int64)
        which = np.searchsorted(self.batch_start, rows, side="right") - 1
        parts, order = [], []
        for k in np.unique(which):
            mine = np.flatnonzero(which == k)
            local = rows[mine] - self.batch_start[k]
            step_rows = self.batches[k].step_rows
            raw = self._raw(int(k), columns).take(pa.array(local if step_rows is None else step_rows[local]))
            parts.append(split_disk_table(pa.Table.from_batches([raw]), columns)[0])
            order.append(mine)
        if not parts:
            return _logical(STEP_SCHEMA.empty_table(), STEP_SCHEMA, columns)
        table = pa.concat_tables(parts)
        return table.take(pa.array(np.argsort(np.concatenate(order), kind="stable")))


_KIND_LENGTH = {"step": 4, "request": 7, "stats": 5}  # the kinds differ in length


def _kind_lengths(kind: pa.Array) -> np.ndarray:
    """The length of each row's kind, from the string offsets alone (0 where null): comparing strings
    per batch would cost more than the rest of the open."""
    offsets = np.frombuffer(kind.buffers()[1], np.int32, len(kind) + 1, kind.offset * 4)
    lengths = np.diff(offsets)
    return np.where(np.asarray(kind.is_null()), 0, lengths) if kind.null_count else lengths


def _cat(parts: list[np.ndarray], dtype=np.int64) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


def open_trace_file(path: str | Path) -> TraceFile:
    """Open a `.sptrace` file lazily: headers and the index only (TraceFormatError when unreadable).

    Every message header is read (cheap: it frames the file and finds damage); the per-record index
    comes from the file's trailer when it has a valid one, else from the index columns of each batch."""
    path = Path(path)
    mm = pa.memory_map(str(path))
    # The map's size, not the file's now: a recorder may have appended since the map was taken.
    size = mm.size()
    if size == 0:
        raise TraceFormatError("the file is empty")
    try:
        messages = pa.ipc.MessageReader.open_stream(mm)
        head = messages.read_next_message()
        schema = pa.ipc.read_schema(head)
    except (pa.ArrowInvalid, OSError, StopIteration, TypeError) as e:
        raise TraceFormatError(f"not an Arrow IPC stream or header truncated ({e})") from None
    version, run_info, tokenizer_json = _check_metadata(schema.metadata)
    missing = [name for name in sorted(_REQUIRED) if name not in schema.names]
    if missing:
        raise TraceFormatError(f"trace is missing column(s): {', '.join(missing)}")
    head_end = mm.tell()
    batches: list[_Batch] = []
    ends: list[int] = []
    damage = None
    while True:
        offset = mm.tell()
        try:
            msg = messages.read_next_message()
        except StopIteration:
            break
        except (pa.ArrowInvalid, OSError) as e:
            damage = (offset, str(e))
            break
        if msg is None:
            break
        if msg.type != "record batch":
            damage = (offset, f"unexpected {msg.type} message")
            break
        batches.append(_Batch(offset, msg, None, 0, False))
        ends.append(mm.tell())
    # A damaged file is indexed from its readable batches: the trailer describes the file as it was written.
    index = read_index(mm, size, head_end) if damage is None else None
    if index is not None and ends == index.ends.tolist():
        columns, stats, source = _index_from_trailer(batches, index), index.stats, "trailer"
    else:
        columns, stats, damage = _index_from_batches(mm, schema, batches, damage)
        source, index = "batches", None
    counts = np.array([b.num_steps for b in batches], dtype=np.int64)
    batch_start = np.zeros(len(batches) + 1, np.int64)
    np.cumsum(counts, out=batch_start[1:])
    note = None
    if damage is not None:
        at, why = damage
        rows = int(batch_start[-1])
        note = (f"the batch at byte offset {at} of {size} is incomplete or corrupt ({why}); "
                f"the {len(batches)} batch(es) before it ({rows} records) are readable")
    return TraceFile(path, version, run_info, tokenizer_json, schema, batches, columns["iteration"],
                     columns["request_id"], columns["accept_length"], columns["iteration_us"], batch_start, stats,
                     damage is not None, note, source,
                     head.serialize().to_pybytes(), mm, _trailer=index)


def _index_from_trailer(batches: list[_Batch], index: FileIndex) -> dict[str, np.ndarray]:
    """The index of ``batches`` from the file's trailer (see `spectool.trace.index`)."""
    for b, steps, requests in zip(batches, index.steps.tolist(), index.requests.tolist()):
        b.num_steps, b.has_requests = steps, requests > 0  # step rows first: ``step_rows`` stays None
    return {name: values.astype(np.float64 if name == "iteration_us" else np.int64)
            for name, values in index.columns.items()}


def _index_from_batches(mm: pa.MemoryMappedFile, schema: pa.Schema, batches: list[_Batch], damage
                        ) -> tuple[dict[str, np.ndarray], dict | None, tuple | None]:
    """The index of every batch from its index columns, in one pass that decompresses nothing else; a batch
    that does not decode ends the readable part (returned as ``damage``)."""
    mm.seek(0)
    index_fields = [i for i, name in enumerate(schema.names) if name in _INDEX_COLUMNS]
    # One thread: the index buffers are small, and a thread pool per batch costs more than it saves.
    reader = pa.ipc.open_stream(mm, options=pa.ipc.IpcReadOptions(included_fields=index_fields, use_threads=False))
    iterations, requests, accepts, times, stats = [], [], [], [], None
    for k, b in enumerate(batches):
        try:
            batch = reader.read_next_batch()
            batch.validate()
            kind = _kind_lengths(batch.column(batch.schema.get_field_index("kind")))
            is_step = kind == _KIND_LENGTH["step"]
        except (pa.ArrowInvalid, pa.ArrowException, OSError, StopIteration) as e:
            damage = (b.offset, str(e))
            del batches[k:]
            break
        b.num_steps = int(is_step.sum())
        b.step_rows = None if is_step[:b.num_steps].all() else np.flatnonzero(is_step)
        for name, out, null in (("iteration", iterations, 0), ("request_id", requests, 0),
                                ("accept_length", accepts, -1), ("iteration_us", times, np.nan)):
            values = column_values(batch.column(batch.schema.get_field_index(name)), null)
            out.append(values[:b.num_steps] if b.step_rows is None else values[b.step_rows])
        if b.num_steps == len(kind):
            continue
        b.has_requests = bool((kind == _KIND_LENGTH["request"]).any())
        stats_rows = np.flatnonzero(kind == _KIND_LENGTH["stats"])
        if "run_stats" in batch.schema.names and stats_rows.size:
            text = batch.column(batch.schema.get_field_index("run_stats"))[int(stats_rows[-1])].as_py()
            stats = json.loads(text) if text else stats
    columns = {"iteration": _cat(iterations), "request_id": _cat(requests), "accept_length": _cat(accepts),
               "iteration_us": _cat(times, np.float64)}
    return columns, stats, damage


def read_trace_file(path: str | Path) -> tuple[pa.Table, pa.Table, dict, str | None, bool]:
    """Read a whole `.sptrace` file -> (steps, requests, run_info, tokenizer_json, truncated)."""
    f = open_trace_file(path)
    parts = list(f.iter_steps())
    steps = pa.concat_tables(parts) if parts else STEP_SCHEMA.empty_table()
    return steps, f.requests(), f.run_info, f.tokenizer_json, f.truncated
