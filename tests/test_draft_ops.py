"""The drafters' kernel-count work: ancestor masks by bounded matrix powers, and
``benchmarks/speculative.py --profile ops``, which counts what each graphed function would launch."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

from spectool.draft.tree import parents_to_mask

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def random_parents(n: int, gen: torch.Generator, chain_bias: float) -> torch.Tensor:
    """A topologically ordered tree; with chain_bias near 1 mostly a deep chain."""
    parents = [-1]
    for i in range(1, n):
        deep = torch.rand((), generator=gen).item() < chain_bias
        parents.append(i - 1 if deep else int(torch.randint(0, i, (), generator=gen)))
    return torch.tensor(parents)


def walked_mask(parents: torch.Tensor) -> torch.Tensor:
    """Oracle: climb every node's parent pointers."""
    n = parents.shape[0]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        node = q
        while node >= 0:
            mask[q, node] = True
            node = int(parents[node])
    return mask


@pytest.mark.parametrize("n", [1, 2, 17, 64, 130, 300])
@pytest.mark.parametrize("chain_bias", [0.0, 0.5, 0.97])
def test_parents_to_mask_equals_walking_the_parents(n, chain_bias):
    gen = torch.Generator().manual_seed(n * 7 + int(chain_bias * 100))
    parents = torch.stack([random_parents(n, gen, chain_bias) for _ in range(3)])
    expected = torch.stack([walked_mask(p) for p in parents])
    assert torch.equal(parents_to_mask(parents), expected)
    # A bound on the depth (what drafters pass) gives the same masks with fewer matmuls.
    depth = int((expected.sum(-1) - 1).max())
    assert torch.equal(parents_to_mask(parents, max_depth=max(depth, 1)), expected)


def test_parents_to_mask_full_chain_needs_every_level():
    """A bound too small to reach the root must show (so the bound really limits the work)."""
    chain = torch.arange(-1, 15)[None]
    full = parents_to_mask(chain)
    assert torch.equal(full[0], torch.ones(16, 16, dtype=torch.bool).tril())
    assert not torch.equal(parents_to_mask(chain, max_depth=4), full)


@pytest.fixture(scope="module")
def op_counts(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ops")
    sys.path.insert(0, str(BENCHMARKS))
    try:
        speculative = importlib.import_module("speculative")
        assert speculative.main(["--profile", "ops", "--device", "cpu", "--quick", "--out", str(out),
                                 "--methods", "plain,eagle,multi_layer_eagle", "--top", "0"]) == 0
    finally:
        sys.path.remove(str(BENCHMARKS))
    return {r["method"]: r for r in json.loads((out / "op_counts.json").read_text())["results"]}


def test_op_counts_cover_every_graph_without_host_syncs(op_counts):
    graphs = {m: {row for row in r["rows"] if row.startswith("graph: ")} for m, r in op_counts.items()}
    assert graphs["plain"] == {"graph: verify step"}
    assert graphs["eagle"] == {"graph: verify step", "graph: draft", "graph: extend"}
    assert graphs["multi_layer_eagle"] == {"graph: verify step", "graph: extend"}
    for r in op_counts.values():
        # .item()-like reads inside graphed code would break CUDA-graph capture.
        assert r["syncs_in_graphs"] == {}
        assert r["total"] == pytest.approx(sum(r["totals"].values()))
        for row, parts in r["rows"].items():
            assert r["totals"][row] == pytest.approx(sum(parts.values()))
            assert sum(r["ops"][row].values()) == pytest.approx(r["totals"][row])


def test_op_counts_split_the_draft_layer_from_bookkeeping(op_counts):
    """At bs 1 every iteration's verify is followed by one extend; EAGLE's draft graph runs only
    for the first iteration (later drafts come from the extend graph). Per call, EAGLE's extend
    runs the layer 1 + 4 times (5 steps), its draft graph 4 times, multi-layer EAGLE's extend
    each of its 4 layers once: all the same block, so one layer's op count comes out equal, but
    for the layer run of each extend whose output is wanted at one position per row (EAGLE's
    extend of the accepted tokens, multi-layer EAGLE's last layer): two gathers before its MLP."""
    eagle, its = op_counts["eagle"]["rows"], op_counts["eagle"]["iterations"]
    layer = eagle["graph: draft"]["draft layer"] * its / 4  # one draft-graph call over `its` iterations
    assert layer > 0
    assert eagle["graph: extend"]["draft layer"] == pytest.approx(5 * layer + 2)
    assert eagle["graph: extend"]["lm_head"] == pytest.approx(5 / 4 * eagle["graph: draft"]["lm_head"] * its)
    multi = op_counts["multi_layer_eagle"]["rows"]
    assert multi["graph: extend"]["draft layer"] == pytest.approx(4 * layer + 2)
