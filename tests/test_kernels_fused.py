"""Fused Triton kernels against their torch references, on the CPU via TRITON_INTERPRET=1.

Same arrangement as test_kernels_attention.py: unless this process started with
TRITON_INTERPRET=1 the file re-runs itself in a child pytest that does. float32 and
float16 must match closely; the interpreter truncates float32 -> bfloat16 where the GPU
rounds to nearest, so bfloat16 is allowed one bfloat16 step here (exact on the GPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")
in_interpreter = pytest.mark.triton_interpreter  # skipped here, run by the launcher below (conftest.py)


def test_kernels_in_an_interpreter_subprocess(triton_interpreter_child):
    triton_interpreter_child()


from spectool.kernels import fused  # noqa: E402  (after the importorskip)

DTYPES = [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)]


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@in_interpreter
def test_kernels_really_run_in_the_interpreter():
    assert type(fused._add_rms_norm_kernel).__name__ == "InterpretedFunction"


@in_interpreter
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("hidden", [64, 200])
def test_add_rms_norm(dtype, tol, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(2, 3, hidden, generator=gen).to(dtype)
    res = torch.randn(2, 3, hidden, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    normed, summed = fused.add_rms_norm_triton(x, res, w, 1e-5)
    ref_normed, ref_summed = fused.add_rms_norm_reference(x, res, w, 1e-5)
    close(normed, ref_normed, tol)
    close(summed, ref_summed, tol)
    # Independent oracle: torch's own RMSNorm on the float32 sum.
    s = x.float() + res.float()
    close(normed.float(), F.rms_norm(s, (hidden,), w.float(), 1e-5), 4 * tol)
    plain, same = fused.add_rms_norm_triton(x, None, w, 1e-5)
    close(plain, fused.add_rms_norm_reference(x, None, w, 1e-5)[0], tol)
    assert same is x or torch.equal(same, x)


@in_interpreter
def test_rms_norm_pair_writes_both_halves():
    from spectool.kernels import ops

    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(2, 3, 64, generator=gen), torch.randn(2, 3, 64, generator=gen)
    wa, wb = 1 + 0.1 * torch.randn(64, generator=gen), 1 + 0.1 * torch.randn(64, generator=gen)
    out = torch.empty(2, 3, 128)
    fused.add_rms_norm_triton(a, None, wa, 1e-5, out=out[..., :64])
    fused.add_rms_norm_triton(b, None, wb, 1e-5, out=out[..., 64:])
    expected = torch.cat([F.rms_norm(a, (64,), wa, 1e-5), F.rms_norm(b, (64,), wb, 1e-5)], -1)
    close(out, expected, 1e-5)
    close(ops.rms_norm_pair(a, wa, b, wb, 1e-5), expected, 1e-5)  # the torch path on CPU tensors
    with pytest.raises(ValueError, match="out must have"):
        fused.add_rms_norm_triton(a, None, wa, 1e-5, out=torch.empty(2, 3, 32))


def rope_inputs(B, T, Hq, Hkv, D, dtype, gen):
    # q, k, v as views into one fused qkv projection output, like the model produces.
    qkv = torch.randn(B, T, (Hq + 2 * Hkv) * D, generator=gen).to(dtype)
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    angles = torch.rand(B, T, D // 2, generator=gen) * 6.3
    return (q.view(B, T, Hq, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D),
            angles.cos().to(dtype), angles.sin().to(dtype))


@in_interpreter
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rope(dtype, tol):
    gen = torch.Generator().manual_seed(5)
    q, k, _, cos, sin = rope_inputs(2, 3, 8, 2, 32, dtype, gen)
    q_rot, k_rot = fused.rope_triton(q, k, cos, sin)
    ref_q, ref_k = fused.rope_reference(q, k, cos, sin)
    close(q_rot, ref_q, tol)
    close(k_rot, ref_k, tol)
    # Independent oracle: a rotation of each (x_i, x_{i+D/2}) pair keeps its length.
    pair_norm = q.float()[..., :16] ** 2 + q.float()[..., 16:] ** 2
    close(q_rot.float()[..., :16] ** 2 + q_rot.float()[..., 16:] ** 2, pair_norm, 30 * tol)


@in_interpreter
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rope_write_kv(dtype, tol):
    gen = torch.Generator().manual_seed(6)
    B, T, Hq, Hkv, D, max_seq = 3, 4, 4, 2, 16, 12
    q, k, v, cos, sin = rope_inputs(B, T, Hq, Hkv, D, dtype, gen)
    slots, starts = torch.tensor([2, 0, 3]), torch.tensor([0, 5, 10])  # row 2 runs past the end
    caches = [torch.randn(4, Hkv, max_seq, D, generator=gen).to(dtype) for _ in range(2)]
    kc, vc = caches[0].clone(), caches[1].clone()
    ref_kc, ref_vc = caches[0].clone(), caches[1].clone()
    # cos and sin as the model passes them: two halves of one gathered [B, T, 2, D/2] table.
    both = torch.stack([cos, sin], dim=2)
    q_rot = fused.rope_write_kv_triton(q, k, v, both[..., 0, :], both[..., 1, :], kc, vc, slots, starts)
    ref_q = fused.rope_write_kv_reference(q, k, v, cos, sin, ref_kc, ref_vc, slots, starts)
    close(q_rot, ref_q, tol)
    close(kc, ref_kc, tol)
    assert torch.equal(vc, ref_vc)
    # Everything outside the written indices is untouched (slot 1 entirely).
    assert torch.equal(kc[1], caches[0][1]) and torch.equal(kc[2, :, T:], caches[0][2, :, T:])


@in_interpreter
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rope_write_kv_keeps_the_rotated_k_it_wrote(dtype, tol):
    # A prefill's attention reads its keys from k_rot instead of the cache: they must be the cache's
    # values exactly, in its dtype, for every row (a row run past the cache's end keeps them all).
    gen = torch.Generator().manual_seed(9)
    B, T, Hq, Hkv, D, max_seq = 3, 5, 4, 2, 16, 8
    q, k, v, cos, sin = rope_inputs(B, T, Hq, Hkv, D, dtype, gen)
    slots, starts = torch.tensor([1, 0, 2]), torch.tensor([0, 0, 6])
    kc, vc = torch.zeros(3, Hkv, max_seq, D, dtype=dtype), torch.zeros(3, Hkv, max_seq, D, dtype=dtype)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    k_rot, ref_k_rot = torch.full_like(k, float("nan")), torch.full_like(k, float("nan"))
    q_rot = fused.rope_write_kv_triton(q, k, v, cos, sin, kc, vc, slots, starts, k_rot=k_rot)
    ref_q = fused.rope_write_kv_reference(q, k, v, cos, sin, ref_kc, ref_vc, slots, starts, k_rot=ref_k_rot)
    close(q_rot, ref_q, tol)
    close(k_rot, ref_k_rot, tol)
    for b in range(2):  # rows 0 and 1 fit the cache whole: k_rot is what it holds
        assert torch.equal(k_rot[b].transpose(0, 1), kc[slots[b], :, :T])
    assert torch.equal(k_rot[2, :2].transpose(0, 1), kc[2, :, 6:])
    with pytest.raises(ValueError, match="k_rot"):
        fused.rope_write_kv_triton(q, k, v, cos, sin, kc, vc, slots, starts, k_rot=k_rot[:, :2])


@in_interpreter
def test_rope_write_kv_reads_slots_and_starts_as_columns_of_a_table():
    # As multi-layer EAGLE passes them: one column of a [B, layers] table per layer.
    gen = torch.Generator().manual_seed(8)
    B, T, Hq, Hkv, D, max_seq = 3, 4, 4, 2, 16, 16
    q, k, v, cos, sin = rope_inputs(B, T, Hq, Hkv, D, torch.float32, gen)
    starts = torch.tensor([[9, 0, 3], [1, 0, 7], [5, 0, 0]])
    slots = torch.tensor([[2, 1], [0, 1], [3, 1]])
    cache = torch.randn(4, Hkv, max_seq, D, generator=gen)
    kc, vc, ref_kc, ref_vc = cache.clone(), cache.clone(), cache.clone(), cache.clone()
    q_rot = fused.rope_write_kv_triton(q, k, v, cos, sin, kc, vc, slots[:, 0], starts[:, 2])
    ref_q = fused.rope_write_kv_reference(q, k, v, cos, sin, ref_kc, ref_vc, slots[:, 0].contiguous(),
                                          starts[:, 2].contiguous())
    close(q_rot, ref_q, 1e-6)
    close(kc, ref_kc, 1e-6)
    assert torch.equal(vc, ref_vc)


@in_interpreter
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_silu_mul(dtype, tol):
    gen = torch.Generator().manual_seed(7)
    gate_up = torch.randn(2, 3, 2 * 1500, generator=gen).to(dtype)
    out = fused.silu_mul_triton(gate_up)
    close(out, fused.silu_mul_reference(gate_up), tol)
    gate, up = gate_up.float().chunk(2, dim=-1)
    close(out.float(), gate * torch.sigmoid(gate) * up, 4 * tol)


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_argmax_first_index_on_ties(dtype):
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(4, 5000, generator=gen).to(dtype)
    logits[1, 3000] = logits[1, 4500] = 50  # tie across chunks
    logits[2, 10] = logits[2, 11] = 50  # tie within a chunk
    logits[3, -1] = 50  # last index, in a partial chunk
    got = fused.argmax_triton(logits, block=1024)
    assert got.dtype == torch.int64
    assert torch.equal(got, fused.argmax_reference(logits))
    assert got[1:].tolist() == [3000, 10, 4999]


@in_interpreter
def test_bad_input_raises_value_error():
    with pytest.raises(ValueError):
        fused.add_rms_norm_triton(torch.randn(2, 8), None, torch.ones(7), 1e-5)
    with pytest.raises(ValueError):
        fused.silu_mul_triton(torch.randn(2, 7))
    q, k, v, cos, sin = rope_inputs(1, 2, 4, 2, 8, torch.float32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError):
        fused.rope_triton(q, k, cos[:, :1], sin[:, :1])
    with pytest.raises(ValueError):
        fused.rope_write_kv_triton(q, k, v, cos, sin, torch.zeros(2, 3, 8, 8), torch.zeros(2, 3, 8, 8),
                                   torch.tensor([0]), torch.tensor([0]))
