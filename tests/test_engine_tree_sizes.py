"""The trees the engine captures N-gram's second graph of a bucket with (engine._roots_alone,
engine._roots_and_padding) are laid out exactly as the drafter's own trees of that size, so the
graph captured ahead is the one later iterations replay (tests/gpu/test_ngram_tree_sizes_gpu.py
checks the captures themselves on CUDA)."""

from __future__ import annotations

import numpy as np
import torch

from spectool.draft.tree import MaskTree
from spectool.engine import _roots_alone, _roots_and_padding
from spectool.native import NgramCorpus

N = 6


def trie_trees(tails: list[list[int]]) -> MaskTree:
    """The trie's trees for ``tails`` after it has seen one short text, as tensors of its dtypes."""
    corpus = NgramCorpus(num_draft_tokens=N)
    corpus.batch_put([[5, 6, 7, 5, 6, 8, 9]])
    corpus.synchronize()
    got = corpus.batch_get(None, tails, None)
    return MaskTree(torch.from_numpy(got.tokens), torch.from_numpy(got.scores), torch.from_numpy(got.mask),
                    torch.from_numpy(got.valid), torch.tensor([len(t) for t in tails]), max_depth=N - 1)


def assert_same_tree(a: MaskTree, b: MaskTree) -> None:
    for name, x in a.as_inputs().items():
        y = getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x, y), name


def test_roots_and_padding_is_the_tree_of_rows_without_a_match():
    unmatched = trie_trees([[1, 2], [3]])  # tails ending in tokens the trie never saw
    assert not unmatched.valid[:, 1:].any()
    assert_same_tree(_roots_and_padding(_roots_alone(unmatched), N), unmatched)


def test_roots_alone_keeps_the_roots_of_a_whole_tree():
    matched = trie_trees([[5], [1, 6]])
    assert matched.valid[:, 1:].any(dim=1).all()
    alone = _roots_alone(matched)
    assert alone.tokens.shape == (2, 1) and alone.mask.shape == (2, 1, 1)
    assert np.array_equal(alone.tokens[:, 0].numpy(), [5, 6])
    assert alone.valid.all() and alone.mask.all()
