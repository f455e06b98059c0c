"""What the Triton sampling verifies are checked against, shared by their interpreter tests: the
torch reference's decision for the same coins, and the edge cases at the ends of the residual."""

from __future__ import annotations

from collections.abc import Callable

import torch
from test_verify import random_batch

from spectool.draft.tree import DraftTree

EXACT = ("status", "accept_path", "accept_length", "bonus", "target_argmax")


def assert_decides_as(got, want) -> None:
    """A kernel's verify result makes the reference's decision: statuses, accept paths and lengths,
    bonus tokens and the target argmax equal, coins, children's probabilities and the bonus CDF
    equal to float32 rounding."""
    for name in EXACT:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.coins.isnan(), want.coins.isnan())
    assert torch.allclose(got.coins.nan_to_num(), want.coins.nan_to_num())
    torch.testing.assert_close(got.child_probs, want.child_probs, equal_nan=True, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.bonus_cdf, want.bonus_cdf, rtol=1e-5, atol=1e-6)


Decide = Callable[[DraftTree, torch.Tensor, float, int, float, torch.Tensor], None]


def check_residual_ends(decide: Decide, bs: int, n: int, vocab: int, token: int,
                        decide_peaked: Decide | None = None) -> None:
    """Coins next to 1 (the bonus is the residual's last tokens, or past its total by rounding), with
    and without top-k and top-p, and
    top-k 1 with the argmax `token` drafted under every node (the children hold all the mass).
    ``decide(tree, logits, temperature, top_k, top_p, coins)`` asserts the kernel decides as the
    reference; ``decide_peaked`` (default ``decide``) does so for the peaked logits."""
    tree, g = random_batch(bs, n, vocab, 21, pad_max=0)
    logits = torch.randn(bs, n, vocab, generator=g)
    decide(tree, logits, 1.0, 0, 1.0, torch.full((bs, n), 1 - 2**-24))
    decide(tree, logits, 1.0, 20, 0.9, torch.full((bs, n), 1 - 2**-24))  # past the kept tokens' total
    argmax_tree = DraftTree.from_parents(
        torch.full((bs, n), token), tree.parents, tree.scores, tree.seq_lens, tree.valid)
    peaked = logits.clone()
    peaked[..., token] = 10.0
    (decide_peaked or decide)(argmax_tree, peaked, 1.0, 1, 1.0, torch.rand(bs, n, generator=g))
