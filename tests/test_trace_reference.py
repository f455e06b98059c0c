"""The checker's reference against hand-worked trees (the worked example of docs/INTERNALS.md and others)."""

from __future__ import annotations

import math

import pytest

from spectool.trace import reference as ref

# The worked example of docs/INTERNALS.md: tokens [r, A, B, C, D], parents [-1, 0, 0, 1, 1], seq_len 10.
R, A, B, C, D, Z = 1, 10, 11, 12, 13, 99
TOKENS = [R, A, B, C, D]
PARENTS = [-1, 0, 0, 1, 1]
VALID = [True] * 5


def test_worked_example_indices():
    assert ref.depths(PARENTS) == [0, 1, 1, 2, 2]
    got = ref.tree_indices(PARENTS, 10)
    assert got["positions"] == [10, 11, 11, 12, 12]
    assert got["retrieve_next_token"] == [1, 3, -1, -1, -1]
    assert got["retrieve_next_sibling"] == [-1, 2, -1, 4, -1]
    assert got["retrieve_index"] == [0, 1, 2, 3, 4]


def test_worked_example_mask_both_ways():
    rows = ["".join("1" if b else "0" for b in row) for row in ref.mask_rows(PARENTS)]
    assert rows == ["10000", "11000", "10100", "11010", "11001"]
    assert ref.parents_from_mask(ref.mask_rows(PARENTS)) == PARENTS


def test_worked_example_greedy_decision():
    # Target argmax per node [A, D, ., ., Z]: A accepted, C rejected, D accepted, bonus Z.
    d = ref.greedy_decision(TOKENS, PARENTS, VALID, [A, D, 0, 0, Z])
    assert d.path == [0, 1, 4] and d.bonus == Z
    assert d.status == [ref.ACCEPTED, ref.ACCEPTED, ref.NOT_VISITED, ref.REJECTED, ref.ACCEPTED]


def test_greedy_rejects_every_child_below_the_last_node():
    d = ref.greedy_decision(TOKENS, PARENTS, VALID, [A, Z, 0, 0, 0])
    assert d.path == [0, 1] and d.bonus == Z
    assert d.status == [ref.ACCEPTED, ref.ACCEPTED, ref.NOT_VISITED, ref.REJECTED, ref.REJECTED]


def test_greedy_duplicate_siblings_take_the_deeper_path():
    # Nodes 1 and 2 both carry A; only 2 has a child the target agrees with.
    tokens, parents = [R, A, A, C], [-1, 0, 0, 2]
    d = ref.greedy_decision(tokens, parents, [True] * 4, [A, 0, C, Z])
    assert d.path == [0, 2, 3] and d.bonus == Z
    assert d.status == [ref.ACCEPTED, ref.REJECTED, ref.ACCEPTED, ref.ACCEPTED]


def test_padding_is_never_accepted():
    d = ref.greedy_decision([R, A, 0], [-1, 0, 0], [True, True, False], [0, Z, Z])
    assert d.path == [0] and d.bonus == 0
    assert d.status == [ref.ACCEPTED, ref.REJECTED, ref.NOT_VISITED]


def test_sampled_decision_by_hand():
    # At the root p(A) = .5, p(B) = .3: coin .6 falls in B's interval [.5, .8). At B nothing is
    # drafted (E dropped), so the residual draw is B's coin .25 minus 0.
    child = [math.nan, 0.5, 0.3, 0.2, 0.1]
    d = ref.sampled_decision(TOKENS, PARENTS, VALID, [0.6, math.nan, 0.25, math.nan, math.nan], child)
    assert d.path == [0, 2] and d.residual_u == pytest.approx(0.25)
    assert d.status == [ref.ACCEPTED, ref.REJECTED, ref.ACCEPTED, ref.NOT_VISITED, ref.NOT_VISITED]
    # Coin .9 falls past both children (mass .8): the walk stops at the root with .1 left.
    d = ref.sampled_decision(TOKENS, PARENTS, VALID, [0.9] + [math.nan] * 4, child)
    assert d.path == [0] and d.residual_u == pytest.approx(0.1)
    assert d.status == [ref.ACCEPTED, ref.REJECTED, ref.REJECTED, ref.NOT_VISITED, ref.NOT_VISITED]


def test_sampled_repeated_token_counts_once():
    tokens, parents = [R, A, A], [-1, 0, 0]
    d = ref.sampled_decision(tokens, parents, [True] * 3, [0.55, math.nan, math.nan], [math.nan, 0.5, 0.5])
    assert d.path == [0] and d.residual_u == pytest.approx(0.05)


def test_near_tie_follows_the_dtype_rounding():
    assert ref.ulp(10.0, "bfloat16") == 2.0 ** -4
    assert ref.is_near_tie(0.05, 10.0, "bfloat16")
    assert ref.is_near_tie(ref.NEAR_TIE_ULPS * 2.0 ** -4, 10.0, "bfloat16")
    assert not ref.is_near_tie(ref.NEAR_TIE_ULPS * 2.0 ** -4 + 1e-3, 10.0, "bfloat16")
    assert not ref.is_near_tie(0.5, 10.0, "bfloat16")
    assert not ref.is_near_tie(0.05, 10.0, "float32")
