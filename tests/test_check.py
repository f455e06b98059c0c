"""`spectool check`: valid traces pass; each kind of corruption is named at its first fault."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from trace_factory import METHODS, make_trace

from spectool.cli import check as check_cli
from spectool.trace import check
from spectool.trace.reader import Trace
from spectool.trace.schema import STEP_SCHEMA


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("method", METHODS)
def test_synthetic_traces_pass(tmp_path, capsys, method, temperature):
    path = tmp_path / "run.sptrace"
    make_trace(method, path=path, num_requests=4, batch_size=2, temperature=temperature, seed=3)
    assert check_cli.main([str(path)]) == 0
    assert capsys.readouterr().out.startswith("ok ")


def _corrupt(trace: Trace, row: int, **changes) -> Trace:
    rows = trace.steps.to_pylist()
    rows[row].update(changes)
    return Trace(pa.Table.from_pylist(rows, schema=STEP_SCHEMA), trace.requests, trace.run_info)


def _row_with(trace: Trace, want) -> int:
    """Index of the first row (in trace order) for which want(row) holds."""
    rows = trace.steps.to_pylist()
    return next(k for k, r in enumerate(rows) if want(r))


def _expect(fault, row: dict, node: int | None, words: str):
    assert fault is not None
    assert (fault.iteration, fault.request_id) == (row["iteration"], row["request_id"])
    text = str(fault)
    assert text.startswith(f"iteration {row['iteration']}, request {row['request_id']}")
    if node is not None:
        assert f"node {node}:" in text
    assert words in text, text


@pytest.fixture(scope="module")
def trace():
    return make_trace("ngram", num_requests=4, batch_size=2, seed=5)


def test_wrong_mask_bit_is_named(trace):
    k = _row_with(trace, lambda r: r["iteration"] > 1 and r["parents"][2] == 0 and r["num_nodes"] > 3)
    row = trace.steps.to_pylist()[k]
    n = row["num_nodes"]
    bits = np.unpackbits(np.frombuffer(row["mask_packed"], np.uint8), count=n * n).reshape(n, n)
    bits[2, 1] ^= 1  # node 1 is not an ancestor of node 2 (both children of the root)
    fault = check.check_trace(_corrupt(trace, k, mask_packed=np.packbits(bits.reshape(-1)).tobytes()))
    _expect(fault, row, 2, "mask[2][1] is 1")


def test_path_that_is_not_a_root_path_is_named(trace):
    k = _row_with(trace, lambda r: r["accept_length"] >= 1)
    row = trace.steps.to_pylist()[k]
    siblings = [i for i in range(1, row["num_nodes"]) if row["parents"][i] != row["accept_path"][-1]
                and row["parents"][i] != 0]
    bad_path = row["accept_path"] + [siblings[0]]
    fault = check.check_trace(_corrupt(trace, k, accept_path=bad_path, accept_length=len(bad_path) - 1))
    _expect(fault, row, siblings[0], "not a root path")


def test_accepting_a_token_the_target_disagrees_with_is_named(trace):
    k = _row_with(trace, lambda r: r["accept_length"] >= 1)
    row = trace.steps.to_pylist()[k]
    first = row["accept_path"][1]
    argmax = list(row["target_argmax"])
    argmax[0] = (argmax[0] + 1) % 40 + 2  # the target now wanted something else at the root
    fault = check.check_trace(_corrupt(trace, k, target_argmax=argmax))
    _expect(fault, row, first, "target argmax")


def test_wrong_positions_disagree_with_the_reference(trace):
    k = _row_with(trace, lambda r: r["iteration"] == 3)
    row = trace.steps.to_pylist()[k]
    positions = list(row["positions"])
    positions[1] += 1
    _expect(check.check_trace(_corrupt(trace, k, positions=positions)), row, 1, "the parents and seq_len give")


def test_output_that_was_not_gained_is_named(trace):
    requests = trace.requests.to_pylist()
    req = requests[0]
    req["output_tokens"][5] = (req["output_tokens"][5] + 1) % 40 + 2
    bad = Trace(trace.steps, pa.Table.from_pylist(requests, schema=trace.requests.schema), trace.run_info)
    fault = check.check_trace(bad)
    assert fault is not None and fault.request_id == req["request_id"] and "output token 5" in str(fault)


def test_the_first_of_two_faults_is_reported(trace):
    early = _row_with(trace, lambda r: r["iteration"] == 2)
    late = _row_with(trace, lambda r: r["iteration"] == 5)
    rows = trace.steps.to_pylist()
    broken = _corrupt(trace, late, parents=[-1] + [5] * (rows[late]["num_nodes"] - 1))
    broken = _corrupt(broken, early, bonus_token=rows[early]["bonus_token"] + 1)
    _expect(check.check_trace(broken), rows[early], None, "bonus")


def test_cli_exit_1_names_the_fault(tmp_path, trace, capsys):
    k = _row_with(trace, lambda r: r["iteration"] == 1)
    row = trace.steps.to_pylist()[k]
    _corrupt(trace, k, seq_len=row["seq_len"] + 4).save(tmp_path / "bad.sptrace")
    assert check_cli.main([str(tmp_path / "bad.sptrace")]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and f"iteration 1, request {row['request_id']}" in out[0]
