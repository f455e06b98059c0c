"""DraftTree, parents <-> mask, validation and EAGLE-2 tree building, against
plain-Python oracles and the worked example of docs/INTERNALS.md."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spectool.draft.tree import (
    DraftTree,
    TreeError,
    build_eagle_tree,
    chain_tree,
    mask_to_parents,
    parents_to_mask,
    validate_tree,
)
from spectool.verify import verify_greedy


def random_parents(bs: int, n: int, generator: torch.Generator, pad_max: int = 0):
    """Random valid trees [bs, n] in topological order, with 0..pad_max padding nodes at the end
    (hanging off the root). Returns (parents, valid)."""
    idx = torch.arange(n)
    parents = (torch.rand(bs, n, generator=generator) * idx).long()
    # Bias toward deep trees in half of the rows: parent = i - 1 (a chain) with prob 0.5.
    chain = torch.rand(bs, n, generator=generator) < 0.5
    deep = torch.rand(bs, 1, generator=generator) < 0.5
    parents = torch.where(chain & deep, idx - 1, parents)
    parents[:, 0] = -1
    pads = torch.randint(0, pad_max + 1, (bs, 1), generator=generator).clamp(max=n - 1)
    valid = idx < (n - pads)
    parents = torch.where(valid, parents, 0)
    parents[:, 0] = -1
    return parents, valid


def oracle_indices(parents: list[int], seq_len: int):
    """Positions, next_token, next_sibling of one tree by plain loops."""
    n = len(parents)
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    children = [[j for j in range(n) if parents[j] == i] for i in range(n)]
    next_token = [c[0] if c else -1 for c in children]
    next_sibling = [-1] * n
    for i in range(1, n):
        later = [j for j in children[parents[i]] if j > i]
        next_sibling[i] = later[0] if later else -1
    return [seq_len + d for d in depth], next_token, next_sibling


def oracle_mask(parents: list[int]) -> list[list[bool]]:
    n = len(parents)
    mask = [[False] * n for _ in range(n)]
    for q in range(n):
        k = q
        while k != -1:
            mask[q][k] = True
            k = parents[k]
    return mask


# The worked example of docs/INTERNALS.md: bs=1, seq_len=10, topk=2, 2 steps, N=5.
r, A, B, C, D, E, F, Z = 50, 11, 12, 13, 14, 15, 16, 17


def worked_example_tree() -> DraftTree:
    return build_eagle_tree(
        root_tokens=torch.tensor([r]),
        step_tokens=[torch.tensor([[A, B]]), torch.tensor([[C, D, E, F]])],
        step_scores=[torch.tensor([[0.6, 0.25]]),
                     torch.tensor([[0.6 * 0.5, 0.6 * 0.4, 0.25 * 0.9, 0.25 * 0.05]])],
        step_parents=[None, torch.tensor([[0, 0, 1, 1]])],
        num_nodes=5,
        seq_lens=torch.tensor([10]),
    )


def test_worked_example_value_for_value():
    tree = worked_example_tree()
    assert tree.tokens.tolist() == [[r, A, B, C, D]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 1]]
    assert tree.positions.tolist() == [[10, 11, 11, 12, 12]]
    assert tree.retrieve_index.tolist() == [[0, 1, 2, 3, 4]]
    assert tree.retrieve_next_token.tolist() == [[1, 3, -1, -1, -1]]
    assert tree.retrieve_next_sibling.tolist() == [[-1, 2, -1, 4, -1]]
    rows = ["".join("1" if x else "0" for x in row) for row in tree.mask[0].tolist()]
    assert rows == ["10000", "11000", "10100", "11010", "11001"]
    assert tree.scores[0].tolist() == pytest.approx([1.0, 0.6, 0.25, 0.30, 0.24])

    # Greedy verify, target argmax per node [A, D, ., ., Z]: A accepted, C rejected, D accepted.
    argmax = torch.tensor([A, D, 0, 0, Z])
    logits = torch.nn.functional.one_hot(argmax, 64).float()[None]
    res = verify_greedy(tree, logits)
    assert res.accept_path.tolist() == [[0, 1, 4]]
    assert res.accept_length.tolist() == [2]
    assert res.bonus.tolist() == [Z]
    assert res.status.tolist() == [[1, 1, 0, 2, 1]]
    emitted = tree.tokens[0, res.accept_path[0, 1:]].tolist() + res.bonus.tolist()
    assert emitted == [A, D, Z]


def test_parents_mask_indices_agree_with_oracle():
    g = torch.Generator().manual_seed(1)
    for n in (1, 2, 3, 7, 16, 33):
        parents, valid = random_parents(20, n, g, pad_max=3)
        seq_lens = torch.randint(0, 1000, (20,), generator=g)
        tokens = torch.randint(0, 100, (20, n), generator=g)
        scores = torch.rand(20, n, generator=g)
        tree = DraftTree.from_parents(tokens, parents, scores, seq_lens, valid)
        for b in range(20):
            p = parents[b].tolist()
            pos, nt, ns = oracle_indices(p, int(seq_lens[b]))
            assert tree.mask[b].tolist() == oracle_mask(p)
            assert tree.positions[b].tolist() == pos
            assert tree.retrieve_next_token[b].tolist() == nt
            assert tree.retrieve_next_sibling[b].tolist() == ns
            assert tree.retrieve_index[b].tolist() == [b * n + i for i in range(n)]
        assert torch.equal(mask_to_parents(tree.mask), parents)
        assert tree.max_depth == int(tree.depth.max())
        # The same tree built from its mask has identical arrays.
        other = DraftTree.from_mask(tokens, tree.mask, scores, seq_lens, valid)
        for name in ("parents", "depth", "positions", "retrieve_index", "retrieve_next_token",
                     "retrieve_next_sibling"):
            assert torch.equal(getattr(tree, name), getattr(other, name)), name


def test_parents_to_mask_single_node_and_chain():
    assert parents_to_mask(torch.tensor([[-1]])).tolist() == [[[True]]]
    chain = torch.arange(-1, 63)[None]
    assert torch.equal(parents_to_mask(chain)[0], torch.ones(64, 64, dtype=torch.bool).tril())


@pytest.mark.parametrize(
    "parents, valid, scores, message",
    [
        ([0, 0, 1], None, None, "node 0: the root must have parent -1"),
        ([-1, 0, -1], None, None, "node 2: parent -1 makes it a second root"),
        ([-1, 0, 3, 1], None, None, "node 2: parent 3 is not an earlier node (not topological)"),
        ([-1, 0, 2], None, None, "node 2: parent 2 is not an earlier node"),
        ([-1, 0, 0, 1], [True, False, True, True], None, "node 1: padding node in the middle"),
        ([-1, 0, 1], [True, True, False], None, "node 2: padding node must hang off the root"),
        ([-1, 0], [False, True], None, "node 0: the root cannot be padding"),
        ([-1, 0, 1], None, [1.0, 0.5, math.nan], "node 2: NaN score"),
    ],
)
def test_validate_parents_names_first_fault(parents, valid, scores, message):
    kwargs = {}
    if valid is not None:
        kwargs["valid"] = torch.tensor([valid])
    if scores is not None:
        kwargs["scores"] = torch.tensor([scores])
    with pytest.raises(TreeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_tree(torch.tensor([parents]), **kwargs)


def test_validate_nan_score_on_padding_is_fine():
    validate_tree(torch.tensor([[-1, 0, 0]]), valid=torch.tensor([[True, True, False]]),
                  scores=torch.tensor([[1.0, 0.5, math.nan]]))


def _mask(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in row] for row in rows])


@pytest.mark.parametrize(
    "rows, message",
    [
        (["10000", "11000", "10100", "11110", "11001"],
         "node 3: sees node 1, which is not an ancestor of its parent 2 .a node with two parents"),
        (["1000", "1100", "1110", "1011"], "node 3: does not see node 1, an ancestor of its parent 2"),
        (["100", "110", "001"], "node 2: does not see the root"),
        (["110", "110", "101"], "node 0: sees later node 1"),
        (["100", "100", "101"], r"node 1: mask\[1\]\[1\] is False"),
    ],
)
def test_validate_mask_names_first_fault(rows, message):
    with pytest.raises(TreeError, match=message):
        validate_tree(mask=_mask(rows))


def test_validate_reports_batch_row_and_first_node():
    parents = torch.tensor([[-1, 0, 1, 2], [-1, 0, 5, 1], [-1, 3, 0, 0]])
    with pytest.raises(TreeError, match=r"node 2: parent 5 .* \(batch row 1\)"):
        validate_tree(parents)
    # Valid masks of random trees pass.
    g = torch.Generator().manual_seed(0)
    p, valid = random_parents(50, 12, g, pad_max=4)
    validate_tree(mask=parents_to_mask(p), valid=valid)
    validate_tree(p, valid=valid)


def test_constructors_reject_bad_input():
    t = torch.zeros(2, 3, dtype=torch.long)
    parents = torch.tensor([[-1, 0, 0], [-1, 0, 1]])
    with pytest.raises(ValueError, match="scores must have shape"):
        DraftTree.from_parents(t, parents, torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="seq_lens"):
        DraftTree.from_parents(t, parents, torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(TreeError, match="node 2"):
        DraftTree.from_parents(t, torch.tensor([[-1, 0, 0], [-1, 0, 2]]), torch.zeros(2, 3),
                               torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="one entry per step"):
        build_eagle_tree(torch.tensor([1]), [], [], [], 4, torch.tensor([0]))


# --- EAGLE-2 tree building -------------------------------------------------------------------


def oracle_eagle(root, step_tokens, step_scores, step_parents, n):
    """Plain-Python EAGLE-2 selection: effective score = min(score, parent's), NaN = -inf,
    best n-1 by (score desc, earlier candidate first), laid out by candidate order."""
    cands = []  # (token, eff, flat parent or -1, depth)
    offset_prev = 0
    for s, (toks, scs) in enumerate(zip(step_tokens, step_scores)):
        start = len(cands)
        for c, (tok, sc) in enumerate(zip(toks, scs)):
            sc = -math.inf if math.isnan(sc) else sc
            parent = -1 if s == 0 else offset_prev + step_parents[s][c]
            eff = sc if parent < 0 else min(sc, cands[parent][1])
            cands.append((tok, eff, parent, s + 1))
        offset_prev = start
    order = sorted(range(len(cands)), key=lambda c: (-cands[c][1], c))
    chosen = sorted(order[: n - 1])
    node_of = {c: i + 1 for i, c in enumerate(chosen)}
    tokens = [root] + [cands[c][0] for c in chosen]
    parents = [-1] + [0 if cands[c][2] < 0 else node_of[cands[c][2]] for c in chosen]
    pad = n - len(tokens)
    return tokens + [0] * pad, parents + [0] * pad, len(chosen)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_eagle_tree_matches_oracle_and_is_ancestor_closed(data):
    bs = data.draw(st.integers(1, 3))
    topk = data.draw(st.integers(1, 4))
    steps = data.draw(st.integers(1, 4))
    n = data.draw(st.integers(1, 24))
    # Scores from a small set so ties are common; NaN and inf included.
    score_values = st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.5, 1.0, math.nan, math.inf, -math.inf])
    step_tokens, step_scores, step_parents = [], [], []
    width_prev = 1
    for s in range(steps):
        frontier = 1 if s == 0 else min(topk, width_prev)
        width = frontier * topk
        step_tokens.append(torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 9), min_size=width,
                                                                         max_size=width),
                                                                min_size=bs, max_size=bs))))
        step_scores.append(torch.tensor(data.draw(st.lists(st.lists(score_values, min_size=width,
                                                                         max_size=width),
                                                                min_size=bs, max_size=bs))))
        parents = data.draw(st.lists(st.lists(st.integers(0, width_prev - 1), min_size=width,
                                              max_size=width), min_size=bs, max_size=bs))
        step_parents.append(None if s == 0 else torch.tensor(parents))
        width_prev = width
    roots = torch.arange(bs) + 100
    tree = build_eagle_tree(roots, step_tokens, step_scores, step_parents, n,
                            torch.full((bs,), 7))
    validate_tree(tree.parents, valid=tree.valid, scores=tree.scores)
    validate_tree(mask=tree.mask)
    assert tree.max_depth == steps and int(tree.depth.max()) <= steps
    for b in range(bs):
        tokens, parents, kept = oracle_eagle(
            int(roots[b]), [t[b].tolist() for t in step_tokens], [t[b].tolist() for t in step_scores],
            [None] + [p[b].tolist() for p in step_parents[1:]], n)
        assert tree.tokens[b].tolist() == tokens
        assert tree.parents[b].tolist() == parents
        assert tree.valid[b].tolist() == [True] * (kept + 1) + [False] * (n - kept - 1)


def test_eagle_tree_pads_when_too_few_candidates():
    tree = build_eagle_tree(torch.tensor([5, 6]), [torch.tensor([[1, 2], [3, 4]])],
                            [torch.tensor([[0.3, 0.7], [0.9, math.nan]])], [None], 5,
                            torch.tensor([0, 3]))
    assert tree.tokens.tolist() == [[5, 1, 2, 0, 0], [6, 3, 4, 0, 0]]
    assert tree.valid.tolist() == [[True, True, True, False, False]] * 2
    assert tree.parents.tolist() == [[-1, 0, 0, 0, 0]] * 2
    assert tree.scores[1, 2].item() == -math.inf


def test_chain_tree_equals_the_tree_built_from_its_parents():
    g = torch.Generator().manual_seed(2)
    for b, n in ((1, 1), (3, 5), (2, 2)):
        tokens = torch.randint(0, 50, (b, n), generator=g)
        scores = torch.rand(b, n, generator=g)
        seq_lens = torch.randint(0, 100, (b,), generator=g)
        parents = torch.arange(-1, n - 1).expand(b, n)
        want = DraftTree.from_parents(tokens, parents, scores, seq_lens)
        for _ in range(2):  # the second call reuses the cached structure
            got = chain_tree(tokens, scores, seq_lens)
            for name in ("tokens", "parents", "depth", "scores", "valid", "mask", "positions", "retrieve_index",
                         "retrieve_next_token", "retrieve_next_sibling", "seq_lens"):
                assert torch.equal(getattr(got, name), getattr(want, name)), (b, n, name)
            assert got.max_depth == want.max_depth
