"""The fused sampling verify on CUDA: the decision of the torch reference for the same coins at a
128k vocabulary (float32 and bf16 logits), and exactly lossless by the statistical test of
tests/test_verify.py with the kernel's coins."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from test_sampling_graph_gpu import on_cuda, two_tokens_with_kernel_coins  # noqa: E402
from test_verify import (  # noqa: E402
    ALPHA,
    random_batch,
)

from spectool.verify import verify_sampling, verify_sampling_fused  # noqa: E402


# bf16 logits tie often; at a top-p cut the two may keep different parts of a tie (the fused verify
# keeps it whole), so bf16 runs the settings without one.
@pytest.mark.parametrize("dtype, temperature, top_k, top_p", [
    (torch.float32, 1.0, 0, 1.0), (torch.float32, 0.7, 50, 0.9), (torch.float32, 1.0, 0, 0.8),
    (torch.bfloat16, 1.0, 0, 1.0), (torch.bfloat16, 0.7, 50, 1.0)])
def test_fused_equals_reference_at_128k(dtype, temperature, top_k, top_p):
    bs, n, vocab = 16, 16, 128256
    tree, g = random_batch(bs, n, vocab, 0)
    tree = on_cuda(tree)
    logits = (torch.randn(bs, n, vocab, generator=g) * 4).to("cuda", dtype)
    coins = torch.rand(bs, n, generator=g).cuda()
    temps = torch.full((bs,), temperature, device="cuda")
    want = verify_sampling(tree, logits, temps, top_k, top_p, coins=coins)
    got = verify_sampling_fused(tree, logits, temps, top_k, top_p, coins)
    for name in ("status", "accept_path", "accept_length", "bonus"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    torch.testing.assert_close(got.child_probs, want.child_probs, equal_nan=True, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 6, 0.85)])
def test_fused_with_kernel_coins_is_lossless_on_cuda(temperature, top_k, top_p):
    pvalue, length = two_tokens_with_kernel_coins(verify_sampling_fused, temperature, top_k, top_p, (2468, 97, 78))
    assert pvalue > ALPHA
    assert (length >= 2).float().mean() > 0.01 and (length == 0).float().mean() > 0.05
