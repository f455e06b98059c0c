"""The recorder: the engine hands it one dict of batch tensors per iteration.

    with Recorder("run.sptrace", run_info, tokenizer_json) as rec:
        rec.record_batch({"iteration": it, "request_id": ids, "tokens": tokens, "mask": mask, ...})
        rec.record_request(0, prompt_ids, output_ids, "length")
    trace = rec.close()

The engine's thread only copies: CUDA tensors go into pinned host buffers with
``non_blocking=True`` and a CUDA event is recorded behind them; CPU tensors are
cloned (the engine reuses its buffers). A background writer thread waits on the
event, splits the batch into one Arrow row per request and appends a record batch
to the file every ``flush_every`` rows. Nothing on the engine's thread waits for
the GPU.

Field conventions for `record_batch` (names from STEP_FIELDS, plus ``mask``):
- per-row scalars (iteration, method, temperature, timings...) may be a plain
  scalar, broadcast to every row, or a [B] array;
- per-node fields are [B, W] with W >= each row's ``num_nodes`` (default W); the
  row keeps its first num_nodes entries;
- ``mask`` is a [B, W, W] bool tensor, packed per row into ``mask_packed``;
- ``target_topk_*`` are [B, W, k]; ``step_topk_*`` are [B, S, K] (the shape is
  recorded); ``accept_path`` is [B, D] padded with -1;
- ``depth`` and ``accept_length`` are derived from parents / accept_path when
  absent; other absent fields are null (ngram_* default to -1, coins to []).
"""

from __future__ import annotations

import datetime
import platform
import queue
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from spectool.trace.format import TraceFileWriter
from spectool.trace.reader import IterationView, TokenText, Trace
from spectool.trace.schema import REQUEST_SCHEMA, STEP_FIELDS, STEP_SCHEMA

NODE_FIELDS = ("tokens", "parents", "depth", "scores", "valid", "positions", "retrieve_index",
               "retrieve_next_token", "retrieve_next_sibling", "target_argmax", "target_argmax_prob",
               "status", "coins")
NODE_K_FIELDS = ("target_topk_tokens", "target_topk_probs")
STEP_TOPK_FIELDS = ("step_topk_tokens", "step_topk_probs")
ACCEPTED_NAMES = frozenset(STEP_FIELDS) | {"mask"}
_DEFAULT_MINUS_ONE = ("ngram_match_len", "ngram_breadth")
_STOP = object()


