"""The recorder: the engine hands it one dict of batch tensors per iteration.

    with Recorder("run.sptrace", run_info, tokenizer_json) as rec:
        rec.record_batch({"iteration": it, "request_id": ids, "tokens": tokens, "mask": mask, ...})
        rec.record_timings({"verify_us": 80.0, ...})   # optional: scalars known only at the end
        rec.record_request(0, prompt_ids, output_ids, "length")
    trace = rec.close()

Where the work happens. The engine's thread only copies: the iteration's tensors
are concatenated as raw bytes into one flat buffer (one ``torch.cat`` per device;
the engine's greedy CUDA graph does it itself, see :func:`pack_rows`). On CUDA that
buffer goes to pinned host memory without waiting for the GPU; on the CPU the
concatenation itself is the copy (the engine reuses its buffers). On CUDA the
buffer is copied with one ``non_blocking`` copy into a pinned host page shared by
every iteration of one hand-off, so the engine's thread never syncs and creates no
event per iteration. Every ``HANDOFF_ROWS`` rows the gathered iterations go to a
background writer thread in one hand-off with one event recorded behind their copies;
it waits on that event, copies the page once, views the bytes as numpy arrays and
every ``flush_every`` rows converts all of them
at once (numpy over the whole stack of iterations -> Arrow list arrays from flat
values and offsets, masks packed with one ``packbits`` per tree size) and appends
one record batch to the file. No Python loop runs per row.

Field conventions for `record_batch` (names from STEP_FIELDS, plus ``mask``):
- per-row scalars (iteration, method, temperature, timings...) may be a plain
  scalar, broadcast to every row, or a [B] array;
- per-node fields are [B, W] with W >= each row's ``num_nodes`` (default W); the
  row keeps its first num_nodes entries;
- ``mask`` is a [B, W, W] bool tensor, packed per row into ``mask_packed``;
- ``target_topk_*`` are [B, W, k]; ``step_topk_*`` are [B, S, K] (the shape is
  recorded); ``accept_path`` is [B, D] padded with -1;
- ``depth``, ``accept_length``, ``target_argmax`` and ``target_argmax_prob`` are
  derived from parents, accept_path and the target top-k when absent; other absent
  fields are null (ngram_* default to -1, coins to []).
"""

from __future__ import annotations

import datetime
import math
import platform
import queue
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from spectool.trace.format import TraceFileWriter
from spectool.trace.reader import IterationView, TokenText, Trace
from spectool.trace.schema import REQUEST_SCHEMA, STEP_FIELDS, STEP_SCHEMA
from spectool.trace.select import Record, Selector, with_selection_counts

NODE_FIELDS = ("tokens", "parents", "depth", "scores", "valid", "positions", "retrieve_index",
               "retrieve_next_token", "retrieve_next_sibling", "target_argmax", "target_argmax_prob",
               "status", "coins", "child_probs")
NODE_K_FIELDS = ("target_topk_tokens", "target_topk_probs")
STEP_TOPK_FIELDS = ("step_topk_tokens", "step_topk_probs")
ACCEPTED_NAMES = frozenset(STEP_FIELDS) | {"mask"}
# Fields whose per-row value is one entry; every other array field has entries per row.
ROW_SCALARS = frozenset(name for name, (typ, _) in STEP_FIELDS.items()
                        if not isinstance(typ, pa.ListType) and name != "mask_packed")
_DEFAULT_MINUS_ONE = ("ngram_match_len", "ngram_breadth", "ngram_put_len")
# Per-row lists padded with -1 past each row's length (the accepted path and the commit's rows).
SIGN_RAGGED = ("accept_path", "commit_src", "commit_dst")
_STOP, _CONVERT = object(), object()
HANDOFF_ROWS = 64  # rows the engine's thread gathers before waking the writer (which frees their pinned page)
PAGE_BYTES = 1 << 20  # pinned host memory per hand-off (more when one iteration needs it)
_SCALARS = (int, float, str, bool)
_TABLE = "_packed_rows"  # a received iteration's still-packed [B, R] byte table: (layout, table)


