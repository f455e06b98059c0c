"""The sampling verify's coins: counter-based Philox uniforms, one launch, CUDA-graph safe.

The coin of node i of a request is Philox4x32-10 (Triton's ``tl.rand``) keyed by the call's
seed and the request's nonce, at the counter ``seq_len * N + i``:

    key = nonce * 2**32 + (seed mod 2**32)          # the two 32-bit Philox key words
    coin[b, i] = uniform(philox(key, seq_len[b] * N + i))

A pure function of device tensors, so a captured graph needs no generator state: every
replay reads the running batch's seq_lens, which grow each iteration, so a request never
draws the same counter twice, and requests differ by their nonce (the engine uses the
request id). Graph warm-up runs are harmless (they draw the same coins again), and equal
seeds give equal coins whatever was captured when.

``philox_uniform_torch`` is the reference, written with int64 torch ops (32-bit products
split in 16-bit halves): under ``TRITON_INTERPRET=1`` and on CUDA the kernel equals it bit
for bit (tests/test_kernels_sampling.py); the CPU path runs it.
"""

from __future__ import annotations

import torch

from spectool.kernels import pdl
from spectool.kernels.tree_indices import triton_on_cpu
from spectool.kernels.triton_import import tl, triton

_MASK32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_SCALE = 4.6566127342e-10  # tl.rand's: the largest int32 times it stays below 1 in float32


@triton.jit
def _coins_kernel(Seed, Nonces, SeqLens, Out, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    b = tl.program_id(0)
    seed = tl.load(Seed) & 0xFFFFFFFF
    key = tl.load(Nonces + b) * 4294967296 + seed
    i = tl.arange(0, BLOCK)
    counter = (tl.load(SeqLens + b) * N + i).to(tl.int32)
    pdl.launch_dependents(PDL)
    tl.store(Out + b * N + i, tl.rand(key, counter), mask=i < N)


def _mul32(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of the 64-bit product of uint32 values ``a`` and the constant ``b``."""
    lo_part = a * (b & 0xFFFF)
    hi_part = a * (b >> 16)
    t = hi_part + (lo_part >> 16)
    return t >> 16, ((t & 0xFFFF) << 16 | (lo_part & 0xFFFF)) & _MASK32


def philox_uniform_torch(key: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """``tl.rand(key, counter)`` for int64 keys (>= 0) and int32-range counters, broadcast; float32."""
    k0, k1 = key & _MASK32, (key >> 32) & _MASK32
    c0 = counter.to(torch.int64) & _MASK32
    c0, k0, k1 = torch.broadcast_tensors(c0, k0, k1)
    c1 = torch.zeros_like(c0)
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(10):
        hi_b, lo_b = _mul32(c2, _ROUND_B)
        hi_a, lo_a = _mul32(c0, _ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    x = torch.where(c0 >= 2**31, c0 - 2**32, c0)  # the int32 bit pattern
    x = torch.where(x < 0, -x - 1, x)
    return x.to(torch.float32) * torch.tensor(_SCALE, dtype=torch.float32)


def sampling_coins_torch(seed: torch.Tensor, nonces: torch.Tensor, seq_lens: torch.Tensor, n: int) -> torch.Tensor:
    """Reference of :func:`sampling_coins`."""
    key = nonces.to(torch.int64)[:, None] * 2**32 + (seed.to(torch.int64) & _MASK32)
    counter = seq_lens.to(torch.int64)[:, None] * n + torch.arange(n, device=seq_lens.device)
    return philox_uniform_torch(key, counter)


def sampling_coins(seed: torch.Tensor, nonces: torch.Tensor, seq_lens: torch.Tensor, n: int) -> torch.Tensor:
    """[B, n] float32 coins in [0, 1) for B requests (see the module docstring).

    Args:
        seed: [1] int64, the call's seed (its low 32 bits are used).
        nonces: [B] int64 in [0, 2**31), one per request.
        seq_lens: [B] int64, each request's cache length before this iteration.
        n: nodes per tree.
    One Triton launch on CUDA (and on CPU with ``TRITON_INTERPRET=1``), else the torch reference.
    """
    if not (seed.is_cuda or triton_on_cpu()):
        return sampling_coins_torch(seed, nonces, seq_lens, n)
    b = nonces.shape[0]
    out = torch.empty(b, n, dtype=torch.float32, device=nonces.device)
    on = pdl.use_pdl(nonces)
    _coins_kernel[(b,)](seed, nonces, seq_lens, out, n, BLOCK=triton.next_power_of_2(max(n, 16)), PDL=on,
                        **pdl.launch_options(on))
    return out
