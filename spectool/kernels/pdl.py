"""Programmatic dependent launch (PDL) for the decode step's kernels (Hopper and later GPUs).

A decode step at batch 1 is a chain of about seven kernels per layer, each too short to keep the
GPU busy for long: between two of them the memory system idles while the first one's last
programs drain and the next one's programs are launched and start. With PDL the next kernel is
launched while the one before it still runs: once every program of the earlier kernel has done
its main work (``launch_dependents``, just before its final stores), the next kernel's programs
take the SMs that free up, and each waits (``wait``, its first statement) until the earlier
kernel has finished and its writes are visible. Since every read and write of a kernel comes
after its wait, the results are the same bits as without PDL.

A CUDA graph keeps the launches' programmatic edges, so the graphed step overlaps its kernels
the same way. A kernel launched without PDL after one launched with it simply waits for it, so
kernels take it up one at a time. ``SPECTOOL_PDL=0`` (or ``ENABLED = False``, as
``benchmarks/decode.py --no-pdl`` sets it for its second timing) launches every kernel without it.

On the H200 (docs/BENCHMARKS.md, "Plain decoding") triggering the next kernel at the start of
each program instead of after its main work, and prefetching the next projection's weight into
L2 before its wait, both made the step slower than triggering late with no prefetch.
"""

from __future__ import annotations

import functools
import os

import torch

from spectool.kernels.triton_import import tl, triton

ENABLED = os.environ.get("SPECTOOL_PDL", "1") != "0"


def use_pdl(x: torch.Tensor) -> bool:
    """Whether kernels working on ``x`` launch with PDL: on a CUDA device of compute capability 9
    or more (Hopper), unless turned off (module docstring)."""
    if not (ENABLED and x.is_cuda):
        return False
    return _capable(x.device.index if x.device.index is not None else torch.cuda.current_device())


@functools.cache
def _capable(index: int) -> bool:
    # Triton has had the launch option and the two instructions since 3.3.
    return torch.cuda.get_device_capability(index)[0] >= 9 and hasattr(tl.extra.cuda, "gdc_wait")


def use_pdl_one_row(x: torch.Tensor, rows: int) -> bool:
    """``use_pdl`` for the kernels between a step's projections (RoPE, attention): only for one query
    row, a batch-1 decode step, whose projections are always the PDL-launched GEMVs. Between
    cuBLAS's projections (more rows) PDL made the H200's 8B step at batch 8 slower."""
    return rows == 1 and use_pdl(x)


def launch_options(on: bool) -> dict:
    """The launch keyword that turns PDL on for one Triton launch (none when off)."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Lets the next kernel's programs start once every program of this one has reached here."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Waits until the kernel before this one has finished and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()
