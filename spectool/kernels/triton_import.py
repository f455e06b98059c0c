"""``triton`` and ``triton.language``, or stand-ins where triton is not installed.

The CPU build of torch does not bring triton, and on a CPU every op takes the torch
reference beside its kernel, so a CPU install must not need it. The kernel modules import
``triton`` and ``tl`` from here: with triton installed they are the real modules; without
it, ``@triton.jit`` still defines the kernels (annotations are strings, so ``tl.constexpr``
is never evaluated) and anything that would launch or query triton raises one clear error.
"""

from __future__ import annotations

from typing import Any

_MISSING = ("this needs triton, which is not installed: `pip install triton` (GPU machines; the CUDA build "
            "of torch brings it). On a CPU spectool uses the torch references and needs no triton.")


class _NoTriton:
    """Stands for triton, triton.language or a jitted kernel; every use but ``jit`` raises."""

    def __init__(self, name: str):
        self._name = name

    def jit(self, fn: Any = None, **_: Any) -> Any:
        if fn is None:  # @triton.jit(...) with options
            return lambda f: _NoTriton(f.__name__)
        return _NoTriton(fn.__name__)

    def _fail(self, *_: Any, **__: Any) -> Any:
        raise ModuleNotFoundError(f"{self._name}: {_MISSING}", name="triton")

    __call__ = __getitem__ = _fail

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        self._fail()


try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # a CPU install: the torch references are the whole path
    triton = _NoTriton("triton")  # type: ignore[assignment]
    tl = _NoTriton("triton.language")  # type: ignore[assignment]
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "tl", "triton"]
