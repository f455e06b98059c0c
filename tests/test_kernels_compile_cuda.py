"""The sampling verifies' Triton kernels, and the split-K projection's, compile for an H100/H200
(sm_90) on this CPU machine.

The interpreter tests run the kernels' Python bodies, which accept code the Triton compiler
refuses; a kernel that only the interpreter has run fails at its first launch on the GPU. Here
every launch of the chunked sampling verify in the engine's three launch shapes (float32 and bf16
logits) and of the fused one, for each combination of temperature, top-k and top-p, is compiled by
Triton for CUDA (tests/cuda_compile.py) from the same wrapper calls the engine makes, and so are the
launch shapes that would replace them once timed (the spread copy, ``-sp2g``). The other launch
shapes, kept to time against the engine's, are compiled on the GPU by
`benchmarks/tree_kernels.py --sampling-configs sweep`.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

triton = pytest.importorskip("triton", reason="the test extras install triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for CUDA; the interpreter replaces the kernels", allow_module_level=True)

from cuda_compile import compiling_for_cuda  # noqa: E402
from test_verify import random_batch  # noqa: E402

from spectool.kernels.verify_sampling_chunked import (  # noqa: E402
    CONFIGS,
    DEFAULT_CONFIG,
    FEW_ROWS_CONFIG,
    ONE_TREE_CONFIG,
)
from spectool.verify import verify_sampling_chunked, verify_sampling_fused  # noqa: E402

CUTS = [(0, 1.0), (50, 1.0), (0, 0.9), (50, 0.9)]  # (top_k, top_p): none, top-k, top-p, both
ENGINE_CONFIGS = (ONE_TREE_CONFIG, FEW_ROWS_CONFIG, DEFAULT_CONFIG)


def sampling_inputs(dtype: torch.dtype, batch: int = 2, nodes: int = 8, vocab: int = 4096):
    tree, g = random_batch(batch, nodes, vocab, seed=0)
    logits = torch.randn(batch, nodes, vocab, generator=g).to(dtype)
    return tree, logits, torch.full((batch,), 0.8), torch.rand(batch, nodes, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_sampling_verify_compiles_for_cuda(dtype):
    tree, logits, temps, coins = sampling_inputs(dtype)
    with compiling_for_cuda() as compiled:
        for (top_k, top_p), config in ((cut, c) for cut in CUTS for c in ENGINE_CONFIGS):
            verify_sampling_chunked(tree, logits, temps, top_k, top_p, coins, config)
    assert {"_stats_kernel", "_cut_kernel", "_residual_kernel", "_spread_kernel"} <= set(compiled)


def test_last_program_counts_with_one_atomic():
    # One tree's shape lets the last row program decide and the last residual program draw the bonus;
    # the count that picks the last program is one atomic with release and acquire at GPU scope.
    tree, logits, temps, coins = sampling_inputs(torch.float32)
    with compiling_for_cuda() as compiled:
        verify_sampling_chunked(tree, logits, temps, 50, 0.9, coins, ONE_TREE_CONFIG)
    for name in ("_cut_kernel", "_residual_kernel"):
        assert compiled.ptx[name].count("atom.global.gpu.acq_rel.add") == 1


def test_spread_copy_launch_shapes_compile_for_cuda():
    # Each engine shape with the spread rounds' copy of the range (``-sp2g``), for top-p alone.
    tree, logits, temps, coins = sampling_inputs(torch.float32)
    for config in (c + "g" for c in ENGINE_CONFIGS):
        with compiling_for_cuda() as compiled:
            verify_sampling_chunked(tree, logits, temps, 0, 0.9, coins, config)
        assert {"_cut_kernel", "_spread_kernel", "_spread_gather_kernel"} <= set(compiled), config


def test_fused_sampling_verify_compiles_for_cuda():
    tree, logits, temps, coins = sampling_inputs(torch.float32)
    with compiling_for_cuda() as compiled:
        for top_k, top_p in CUTS:
            verify_sampling_fused(tree, logits, temps, top_k, top_p, coins)
    assert compiled, "no kernel was launched"


def register_cap(ptx: str) -> int:
    """The ``.maxnreg`` directive of a kernel's PTX (0: none, the compiler chooses)."""
    directive = re.search(r"\.maxnreg (\d+)", ptx)
    return int(directive.group(1)) if directive else 0


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (50, 0.9)])
def test_register_caps_reach_the_compiler(top_k, top_p):
    # The many-row shape caps its stats pass at 64 registers a thread so that eight programs share
    # an SM; the cap is a directive ptxas must see, and the few-row shape leaves the choice to it.
    tree, logits, temps, coins = sampling_inputs(torch.float32)
    for config, cap in ((DEFAULT_CONFIG, CONFIGS[DEFAULT_CONFIG].stats_regs), (FEW_ROWS_CONFIG, 0)):
        with compiling_for_cuda() as compiled:
            verify_sampling_chunked(tree, logits, temps, top_k, top_p, coins, config)
        assert register_cap(compiled.ptx["_stats_kernel"]) == cap, config
        assert register_cap(compiled.ptx["_cut_kernel"]) == 0, config


def test_cut_register_cap_reaches_the_compiler():
    # A launch shape may cap the cut programs' registers (``cut_regs``) so that 8 fit an SM.
    tree, logits, temps, coins = sampling_inputs(torch.float32)
    with compiling_for_cuda() as compiled:
        verify_sampling_chunked(tree, logits, temps, 50, 0.9, coins, "c2048-p16-w4-g128-cw4-gt256-t64-r64-cr64")
    assert register_cap(compiled.ptx["_cut_kernel"]) == 64


def test_split_projection_compiles_for_cuda_with_one_counting_atomic():
    # The slab's last program is found by one count with release and acquire at GPU scope; a span
    # of the whole K (split 1) counts nothing.
    from spectool.kernels.gemv_split import gemv_split

    x, w = torch.randn(8, 1, 512), torch.randn(256, 512)
    for split, atomics in ((2, 1), (1, 0)):
        with compiling_for_cuda() as compiled:
            gemv_split(x, w, config=(64, 128, split, 4, 3))
        assert compiled.ptx["_split_kernel"].count("atom.global.gpu.acq_rel.add") == atomics


def test_split_projection_configs_fit_shared_memory_with_float32_weights():
    # Every config in gemv_split's table, chosen on bf16 weights, compiles to programs whose tiles fit
    # a Hopper SM's shared memory with float32 weights (twice the bytes; a config that does not fit
    # fails at launch). Compiled from CPU tensors, bf16 would take the float32 tl.dot as well (DOT_F32),
    # so float32 is the case this machine compiles as the GPU does.
    from spectool.kernels import gemv_split

    x, w = torch.randn(8, 1, 4096), torch.randn(256, 4096)
    configs = {c for c in gemv_split.CONFIGS.values() if c is not None} | {gemv_split.DEFAULT_CONFIG}
    for config in sorted(configs):
        with compiling_for_cuda() as compiled:
            gemv_split.gemv_split(x, w, config=config)
        assert 0 < compiled.shared["_split_kernel"] <= gemv_split.SHARED_BYTES, config
