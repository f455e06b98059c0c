"""Compile Triton kernels for a CUDA target on a machine without a GPU.

``TRITON_INTERPRET=1`` runs a kernel's Python body, which accepts things the compiler refuses (a
plain module-level global read in a kernel, a variable whose type changes between the branches
of a runtime ``if``). ``compiling_for_cuda()`` replaces every launch with Triton's real
compilation for an sm_90 target (front end, optimisers, ptxas), inferring each argument's type
from the launch's values and specialising it as the JIT does on a GPU (a pointer aligned to 16
bytes, an int divisible by 16: the hints that decide vectorised loads), and records what it
compiled; nothing runs, so the wrapper's outputs stay uninitialised. Triton's wheel brings
ptxas, so this needs no CUDA driver.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_POINTER = {torch.float64: "*fp64", torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
            torch.int64: "*i64", torch.int32: "*i32", torch.int16: "*i16", torch.int8: "*i8", torch.uint8: "*u8",
            torch.bool: "*i1"}
_DIVISIBLE = [["tt.divisibility", 16]]
OPTIONS = ("num_warps", "num_stages", "num_ctas", "launch_pdl", "enable_fp_fusion", "maxnreg")


class Compiled(list):
    """The names of the kernels compiled, in order; ``ptx`` and ``shared``: each name's PTX and the
    bytes of shared memory a program takes (the last compiled)."""

    def __init__(self):
        super().__init__()
        self.ptx: dict[str, str] = {}
        self.shared: dict[str, int] = {}


def _scalar_type(value) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type a kernel argument of {type(value).__name__}")


@contextlib.contextmanager
def compiling_for_cuda(capability: int = 90) -> Iterator[Compiled]:
    """Within the block, ``kernel[grid](...)`` compiles ``kernel`` for CUDA instead of launching it;
    yields the kernel names compiled (one entry per distinct signature and constants, a ``Compiled``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    compiled = Compiled()
    seen: set = set()
    target = GPUTarget("cuda", capability, 32)

    def compile_only(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in OPTIONS if k in kwargs}
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        signature, constants, attrs = {}, {}, {}
        for i, param in enumerate(self.params):
            value = bound.arguments[param.name]
            if param.is_constexpr or value is None:
                signature[param.name] = "constexpr"
                constants[(i,)] = value
            elif isinstance(value, torch.Tensor):
                signature[param.name] = _POINTER[value.dtype]
                if value.data_ptr() % 16 == 0:
                    attrs[(i,)] = _DIVISIBLE
            else:
                signature[param.name] = _scalar_type(value)
                if not isinstance(value, bool | float) and value % 16 == 0:
                    attrs[(i,)] = _DIVISIBLE
        key = (self.fn.__qualname__, tuple(signature.items()), tuple((k, repr(v)) for k, v in constants.items()),
               tuple(attrs), tuple(options.items()))
        if key not in seen:
            seen.add(key)
            kernel = triton.compile(ASTSource(self, signature, constants, attrs), target=target, options=options)
            compiled.append(self.fn.__qualname__)
            compiled.ptx[self.fn.__qualname__] = kernel.asm["ptx"]
            compiled.shared[self.fn.__qualname__] = kernel.metadata.shared

    original = JITFunction.run
    JITFunction.run = compile_only
    try:
        yield compiled
    finally:
        JITFunction.run = original