def default_run_info(run_info: dict) -> dict:
    """run_info with the start time and library versions filled in when absent."""
    import spectool

    info = dict(run_info)
    info.setdefault("start_time", datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    info.setdefault("versions", {"spectool": spectool.__version__, "torch": torch.__version__,
                                 "pyarrow": pa.__version__, "python": platform.python_version()})
    return info


def _ragged(values: np.ndarray, lengths: np.ndarray, typ: pa.ListType) -> pa.Array:
    """[B, W, ...] array -> list array whose row b holds values[b, :lengths[b]] flattened."""
    width = values.shape[1]
    if (lengths > width).any():
        raise ValueError(f"num_nodes {int(lengths.max())} is more than the {width} recorded entries")
    keep = np.arange(width)[None, :] < lengths[:, None]
    flat = values[keep].reshape(-1)
    per_entry = int(np.prod(values.shape[2:], dtype=np.int64))
    offsets = np.concatenate([[0], np.cumsum(lengths * per_entry)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=typ.value_type))


def _to_numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dtype in (torch.bfloat16, torch.float16):
            value = value.float()
        return value.numpy()
    return value


class Recorder:
    """Records one run: step rows per (iteration, request), request rows, run info.

    Args:
        path: the `.sptrace` file to append to, or None to keep the trace in memory only.
        run_info: engine and draft config, model id and hash, device... (JSON-able);
            start time and versions are added when absent.
        tokenizer_json: the tokenizer's JSON string, so token text works without the model.
        flush_every: rows (of either kind) buffered before a record batch is written.
    """

    def __init__(self, path: str | Path | None, run_info: dict, tokenizer_json: str | None = None,
                 flush_every: int = 64):
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        self.path = None if path is None else Path(path)
        self.run_info = default_run_info(run_info)
        self.tokenizer_json = tokenizer_json
        self.flush_every = flush_every
        self._file = None if path is None else TraceFileWriter(path, self.run_info, tokenizer_json)
        self._steps: list[pa.RecordBatch] = []   # every step batch converted so far
        self._requests: list[dict] = []
        self._flushed_steps = 0                    # batches / request rows already written
        self._flushed_requests = 0
        self._pending_rows = 0
        self._viewed_steps = 0                     # batches handed out by iteration_rows()
        self._text = TokenText(tokenizer_json)
        self._error: BaseException | None = None
        self._trace: Trace | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._write_loop, name="spectool-trace-writer", daemon=True)
        self._thread.start()

    # -- engine thread -------------------------------------------------------------

    def record_batch(self, fields: dict[str, Any]) -> None:
        """Record one iteration for the whole batch (see the module docstring for shapes)."""
        self._check_open()
        unknown = sorted(set(fields) - ACCEPTED_NAMES)
        if unknown:
            raise ValueError(f"unknown trace field(s): {', '.join(unknown)}")
        for name in ("iteration", "request_id"):
            if name not in fields:
                raise ValueError(f"record_batch needs {name!r}")
        rows = np.ndim(fields["request_id"]) and len(fields["request_id"])
        if not rows:
            raise ValueError("request_id must be a non-empty [B] array of request ids")
        host: dict[str, Any] = {}
        event = None
        for name, value in fields.items():
            if isinstance(value, torch.Tensor):
                value = value.detach()
                if value.ndim and value.shape[0] != rows:
                    raise ValueError(f"{name} has leading dim {value.shape[0]}, batch has {rows} rows")
                if value.is_cuda:
                    buf = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                    buf.copy_(value, non_blocking=True)
                    host[name] = buf
                    event = event or torch.cuda.Event()
                else:
                    host[name] = value.clone()
            elif isinstance(value, np.ndarray):
                host[name] = value.copy()
            else:
                host[name] = value
        if event is not None:
            event.record()  # on the current stream, behind the copies; the writer waits on it
        self._queue.put(("steps", host, event, rows))

    def record_request(self, request_id: int, prompt_tokens, output_tokens, finish_reason: str,
                       prompt_text: str = "") -> None:
        """Record a finished request: its prompt, every output token (the first comes from prefill)."""
        self._check_open()
        row = {"request_id": int(request_id),
               "prompt_tokens": [int(t) for t in _to_numpy(prompt_tokens)],
               "output_tokens": [int(t) for t in _to_numpy(output_tokens)],
               "finish_reason": str(finish_reason), "prompt_text": prompt_text or ""}
        self._queue.put(("request", row, None, 1))

    def iteration_rows(self) -> list[IterationView]:
        """Step records added since the previous call, as IterationViews (for live views).

        Waits for the writer thread to convert everything recorded so far, so it
        synchronises with the GPU: `engine.stream` calls it once per iteration.
        """
        self._queue.join()
        self._raise_writer_error()
        new = self._steps[self._viewed_steps:]
        self._viewed_steps = len(self._steps)
        return [IterationView.from_row(row, self._text) for batch in new for row in batch.to_pylist()]

    def close(self) -> Trace:
        """Flush everything, stop the writer thread, close the file and return the Trace."""
        if self._trace is None:
            self._queue.put((_STOP, None, None, 0))
            self._thread.join()
            if self._file is not None:
                self._file.close()
            self._raise_writer_error()
            steps = pa.Table.from_batches(self._steps, schema=STEP_SCHEMA)
            requests = pa.Table.from_pylist(self._requests, schema=REQUEST_SCHEMA)
            self._trace = Trace(steps, requests, self.run_info, self.tokenizer_json)
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
            kind, payload, event, rows = self._queue.get()
            try:
                if kind is _STOP:
                    self._flush()
                    return
                if self._error is not None:
                    continue  # keep draining so the engine never blocks on a dead writer
                if event is not None:
                    event.synchronize()
                if kind == "steps":
                    self._steps.append(steps_batch(payload, rows))
                else:
                    self._requests.append(payload)
                self._pending_rows += rows
                if self._pending_rows >= self.flush_every:
                    self._flush()
            except BaseException as e:  # surfaced on the engine's next call
                self._error = e
            finally:
                self._queue.task_done()

    def _flush(self) -> None:
        if self._error is not None:
            return
        if self._file is not None:
            steps = pa.Table.from_batches(self._steps[self._flushed_steps:], schema=STEP_SCHEMA)
            requests = pa.Table.from_pylist(self._requests[self._flushed_requests:], schema=REQUEST_SCHEMA)
            self._file.write(steps, requests)
        self._flushed_steps, self._flushed_requests = len(self._steps), len(self._requests)
        self._pending_rows = 0


