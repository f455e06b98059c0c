"""The tree-index kernel: the Triton kernel (run on CPU through the Triton interpreter: unless
this process started with TRITON_INTERPRET=1, the file re-runs itself in a child pytest that
does, conftest.py) against the torch reference, and both against indices built straight from
parents."""

from __future__ import annotations

import pytest
import torch
from test_tree import random_parents

from spectool.draft.tree import DraftTree, parents_to_mask
from spectool.kernels import reconstruct_indices_from_tree_mask
from spectool.kernels.tree_indices import reconstruct_indices_torch, reconstruct_indices_triton


def test_reference_equals_indices_from_parents():
    g = torch.Generator().manual_seed(3)
    for bs, n in ((1, 1), (7, 5), (256, 16), (64, 64)):
        parents, valid = random_parents(bs, n, g, pad_max=2)
        seq_lens = torch.randint(0, 5000, (bs,), generator=g)
        tree = DraftTree.from_parents(torch.zeros(bs, n, dtype=torch.long), parents, torch.zeros(bs, n),
                                      seq_lens, valid)
        got = reconstruct_indices_from_tree_mask(parents_to_mask(parents), seq_lens, with_parents=True)
        for name, value in zip(("positions", "retrieve_index", "retrieve_next_token",
                                "retrieve_next_sibling", "parents"), got):
            assert value.dtype == torch.int64
            assert torch.equal(value, getattr(tree, name)), name


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match=r"\[B, N, N\]"):
        reconstruct_indices_torch(torch.ones(2, 3, 4, dtype=torch.bool), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="torch.bool"):
        reconstruct_indices_torch(torch.ones(2, 3, 3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="seq_lens"):
        reconstruct_indices_torch(torch.ones(2, 3, 3, dtype=torch.bool), torch.zeros(3, dtype=torch.long))


def test_kernels_in_an_interpreter_subprocess(triton_interpreter_child):
    triton_interpreter_child()


@pytest.mark.triton_interpreter
def test_triton_kernel_matches_reference():
    g = torch.Generator().manual_seed(11)
    for bs, n in ((1, 1), (3, 2), (5, 7), (256, 8), (17, 16), (4, 33), (256, 64)):
        parents, _ = random_parents(bs, n, g, pad_max=3)
        mask = parents_to_mask(parents)
        seq_lens = torch.randint(0, 10**6, (bs,), generator=g)
        want = reconstruct_indices_torch(mask, seq_lens)
        # Called directly: on CPU tensors a @triton.jit kernel only runs through the interpreter.
        got = reconstruct_indices_triton(mask, seq_lens)
        for w, t in zip(want, got):
            assert t.dtype == torch.int64 and torch.equal(w, t), (bs, n, w, t)
        # With TRITON_INTERPRET=1 the public entry point takes the Triton path on CPU too.
        for w, t in zip(want, reconstruct_indices_from_tree_mask(mask, seq_lens)):
            assert torch.equal(w, t)
        # The parents the kernel finds on the way are the tree's parents.
        assert torch.equal(reconstruct_indices_triton(mask, seq_lens, with_parents=True)[4], parents)
