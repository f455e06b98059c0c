"""The fused sampling verify (spectool/kernels/verify_sampling_triton.py) against the torch
reference ``verify_sampling``, under TRITON_INTERPRET=1 (unless this process started with it, the
file re-runs itself in a child pytest that does).

For the same coins both make the same decision: statuses, accept paths and lengths, bonus tokens
and the target argmax are equal; the children's probabilities and the bonus CDF agree to float32
rounding. Cases: random trees with repeated tokens, temperature alone and with top-k / top-p, tied
logits at the top-k cut, coins next to 1 (the residual's inverse CDF at its end) and trees whose
children hold all the mass (the argmax fallback). The statistical lossless test with the kernel
runs on the GPU (tests/gpu/test_verify_sampling_gpu.py): the interpreter is too slow for its trials.
"""

from __future__ import annotations

import pytest
import torch
from sampling_checks import assert_decides_as, check_residual_ends
from test_verify import random_batch

from spectool.draft.tree import DraftTree
from spectool.verify import verify_sampling, verify_sampling_fused


def test_kernels_in_an_interpreter_subprocess(triton_interpreter_child):
    triton_interpreter_child()


def assert_same_decision(tree: DraftTree, logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                         coins: torch.Tensor) -> None:
    want = verify_sampling(tree, logits, temperature, top_k, top_p, coins=coins)
    temps = torch.full((logits.shape[0],), temperature)
    assert_decides_as(verify_sampling_fused(tree, logits, temps, top_k, top_p, coins), want)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("seed", range(4))
def test_fused_equals_reference_with_temperature(seed):
    bs, n, vocab = 12, 9, 300
    tree, g = random_batch(bs, n, 6, seed)
    logits = torch.randn(bs, n, vocab, generator=g) * 3
    coins = torch.rand(bs, n, generator=g)
    assert_same_decision(tree, logits, (0.6, 1.0, 1.7, 1.0)[seed], 0, 1.0, coins)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.7), (7, 0.8)])
def test_fused_equals_reference_with_top_k_and_top_p(top_k, top_p):
    bs, n, vocab = 3, 5, 40
    tree, g = random_batch(bs, n, 6, 10 + top_k)
    logits = torch.randn(bs, n, vocab, generator=g) * 2
    # The drafted tokens among the likely ones (no two equal: a tie at the top-p cut is where the
    # two may differ), so the cut decides some of them.
    lifted = 2.5 + torch.rand(bs, n, n, generator=g)
    logits.scatter_(2, tree.tokens[:, None, :].expand(bs, n, n), lifted)
    coins = torch.rand(bs, n, generator=g)
    assert_same_decision(tree, logits, 0.8, top_k, top_p, coins)


@pytest.mark.triton_interpreter
def test_fused_keeps_ties_at_the_top_k_cut():
    bs, n, vocab = 2, 4, 24
    tree, g = random_batch(bs, n, 4, 3)
    logits = torch.randint(0, 4, (bs, n, vocab), generator=g).float()  # many equal values
    coins = torch.rand(bs, n, generator=g)
    assert_same_decision(tree, logits, 1.0, 3, 1.0, coins)


@pytest.mark.triton_interpreter
def test_fused_at_the_ends_of_the_residual():
    check_residual_ends(assert_same_decision, bs=8, n=6, vocab=64, token=7)
