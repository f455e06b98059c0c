"""Triton kernels against their torch references on CUDA, in bfloat16 (the decode dtype)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from spectool.kernels import attention_triton as attn  # noqa: E402
from spectool.kernels import fused  # noqa: E402


def tree_mask(B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor masks of random trees in topological order."""
    mask = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            mask[b, i, i] = True
            if i:
                mask[b, i] |= mask[b, int(torch.randint(0, i, (1,), generator=gen))]
    return mask


@pytest.mark.parametrize("B,T,Hq,Hkv,D,with_mask", [
    (1, 1, 32, 8, 128, False),   # 8B decode
    (8, 1, 32, 8, 64, False),    # 1B decode, batch 8
    (2, 16, 32, 8, 128, True),   # tree verify
    (4, 64, 32, 8, 64, True),    # the largest tree
    (3, 7, 12, 4, 80, False),
])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_attention_matches_reference(B, T, Hq, Hkv, D, with_mask, dtype, tol):
    gen = torch.Generator().manual_seed(T * 7 + D)
    max_seq = 1500
    kc = torch.randn(8, Hkv, max_seq, D, generator=gen).to(dtype).cuda()
    vc = torch.randn(8, Hkv, max_seq, D, generator=gen).to(dtype).cuda()
    q = torch.randn(B, T, Hq, D, generator=gen).to(dtype).cuda()
    slots = torch.randperm(8, generator=gen)[:B].cuda()
    starts = torch.randint(0, max_seq - T, (B,), generator=gen).cuda()
    mask = tree_mask(B, T, gen).cuda() if with_mask else None
    ref = attn.cached_attention_reference(q, kc, vc, slots, starts, mask)
    for splits in (None, 1, 5):
        out = attn.cached_attention_triton(q, kc, vc, slots, starts, mask, num_splits=splits)
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_attention_in_a_cuda_graph_follows_starts_on_device():
    gen = torch.Generator().manual_seed(0)
    kc = torch.randn(2, 8, 2048, 128, generator=gen).bfloat16().cuda()
    vc = torch.randn(2, 8, 2048, 128, generator=gen).bfloat16().cuda()
    q = torch.randn(2, 1, 32, 128, generator=gen).bfloat16().cuda()
    slots = torch.tensor([1, 0], device="cuda")
    starts = torch.tensor([10, 100], device="cuda")
    attn.cached_attention_triton(q, kc, vc, slots, starts)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.cached_attention_triton(q, kc, vc, slots, starts)
    for new_starts in ([10, 100], [1500, 3], [0, 2047]):
        starts.copy_(torch.tensor(new_starts))
        graph.replay()
        ref = attn.cached_attention_reference(q, kc, vc, slots, starts)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_fused_ops_bf16_match_references():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4096, generator=gen).bfloat16().cuda()
    r = torch.randn(8, 4096, generator=gen).bfloat16().cuda()
    w = (1 + 0.1 * torch.randn(4096, generator=gen)).bfloat16().cuda()
    pairs = zip(fused.add_rms_norm_triton(x, r, w, 1e-5), fused.add_rms_norm_reference(x, r, w, 1e-5))
    for got, ref in pairs:
        torch.testing.assert_close(got.float(), ref.float(), atol=1e-2, rtol=1e-2)
    gate_up = torch.randn(8, 2 * 14336, generator=gen).bfloat16().cuda()
    torch.testing.assert_close(fused.silu_mul_triton(gate_up).float(),
                               fused.silu_mul_reference(gate_up).float(), atol=1e-2, rtol=1e-2)
    logits = torch.randn(8, 128256, generator=gen).cuda()
    logits[3, 5] = logits[3, 100000] = 99.0
    assert torch.equal(fused.argmax_triton(logits), logits.argmax(-1))
    B, T, Hq, Hkv, D = 2, 3, 32, 8, 128
    qkv = torch.randn(B, T, (Hq + 2 * Hkv) * D, generator=gen).bfloat16().cuda()
    q, k, v = (t.view(B, T, -1, D) for t in qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1))
    ang = (torch.rand(B, T, D // 2, generator=gen) * 6).cuda()
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    kc, vc = torch.zeros(4, Hkv, 64, D).bfloat16().cuda(), torch.zeros(4, Hkv, 64, D).bfloat16().cuda()
    kr, vr = kc.clone(), vc.clone()
    slots, starts = torch.tensor([3, 1], device="cuda"), torch.tensor([0, 61], device="cuda")
    got = fused.rope_write_kv_triton(q, k, v, cos, sin, kc, vc, slots, starts)
    ref = fused.rope_write_kv_reference(q, k, v, cos, sin, kr, vr, slots, starts)
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(kc.float(), kr.float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(vc, vr)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_prefill_attention_from_index_0_matches_reference(dtype, tol):
    """A prefill's attention (starts 0, kv_len = T, no tree mask) takes SDPA's causal path on CUDA;
    it must attend as the masked reference does, padded rows and GQA included."""
    from spectool.kernels import ops

    gen = torch.Generator().manual_seed(3)
    B, T, Hq, Hkv, D = 3, 200, 8, 2, 64
    kc = torch.randn(4, Hkv, 512, D, generator=gen).to(dtype).cuda()
    vc = torch.randn(4, Hkv, 512, D, generator=gen).to(dtype).cuda()
    q = torch.randn(B, T, Hq, D, generator=gen).to(dtype).cuda()
    slots = torch.tensor([2, 0, 3], device="cuda")
    starts = torch.zeros(B, dtype=torch.long, device="cuda")
    ref = attn.cached_attention_reference(q, kc, vc, slots, starts)
    out = ops.cached_attention(q, kc, vc, slots, starts, None, T)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_prefill_reads_the_keys_it_wrote_as_the_cache_holds_them(dtype, tol):
    """A prefill from index 0 attends over the rotated keys as written, without reading the cache back:
    the same cache and the same output, to the bit, as the RoPE-and-write kernel then the attention
    over the cache; and close to the torch reference. Padded rows and GQA included."""
    from spectool.kernels import ops

    gen = torch.Generator().manual_seed(4)
    B, T, Hq, Hkv, D = 3, 200, 8, 2, 64
    kc = torch.randn(4, Hkv, 512, D, generator=gen).to(dtype).cuda()
    vc = torch.randn(4, Hkv, 512, D, generator=gen).to(dtype).cuda()
    qkv = torch.randn(B, T, Hq + 2 * Hkv, D, generator=gen).to(dtype).cuda()
    q, k, v = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hkv], qkv[:, :, Hq + Hkv:]
    angle = torch.rand(B, T, D // 2, generator=gen) * 6.3
    cos, sin = angle.cos().to(dtype).cuda(), angle.sin().to(dtype).cuda()
    slots = torch.tensor([2, 0, 3], device="cuda")
    starts = torch.zeros(B, dtype=torch.long, device="cuda")
    got_k, got_v = kc.clone(), vc.clone()
    got = ops.rope_cached_attention(q, k, v, cos, sin, got_k, got_v, slots, starts, None, T)
    read_k, read_v = kc.clone(), vc.clone()
    q_rot = ops.rope_write_kv(q, k, v, cos, sin, read_k, read_v, slots, starts)
    read = ops.cached_attention(q_rot, read_k, read_v, slots, starts, None, T)
    assert torch.equal(got_k, read_k) and torch.equal(got_v, read_v)
    assert torch.equal(got, read)
    ref_k, ref_v = kc.clone(), vc.clone()
    ref = attn.rope_cached_attention_reference(q, k, v, cos, sin, ref_k, ref_v, slots, starts)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("B,Hq,Hkv,D", [(1, 32, 8, 128), (1, 32, 8, 64), (8, 32, 8, 64), (3, 12, 4, 80)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_in_attention_gives_the_bits_of_rope_then_attention(B, Hq, Hkv, D, dtype):
    # A decode step's attention with RoPE and the cache write inside it against the two launches it
    # replaces (the RoPE kernel, then the attention): the same output and cache, bit for bit, eager and
    # in a CUDA graph; and close to the torch references.
    gen = torch.Generator().manual_seed(B + D)
    max_seq = 1500
    kc = torch.randn(8, Hkv, max_seq, D, generator=gen).to(dtype).cuda()
    vc = torch.randn(8, Hkv, max_seq, D, generator=gen).to(dtype).cuda()
    qkv = torch.randn(B, 1, Hq + 2 * Hkv, D, generator=gen).to(dtype).cuda()
    q, k, v = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hkv], qkv[:, :, Hq + Hkv:]
    angle = torch.rand(B, 1, D // 2, generator=gen) * 6.3
    cos, sin = angle.cos().to(dtype).cuda(), angle.sin().to(dtype).cuda()
    slots = torch.randperm(8, generator=gen)[:B].cuda()
    starts = torch.randint(0, max_seq - 1, (B,), generator=gen).cuda()
    apart_k, apart_v = kc.clone(), vc.clone()
    q_rot = fused.rope_write_kv_triton(q, k, v, cos, sin, apart_k, apart_v, slots, starts)
    apart = attn.cached_attention_triton(q_rot, apart_k, apart_v, slots, starts)
    ref_k, ref_v = kc.clone(), vc.clone()
    ref = attn.rope_cached_attention_reference(q, k, v, cos, sin, ref_k, ref_v, slots, starts)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(apart.float(), ref.float(), atol=tol, rtol=tol)
    eager_k, eager_v = kc.clone(), vc.clone()
    eager = attn.rope_cached_attention_triton(q, k, v, cos, sin, eager_k, eager_v, slots, starts)
    graph_k, graph_v = kc.clone(), vc.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = attn.rope_cached_attention_triton(q, k, v, cos, sin, graph_k, graph_v, slots, starts)
    graph.replay()
    torch.cuda.synchronize()
    for out, k_cache, v_cache in ((eager, eager_k, eager_v), (graphed, graph_k, graph_v)):
        assert torch.equal(out, apart)
        assert torch.equal(k_cache, apart_k) and torch.equal(v_cache, apart_v)
