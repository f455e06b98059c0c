"""Suspicious-number warnings: silent on healthy traces, each one raised by the number it names."""

from __future__ import annotations

import pyarrow as pa
import pytest
from trace_factory import make_trace

from spectool.trace.reader import Trace
from spectool.trace.schema import STEP_SCHEMA
from spectool.trace.suspicious import suspicious_numbers


def _edit(trace: Trace, change, run_info: dict | None = None) -> Trace:
    rows = trace.steps.to_pylist()
    for row in rows:
        change(row)
    return Trace(pa.Table.from_pylist(rows, schema=STEP_SCHEMA), trace.requests, run_info or trace.run_info)


@pytest.fixture(scope="module")
def chain():
    return make_trace("multi_layer_eagle", num_requests=6, batch_size=3, max_new_tokens=48, seed=2)


@pytest.mark.parametrize("method", ["ngram", "eagle", "multi_layer_eagle"])
def test_healthy_synthetic_traces_raise_nothing(method):
    trace = make_trace(method, num_requests=6, batch_size=3, max_new_tokens=48, seed=2)
    assert suspicious_numbers(trace) == []


def test_a_dead_layer_is_named(chain):
    def cap(row):
        row["accept_length"] = min(row["accept_length"], 1)

    warnings = suspicious_numbers(_edit(chain, cap))
    assert any(w.startswith("layer 1 accepts 0.0 %") for w in warnings), warnings


def test_an_unreached_depth_is_named(chain):
    info = dict(chain.run_info, draft={**chain.run_info["draft"], "num_steps": 12})
    assert any("num_steps is 12" in w for w in suspicious_numbers(_edit(chain, lambda r: None, info)))


def test_a_request_far_below_the_others_is_named(chain):
    def starve(row):
        if row["request_id"] == 3:
            row["accept_length"] = 0

    assert any(w.startswith("request 3 accepts 0.00") for w in suspicious_numbers(_edit(chain, starve)))


def test_a_draft_that_repeats_the_root_is_named(chain):
    def repeat(row):
        row["tokens"] = [row["tokens"][0]] * 2 + row["tokens"][2:]

    assert any("repeats the root token" in w for w in suspicious_numbers(_edit(chain, repeat)))


def test_sampled_acceptance_above_greedy_is_named():
    trace = make_trace("eagle", num_requests=6, batch_size=3, max_new_tokens=48, seed=2, temperature=0.8)
    assert not any("sampled acceptance" in w for w in suspicious_numbers(trace))

    def target_never_agrees(row):  # greedy verification of these drafts would accept nothing
        row["target_argmax"] = [0] * len(row["tokens"])

    assert any("sampled acceptance" in w for w in suspicious_numbers(_edit(trace, target_never_agrees)))


def test_a_lazily_read_trace_warns_as_the_same_trace_in_memory(chain, tmp_path):
    """Warnings are added up one stored batch at a time: many small batches give the same sentences."""
    from spectool.trace.format import write_trace_file

    def starve_and_repeat(row):
        if row["request_id"] == 3:
            row["accept_length"] = 0
        row["tokens"] = [row["tokens"][0]] * 2 + row["tokens"][2:]
        row["accept_length"] = min(row["accept_length"], 1)

    info = dict(chain.run_info, draft={**chain.run_info["draft"], "num_steps": 12})
    edited = _edit(chain, starve_and_repeat, info)
    warnings = suspicious_numbers(edited)
    assert len(warnings) == 4, warnings  # dead layer, unreached steps, a starved request, repeated roots
    write_trace_file(tmp_path / "t.sptrace", edited.steps, edited.requests, info, None, rows_per_batch=3)
    lazy = Trace.load(tmp_path / "t.sptrace")
    assert len(lazy._file.batches) > 10 and suspicious_numbers(lazy) == warnings


def test_the_median_of_the_other_requests_is_the_plain_median():
    import statistics

    import numpy as np

    from spectool.trace.suspicious import _median_of_others

    rng = np.random.default_rng(0)
    for n in (3, 4, 5, 10, 11):
        means = {3 * i: float(v) for i, v in enumerate(rng.integers(0, 5, n) / 2)}
        got = _median_of_others(means)
        assert got == {k: statistics.median([v for r, v in means.items() if r != k]) for k in means}
