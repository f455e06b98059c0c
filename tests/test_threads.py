"""The CPU thread count: spectool picks one for a small model unless the user did."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_LOAD = """
import sys, torch
import spectool as st
from spectool.threads import torch_default_threads
{before}
st.load(st.demo_model() / "target", device="cpu")
print(torch.get_num_threads())
{after}
"""


def _threads(before: str = "", after: str = "", **env: str) -> list[int]:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    p = subprocess.run([sys.executable, "-c", _LOAD.format(before=before, after=after)], capture_output=True,
                       text=True, timeout=300, env={**clean, "PYTHONPATH": str(ROOT), **env})
    assert p.returncode == 0, p.stderr[-3000:]
    return [int(x) for x in p.stdout.split()]


def test_small_model_gets_one_thread_and_a_later_choice_wins():
    # Default environment: the demo target decodes on one thread. A later set_num_threads is kept, even across
    # another load. (And loading never pulls in torch._dynamo, whose import costs seconds on a small CPU.)
    assert _threads(after="torch.set_num_threads(3)\nst.load(st.demo_model() / 'target', device='cpu')\n"
                          "print(torch.get_num_threads())\nprint(int('torch._dynamo' in sys.modules))") == [1, 3, 0]


def test_the_users_choice_wins(monkeypatch):
    import torch

    from spectool import threads

    before = torch.get_num_threads()
    default = max(threads.torch_default_threads())
    try:
        for env, count, kept in (({"OMP_NUM_THREADS": "2"}, default, True), ({"MKL_NUM_THREADS": "3"}, default, True),
                                 ({}, default + 1, True), ({}, default, False)):
            monkeypatch.setattr(threads, "_decided", False)
            for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                monkeypatch.delenv(name, raising=False)
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            torch.set_num_threads(count)
            assert threads.pick_cpu_threads(10_000) == (count if kept else 1), (env, count)
            # A large model keeps whatever is set.
            monkeypatch.setattr(threads, "_decided", False)
            torch.set_num_threads(count)
            assert threads.pick_cpu_threads(threads.SMALL_MODEL_PARAMS) == count
    finally:
        torch.set_num_threads(before)
