"""Sampling on CUDA: the coins kernel equals its torch reference bit for bit, the sampling verify
step runs from its CUDA graph (no eager step), and with the kernel's coins the verify is exactly
lossless (the statistical test of tests/test_kernels_sampling.py, on the GPU)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

import numpy as np  # noqa: E402
from test_verify import ALPHA, TRIALS, VOCAB, adversarial_trees, chi_square_pvalue, emitted_tokens, exact_probs  # noqa: E402

import spectool as st  # noqa: E402
from spectool.draft.tree import DraftTree  # noqa: E402
from spectool.kernels.sampling import sampling_coins, sampling_coins_torch  # noqa: E402
from spectool.verify import verify_sampling  # noqa: E402


def on_cuda(tree: DraftTree) -> DraftTree:
    return DraftTree(**{k: v.cuda() for k, v in tree.as_inputs().items()}, max_depth=tree.max_depth)


def test_coin_kernel_matches_reference_on_cuda():
    g = torch.Generator().manual_seed(0)
    for n in (1, 12, 16, 64):
        b = 64
        seed = torch.randint(0, 2**40, (1,), generator=g)
        nonces = torch.randint(0, 2**31, (b,), generator=g)
        seq_lens = torch.randint(0, 100_000, (b,), generator=g)
        got = sampling_coins(seed.cuda(), nonces.cuda(), seq_lens.cuda(), n)
        assert torch.equal(got.cpu(), sampling_coins_torch(seed, nonces, seq_lens, n)), n


def two_tokens_with_kernel_coins(verify, temperature: float, top_k: int, top_p: float, seeds: tuple[int, int, int],
                                 device: str = "cuda") -> tuple[float, torch.Tensor]:
    """The first two emitted tokens of TRIALS seeded requests, verified by ``verify(tree, logits,
    temperatures, top_k, top_p, coins)`` with the coins kernel's coins over adversarial trees: the
    chi-square p-value of their joint counts against the target's exact distribution, and the first
    verify's accept lengths. ``seeds``: the logit table's, the trees' and the coins' seeds."""
    table_seed, tree_seed, coin_seed = seeds
    table = np.random.default_rng(table_seed).normal(0, 1.5, (VOCAB, VOCAB))
    exact = exact_probs(table, temperature, top_k, top_p)
    want = exact[3][:, None] * exact
    g = torch.Generator().manual_seed(tree_seed)
    dev = torch.device(device)
    seed, nonces = torch.tensor([coin_seed], device=dev), torch.arange(TRIALS, device=dev)
    seq_lens = torch.randint(5, 500, (TRIALS,), generator=g).to(dev)
    logits_table = torch.tensor(table, dtype=torch.float32, device=dev)
    probs_table = torch.tensor(exact, dtype=torch.float32)
    temps = torch.full((TRIALS,), temperature, device=dev)
    to_dev = (lambda tree: tree) if dev.type == "cpu" else on_cuda
    tree = to_dev(adversarial_trees(torch.full((TRIALS,), 3), probs_table, g))
    res = verify(tree, logits_table[tree.tokens], temps, top_k, top_p, sampling_coins(seed, nonces, seq_lens,
                                                                                       tree.num_nodes))
    first, second, length = emitted_tokens(tree, res)
    tree2 = to_dev(adversarial_trees(first.cpu(), probs_table, g))
    res2 = verify(tree2, logits_table[tree2.tokens], temps, top_k, top_p,
                  sampling_coins(seed, nonces, seq_lens + length + 1, tree2.num_nodes))
    second = torch.where(length >= 1, second, emitted_tokens(tree2, res2)[0])
    counts = np.bincount((first * VOCAB + second).cpu().numpy(), minlength=VOCAB * VOCAB).astype(np.float64)
    return chi_square_pvalue(counts, want.ravel() * TRIALS), length


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 6, 0.85)])
def test_sampling_with_kernel_coins_is_lossless_on_cuda(temperature, top_k, top_p):
    def torch_verify(tree, logits, temps, top_k, top_p, coins):
        return verify_sampling(tree, logits, temps, top_k, top_p, None, coins)

    pvalue, _ = two_tokens_with_kernel_coins(torch_verify, temperature, top_k, top_p, (4321, 98, 77))
    assert pvalue > ALPHA


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (50, 0.9), (0, 0.9)])
@pytest.mark.parametrize("method", ["none", "ngram", "eagle", "multi_layer_eagle"])
def test_sampling_runs_from_its_graph(demo_model_dir, method, top_k, top_p):
    target = st.load(demo_model_dir / "target", device="cuda", dtype=torch.bfloat16)
    draft = {"none": None, "ngram": st.NgramConfig(num_draft_tokens=12),
             "eagle": st.EagleConfig(demo_model_dir / "eagle", num_steps=5, topk=4, num_draft_tokens=16),
             "multi_layer_eagle": st.MultiLayerEagleConfig(demo_model_dir / "multi_layer_eagle", num_steps=4),
             }[method]
    prompt = target.encode("def fibonacci(n):\n    ")

    def run():
        # A fresh engine per run: a reused N-gram trie would draft other trees the second time, and
        # other trees spend the same coins on other decisions (each output is still exact).
        engine = st.Engine(target, draft=draft, max_batch_size=2, max_seq_len=256)
        engine.warmup(record=False, top_k=top_k, top_p=top_p)
        return engine.generate([prompt, prompt], max_new_tokens=64, temperature=1.0, top_k=top_k, top_p=top_p,
                               seed=5, ignore_eos=True, record=False)

    runs = [run() for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids, "equal seeds must give equal outputs"
    assert runs[0].token_ids[0] != runs[0].token_ids[1], "two requests must draw different coins"
    for run in runs:
        graphs = run.stats.graphs
        assert graphs["eager"] == 0 and graphs["replays"] > 0 and graphs["captures"] == 0
