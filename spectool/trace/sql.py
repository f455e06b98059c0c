"""SQL over a trace with DuckDB (optional: ``pip install duckdb``).

    trace.sql("select iteration, request_id, accept_length from steps order by accept_length desc limit 20")
    spectool query run.sptrace "select request_id, avg(accept_length) from steps group by 1"

Tables:
- ``steps``: one row per record (iteration, request), the STEP_SCHEMA columns with their
  documented names (docs/INTERNALS.md, trace section; list columns are DuckDB lists,
  1-based: ``status[2]`` is node 1's status);
- ``requests``: one row per request (request_id, prompt_tokens, output_tokens, finish_reason,
  prompt_text);
- ``nodes``: one row per draft-tree node: iteration, request_id, node (0 = root), token,
  parent, depth, score, status (0 not visited, 1 accepted, 2 rejected), target_argmax,
  target_argmax_prob.
Only the step columns a query names are read from the file (every column for ``*``), so
a query over a few scalar columns of a million records stays light.
"""

from __future__ import annotations

import re

from spectool.trace.schema import STEP_SCHEMA

NODE_COLUMNS = {"node": "range(num_nodes)", "token": "tokens", "parent": "parents", "depth": "depth",
                "score": "scores", "status": "status", "target_argmax": "target_argmax",
                "target_argmax_prob": "target_argmax_prob"}
_NODES_VIEW = ("CREATE VIEW nodes AS SELECT iteration, request_id, "
               + ", ".join(f"unnest({src}) AS {name}" for name, src in NODE_COLUMNS.items()) + " FROM steps")


def _duckdb():
    try:
        import duckdb
    except ImportError:
        raise ImportError("trace SQL needs DuckDB: pip install duckdb") from None
    return duckdb


def _step_columns(query: str) -> list[str]:
    """The step columns a query may read: every one it names (all of them for ``*``)."""
    words = set(re.findall(r"[A-Za-z_]\w*", query))
    if "*" in re.sub(r"count\s*\(\s*\*\s*\)", "", query, flags=re.I):
        return STEP_SCHEMA.names
    want = {"iteration", "request_id"} | (words & set(STEP_SCHEMA.names))
    if "nodes" in words:
        want |= {"num_nodes", *(src for src in NODE_COLUMNS.values() if src in STEP_SCHEMA.names)}
    return [n for n in STEP_SCHEMA.names if n in want]


def connect(trace):
    """A DuckDB connection with ``steps``, ``requests`` and ``nodes`` over ``trace``, every step column."""
    return _connect(trace, STEP_SCHEMA.names)


def _connect(trace, columns: list[str]):
    duckdb = _duckdb()
    con = duckdb.connect()
    steps = trace.columns(columns)
    con.register("steps", steps)
    con.register("requests", trace.requests)
    if {"num_nodes", "tokens", "parents", "depth", "scores", "status", "target_argmax",
            "target_argmax_prob"} <= set(steps.column_names):
        con.execute(_NODES_VIEW)
    return con


def run_sql(trace, query: str):
    """Run ``query`` over ``trace``; a pandas DataFrame. Bad SQL raises ValueError with DuckDB's message."""
    duckdb = _duckdb()
    con = _connect(trace, _step_columns(query))
    try:
        return con.execute(query).df()
    except duckdb.Error as e:
        raise ValueError(f"SQL error: {e}") from None
    finally:
        con.close()

