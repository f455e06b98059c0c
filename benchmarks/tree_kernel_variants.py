"""Variants of the tree-index kernel, timed as benchmarks/tree_kernels.py times the one on main.

    python3 benchmarks/tree_kernel_variants.py       # H200: checks every variant, then two rounds of timings
    TRITON_INTERPRET=1 python benchmarks/tree_kernel_variants.py   # CPU: the correctness check alone

The exploration behind docs/BENCHMARKS.md "Kernel variants against the launch floor" and "The
join variant at every size" (issue #4's >= 50x at bs 256, N 64): paired ``tl.reduce`` reductions
(BODY "tuple"), both minima in one ``tl.min`` over a ``tl.join`` (BODY "join"), two batch rows per
program (RPP) and 2 / 4 / 8 warps. Every variant must equal the torch reference on random trees first.
"""
import torch
import triton
import triton.language as tl
from tree_kernels import bench_us, random_parents, warm_up_gpu

from spectool.draft.tree import parents_to_mask
from spectool.kernels.tree_indices import (
    _child_and_sibling,
    _depth_and_parent,
    _load_tile,
    _request_indices,
    _store_indices,
    reconstruct_indices_torch,
    reconstruct_indices_triton,
)


@triton.jit
def _sum_max(a_s, a_m, b_s, b_m):
    return a_s + b_s, tl.maximum(a_m, b_m)


@triton.jit
def _min_min(a1, a2, b1, b2):
    return tl.minimum(a1, b1), tl.minimum(a2, b2)


@triton.jit
def _paired(Mask, SeqLens, Out, N, STRIDE, b, BLOCK: tl.constexpr):
    """The kernel on main's body for request b with its four reductions paired into two."""
    rows = tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK)
    m = _load_tile(Mask, b, N, rows, cols)
    lower = m & (cols[None, :] < rows[:, None])
    d1, parent_row = tl.reduce((m.to(tl.int32), tl.where(lower, cols[None, :], -1)), 1, _sum_max)
    big = BLOCK + N
    is_child, sib = _child_and_sibling(parent_row, rows, cols, N)
    next_token, next_sibling = tl.reduce((tl.where(is_child, cols[None, :], big),
                                          tl.where(sib, cols[None, :], big)), 1, _min_min)
    _store_indices(Out, SeqLens, STRIDE, b, N, rows, d1 - 1, parent_row, next_token, next_sibling, big)


@triton.jit
def _joined(Mask, SeqLens, Out, N, STRIDE, b, BLOCK: tl.constexpr):
    """The kernel on main's body for request b with both minima taken by one reduction over a
    [BLOCK, BLOCK, 2] join (one pass of shuffles instead of two)."""
    rows = tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK)
    depth, parent_row = _depth_and_parent(_load_tile(Mask, b, N, rows, cols), rows, cols)
    big = BLOCK + N
    is_child, sib = _child_and_sibling(parent_row, rows, cols, N)
    both = tl.min(tl.join(tl.where(is_child, cols[None, :], big), tl.where(sib, cols[None, :], big)), axis=1)
    next_token, next_sibling = tl.split(both)
    _store_indices(Out, SeqLens, STRIDE, b, N, rows, depth, parent_row, next_token, next_sibling, big)


@triton.jit
def _kernel(Mask, SeqLens, Out, N, B, STRIDE, BLOCK: tl.constexpr, BODY: tl.constexpr, RPP: tl.constexpr):
    for r in tl.static_range(RPP):
        b = tl.program_id(0).to(tl.int64) * RPP + r
        if b < B:
            if BODY == "tuple":
                _paired(Mask, SeqLens, Out, N, STRIDE, b, BLOCK)
            elif BODY == "join":
                _joined(Mask, SeqLens, Out, N, STRIDE, b, BLOCK)
            else:
                _request_indices(Mask, SeqLens, Out, N, STRIDE, b, BLOCK)


def make(body, rpp, warps):
    def fn(mask, seq_lens):
        bs, n, _ = mask.shape
        out = torch.empty(5, bs, n, dtype=torch.int64, device=mask.device)
        block = max(16, triton.next_power_of_2(n))
        _kernel[(triton.cdiv(bs, rpp),)](mask, seq_lens, out, n, bs, bs * n, BLOCK=block, BODY=body, RPP=rpp,
                                         num_warps=warps)
        return tuple(out[:4].unbind(0))
    return fn


def variants() -> dict:
    out = {"main": reconstruct_indices_triton}
    for body in ("main", "tuple", "join"):
        for rpp in (1, 2):
            for warps in (2, 4, 8):
                out[f"{body} rpp={rpp} w={warps}"] = make(body, rpp, warps)
    return out


SIZES = [(1, 8), (1, 16), (1, 64), (64, 8), (64, 16), (64, 64), (256, 8), (256, 16), (256, 64)]


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    kernels = variants()
    cases = {}
    for bs, n in (SIZES if dev == "cuda" else [(1, 8), (3, 16), (3, 64)]):
        mask = parents_to_mask(random_parents(bs, n, g)).to(dev)
        seq = torch.randint(0, 1000, (bs,), generator=g).to(dev)
        cases[(bs, n)] = (mask, seq)
        want = reconstruct_indices_torch(mask, seq)
        for name, fn in kernels.items():
            assert all(torch.equal(a, b) for a, b in zip(fn(mask, seq), want)), (name, bs, n)
    print("every variant equals the reference")
    if dev == "cpu":
        return
    cuda = torch.device("cuda")
    warm_up_gpu()

    def times(fn) -> dict:
        return {k: bench_us(lambda m=m, s=s: fn(m, s), cuda) for k, (m, s) in cases.items()}

    ref = times(reconstruct_indices_torch)
    print("torch reference", {f"{k[0]}x{k[1]}": round(v, 1) for k, v in ref.items()})
    for _ in range(2):  # two rounds: the spread between them is the noise
        for name, fn in kernels.items():
            t = times(fn)
            print(f"{name:24s}", " ".join(f"{k[0]}x{k[1]}:{v:.2f}" for k, v in t.items()),
                  f"| 256x64 ratio {ref[(256, 64)] / t[(256, 64)]:.1f}x")


if __name__ == "__main__":
    main()
