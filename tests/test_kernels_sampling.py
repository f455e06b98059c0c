"""The sampling verify's coins (spectool/kernels/sampling.py).

- The Triton kernel equals its torch reference bit for bit (under TRITON_INTERPRET=1: unless
  this process started with it, the file re-runs itself in a child pytest that does), and the
  reference equals Triton's own ``tl.rand`` on the same key and counters.
- The coins are uniform and fresh: a Kolmogorov-Smirnov test on many of them, no request's
  coins of one iteration repeated by another request or iteration.
- Sampling verify with these coins (the reference's) is exactly lossless: the statistical test of
  tests/test_verify.py (adversarial trees, chi-square on the first two emitted tokens), with
  each trial a request of its own nonce and its second iteration one token further on.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_verify import ALPHA, TRIALS, VOCAB, adversarial_trees, chi_square_pvalue, emitted_tokens, exact_probs

from spectool.kernels.sampling import philox_uniform_torch, sampling_coins, sampling_coins_torch
from spectool.verify import verify_sampling


def test_kernels_in_an_interpreter_subprocess(triton_interpreter_child):
    triton_interpreter_child()


@pytest.mark.triton_interpreter
def test_coin_kernel_matches_reference():
    g = torch.Generator().manual_seed(0)
    for n in (1, 5, 16, 64, 70):
        b = 6
        seed = torch.randint(0, 2**40, (1,), generator=g)
        nonces = torch.cat([torch.tensor([0, 2**31 - 1]), torch.randint(0, 2**31, (b - 2,), generator=g)])
        seq_lens = torch.randint(0, 100_000, (b,), generator=g)
        got = sampling_coins(seed, nonces, seq_lens, n)
        assert got.shape == (b, n) and got.dtype == torch.float32
        assert torch.equal(got, sampling_coins_torch(seed, nonces, seq_lens, n)), n


@pytest.mark.triton_interpreter
def test_reference_equals_triton_rand():
    import triton
    import triton.language as tl

    @triton.jit
    def rand_kernel(out, key, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(out + i, tl.rand(key, (i * 7919 + 12345).to(tl.int32)))

    for key in (0, 1, 2**32 + 5, 123456789 * 2**32 + 987654321):
        out = torch.empty(256)
        rand_kernel[(1,)](out, key, BLOCK=256)
        counters = torch.arange(256) * 7919 + 12345
        assert torch.equal(out, philox_uniform_torch(torch.tensor(key), counters)), key


def test_coins_are_uniform_and_never_repeat():
    b, n, iterations = 32, 16, 40
    seed = torch.tensor([2024])
    nonces = torch.arange(b)
    seq_lens = torch.randint(10, 50, (b,), generator=torch.Generator().manual_seed(1))
    draws = []
    for _ in range(iterations):
        draws.append(sampling_coins(seed, nonces, seq_lens, n))
        seq_lens = seq_lens + torch.randint(1, n + 1, (b,))  # an iteration gains accept length + 1
    rows = torch.cat(draws)
    # A reused key and counter would repeat a whole row (one request's coins of one iteration).
    assert rows.unique(dim=0).shape[0] == rows.shape[0], "coins repeated across requests or iterations"
    coins = rows.flatten().double().sort().values
    assert coins.min() >= 0 and coins.max() < 1
    # Kolmogorov-Smirnov against U[0, 1): at alpha 1e-4 the critical value is about 2.15 / sqrt(n).
    k = coins.numel()
    ecdf = torch.arange(1, k + 1, dtype=torch.float64) / k
    d = torch.maximum(ecdf - coins, coins - (ecdf - 1 / k)).max().item()
    assert d < 2.15 / k ** 0.5
    # Another seed gives other coins; the same inputs the same ones.
    first = sampling_coins(seed, nonces, torch.zeros(b, dtype=torch.long), n)
    assert torch.equal(first, sampling_coins(seed, nonces, torch.zeros(b, dtype=torch.long), n))
    other = sampling_coins(seed + 1, nonces, torch.zeros(b, dtype=torch.long), n)
    assert (first != other).float().mean() > 0.99


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 6, 0.85)])
def test_sampling_with_these_coins_is_lossless(temperature, top_k, top_p):
    rng = np.random.default_rng(4321)
    table = rng.normal(0, 1.5, (VOCAB, VOCAB))
    exact = exact_probs(table, temperature, top_k, top_p)
    root = 3
    want = exact[root][:, None] * exact

    g = torch.Generator().manual_seed(98)
    seed = torch.tensor([77])
    nonces = torch.arange(TRIALS)
    seq_lens = torch.randint(5, 500, (TRIALS,), generator=g)
    logits_table = torch.tensor(table, dtype=torch.float32)
    probs_table = torch.tensor(exact, dtype=torch.float32)
    temps = torch.full((TRIALS,), temperature)
    tree = adversarial_trees(torch.full((TRIALS,), root), probs_table, g)
    # The reference (the kernel equals it bit for bit, above), so the interpreter child stays quick.
    coins = sampling_coins_torch(seed, nonces, seq_lens, tree.num_nodes)
    res = verify_sampling(tree, logits_table[tree.tokens], temps, top_k, top_p, coins=coins)
    first, second, length = emitted_tokens(tree, res)
    tree2 = adversarial_trees(first, probs_table, g)
    coins2 = sampling_coins_torch(seed, nonces, seq_lens + length + 1, tree2.num_nodes)
    res2 = verify_sampling(tree2, logits_table[tree2.tokens], temps, top_k, top_p, coins=coins2)
    second = torch.where(length >= 1, second, emitted_tokens(tree2, res2)[0])

    counts = np.bincount((first * VOCAB + second).numpy(), minlength=VOCAB * VOCAB).astype(np.float64)
    assert chi_square_pvalue(counts, want.ravel() * TRIALS) > ALPHA
    assert (length >= 2).float().mean() > 0.01 and (length == 0).float().mean() > 0.05
