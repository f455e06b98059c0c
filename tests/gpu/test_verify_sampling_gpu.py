"""The fused and the chunked sampling verifies on CUDA: the decision of the torch reference for the
same coins at a 128k vocabulary (float32 and bf16 logits, bs 1 and 16; the engine's launch shapes
of the chunked one at every cut, the others at one top-k and one top-p cut), and exactly lossless
by the statistical test of tests/test_verify.py with the kernel's coins."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from test_sampling_graph_gpu import on_cuda, two_tokens_with_kernel_coins  # noqa: E402
from test_verify import (  # noqa: E402
    ALPHA,
    random_batch,
)

from spectool.kernels.verify_sampling_chunked import (  # noqa: E402
    CONFIGS,
    DEFAULT_CONFIG,
    FEW_ROWS_CONFIG,
    ONE_TREE_CONFIG,
)
from spectool.verify import (  # noqa: E402
    target_probs_at,
    verify_sampling,
    verify_sampling_chunked,
    verify_sampling_fused,
)

# The launch shapes the engine takes (``default_config``).
ENGINE_CONFIGS = [ONE_TREE_CONFIG, FEW_ROWS_CONFIG, DEFAULT_CONFIG]


def case_at_128k(bs: int, dtype: torch.dtype, temperature: float, scale: float = 4.0):
    tree, g = random_batch(bs, 16, 128256, 0)
    tree = on_cuda(tree)
    logits = (torch.randn(bs, 16, 128256, generator=g) * scale).to("cuda", dtype)
    coins = torch.rand(bs, 16, generator=g).cuda()
    return tree, logits, coins, torch.full((bs,), temperature, device="cuda")


def assert_decision(got, want, rtol=1e-4):
    for name in ("status", "accept_path", "accept_length", "bonus"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    torch.testing.assert_close(got.child_probs, want.child_probs, equal_nan=True, rtol=rtol, atol=1e-6)


# bf16 logits tie often; at a top-p cut the fused verify keeps a tie whole where the reference keeps
# its lowest ids, so bf16 runs it on the settings without one.
@pytest.mark.parametrize("dtype, temperature, top_k, top_p", [
    (torch.float32, 1.0, 0, 1.0), (torch.float32, 0.7, 50, 0.9), (torch.float32, 1.0, 0, 0.8),
    (torch.bfloat16, 1.0, 0, 1.0), (torch.bfloat16, 0.7, 50, 1.0)])
def test_fused_equals_reference_at_128k(dtype, temperature, top_k, top_p):
    tree, logits, coins, temps = case_at_128k(16, dtype, temperature)
    want = verify_sampling(tree, logits, temps, top_k, top_p, coins=coins)
    assert_decision(verify_sampling_fused(tree, logits, temps, top_k, top_p, coins), want)


def near_the_top_p_cut(logits: torch.Tensor, temps: torch.Tensor, top_k: int, top_p: float,
                       tol: float = 1e-5) -> torch.Tensor:
    """[B, N, V]: the tokens whose mass before them (ranked as the reference ranks them, summed in
    float64 over the same float32 values) is within ``tol`` of ``top_p``. Whether such a token is
    kept turns on the float32 rounding of that sum, which no two summation orders share. Without a
    top-p cut there is none: every token's place is exact."""
    if top_p >= 1:
        return torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    x = (logits.float() / temps.float().view(-1, 1, 1)).double()
    if 0 < top_k < x.shape[-1]:
        x = x.masked_fill(x < x.topk(top_k, dim=-1).values[..., -1:], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    near = ((sorted_p.cumsum(-1) - sorted_p) - top_p).abs() < tol
    return torch.zeros_like(near).scatter(-1, order, near)


# The chunked verify keeps the reference's tie rule at both cuts (the interpreter tests build ties
# at each), so bf16 runs with top-k and top-p too; top-p alone over 100k tied bf16 values would put
# the cut where the two float32 sums of the mass before it may round apart, so it runs on float32.
@pytest.mark.parametrize("config", ENGINE_CONFIGS)
@pytest.mark.parametrize("bs", [1, 16])
@pytest.mark.parametrize("dtype, temperature, top_k, top_p", [
    (torch.float32, 1.0, 0, 1.0), (torch.float32, 0.7, 50, 0.9), (torch.float32, 1.0, 0, 0.8),
    (torch.bfloat16, 1.0, 0, 1.0), (torch.bfloat16, 0.7, 50, 0.9), (torch.float32, 0.7, 50, 1.0)])
def test_chunked_equals_reference_at_128k(config, bs, dtype, temperature, top_k, top_p):
    assert_chunked_as_reference(*case_at_128k(bs, dtype, temperature), top_k, top_p, config)


# The shapes only benchmarks take (``--sampling-configs``): each on the two paths a cut can take,
# the candidates of top-k and the row search of top-p alone. Every launch shape compiles its own
# kernels, so all of them at every case above took most of this file's time.
@pytest.mark.parametrize("config", sorted(set(CONFIGS) - set(ENGINE_CONFIGS)))
@pytest.mark.parametrize("bs, temperature, top_k, top_p", [(16, 0.7, 50, 0.9), (1, 1.0, 0, 0.8)])
def test_every_launch_shape_equals_reference_at_128k(config, bs, temperature, top_k, top_p):
    assert_chunked_as_reference(*case_at_128k(bs, torch.float32, temperature), top_k, top_p, config)


@pytest.mark.parametrize("config", ["c1024-p16-w4-g128", "c2048-p16-w4-g128", "c1024-p16-w4-g128-pw16",
                                    "c1024-p16-w4-g128-sp2", "c1024-p16-w4-g128-m2-fused-pw16-sp2",
                                    "c1024-p16-w4-g128-sp2g", "c1024-p16-w4-g128-m2-fused-pw16-sp2g"])
@pytest.mark.parametrize("bs", [1, 16])
def test_chunked_top_p_over_a_flat_row_equals_reference_at_128k(config, bs):
    # The sampling benchmark's logits: top-p 0.9 keeps about 14,000 tokens of each row, far more than
    # the candidate buffer, so the cut search narrows the range over the row and searches its copy.
    assert_chunked_as_reference(*case_at_128k(bs, torch.float32, 0.8, scale=2.0), 0, 0.9, config)


def assert_chunked_as_reference(tree, logits, coins, temps, top_k, top_p, config):
    want = verify_sampling(tree, logits, temps, top_k, top_p, coins=coins)
    got = verify_sampling_chunked(tree, logits, temps, top_k, top_p, coins, config)
    assert_decision(got, want)
    assert torch.equal(got.target_argmax, want.target_argmax)
    # The rows keep exactly the reference's tokens, but for one whose place at the top-p cut is
    # decided by float32 rounding; every row without such a token has the reference's probabilities.
    ids = torch.arange(logits.shape[-1], device="cuda").expand(logits.shape).contiguous()
    probs = target_probs_at(logits, temps, got.target_rows, ids)
    differ = (probs > 0) != (want.target_probs > 0)
    assert not (differ & ~near_the_top_p_cut(logits, temps, top_k, top_p)).any()
    same = ~differ.any(-1)
    assert same.float().mean() > 0.9
    torch.testing.assert_close(probs[same], want.target_probs[same], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("verify", [verify_sampling_fused, verify_sampling_chunked])
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 6, 0.85), (1.0, 0, 0.7)])
def test_kernel_verify_with_kernel_coins_is_lossless_on_cuda(verify, temperature, top_k, top_p):
    pvalue, length = two_tokens_with_kernel_coins(verify, temperature, top_k, top_p, (2468, 97, 78))
    assert pvalue > ALPHA
    assert (length >= 2).float().mean() > 0.01 and (length == 0).float().mean() > 0.05
