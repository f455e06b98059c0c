"""The last program to arrive: one launch doing the work a second kernel after it would do.

Where each program of a kernel writes one part of a result and a second kernel would combine the
parts, the last of the programs to finish can combine them instead: each program counts itself in
at a counter once its stores are made, and the one that brings the count to its total sees every
other program's stores and does the follow-up work. A launch fewer, and no wait for the slowest
program's neighbours on the SMs. The counter must read 0 when the kernel starts: zeroed by a kernel
before it, or put back to 0 by the last program.
"""

from __future__ import annotations

from spectool.kernels.triton_import import tl, triton


@triton.jit
def last_of(Arrived, programs):
    """Whether this program is the last of ``programs`` to report at ``Arrived`` (an int32 count).
    The count goes up once every thread's stores are made (the barrier) with release and acquire
    at GPU scope, so the last program to arrive sees every other's stores."""
    tl.debug_barrier()
    return tl.atomic_add(Arrived, 1, sem="acq_rel", scope="gpu") == programs - 1