def default_run_info(run_info: dict) -> dict:
    """run_info with the start time and library versions filled in when absent."""
    import spectool

    info = dict(run_info)
    info.setdefault("start_time", datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    info.setdefault("versions", {"spectool": spectool.__version__, "torch": torch.__version__,
                                 "pyarrow": pa.__version__, "python": platform.python_version()})
    return info


# -- moving tensors off the engine's thread ------------------------------------------

@dataclass
class _Packed:
    """One device's tensors of one iteration as raw bytes: (name, dtype, shape, offset) each.

    ``rows`` 0: the fields lie one after another, shapes in full. ``rows`` B: the bytes are a
    [B, R] table (see :class:`PackedRows`), shapes and offsets are per row.
    """

    layout: list[tuple[str, torch.dtype, tuple[int, ...], int]]
    data: torch.Tensor | None     # uint8 host bytes (CPU); None: at ``page_offset`` in its hand-off's page (CUDA)
    nbytes: int
    rows: int = 0
    page_offset: int = 0


@dataclass
class PackedRows:
    """Per-request fields already packed as bytes: ``data`` [B, R] uint8, one row per request,
    and ``layout``: (name, dtype, shape of one row's value, byte offset in the row) per field.

    Made by :func:`pack_rows`. The engine packs inside its CUDA graph, so recording an
    iteration costs one copy and no per-field work on its thread.
    """

    layout: list[tuple[str, torch.dtype, tuple[int, ...], int]]
    data: torch.Tensor


def pack_rows(named: list[tuple[str, torch.Tensor]]) -> PackedRows:
    """Pack [B, ...] tensors into one [B, R] uint8 table (graph safe: fixed shapes, no sync).
    Widest dtype first, so every field of a row stays aligned."""
    named = sorted(named, key=lambda nt: -nt[1].element_size())
    rows = named[0][1].shape[0]
    layout, parts, offset = [], [], 0
    for name, t in named:
        if t.shape[0] != rows:
            raise ValueError(f"{name} has leading dim {t.shape[0]}, batch has {rows} rows")
        layout.append((name, t.dtype, tuple(t.shape[1:]), offset))
        part = _as_bytes(t.reshape(rows, -1))
        parts.append(part)
        offset += part.shape[1]
    return PackedRows(layout, torch.cat(parts, dim=1))


def _pack(named: list[tuple[str, torch.Tensor]]) -> tuple[list, torch.Tensor]:
    """Concatenate tensors as bytes, widest dtype first so every field stays aligned."""
    named.sort(key=lambda nt: -nt[1].element_size())
    layout, parts, offset = [], [], 0
    for name, t in named:
        layout.append((name, t.dtype, tuple(t.shape), offset))
        parts.append(_as_bytes(t.reshape(-1)))
        offset += t.numel() * t.element_size()
    return layout, torch.cat(parts)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D or 2-D tensor, made contiguous, as raw bytes along its last dim. A size-1 dim may
    keep any stride while contiguous; view(dtype) insists on stride 1, so the strides are reset."""
    t = t.contiguous()
    return t.as_strided(t.shape, (t.shape[-1], 1)[-t.dim():]).view(torch.uint8)


_NUMPY_DTYPE: dict[torch.dtype, np.dtype] = {}


def _view(raw: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Contiguous bytes as a numpy array of ``dtype`` and ``shape``; 16-bit floats become float32."""
    if dtype == torch.bfloat16:  # numpy has no bfloat16: its bits are the top half of a float32
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    np_dtype = _NUMPY_DTYPE.get(dtype)
    if np_dtype is None:
        np_dtype = _NUMPY_DTYPE[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
    value = raw.view(np_dtype).reshape(shape)
    return value.astype(np.float32) if np_dtype == np.float16 else value


def _unpack(packed: _Packed, host: np.ndarray) -> dict[str, np.ndarray]:
    """Numpy views of each field in ``host`` (the packed bytes)."""
    out = {}
    table = host[:packed.nbytes].reshape(packed.rows, -1) if packed.rows else None
    for name, dtype, shape, offset in packed.layout:
        size = math.prod(shape) * dtype.itemsize
        if table is None:
            out[name] = _view(host[offset:offset + size], dtype, shape)
        else:
            out[name] = _view(np.ascontiguousarray(table[:, offset:offset + size]), dtype, (packed.rows, *shape))
    return out


class Recorder:
    """Records one run: step rows per (iteration, request), request rows, run info.

    Args:
        path: the `.sptrace` file to append to, or None to keep the trace in memory only. With a
            file, rows leave memory once written (memory stays at about one ``flush_every`` whatever
            the run's length) and `close` returns the file opened lazily.
        run_info: engine and draft config, model id and hash, device... (JSON-able);
            start time and versions are added when absent.
        tokenizer_json: the tokenizer's JSON string, so token text works without the model.
        flush_every: rows (of either kind) gathered before they are converted and
            written as one record batch (the unit a crash can lose). Each conversion has a
            fixed cost of a few ms, so a long run records cheaper with a larger unit (the
            engine uses 1024).
        select: what to keep (`spectool.trace.select.Record`); None keeps every record.
    """

    def __init__(self, path: str | Path | None, run_info: dict, tokenizer_json: str | None = None,
                 flush_every: int = 64, select: Record | None = None):
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        self.path = None if path is None else Path(path)
        self.run_info = default_run_info(run_info)
        self._select = None if select is None or select.keeps_everything else Selector(select)
        if self._select is not None:
            self.run_info["record"] = select.describe()
        self._skipped = False  # the newest iteration was not kept (its timings go nowhere)
        self.tokenizer_json = tokenizer_json
        self.flush_every = flush_every
        self._file = None if path is None else TraceFileWriter(path, self.run_info, tokenizer_json)
        self._steps: list[pa.RecordBatch] = []   # step batches converted and still held (all, in memory)
        self._requests: list[dict] = []
        self._pending: list[tuple[dict, int]] = []  # iterations received, not yet converted
        self._flushed_steps = 0                    # batches / request rows already written
        self._flushed_requests = 0
        self._pending_rows = 0
        self._viewed_steps = 0                     # batches handed out by iteration_rows()
        self._live = False                         # iteration_rows() is in use: keep batches until viewed
        self._page: torch.Tensor | None = None     # pinned page the current hand-off's CUDA bytes go to
        self._page_used = 0
        self._free_pages: deque[torch.Tensor] = deque()  # pages the writer has copied out
        self._layouts: dict[int, tuple[list, frozenset[str]]] = {}  # id(packed layout) -> (layout, names)
        self._text = TokenText(tokenizer_json)
        self._error: BaseException | None = None
        self._trace: Trace | None = None
        self._queue: queue.Queue = queue.Queue()
        # Items wait here until HANDOFF_ROWS (or flush_every) rows have gathered, then go to the writer
        # in one hand-off: waking it every iteration made it take the GIL from the engine each time.
        self._outbox: list[tuple[str, Any, int]] = []
        self._outbox_rows = 0
        self._handoff_rows = min(flush_every, HANDOFF_ROWS)
        self._last: dict | None = None  # the newest iteration's scalars, still in the outbox (record_timings)
        self._thread = threading.Thread(target=self._write_loop, name="spectool-trace-writer", daemon=True)
        self._thread.start()

    # -- engine thread -------------------------------------------------------------

    def record_batch(self, fields: dict[str, Any], packed: PackedRows | None = None) -> None:
        """Record one iteration for the whole batch (see the module docstring for shapes).

        ``packed``: more of the iteration's per-request fields, already packed (:func:`pack_rows`).
        """
        self._check_open()
        self._maybe_send()
        unknown = fields.keys() - ACCEPTED_NAMES
        if unknown:
            raise ValueError(f"unknown trace field(s): {', '.join(sorted(unknown))}")
        packed_names = self._layout_names(packed.layout) if packed is not None else frozenset()
        if not packed_names.isdisjoint(fields):
            raise ValueError("a field is given both in fields and in packed")
        for name in ("iteration", "request_id"):
            if name not in fields and name not in packed_names:
                raise ValueError(f"record_batch needs {name!r}")
        rows = packed.data.shape[0] if packed is not None else (
            np.ndim(fields["request_id"]) and len(fields["request_id"]))
        if not rows:
            raise ValueError("request_id must be a non-empty [B] array of request ids")
        self._skipped = False
        if self._select is not None:
            iteration = fields.get("iteration")
            if not isinstance(iteration, int | np.integer):
                raise ValueError("recording with a selection needs a scalar iteration per record_batch")
            if not self._select.keeps_iteration(int(iteration), rows):
                self._skipped, self._last = True, None
                return
        plain: dict[str, Any] = {}
        on_cpu: list[tuple[str, torch.Tensor]] = []
        on_cuda: list[tuple[str, torch.Tensor]] = []
        for name, value in fields.items():
            if isinstance(value, _SCALARS):  # most of the engine's fields: take them as they are
                plain[name] = value
            elif isinstance(value, torch.Tensor):
                if value.ndim and value.shape[0] != rows:
                    raise ValueError(f"{name} has leading dim {value.shape[0]}, batch has {rows} rows")
                (on_cuda if value.is_cuda else on_cpu).append((name, value.detach()))
            elif isinstance(value, np.ndarray):
                if value.ndim and value.shape[0] != rows:
                    raise ValueError(f"{name} has leading dim {value.shape[0]}, batch has {rows} rows")
                plain[name] = value.copy()
            elif value is not None:
                plain[name] = value
        parts = []
        if on_cpu:
            layout, data = _pack(on_cpu)
            parts.append(_Packed(layout, data, data.numel()))
        to_copy = [(*_pack(on_cuda), 0)] if on_cuda else []
        if packed is not None:
            flat = packed.data.reshape(-1)
            if flat.is_cuda:
                to_copy.append((packed.layout, flat, rows))
            else:
                parts.append(_Packed(packed.layout, flat, flat.numel(), rows=rows))
        if to_copy:
            parts += self._copy_to_page(to_copy)
        self._post("steps", (plain, parts), rows)
        self._last = plain

    def record_timings(self, timings: dict[str, float]) -> None:
        """Add per-row scalars known only when the iteration ends (its phase timings) to the
        iteration recorded last. The engine records an iteration before its host sync, so that
        work overlaps the GPU's, and its timings after."""
        if self._skipped:
            return
        if self._last is None:
            raise ValueError("record_timings must follow record_batch")
        unknown = timings.keys() - ACCEPTED_NAMES
        if unknown:
            raise ValueError(f"unknown trace field(s): {', '.join(sorted(unknown))}")
        self._last.update(timings)

    def _layout_names(self, layout: list) -> frozenset[str]:
        """The field names of a packed layout, checked once per layout (the engine reuses one per tree size)."""
        known = self._layouts.get(id(layout))
        if known is not None and known[0] is layout:
            return known[1]
        names = frozenset(name for name, *_ in layout)
        if len(names) != len(layout):
            raise ValueError("a field is packed twice")
        unknown = names - ACCEPTED_NAMES
        if unknown:
            raise ValueError(f"unknown trace field(s): {', '.join(sorted(unknown))}")
        if len(self._layouts) >= 64:  # a caller packing afresh every iteration: keep the cache small
            self._layouts.clear()
        self._layouts[id(layout)] = (layout, names)  # holding the layout keeps its id from being reused
        return names

    def _copy_to_page(self, to_copy: list[tuple[list, torch.Tensor, int]]) -> list[_Packed]:
        """Async copies of packed CUDA bytes into the hand-off's pinned page (16-byte aligned);
        the event behind them is recorded once, when the hand-off goes to the writer."""
        sizes = [-(-flat.numel() // 16) * 16 for _, flat, _ in to_copy]
        if self._page is not None and self._page_used + sum(sizes) > self._page.numel():
            self._send()  # this page is full: it goes to the writer with the iterations on it
        if self._page is None:
            page = self._free_pages.pop() if self._free_pages else None
            if page is None or page.numel() < sum(sizes):
                page = torch.empty(max(PAGE_BYTES, 2 * sum(sizes)), dtype=torch.uint8, pin_memory=True)
            self._page, self._page_used = page, 0
        out = []
        for (layout, flat, rows), size in zip(to_copy, sizes):
            start = self._page_used
            self._page[start:start + flat.numel()].copy_(flat, non_blocking=True)
            self._page_used += size
            out.append(_Packed(layout, None, flat.numel(), rows=rows, page_offset=start))
        return out

    def record_request(self, request_id: int, prompt_tokens, output_tokens, finish_reason: str,
                       prompt_text: str = "") -> None:
        """Record a finished request: its prompt, every output token (the first comes from prefill)."""
        self._check_open()
        if self._select is not None and not self._select.keeps_request(int(request_id)):
            return
        self._maybe_send()
        row = {"request_id": int(request_id),
               "prompt_tokens": _int_list(prompt_tokens), "output_tokens": _int_list(output_tokens),
               "finish_reason": str(finish_reason), "prompt_text": prompt_text or ""}
        self._post("request", row, 1)

    def _post(self, kind: str, payload: Any, rows: int) -> None:
        self._outbox.append((kind, payload, rows))
        self._outbox_rows += rows

    def _maybe_send(self) -> None:
        """Hand the outbox to the writer once it holds enough rows. Checked before an item is added,
        never after, so the newest iteration stays here for :meth:`record_timings`."""
        if self._outbox_rows >= self._handoff_rows:
            self._send()

    def _send(self) -> None:
        if not self._outbox:
            return
        page = None
        if self._page is not None and self._page_used:
            event = torch.cuda.Event()
            event.record()  # on the current stream, behind every copy onto the page
            page = (self._page, self._page_used, event)
            self._page = None
        self._queue.put(("many", (self._outbox, page), self._outbox_rows))
        self._outbox, self._outbox_rows, self._last = [], 0, None

    def iteration_rows(self) -> list[IterationView]:
        """Step records added since the previous call, as IterationViews (for live views).

        Waits for the writer thread to convert everything recorded so far, so it
        synchronises with the GPU: `engine.stream` calls it once per iteration.
        """
        self._live = True
        self._send()
        self._queue.put((_CONVERT, None, 0))
        self._queue.join()  # the writer is idle until the next hand-off: its lists may be touched here
        self._raise_writer_error()
        new = self._steps[self._viewed_steps:]
        self._viewed_steps = len(self._steps)
        self._release_written()
        return [IterationView.from_row(row, self._text) for batch in new for row in batch.to_pylist()]

    def close(self) -> Trace:
        """Flush everything, stop the writer thread, close the file and return the Trace."""
        if self._trace is None:
            self._send()
            self._queue.put((_STOP, None, 0))
            self._thread.join()
            if self._file is not None:
                self._file.close()
            self._raise_writer_error()
            if self._file is not None:
                self._trace = Trace.load(self.path)
            else:
                steps = pa.Table.from_batches(self._steps, schema=STEP_SCHEMA)
                requests = pa.Table.from_pylist(self._requests, schema=REQUEST_SCHEMA)
                counts = self._select.counts() if self._select is not None else None
                self._trace = Trace(steps, requests, with_selection_counts(self.run_info, counts),
                                    self.tokenizer_json)
        return self._trace

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._trace is not None:
            raise ValueError("the recorder is closed")
        self._raise_writer_error()

    def _raise_writer_error(self) -> None:
        if self._error is not None:
            raise ValueError(f"trace writer failed: {self._error}") from self._error

    # -- writer thread -------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            kind, payload, rows = self._queue.get()
            try:
                self._handle(kind, payload, rows)
            except BaseException as e:  # surfaced on the engine's next call
                self._error = e
            finally:
                self._queue.task_done()
            if kind is _STOP:
                return

    def _handle(self, kind, payload, rows: int) -> None:
        if kind is _STOP:
            self._flush()
        elif self._error is not None:
            return  # keep draining so the engine never blocks on a dead writer
        elif kind is _CONVERT:
            self._convert()
        else:
            items, page = payload
            host_page = None
            if page is not None:
                data, used, event = page
                event.synchronize()
                host_page = data[:used].numpy().copy()
                self._free_pages.append(data)  # the engine's thread may reuse it now
            for item_kind, item, item_rows in items:
                if item_kind == "steps":
                    self._pending.append((self._receive(*item, host_page), item_rows))
                else:
                    self._requests.append(item)
                self._pending_rows += item_rows
                if self._pending_rows >= self.flush_every:
                    self._flush()

    def _receive(self, plain: dict[str, Any], packed: list[_Packed], host_page: np.ndarray | None
                 ) -> dict[str, Any]:
        """One iteration's fields as numpy arrays / scalars. A packed row table stays packed
        (under ``_TABLE``) until its run of iterations is converted."""
        fields = dict(plain)
        for p in packed:
            host = p.data.numpy() if p.data is not None else host_page[p.page_offset:p.page_offset + p.nbytes]
            if p.rows:
                fields[_TABLE] = (p.layout, host[:p.nbytes].reshape(p.rows, -1))
            else:
                fields.update(_unpack(p, host))
        return fields

    def _convert(self) -> None:
        """Turn the pending iterations into record batches.

        The engine's iterations (a packed table plus scalars and [B] arrays, the same keys
        every time) are stacked a whole run at once: one concatenation per field, whatever
        the number of iterations. Anything else goes through the general path, which
        normalises each iteration and stacks runs of like-shaped ones.
        """
        pending, self._pending = self._pending, []
        first_new = len(self._steps)
        self._convert_runs(pending)
        if self._select is not None:
            self._steps[first_new:] = [self._select.filter(b) for b in self._steps[first_new:]]

    def _convert_runs(self, pending: list[tuple[dict, int]]) -> None:
        runs: list[tuple[tuple | None, list[tuple[dict, int]]]] = []
        for item in pending:
            key = _table_key(item[0])
            if runs and runs[-1][0] == key:
                runs[-1][1].append(item)
            else:
                runs.append((key, [item]))
        for key, items in runs:
            if key is not None:
                try:
                    self._steps.append(steps_batch(*_stack_tables(items)))
                    continue
                except (ValueError, TypeError, IndexError, pa.ArrowException):
                    pass  # the general path below keeps every good iteration and names the bad one
            self._convert_general([(_expand_table(f), rows) for f, rows in items])

    def _convert_general(self, items: list[tuple[dict, int]]) -> None:
        for group in _like_shaped_runs([_normalise(f, rows) for f, rows in items]):
            try:
                self._steps.append(steps_batch(_stack(group), sum(rows for _, rows in group)))
            except (ValueError, TypeError, IndexError, pa.ArrowException):
                # Keep every iteration before the bad one, then report the bad one's error.
                for one in group:
                    self._steps.append(steps_batch(_stack([one]), one[1]))

    def _flush(self) -> None:
        if self._error is not None:
            return
        self._convert()
        if self._file is not None:
            steps = pa.Table.from_batches(self._steps[self._flushed_steps:], schema=STEP_SCHEMA)
            requests = pa.Table.from_pylist(self._requests[self._flushed_requests:], schema=REQUEST_SCHEMA)
            self._file.write(steps, requests, self._select.counts() if self._select is not None else None)
        self._flushed_steps, self._flushed_requests = len(self._steps), len(self._requests)
        self._pending_rows = 0
        self._release_written()

    def _release_written(self) -> None:
        """With a file, let go of the rows already written (and handed out, when viewed live)."""
        if self._file is None:
            return
        done = min(self._flushed_steps, self._viewed_steps) if self._live else self._flushed_steps
        del self._steps[:done]
        self._flushed_steps -= done
        self._viewed_steps = max(0, self._viewed_steps - done)
        del self._requests[:self._flushed_requests]
        self._flushed_requests = 0


def _int_list(values) -> list[int]:
    if isinstance(values, torch.Tensor):
        values = values.cpu().numpy()
    return np.asarray(values, dtype=np.int64).reshape(-1).tolist()


# -- iterations -> Arrow (writer thread) ----------------------------------------------

def _table_key(f: dict[str, Any]) -> tuple | None:
    """Equal for iterations that :func:`_stack_tables` can stack: the same keys, the same packed
    layout, and only scalars, [B] arrays and arrays of equal trailing shape besides; else None."""
    table = f.get(_TABLE)
    if table is None:
        return None
    shapes = []
    for name, value in f.items():
        if isinstance(value, np.ndarray):
            shapes.append(value.shape[1:])
        elif name == _TABLE or isinstance(value, int | float | str | np.generic):
            shapes.append(None)
        else:
            return None
    return tuple(f), tuple(table[0]), tuple(shapes)


def _stack_tables(items: list[tuple[dict, int]]) -> tuple[dict[str, Any], int]:
    """One run of like-keyed engine iterations as one dict of stacked arrays, and its row count."""
    rows = [r for _, r in items]
    first = items[0][0]
    layout = first[_TABLE][0]
    table = np.concatenate([f[_TABLE][1] for f, _ in items])
    out = _unpack(_Packed(layout, table.reshape(-1), table.size, rows=table.shape[0]), table.reshape(-1))
    for name, value in first.items():
        if name == _TABLE:
            continue
        values = [f[name] for f, _ in items]
        if isinstance(value, np.ndarray) and value.ndim:
            out[name] = np.concatenate(values)
        else:  # a scalar for the whole iteration: one value per row
            out[name] = np.repeat(np.asarray(values), rows)
    return out, sum(rows)


def _expand_table(f: dict[str, Any]) -> dict[str, Any]:
    """An iteration with its packed table unpacked into fields (the general path)."""
    if _TABLE not in f:
        return f
    f = dict(f)
    layout, table = f.pop(_TABLE)
    f.update(_unpack(_Packed(layout, table.reshape(-1), table.size, rows=table.shape[0]), table.reshape(-1)))
    return f


def _normalise(f: dict[str, Any], rows: int) -> tuple[dict[str, Any], int]:
    """Give one iteration an explicit [B] num_nodes and [B] arrays for every per-row scalar."""
    f = dict(f)
    if "num_nodes" in f:
        f["num_nodes"] = np.broadcast_to(np.asarray(f["num_nodes"], dtype=np.int64), (rows,))
    elif "tokens" in f and np.ndim(f["tokens"]) == 2:
        f["num_nodes"] = np.full(rows, np.shape(f["tokens"])[1], dtype=np.int64)
    else:
        f["num_nodes"] = np.ones(rows, dtype=np.int64)
    for name in ROW_SCALARS & f.keys():
        f[name] = np.broadcast_to(np.asarray(f[name]), (rows,))
    return f, rows


def _shape_key(f: dict[str, Any]) -> tuple | None:
    """Iterations with equal keys stack into one conversion; None = convert on its own."""
    key = []
    for name in sorted(f):
        value = f[name]
        if name in ROW_SCALARS or name in SIGN_RAGGED:  # padded with -1 to stack
            key.append(name)
        elif isinstance(value, np.ndarray) and value.ndim >= 1:
            key.append((name, value.shape[1:]))
        else:
            return None  # a ragged list or an unusual value: the per-iteration path handles it
    return tuple(key)


def _like_shaped_runs(items: list[tuple[dict, int]]) -> list[list[tuple[dict, int]]]:
    runs: list[list[tuple[dict, int]]] = []
    last = None
    for item in items:
        key = _shape_key(item[0])
        if runs and key is not None and key == last:
            runs[-1].append(item)
        else:
            runs.append([item])
        last = key
    return runs


def _stack(group: list[tuple[dict, int]]) -> dict[str, Any]:
    """Concatenate like-shaped iterations row-wise (a single iteration passes through)."""
    if len(group) == 1:
        return group[0][0]
    out = {}
    for name in group[0][0]:
        values = [f[name] for f, _ in group]
        if name in SIGN_RAGGED:
            width = max(np.shape(v)[1] for v in values)
            values = [np.pad(np.asarray(v), ((0, 0), (0, width - np.shape(v)[1])), constant_values=-1)
                      for v in values]
        out[name] = np.concatenate(values)
    return out


def steps_batch(fields: dict[str, Any], rows: int) -> pa.RecordBatch:
    """Turn host arrays with ``rows`` rows (one iteration or several stacked) into a STEP_SCHEMA batch."""
    f = _normalise(fields, rows)[0]
    n = np.asarray(f["num_nodes"], dtype=np.int64)
    if "depth" not in f and "parents" in f and np.ndim(f["parents"]) == 2:
        f["depth"] = depth_from_parents(np.asarray(f["parents"]))
    if "accept_length" not in f and "accept_path" in f and np.ndim(f["accept_path"]) == 2:
        f["accept_length"] = (np.asarray(f["accept_path"]) >= 0).sum(1) - 1
    for name, topk in (("target_argmax", "target_topk_tokens"), ("target_argmax_prob", "target_topk_probs")):
        value = f.get(topk)
        if name not in f and isinstance(value, np.ndarray) and value.ndim == 3:  # the target's best is its top-1
            f[name] = value[:, :, 0]

    cols = []
    for fl in STEP_SCHEMA:
        name, typ, value = fl.name, fl.type, f.get(fl.name)
        if name == "num_nodes":
            cols.append(pa.array(n, pa.int32()))
        elif name == "mask_packed":
            cols.append(_mask_column(f, n, rows))
        elif name == "step_topk_shape":
            cols.append(_step_topk_shape(f, rows))
        elif value is None:
            if name in _DEFAULT_MINUS_ONE:
                cols.append(pa.array(np.full(rows, -1), typ))
            elif name in ("coins", *STEP_TOPK_FIELDS):
                cols.append(_empty_lists(rows, typ))
            else:
                cols.append(pa.nulls(rows, typ))
        elif isinstance(typ, pa.ListType):
            cols.append(_list_column(name, value, n, rows, typ))
        else:
            arr = np.asarray(value)
            cols.append(pa.array(arr.tolist() if arr.dtype.kind in "OUS" else arr, typ))
    return pa.RecordBatch.from_arrays(cols, schema=STEP_SCHEMA)


def _ragged(values: np.ndarray, lengths: np.ndarray, typ: pa.ListType) -> pa.Array:
    """[R, W, ...] array -> list array whose row r holds values[r, :lengths[r]] flattened."""
    width = values.shape[1]
    if (lengths > width).any():
        raise ValueError(f"num_nodes {int(lengths.max())} is more than the {width} recorded entries")
    if (lengths == width).all():
        flat = values.reshape(-1)
    else:
        flat = values[np.arange(width)[None, :] < lengths[:, None]].reshape(-1)
    per_entry = int(np.prod(values.shape[2:], dtype=np.int64))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths * per_entry, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=typ.value_type))


def _empty_lists(rows: int, typ: pa.ListType) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(np.zeros(rows + 1, np.int32)), pa.array([], typ.value_type))


def _list_column(name: str, value: Any, n: np.ndarray, rows: int, typ: pa.ListType) -> pa.Array:
    if isinstance(value, list) and (not value or not np.isscalar(value[0])):
        try:
            return pa.array([None if v is None else np.asarray(v).reshape(-1).tolist() for v in value], typ)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            value = np.asarray(value)
    value = np.asarray(value)
    if value.ndim == 1:  # one entry per row is not a list field: a clear error beats a silent reshape
        raise ValueError(f"{name} must be [B, ...] per row, got shape {value.shape}")
    if name in NODE_FIELDS or name in NODE_K_FIELDS:
        return _ragged(value, n, typ)
    if name in SIGN_RAGGED:
        value = value.reshape(rows, -1)
        return _ragged(value, (value >= 0).sum(1), typ)
    value = value.reshape(rows, -1)  # step_topk_*: the whole [S, K] per row
    return _ragged(value, np.full(rows, value.shape[1]), typ)


def _mask_column(f: dict[str, Any], n: np.ndarray, rows: int) -> pa.Array:
    """Each row's mask[:n, :n] bit-packed, one packbits call per distinct tree size."""
    if "mask_packed" in f:
        return pa.array([None if m is None else bytes(m) for m in f["mask_packed"]], pa.binary())
    if "mask" not in f:
        return pa.nulls(rows, pa.binary())
    mask = np.asarray(f["mask"]).astype(bool, copy=False)
    if mask.ndim != 3 or mask.shape[1] != mask.shape[2]:
        raise ValueError(f"mask must be [B, N, N] bool, got shape {mask.shape}")
    if (n > mask.shape[1]).any():
        raise ValueError(f"num_nodes {int(n.max())} is more than the mask's {mask.shape[1]} nodes")
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum((n * n + 7) // 8, out=offsets[1:])
    data = np.empty(int(offsets[-1]), dtype=np.uint8)
    for k in np.unique(n):
        which = np.flatnonzero(n == k)
        packed = np.packbits(mask[which, :k, :k].reshape(len(which), k * k), axis=1)
        data[offsets[which][:, None] + np.arange(packed.shape[1])] = packed
    buffers = [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data)]
    return pa.Array.from_buffers(pa.binary(), rows, buffers)


def _step_topk_shape(f: dict[str, Any], rows: int) -> pa.Array:
    if "step_topk_shape" in f:
        shape = np.broadcast_to(np.asarray(f["step_topk_shape"]).reshape(-1, 2)[-1], (rows, 2))
    else:
        tokens = f.get("step_topk_tokens")
        if tokens is None or np.ndim(tokens) != 3:
            return _empty_lists(rows, pa.list_(pa.int32()))
        shape = np.broadcast_to(np.shape(tokens)[1:], (rows, 2))
    return _ragged(np.ascontiguousarray(shape), np.full(rows, 2), pa.list_(pa.int32()))


def depth_from_parents(parents: np.ndarray) -> np.ndarray:
    """Depth of every node of [B, N] parent arrays (nodes in topological order; -1 = root).

    Entries past a row's num_nodes may be junk: a parent that is not an earlier node gives depth 0.
    """
    depth = np.zeros(parents.shape, dtype=np.int64)
    rows = np.arange(parents.shape[0])
    for i in range(1, parents.shape[1]):
        p = parents[:, i]
        depth[:, i] = np.where((p >= 0) & (p < i), depth[rows, np.clip(p, 0, i - 1)] + 1, 0)
    return depth
