"""Choosing what to record: every k-th iteration, some requests, or the iterations that match.

    engine.generate(prompts, record=st.Record(every=10))                  # 1 iteration in 10
    engine.generate(prompts, record=st.Record(requests=[0, 3]))           # two requests only
    engine.generate(prompts, record=st.Record(where="accept_length == 0"))
    engine.generate(prompts, record=st.Record(slowest=0.05))              # the slowest 5 % of iterations
    engine.generate(prompts, record=st.Record(path="run.sptrace"))        # every record, straight to a file

Options combine (a record is kept when every given option keeps it). What was asked
goes into the trace's ``run_info["record"]``; the recorder counts what it saw and
kept (``seen_records``, ``kept_records``, ``seen_iterations``, ``kept_iterations``) and
stores the counts with every flush, so ``run_info["record"]["kept_fraction"]`` and
every summary computed from the trace say how much of the run it holds.

``every`` is decided on the engine's thread before anything is copied, so skipped
iterations cost nothing. The others need the converted record and run on the writer
thread. ``slowest=p`` keeps an iteration when its ``iteration_us`` is at least the
(1 - p) quantile of the iterations seen so far (a running threshold: the recorder
cannot wait for the end of the run, so early iterations are judged against fewer
peers; the counts give the exact fraction kept).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_WHERE = re.compile(r"^\s*([A-Za-z_]\w*)\s*(==|!=|<=|>=|<|>)\s*(-?\d+(?:\.\d*)?(?:[eE]-?\d+)?)\s*$")
_OPS = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
        ">=": operator.ge}


@dataclass(frozen=True)
class Record:
    """What to keep of a run (pass as ``record=`` to `Engine.generate` / `Engine.stream`).

    Args:
        every: keep iterations whose number is a multiple of ``every`` (1 = all).
        requests: keep only these request ids (None = all).
        where: keep records matching ``"<column> <op> <number>"`` over a per-record column of the
            trace (e.g. ``"accept_length == 0"``, ``"ngram_match_len < 3"``), or a callable taking a
            pyarrow Table of records and returning one bool per record.
        slowest: keep the slowest fraction (0 < slowest <= 1) of iterations by ``iteration_us``.
        path: write the trace to this `.sptrace` file as the run goes, one batch of records at a time,
            instead of holding it in memory (a long run's memory stays bounded; a run killed midway
            leaves a file that loads up to its last complete batch). The result's trace is then the
            file, opened lazily. None keeps the trace in memory.
        flush_every: records gathered before they are converted and written as one batch (the most
            a killed run can lose; a conversion has a fixed cost of a few ms, so larger is cheaper).
    """

    every: int = 1
    requests: tuple[int, ...] | None = None
    where: str | Callable | None = None
    slowest: float | None = None
    path: str | Path | None = None
    flush_every: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"Record(every=...) must be an int >= 1, got {self.every!r}")
        if not isinstance(self.flush_every, int) or self.flush_every < 1:
            raise ValueError(f"Record(flush_every=...) must be an int >= 1, got {self.flush_every!r}")
        if self.requests is not None:
            object.__setattr__(self, "requests", tuple(int(r) for r in self.requests))
        if self.slowest is not None and not 0 < self.slowest <= 1:
            raise ValueError(f"Record(slowest=...) must be in (0, 1], got {self.slowest!r}")
        if isinstance(self.where, str):
            from spectool.trace.schema import STEP_FIELDS

            m = _WHERE.match(self.where)
            if m is None:
                raise ValueError(f"Record(where={self.where!r}): expected '<column> <op> <number>' "
                                 f"with op one of {', '.join(_OPS)}")
            column = m.group(1)
            if column not in STEP_FIELDS or isinstance(STEP_FIELDS[column][0], pa.ListType):
                raise ValueError(f"Record(where=...): {column!r} is not a per-record trace column")
        elif self.where is not None and not callable(self.where):
            raise ValueError("Record(where=...) must be a string like 'accept_length == 0' or a callable")

    @property
    def keeps_everything(self) -> bool:
        """True when no option drops a record (``path`` and ``flush_every`` only say where and how they go)."""
        return self.every == 1 and self.requests is None and self.where is None and self.slowest is None

    def describe(self) -> dict:
        """The options as JSON (callables by name), as stored in ``run_info["record"]``."""
        where = self.where if self.where is None or isinstance(self.where, str) else getattr(
            self.where, "__name__", "a callable")
        return {"every": self.every, "requests": None if self.requests is None else list(self.requests),
                "where": where, "slowest": self.slowest}


class Selector:
    """Applies a `Record` inside the recorder and counts what it saw and kept."""

    def __init__(self, options: Record):
        self.options = options
        self.seen_records = self.seen_iterations = 0       # engine thread
        self.kept_records = self.kept_iterations = 0       # writer thread
        self._times: list[float] = []

    def keeps_iteration(self, iteration: int, rows: int) -> bool:
        """Engine thread: count the iteration; False when ``every`` skips it."""
        self.seen_records += rows
        self.seen_iterations += 1
        return iteration % self.options.every == 0

    def keeps_request(self, request_id: int) -> bool:
        """Whether the request's own row (prompt, outputs) is kept."""
        return self.options.requests is None or request_id in self.options.requests

    def filter(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """Writer thread: the records of ``batch`` (whole iterations) that the options keep."""
        o = self.options
        keep = np.ones(batch.num_rows, bool)
        if o.requests is not None:
            keep &= np.isin(batch.column(batch.schema.get_field_index("request_id")).to_numpy(), o.requests)
        if o.where is not None:
            keep &= self._where(pa.Table.from_batches([batch]))
        if o.slowest is not None:
            keep &= self._slow(batch)
        out = batch if keep.all() else batch.filter(pa.array(keep))
        self.kept_records += out.num_rows
        self.kept_iterations += len(np.unique(out.column(batch.schema.get_field_index("iteration")).to_numpy()))
        return out

    def _where(self, table: pa.Table) -> np.ndarray:
        o = self.options
        if callable(o.where):
            got = o.where(table)
            got = np.asarray(got.to_numpy(zero_copy_only=False) if isinstance(got, pa.Array | pa.ChunkedArray)
                             else got, dtype=bool).reshape(-1)
            if got.shape != (table.num_rows,):
                raise ValueError(f"Record(where=...) returned {got.shape[0]} values for {table.num_rows} records")
            return got
        column, op, number = _WHERE.match(o.where).groups()
        values = table.column(column)
        if values.null_count:
            values = pc.fill_null(values, np.nan) if pa.types.is_floating(values.type) else values
        values = np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.float64)
        return _OPS[op](values, float(number))

    def _slow(self, batch: pa.RecordBatch) -> np.ndarray:
        col = batch.column(batch.schema.get_field_index("iteration_us"))
        if col.null_count == len(col):
            raise ValueError("Record(slowest=...) needs iteration_us, which this run does not record")
        times = np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64)
        its = batch.column(batch.schema.get_field_index("iteration")).to_numpy()
        _, first = np.unique(its, return_index=True)
        self._times.extend(np.nan_to_num(times[first], nan=0.0).tolist())
        threshold = np.quantile(self._times, 1.0 - self.options.slowest)
        return np.nan_to_num(times, nan=-np.inf) >= threshold

    def counts(self) -> dict:
        return {"seen_records": self.seen_records, "kept_records": self.kept_records,
                "seen_iterations": self.seen_iterations, "kept_iterations": self.kept_iterations}


