"""spectool: a speculative-decoding engine that shows its work.

    import spectool as st
    target = st.load(st.demo_model() / "target")
    engine = st.Engine(target, draft=st.NgramConfig())
    result = engine.generate(["def fib(n):"], max_new_tokens=64)
"""

from __future__ import annotations

import sys
from importlib import import_module
from pathlib import Path
from typing import Any

from spectool.config import DraftModelConfig, Eagle3Config, EagleConfig, MultiLayerEagleConfig, NgramConfig


def _find_built_parts() -> None:
    """In a source checkout that was installed with ``pip install .`` (not built in place), Python run from the
    repository root imports this directory, which lacks the compiled extension and the ``widgets`` package: take
    those from the installed copy, so ``python -m spectool`` works there too."""
    here = Path(__file__).resolve().parent
    if any(here.glob("_native*")):
        return
    for entry in sys.path:
        other = Path(entry or ".").resolve() / "spectool"
        if other != here and any(other.glob("_native*")):
            __path__.append(str(other))
            return


_find_built_parts()

__version__ = "0.1.0"

# Heavy parts load on first use so `import spectool` stays quick in notebooks and the CLI.
_LAZY = {
    "load": ("spectool.model.loader", "load"),
    "Target": ("spectool.model.loader", "Target"),
    "demo_model": ("spectool.demo", "demo_model"),
    "Engine": ("spectool.engine", "Engine"),
    "GenerateResult": ("spectool.engine", "GenerateResult"),
    "Trace": ("spectool.trace.reader", "Trace"),
    "draft_from_sglang_args": ("spectool.deploy", "draft_from_sglang_args"),
    "draft_from_vllm_config": ("spectool.deploy", "draft_from_vllm_config"),
    "tune": ("spectool.tune.recommend", "tune"),
    "Record": ("spectool.trace.select", "Record"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(import_module(module), attr)
    raise AttributeError(f"module 'spectool' has no attribute {name!r}")


__all__ = ["DraftModelConfig", "Eagle3Config", "EagleConfig", "MultiLayerEagleConfig", "NgramConfig", *_LAZY]
