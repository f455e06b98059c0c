"""Reading a recorded run: `Trace` (tables + run info) and `IterationView` (one tree).

    trace = Trace.load("run.sptrace")
    trace.steps                      # pyarrow Table, one row per (iteration, request)
    view = trace.iteration(3, request=0)
    view.tokens, view.mask, view.status, view.token_texts
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from spectool.trace.format import TraceFormatError, read_trace_file, split_disk_table, write_trace_file
from spectool.trace.schema import PHASE_FIELDS, REQUEST_SCHEMA, STEP_SCHEMA
from spectool.trace.stats import summarize


class TokenText:
    """Token id -> display text through the run's tokenizer (str(id) when there is none)."""

    def __init__(self, tokenizer_json: str | None):
        self._tok = None
        if tokenizer_json:
            from tokenizers import Tokenizer

            try:
                self._tok = Tokenizer.from_str(tokenizer_json)
            except Exception:  # a damaged tokenizer must not make the trace unreadable
                self._tok = None
        self._cache: dict[int, str] = {}

    def __call__(self, ids) -> list[str]:
        out = []
        for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
            text = self._cache.get(i)
            if text is None:
                text = str(i)
                if self._tok is not None and 0 <= i < self._tok.get_vocab_size():
                    text = (self._tok.decode([i], skip_special_tokens=False)
                            or self._tok.id_to_token(i) or text)
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
    missing = [n for n in schema.names if n not in table.column_names]
    if missing:
        raise TraceFormatError(f"{what} table is missing column(s): {', '.join(missing)}")
    try:
        return table.select(schema.names).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise TraceFormatError(f"{what} table has unexpected column types: {e}") from None


class Trace:
    """A recorded run: steps (one row per iteration and request), requests and run info."""

    def __init__(self, steps: pa.Table, requests: pa.Table, run_info: dict,
                 tokenizer_json: str | None = None, truncated: bool = False):
        self.steps = steps
        self.requests = requests
        self.run_info = run_info
        self.tokenizer_json = tokenizer_json
        self.truncated = truncated  # True when loaded from a file cut short by a crash
        self._text = TokenText(tokenizer_json)
        self._row_index: dict[tuple[int, int], int] | None = None

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
        """Read a `.sptrace` file; raises TraceFormatError when it is not a readable trace."""
        steps, requests, run_info, tokenizer_json, truncated = read_trace_file(path)
        return cls(steps, requests, run_info, tokenizer_json, truncated)

    @classmethod
    def from_disk_table(cls, table: pa.Table, run_info: dict, tokenizer_json: str | None = None) -> Trace:
        """Wrap a table in the disk layout (a ``kind`` column plus both row kinds)."""
        steps, requests = split_disk_table(table)
        return cls(steps, requests, run_info, tokenizer_json)

    def save(self, path: str | Path) -> None:
        """Write the trace as one `.sptrace` file (atomically replaces ``path``)."""
        write_trace_file(path, self.steps, self.requests, self.run_info, self.tokenizer_json)

    def __len__(self) -> int:
        return self.steps.num_rows

    def __repr__(self) -> str:
        return (f"Trace({self.steps.num_rows} step rows, {len(self.request_ids)} requests, "
                f"method={self.method!r}{', truncated' if self.truncated else ''})")

    @property
    def method(self) -> str:
        """The draft method of the run (``none`` for plain decoding; ``?`` when nothing records it)."""
        draft = self.run_info.get("draft")
        if isinstance(draft, dict) and draft.get("method"):
            return str(draft["method"])
        if self.run_info.get("method"):
            return str(self.run_info["method"])
        methods = self.steps.column("method") if self.steps.num_rows else None
        return str(methods[0].as_py()) if methods is not None and methods[0].is_valid else "?"

    def to_pandas(self):
        """The steps as a pandas DataFrame."""
        return self.steps.to_pandas()

    @property
    def request_ids(self) -> list[int]:
        """Every request id that has step rows or a request row, ascending."""
        ids = set(self.steps.column("request_id").to_pylist())
        ids |= set(self.requests.column("request_id").to_pylist())
        return sorted(i for i in ids if i is not None)

    def request(self, request_id: int) -> dict:
        """The request row (prompt_tokens, output_tokens, finish_reason, prompt_text) as a dict."""
        rows = self.requests.filter(pc.equal(self.requests.column("request_id"), request_id)).to_pylist()
        if not rows:
            raise KeyError(f"no request row for request {request_id} (was the run cut short?)")
        return rows[-1]

    def iterations(self, request_id: int) -> list[int]:
        """Iteration numbers in which ``request_id`` took part, ascending."""
        return sorted(it for (it, req) in self._index() if req == request_id)

    def iteration(self, i: int, request: int = 0) -> IterationView:
        """The full record of request ``request`` in iteration ``i``."""
        row = self._index().get((int(i), int(request)))
        if row is None:
            raise KeyError(f"no record for iteration {i}, request {request}")
        return IterationView.from_row(self.steps.slice(row, 1).to_pylist()[0], self._text)

    def token_text(self, ids) -> list[str]:
        """Display text of each token id."""
        return self._text(ids)

    def decode(self, ids) -> str:
        """Text of a token sequence through the run's tokenizer."""
        return self._text.decode(ids)

    def summary(self) -> dict:
        """Summary statistics (see `spectool.trace.stats.summarize`)."""
        return summarize(self.steps)

    def _index(self) -> dict[tuple[int, int], int]:
        if self._row_index is None:
            its = self.steps.column("iteration").to_pylist()
            reqs = self.steps.column("request_id").to_pylist()
            self._row_index = {(it, rq): k for k, (it, rq) in enumerate(zip(its, reqs))}
        return self._row_index
