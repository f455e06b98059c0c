"""Shared test fixtures: the bundled demo model, and re-running a kernel test file under Triton's
interpreter.

Triton picks interpreter or compiler when it is imported (its own helpers such as ``tl.cdiv``
are jit functions too), so a file whose tests need ``TRITON_INTERPRET=1`` marks them
``@pytest.mark.triton_interpreter`` and has one launcher test that takes the
``triton_interpreter_child`` fixture: in a normal run the marked tests are skipped and the
launcher re-runs the whole file in a child pytest with the variable set; the parent never sets
it, so other tests (and compiled GPU kernels) are untouched. In a marked test every
``torch.empty`` comes back poisoned (NaN, True, or an integer type's largest value), so a kernel
that reads an entry of a buffer before anything wrote it makes a result no reference matches.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable

import pytest

# One OpenMP thread for this process and every child (notebook kernels, JupyterLab, subprocess
# tests), set before torch loads. The suite's models are tiny, so a second thread buys nothing,
# and on a 2-core runner with anything else busy (a notebook kernel beside pytest, Chromium)
# two-thread regions stall: a 32-token demo-model decode took 16.8 s with 2 threads, 1.0 s with 1.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (after OMP_NUM_THREADS)

import spectool as st  # noqa: E402

_empty = torch.empty


def _triton_interpreted() -> bool:
    """True when this process imported Triton in interpreter mode."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import triton

    return type(triton.language.standard.cdiv).__name__ == "InterpretedFunction"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "triton_interpreter: runs only in the TRITON_INTERPRET=1 child run")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("triton_interpreter") and not _triton_interpreted():
        pytest.skip("runs in the TRITON_INTERPRET=1 child")


def _poisoned_empty(*size, **kwargs):
    out = _empty(*size, **kwargs)
    if out.is_floating_point():
        return out.fill_(math.nan)
    return out.fill_(True if out.dtype == torch.bool else torch.iinfo(out.dtype).max)


@pytest.fixture(autouse=True)
def _poisoned_buffers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("triton_interpreter"):
        monkeypatch.setattr(torch, "empty", _poisoned_empty)


@pytest.fixture
def triton_interpreter_child(request: pytest.FixtureRequest) -> Callable[[], None]:
    """Call it to run the requesting test file in a child pytest under ``TRITON_INTERPRET=1``.

    Skips when this process already is that child. The child must pass every test and skip
    only the launcher, so a marked test that silently skipped there would fail here.
    """
    if _triton_interpreted():
        pytest.skip("already in the interpreter")
    path = str(request.path)

    def run() -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
                               env=env, capture_output=True, text=True, timeout=600)
        assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
        assert " passed, 1 skipped in" in child.stdout, child.stdout[-2000:]

    return run


@pytest.fixture(scope="session")
def demo_model_dir():
    """Directory of the bundled demo model (target/, eagle/, multi_layer_eagle/, prompts.jsonl)."""
    return st.demo_model()


@pytest.fixture(scope="session")
def target(demo_model_dir):
    """The demo target on CPU in float32 (the dtype greedy outputs are compared in), loaded once.
    A module that needs another target (CUDA, bfloat16, random weights) defines its own."""
    from test_engine_support import load_demo_target

    return load_demo_target(demo_model_dir)