def with_selection_counts(run_info: dict, counts: dict | None) -> dict:
    """run_info with the recorder's counts and the kept fraction merged into ``run_info["record"]``."""
    if not counts:
        return run_info
    info = dict(run_info)
    record = dict(info.get("record") or {})
    record.update(counts)
    seen = counts.get("seen_records") or 0
    record["kept_fraction"] = counts.get("kept_records", 0) / seen if seen else 1.0
    info["record"] = record
    return info


def kept_note(run_info: dict) -> dict:
    """``kept_fraction`` (of the run's records that the trace holds) and ``selection`` (a phrase, or
    None when it holds them all), for every summary."""
    fraction, parts = 1.0, []
    record = run_info.get("record") or {}
    if record:
        fraction *= float(record.get("kept_fraction", 1.0))
        if record.get("every", 1) != 1:
            parts.append(f"1 iteration in {record['every']}")
        if record.get("requests") is not None:
            parts.append(f"requests {', '.join(map(str, record['requests']))}")
        if record.get("where") is not None:
            parts.append(f"records where {record['where']}")
        if record.get("slowest") is not None:
            parts.append(f"the slowest {100 * record['slowest']:g} % of iterations")
    subset = run_info.get("subset")
    if subset and subset.get("of_records"):
        fraction *= subset["records"] / subset["of_records"]
        if subset.get("requests") is not None:
            parts.append(f"requests {', '.join(map(str, subset['requests']))} of the trace")
        if subset.get("iterations") is not None:
            parts.append(f"iterations {subset['iterations'][0]} to {subset['iterations'][1] - 1} of the trace")
    return {"kept_fraction": fraction, "selection": "; ".join(parts) if parts else None}
