"""Reading a recorded run: `Trace` (tables + run info) and `IterationView` (one tree).

    trace = Trace.load("run.sptrace")
    trace.steps                      # pyarrow Table, one row per (iteration, request)
    view = trace.iteration(3, request=0)
    view.tokens, view.mask, view.status, view.token_texts
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from spectool.trace.format import TraceFile, TraceFormatError, open_trace_file, split_disk_table, write_trace_file
from spectool.trace.schema import PHASE_FIELDS, REQUEST_SCHEMA, STEP_SCHEMA, with_optional_columns
from spectool.trace.select import kept_note, with_selection_counts
from spectool.trace.stats import summarize, summary_columns


class TokenText:
    """Token id -> display text through the run's tokenizer (str(id) when there is none).

    The tokenizer is parsed on first use: a large vocabulary takes a few hundred ms, which opening a
    trace should not pay."""

    def __init__(self, tokenizer_json: str | None):
        self._json = tokenizer_json
        self._parsed = False
        self._cache: dict[int, str] = {}

    @property
    def _tok(self):
        if not self._parsed:
            self._parsed, tok = True, None
            if self._json:
                from tokenizers import Tokenizer

                try:
                    tok = Tokenizer.from_str(self._json)
                except Exception:  # a damaged tokenizer must not make the trace unreadable
                    tok = None
            self._tokenizer = tok
        return self._tokenizer

    def __call__(self, ids) -> list[str]:
        out = []
        for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
            text = self._cache.get(i)
            if text is None:
                text = str(i)
                tok = self._tok
                if tok is not None and 0 <= i < tok.get_vocab_size():
                    text = tok.decode([i], skip_special_tokens=False) or tok.id_to_token(i) or text
                self._cache[i] = text
            out.append(text)
        return out

    def decode(self, ids) -> str:
        """The text of a whole token sequence (joined ids when there is no tokenizer)."""
        ids = [int(i) for i in ids]
        if self._tok is None:
            return " ".join(map(str, ids))
        return self._tok.decode(ids, skip_special_tokens=False)


def _arr(value, dtype) -> np.ndarray:
    return np.asarray([] if value is None else value, dtype=dtype)


def _shaped(value, dtype, rows: int, shape: list[int] | None = None) -> np.ndarray:
    """A flattened list field as [rows, k] (or ``shape``); empty [rows or 0, 0] when absent."""
    flat = _arr(value, dtype)
    if shape is not None and len(shape) == 2 and flat.size == shape[0] * shape[1] and flat.size:
        return flat.reshape(shape)
    if shape is None and rows and flat.size and flat.size % rows == 0:
        return flat.reshape(rows, -1)
    return np.zeros((rows if shape is None else 0, 0), dtype)


@dataclass
class IterationView:
    """One request's record of one iteration, as numpy arrays the views draw from.

    Per-node arrays have length N = num_nodes; ``mask`` is [N, N] bool;
    ``target_topk_*`` are [N, k]; ``step_topk_*`` are [S, K] (EAGLE, else [0, 0]);
    ``coins`` is empty when greedy; ``timings`` maps a phase field (``draft_us``...)
    to µs for the phases that were recorded.
    """

    iteration: int
    request_id: int
    method: str
    seq_len: int
    num_nodes: int
    tokens: np.ndarray
    parents: np.ndarray
    depth: np.ndarray
    scores: np.ndarray
    valid: np.ndarray
    mask: np.ndarray
    positions: np.ndarray
    retrieve_index: np.ndarray
    retrieve_next_token: np.ndarray
    retrieve_next_sibling: np.ndarray
    status: np.ndarray
    accept_path: np.ndarray
    accept_length: int
    bonus_token: int
    target_argmax: np.ndarray
    target_argmax_prob: np.ndarray
    target_topk_tokens: np.ndarray
    target_topk_probs: np.ndarray
    coins: np.ndarray
    temperature: float
    ngram_match_len: int
    ngram_breadth: int
    step_topk_tokens: np.ndarray
    step_topk_probs: np.ndarray
    timings: dict[str, float]
    token_texts: list[str] = field(default_factory=list)
    bonus_text: str = ""

    @property
    def step_topk(self) -> tuple[np.ndarray, np.ndarray]:
        """EAGLE per-step top-k (tokens, probs), each [S, K]."""
        return self.step_topk_tokens, self.step_topk_probs

    @classmethod
    def from_row(cls, row: dict[str, Any], token_text: TokenText) -> IterationView:
        """Build a view from one steps-table row (a dict as ``Table.to_pylist`` gives)."""
        n = int(row["num_nodes"] or 0)
        packed = row["mask_packed"]
        if packed is None:
            mask = np.zeros((n, n), dtype=bool)
        else:
            bits = np.unpackbits(np.frombuffer(packed, dtype=np.uint8), count=n * n)
            mask = bits.astype(bool).reshape(n, n)
        shape = list(row["step_topk_shape"] or [])
        tokens = _arr(row["tokens"], np.int64)
        bonus = -1 if row["bonus_token"] is None else int(row["bonus_token"])
        return cls(
            iteration=int(row["iteration"]),
            request_id=int(row["request_id"]),
            method=row["method"] or "",
            seq_len=-1 if row["seq_len"] is None else int(row["seq_len"]),
            num_nodes=n,
            tokens=tokens,
            parents=_arr(row["parents"], np.int64),
            depth=_arr(row["depth"], np.int64),
            scores=_arr(row["scores"], np.float32),
            valid=_arr(row["valid"], bool),
            mask=mask,
            positions=_arr(row["positions"], np.int64),
            retrieve_index=_arr(row["retrieve_index"], np.int64),
            retrieve_next_token=_arr(row["retrieve_next_token"], np.int64),
            retrieve_next_sibling=_arr(row["retrieve_next_sibling"], np.int64),
            status=_arr(row["status"], np.int8),
            accept_path=_arr(row["accept_path"], np.int64),
            accept_length=-1 if row["accept_length"] is None else int(row["accept_length"]),
            bonus_token=bonus,
            target_argmax=_arr(row["target_argmax"], np.int64),
            target_argmax_prob=_arr(row["target_argmax_prob"], np.float32),
            target_topk_tokens=_shaped(row["target_topk_tokens"], np.int64, n),
            target_topk_probs=_shaped(row["target_topk_probs"], np.float32, n),
            coins=_arr(row["coins"], np.float32),
            temperature=float(row["temperature"] or 0.0),
            ngram_match_len=-1 if row["ngram_match_len"] is None else int(row["ngram_match_len"]),
            ngram_breadth=-1 if row["ngram_breadth"] is None else int(row["ngram_breadth"]),
            step_topk_tokens=_shaped(row["step_topk_tokens"], np.int64, 0, shape),
            step_topk_probs=_shaped(row["step_topk_probs"], np.float32, 0, shape),
            timings={p: float(row[p]) for p in (*PHASE_FIELDS, "iteration_us") if row.get(p) is not None},
            token_texts=token_text(tokens),
            bonus_text=token_text([bonus])[0] if bonus >= 0 else "",
        )


def _conform(table: pa.Table, schema: pa.Schema, what: str) -> pa.Table:
    if schema is STEP_SCHEMA:
        table = with_optional_columns(table)
    missing = [n for n in schema.names if n not in table.column_names]
    if missing:
        raise TraceFormatError(f"{what} table is missing column(s): {', '.join(missing)}")
    try:
        return table.select(schema.names).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise TraceFormatError(f"{what} table has unexpected column types: {e}") from None


def _ids(table: pa.Table, name: str) -> np.ndarray:
    return np.asarray(table.column(name).fill_null(-1).to_numpy(), dtype=np.int64)


_SUMMARY_COLUMNS = ["iteration", "accept_length", "depth", "iteration_us", *PHASE_FIELDS]


class Trace:
    """A recorded run: steps (one row per iteration and request), requests and run info.

    A trace from `Trace.load` is lazy: the file is memory-mapped and only its index
    (iteration and request of every record) is read at open. ``steps`` and
    ``requests`` are materialised on first use (the whole table); the other accessors
    (`iteration`, `iter_batches`, `request_steps`, `columns`, `summary`, `sql`,
    `select`, `aggregates`) read only the batches and columns they need.
    """

    def __init__(self, steps: pa.Table, requests: pa.Table, run_info: dict,
                 tokenizer_json: str | None = None, truncated: bool = False):
        self._steps: pa.Table | None = steps
        self._requests: pa.Table | None = requests
        self._file: TraceFile | None = None
        self.run_info = run_info
        self.tokenizer_json = tokenizer_json
        self.truncated = truncated  # True when loaded from a file cut short by a crash (or damaged)
        self.damage: str | None = None  # where and why reading stopped early
        self.parent: Trace | None = None  # the whole trace this one was selected from (aggregates over all)
        self._text = TokenText(tokenizer_json)
        self._keys: tuple[np.ndarray, np.ndarray] | None = None
        self._order: tuple[np.ndarray, np.ndarray, int] | None = None
        self._iterations_sorted: bool | None = None

    @classmethod
    def from_tables(cls, steps: pa.Table, requests: pa.Table | None, run_info: dict,
                    tokenizer_json: str | None = None) -> Trace:
        """Wrap tables that follow STEP_SCHEMA / REQUEST_SCHEMA (missing column -> TraceFormatError)."""
        if requests is None:
            requests = REQUEST_SCHEMA.empty_table()
        return cls(_conform(steps, STEP_SCHEMA, "steps"), _conform(requests, REQUEST_SCHEMA, "requests"),
                   dict(run_info), tokenizer_json)

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Open a `.sptrace` file lazily; raises TraceFormatError when it is not a readable trace."""
        f = open_trace_file(path)
        trace = cls(None, None, with_selection_counts(f.run_info, f.stats), f.tokenizer_json, f.truncated)
        trace._file, trace.damage = f, f.damage
        return trace

    @classmethod
    def from_disk_table(cls, table: pa.Table, run_info: dict, tokenizer_json: str | None = None) -> Trace:
        """Wrap a table in the disk layout (a ``kind`` column plus both row kinds)."""
        steps, requests = split_disk_table(table)
        return cls(steps, requests, run_info, tokenizer_json)

    # -- whole tables ----------------------------------------------------------------

    @property
    def steps(self) -> pa.Table:
        """Every step row as one pyarrow Table (STEP_SCHEMA); read from the file on first use."""
        if self._steps is None:
            parts = list(self._file.iter_steps())
            self._steps = pa.concat_tables(parts) if parts else STEP_SCHEMA.empty_table()
        return self._steps

    @steps.setter
    def steps(self, table: pa.Table) -> None:
        self._requests = self.requests  # read before the file is let go
        self._steps, self._file, self._keys, self._order, self._iterations_sorted = table, None, None, None, None

    @property
    def requests(self) -> pa.Table:
        """Every request row (REQUEST_SCHEMA); read from the file on first use."""
        if self._requests is None:
            self._requests = self._file.requests()
        return self._requests

    @requests.setter
    def requests(self, table: pa.Table) -> None:
        self._requests = table

    def save(self, path: str | Path) -> None:
        """Write the trace as one `.sptrace` file (atomically replaces ``path``); a lazy trace streams."""
        steps = self.iter_batches() if self._steps is None else self._steps
        write_trace_file(path, steps, self.requests, self.run_info, self.tokenizer_json)

    def __len__(self) -> int:
        return len(self.keys()[0])

    def __repr__(self) -> str:
        return (f"Trace({len(self)} step rows, {len(self.request_ids)} requests, "
                f"method={self.method!r}{', truncated' if self.truncated else ''})")

    @property
    def method(self) -> str:
        """The draft method of the run (``none`` for plain decoding; ``?`` when nothing records it)."""
        draft = self.run_info.get("draft")
        if isinstance(draft, dict) and draft.get("method"):
            return str(draft["method"])
        if self.run_info.get("method"):
            return str(self.run_info["method"])
        methods = self.take([0], ["method"]).column("method") if len(self) else None
        return str(methods[0].as_py()) if methods is not None and methods[0].is_valid else "?"

    def to_pandas(self):
        """The steps as a pandas DataFrame."""
        return self.steps.to_pandas()

    # -- the index -------------------------------------------------------------------

    def keys(self) -> tuple[np.ndarray, np.ndarray]:
        """(iteration, request_id) of every step row, in row order, as int64 arrays (no decoding)."""
        if self._keys is None:
            if self._file is not None:
                self._keys = (self._file.iteration, self._file.request_id)
            else:
                self._keys = (_ids(self._steps, "iteration"), _ids(self._steps, "request_id"))
        return self._keys

    def scalars(self) -> dict[str, np.ndarray]:
        """iteration, request_id, accept_length (-1 = null) and iteration_us (NaN = null) of every step row,
        in row order, as numpy arrays: read with the index at open, so whole-trace plots decode nothing."""
        if self._file is not None:
            f = self._file
            return {"iteration": f.iteration, "request_id": f.request_id, "accept_length": f.accept_length,
                    "iteration_us": f.iteration_us}
        its, reqs = self.keys()
        return {"iteration": its, "request_id": reqs,
                "accept_length": np.asarray(self._steps["accept_length"].fill_null(-1).to_numpy(), np.int64),
                "iteration_us": np.asarray(self._steps["iteration_us"].to_numpy(zero_copy_only=False), np.float64)}

    def _row(self, i: int, request: int) -> int | None:
        its, reqs = self.keys()
        if self._order is None and self._sorted_iterations():
            # A recording is written in iteration order: a binary search finds the iteration's rows.
            lo, hi = np.searchsorted(its, [int(i), int(i) + 1])
            hit = np.flatnonzero(reqs[lo:hi] == int(request))
            return int(lo + hit[-1]) if hit.size else None
        if self._order is None:
            width = int(reqs.max()) + 2 if len(reqs) else 1
            key = its * width + (reqs + 1)
            order = np.argsort(key, kind="stable")
            self._order = (order, key[order], width)
        order, sorted_key, width = self._order
        want = int(i) * width + int(request) + 1
        if not 0 <= int(request) + 1 < width:
            return None
        at = np.searchsorted(sorted_key, want, side="right") - 1  # the last row of a repeated key
        return int(order[at]) if at >= 0 and sorted_key[at] == want else None

    def _sorted_iterations(self) -> bool:
        if self._iterations_sorted is None:
            its = self.keys()[0]
            self._iterations_sorted = bool(len(its) == 0 or (its[1:] >= its[:-1]).all())
        return self._iterations_sorted

    @property
    def request_ids(self) -> list[int]:
        """Every request id that has step rows or a request row, ascending."""
        ids = set(np.unique(self.keys()[1]).tolist())
        ids |= set(self.requests.column("request_id").to_pylist())
        return sorted(i for i in ids if i is not None and i >= 0)

    @property
    def finds_requests_fast(self) -> bool:
        """Whether `request` reads one request's row without reading every request row (held in memory,
        or listed in the file's index trailer): a large trace without that reads all of them first."""
        return self._requests is not None or self._file is None or self._file.indexes_requests

    def request(self, request_id: int) -> dict:
        """The request row (prompt_tokens, output_tokens, finish_reason, prompt_text) as a dict."""
        found = self._file.request_rows(request_id) if self._requests is None and self._file is not None else None
        if found is None:
            found = self.requests.filter(pc.equal(self.requests.column("request_id"), request_id))
        rows = found.to_pylist()
        if not rows:
            raise KeyError(f"no request row for request {request_id} (was the run cut short?)")
        return rows[-1]

    def iterations(self, request_id: int) -> list[int]:
        """Iteration numbers in which ``request_id`` took part, ascending."""
        its, reqs = self.keys()
        return np.unique(its[reqs == request_id]).tolist()

    # -- reading parts -----------------------------------------------------------------

    def take(self, rows, columns: list[str] | None = None) -> pa.Table:
        """Step rows by row number (see `keys`), in the order given; only ``columns`` when given."""
        rows = np.asarray(rows, dtype=np.int64)
        if self._file is not None:
            return self._file.take(rows, columns)
        table = self._steps if columns is None else self._steps.select(
            [c for c in self._steps.column_names if c in columns])
        return table.take(pa.array(rows))

    def iteration(self, i: int, request: int = 0) -> IterationView:
        """The full record of request ``request`` in iteration ``i`` (decodes one batch when lazy)."""
        row = self._row(i, request)
        if row is None:
            raise KeyError(f"no record for iteration {i}, request {request}")
        return IterationView.from_row(self.take([row]).to_pylist()[0], self._text)

    def iter_batches(self, columns: list[str] | None = None, requests=None,
                     iterations: tuple[int, int] | None = None) -> Iterator[pa.Table]:
        """Step rows as a stream of tables (one per stored batch), with only ``columns`` when given,
        only the request ids in ``requests`` and iterations in [first, last) of ``iterations``.
        Memory stays at one batch whatever the trace's size."""
        need = None if columns is None else list(dict.fromkeys([*columns, "iteration", "request_id"]))
        source = self._file.iter_steps(need) if self._file is not None else (
            self._steps.select(need) if need else self._steps).to_batches(max_chunksize=4096)
        for part in source:
            table = part if isinstance(part, pa.Table) else pa.Table.from_batches([part])
            keep = None
            if requests is not None:
                keep = pc.is_in(table["request_id"], pa.array(list(requests), pa.int32()))
            if iterations is not None:
                first, last = iterations
                inside = pc.and_(pc.greater_equal(table["iteration"], first), pc.less(table["iteration"], last))
                keep = inside if keep is None else pc.and_(keep, inside)
            if keep is not None:
                table = table.filter(keep)
            if columns is not None:
                table = table.select([c for c in dict.fromkeys(columns) if c in table.column_names])
            if table.num_rows:
                yield table

    def columns(self, names: list[str]) -> pa.Table:
        """Only the columns ``names`` of every step row, as one table (decodes nothing else)."""
        names = [c for c in dict.fromkeys(names) if c in STEP_SCHEMA.names]
        if self._file is None:
            return self._steps.select(names)
        parts = list(self.iter_batches(names))
        return pa.concat_tables(parts) if parts else STEP_SCHEMA.empty_table().select(names)

    def request_steps(self, request_id: int, columns: list[str] | None = None) -> pa.Table:
        """Every step row of one request, by iteration (decodes only the batches that hold them)."""
        its, reqs = self.keys()
        rows = np.flatnonzero(reqs == request_id)
        rows = rows[np.argsort(its[rows], kind="stable")]
        return self.take(rows, columns)

    def select(self, requests=None, iterations: tuple[int, int] | None = None) -> Trace:
        """An in-memory Trace of some requests and/or iterations [first, last); run_info["subset"] says
        which, and ``parent`` is this trace (for plots over the whole run)."""
        its, ids = self.keys()
        keep = np.ones(len(its), bool)
        if requests is not None:
            keep &= np.isin(ids, np.asarray(list(requests), np.int64))
        if iterations is not None:
            keep &= (its >= iterations[0]) & (its < iterations[1])
        steps = self.take(np.flatnonzero(keep))  # only the batches holding those records are decoded
        reqs = self.requests
        if requests is not None:
            reqs = reqs.filter(pc.is_in(reqs["request_id"], pa.array(list(requests), pa.int32())))
        info = dict(self.run_info)
        info["subset"] = {"requests": None if requests is None else sorted(int(r) for r in requests),
                          "iterations": None if iterations is None else [int(v) for v in iterations],
                          "records": steps.num_rows, "of_records": len(self)}
        out = Trace(steps, reqs, info, self.tokenizer_json, self.truncated)
        out.damage, out.parent = self.damage, self
        return out

    def token_text(self, ids) -> list[str]:
        """Display text of each token id."""
        return self._text(ids)

    def decode(self, ids) -> str:
        """Text of a token sequence through the run's tokenizer."""
        return self._text.decode(ids)

    # -- aggregates --------------------------------------------------------------------

    def summary(self) -> dict:
        """Summary statistics (see `spectool.trace.stats.summarize`), streamed over the batches when
        lazy, with ``kept_fraction`` and ``selection``: how much of the run the trace holds."""
        if self._file is None:
            out = summarize(self._steps)
        elif (stored := self._file.stored_summary_columns()) is not None:
            f = self._file  # a closed file's trailer holds every column the summary reads: no batch is decoded
            stored = stored.append_column("iteration", pa.array(f.iteration, pa.int32()))
            stored = stored.append_column("accept_length", pa.array(f.accept_length, mask=f.accept_length < 0))
            out = summarize(stored.append_column("iteration_us", pa.array(f.iteration_us, from_pandas=True)))
        else:
            parts = [summary_columns(t) for t in self.iter_batches(_SUMMARY_COLUMNS)]
            out = summarize(pa.concat_tables(parts) if parts else summary_columns(
                STEP_SCHEMA.empty_table().select(_SUMMARY_COLUMNS)))
        return out | kept_note(self.run_info)

    def aggregates(self, max_points: int = 2000) -> dict:
        """Per-iteration series for plots over the whole trace, at most ``max_points`` points each
        (see `spectool.trace.aggregate`)."""
        from spectool.trace.aggregate import iteration_aggregates

        return iteration_aggregates(self, max_points)

    def sql(self, query: str):
        """Run DuckDB SQL over the trace's tables ``steps``, ``requests`` and ``nodes`` (one row per
        draft-tree node); returns a pandas DataFrame. See `spectool.trace.sql`."""
        from spectool.trace.sql import run_sql

        return run_sql(self, query)
