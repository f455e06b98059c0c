"""The CPU thread count spectool picks for torch when the user has not picked one.

torch starts one intra-op thread per physical core. For a small model every op of a decode
step is a few microseconds of work, so splitting it across threads costs more in
synchronisation than it saves, and on a machine whose cores are busy with anything else a
thread that waits at a barrier for a descheduled sibling stalls the whole step (on a 2-core
machine a demo-model decode ran 15x faster with one thread than with two). So models below
``SMALL_MODEL_PARAMS`` decode with one thread; larger ones keep torch's default, where the
matrix products are big enough to pay for the split.

A user's own choice always wins: ``OMP_NUM_THREADS`` (or ``MKL_NUM_THREADS``) in the
environment, or any ``torch.set_num_threads`` call that left a count other than torch's
default. spectool decides once, at the first CPU ``load``, so a later
``torch.set_num_threads`` also wins.
"""

from __future__ import annotations

import os

import torch

SMALL_MODEL_PARAMS = 100_000_000
_decided = False


def _physical_cores() -> int | None:
    """Physical cores from /proc/cpuinfo (torch's default count on Linux x86), None elsewhere."""
    try:
        text = open("/proc/cpuinfo", encoding="ascii", errors="replace").read()
    except OSError:
        return None
    cores, phys = set(), "0"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "physical id":
            phys = value.strip()
        elif key == "core id":
            cores.add((phys, value.strip()))
    return len(cores) or None


def torch_default_threads() -> set[int]:
    """The counts torch may have started with when nobody set one (it depends on the platform's view of
    cores: physical cores, logical CPUs, or the CPUs this process may run on)."""
    counts = {os.cpu_count() or 1, _physical_cores() or 1}
    if hasattr(os, "sched_getaffinity"):
        counts.add(len(os.sched_getaffinity(0)))
    return counts


def user_chose_threads() -> bool:
    """True when the environment or a ``torch.set_num_threads`` call fixed torch's thread count."""
    if any(os.environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        return True
    return torch.get_num_threads() not in torch_default_threads()


def pick_cpu_threads(num_params: int) -> int:
    """Set torch's thread count for a CPU model of ``num_params`` parameters unless the user set one (or
    spectool already did); returns the count in effect."""
    global _decided
    if not _decided:
        _decided = True
        if num_params < SMALL_MODEL_PARAMS and not user_chose_threads():
            torch.set_num_threads(1)
    return torch.get_num_threads()