def steps_batch(fields: dict[str, Any], rows: int) -> pa.RecordBatch:
    """Turn one iteration's host arrays into a STEP_SCHEMA record batch of ``rows`` rows."""
    f = {name: _to_numpy(v) for name, v in fields.items()}
    if "num_nodes" in f:
        n = np.broadcast_to(np.asarray(f["num_nodes"], dtype=np.int64), (rows,)).copy()
    elif "tokens" in f and np.ndim(f["tokens"]) == 2:
        n = np.full(rows, np.shape(f["tokens"])[1], dtype=np.int64)
    else:
        n = np.ones(rows, dtype=np.int64)
    if "depth" not in f and "parents" in f and np.ndim(f["parents"]) == 2:
        f["depth"] = depth_from_parents(np.asarray(f["parents"]))
    if "accept_length" not in f and "accept_path" in f and np.ndim(f["accept_path"]) == 2:
        f["accept_length"] = (np.asarray(f["accept_path"]) >= 0).sum(1) - 1

    cols = {}
    for fl in STEP_SCHEMA:
        name, typ, value = fl.name, fl.type, f.get(fl.name)
        if name == "num_nodes":
            cols[name] = pa.array(n, pa.int32())
        elif name == "mask_packed":
            cols[name] = _mask_column(f, n, rows)
        elif name == "step_topk_shape":
            cols[name] = _step_topk_shape(f, rows)
        elif value is None:
            if name in _DEFAULT_MINUS_ONE:
                cols[name] = pa.array(np.full(rows, -1), typ)
            elif name in ("coins", "step_topk_tokens", "step_topk_probs"):
                cols[name] = pa.array([[]] * rows, typ)
            else:
                cols[name] = pa.nulls(rows, typ)
        elif isinstance(typ, pa.ListType):
            cols[name] = _list_column(name, value, n, rows, typ)
        else:
            arr = np.broadcast_to(np.asarray(value), (rows,))
            cols[name] = pa.array(arr.tolist() if arr.dtype.kind in "OUS" else arr, typ)
    return pa.RecordBatch.from_arrays(list(cols.values()), schema=STEP_SCHEMA)


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
    if name == "accept_path":
        value = value.reshape(rows, -1)
        lengths = (value >= 0).sum(1)
        return _ragged(value, lengths, typ)
    return _ragged(value.reshape(rows, -1), np.full(rows, value[0].size), typ)  # step_topk_*


def _mask_column(f: dict[str, Any], n: np.ndarray, rows: int) -> pa.Array:
    if "mask_packed" in f:
        return pa.array([None if m is None else bytes(m) for m in f["mask_packed"]], pa.binary())
    if "mask" not in f:
        return pa.nulls(rows, pa.binary())
    mask = np.asarray(f["mask"]).astype(bool, copy=False)
    if mask.ndim != 3 or mask.shape[1] != mask.shape[2]:
        raise ValueError(f"mask must be [B, N, N] bool, got shape {mask.shape}")
    return pa.array([np.packbits(mask[b, :k, :k].reshape(-1)).tobytes() for b, k in enumerate(n)],
                    pa.binary())


def _step_topk_shape(f: dict[str, Any], rows: int) -> pa.Array:
    if "step_topk_shape" in f:
        shape = np.broadcast_to(np.asarray(f["step_topk_shape"]).reshape(-1, 2)[-1], (rows, 2))
        return pa.array(shape.tolist(), pa.list_(pa.int32()))
    tokens = f.get("step_topk_tokens")
    if tokens is None or np.ndim(tokens) != 3:
        return pa.array([[]] * rows, pa.list_(pa.int32()))
    return pa.array([list(np.shape(tokens)[1:])] * rows, pa.list_(pa.int32()))


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
