"""The `.sptrace` file: one Arrow IPC stream, appended one record batch per flush.

Layout. A single stream keeps the file self-describing and crash-safe: the schema
message at the head carries the metadata (MAGIC, FORMAT_VERSION, run_info JSON and
the tokenizer JSON), and every later message is a complete record batch. Step rows
and request rows share that one stream: the disk schema is a ``kind`` column
("step" | "request") followed by the STEP_SCHEMA columns and the request-only
columns of REQUEST_SCHEMA (``request_id`` is shared); the columns a row's kind does
not use are null. A reader splits on ``kind``.

Durability. Each flush writes one batch and flushes the file to the OS, so a
process killed at any moment leaves a file whose complete batches all read back;
`read_trace_file` stops at the first incomplete one and reports ``truncated``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from spectool.trace.schema import FORMAT_VERSION, MAGIC, REQUEST_SCHEMA, STEP_SCHEMA

_KEY_MAGIC = b"spectool.magic"
_KEY_VERSION = b"spectool.format_version"
_KEY_RUN_INFO = b"spectool.run_info"
_KEY_TOKENIZER = b"spectool.tokenizer_json"

_REQUEST_ONLY = [f for f in REQUEST_SCHEMA if f.name not in STEP_SCHEMA.names]
DISK_FIELDS = [pa.field("kind", pa.string()), *STEP_SCHEMA, *_REQUEST_ONLY]


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


def to_disk_batch(steps: pa.Table, requests: pa.Table, schema: pa.Schema) -> pa.RecordBatch:
    """Stack step rows and request rows into one record batch of the disk schema."""
    parts = [(kind, t) for kind, t in (("step", steps), ("request", requests)) if t.num_rows]
    columns = []
    for field in DISK_FIELDS:
        chunks = []
        for kind, table in parts:
            n = table.num_rows
            if field.name == "kind":
                chunks.append(pa.array([kind] * n, pa.string()))
            elif field.name in table.column_names:
                column = table.column(field.name)
                chunks += (column if column.type == field.type else column.cast(field.type)).chunks
            else:
                chunks.append(pa.nulls(n, field.type))
        columns.append(pa.concat_arrays(chunks) if chunks else pa.array([], field.type))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


class TraceFileWriter:
    """Appends disk batches to a `.sptrace` file, flushing each to the OS."""

    def __init__(self, path: str | Path, run_info: dict, tokenizer_json: str | None):
        self.schema = disk_schema(run_info, tokenizer_json)
        self._file = open(path, "wb")
        self._writer = pa.ipc.new_stream(self._file, self.schema)
        self._file.flush()  # the header alone is already a valid, empty trace

    def write(self, steps: pa.Table, requests: pa.Table) -> None:
        if steps.num_rows == 0 and requests.num_rows == 0:
            return
        self._writer.write_batch(to_disk_batch(steps, requests, self.schema))
        self._file.flush()

    def close(self) -> None:
        self._writer.close()
        self._file.close()


def write_trace_file(path: str | Path, steps: pa.Table, requests: pa.Table, run_info: dict,
                     tokenizer_json: str | None, rows_per_batch: int = 4096) -> None:
    """Write a whole trace at once (via a temporary file, so a crash never leaves half a save)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    writer = TraceFileWriter(tmp, run_info, tokenizer_json)
    try:
        for start in range(0, max(steps.num_rows, 1), rows_per_batch):
            writer.write(steps.slice(start, rows_per_batch), requests.slice(0, 0))
        writer.write(steps.slice(0, 0), requests)
    finally:
        writer.close()
    os.replace(tmp, path)


def _check_metadata(meta: dict[bytes, bytes] | None) -> tuple[dict, str | None]:
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
    if version < FORMAT_VERSION:
        # Version 1 is the first released format: nothing older can be migrated.
        raise TraceFormatError(f"trace format version {version} is older than this spectool reads "
                               f"(version {FORMAT_VERSION}) and cannot be migrated")
    try:
        run_info = json.loads(meta.get(_KEY_RUN_INFO, b"{}"))
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"run_info metadata is not JSON: {e}") from None
    tok = meta.get(_KEY_TOKENIZER)
    return run_info, (tok.decode() if tok else None)


def split_disk_table(table: pa.Table) -> tuple[pa.Table, pa.Table]:
    """Split a disk table into (steps, requests) with exactly STEP_SCHEMA and REQUEST_SCHEMA."""
    missing = [f.name for f in DISK_FIELDS if f.name not in table.column_names]
    if missing:
        raise TraceFormatError(f"trace is missing column(s): {', '.join(missing)}")
    kind = table.column("kind")
    out = []
    for name, schema in (("step", STEP_SCHEMA), ("request", REQUEST_SCHEMA)):
        rows = table.filter(pc.equal(kind, name))
        try:
            out.append(rows.select(schema.names).cast(schema))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise TraceFormatError(f"trace columns have unexpected types: {e}") from None
    return out[0], out[1]


def read_trace_file(path: str | Path) -> tuple[pa.Table, pa.Table, dict, str | None, bool]:
    """Read a `.sptrace` file -> (steps, requests, run_info, tokenizer_json, truncated).

    A file cut short by a crash reads back up to its last complete batch with
    ``truncated=True``. Anything that is not a trace raises TraceFormatError.
    """
    data = Path(path).read_bytes()
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(data))
    except (pa.ArrowInvalid, OSError) as e:
        raise TraceFormatError(f"not an Arrow IPC stream or header truncated ({e})") from None
    run_info, tokenizer_json = _check_metadata(reader.schema.metadata)
    batches, truncated = [], False
    while True:
        try:
            batches.append(reader.read_next_batch())
        except StopIteration:
            break
        except (pa.ArrowInvalid, OSError):
            truncated = True
            break
    table = pa.Table.from_batches(batches, schema=reader.schema)
    steps, requests = split_disk_table(table)
    return steps, requests, run_info, tokenizer_json, truncated
