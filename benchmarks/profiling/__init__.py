"""Where a benchmark's time goes: the ``--profile KIND`` modes of decode.py, speculative.py and
tree_kernels.py.

A benchmark reports a figure; its profiles explain it, and run only through the benchmark:

    python3 benchmarks/decode.py --profile kernels --shape 8B         # a graphed decode step, kernel by kernel
    python3 benchmarks/speculative.py --profile phases                # GPU kernel time against host time per phase
    python3 benchmarks/speculative.py --profile ops                   # kernels launched per iteration (CPU)
    python3 benchmarks/speculative.py --profile host                  # host work outside the timed phases
    python3 benchmarks/speculative.py --profile prefill               # a prefill: graphs against eager, GPU time
    python3 benchmarks/tree_kernels.py --profile sampling             # the graphed sampling verify, kernel by kernel

Everything after ``--profile KIND`` is the profile's own options (``--profile ops --help`` lists them).
"""

from __future__ import annotations

import importlib
import sys

# Per benchmark, each profile kind and the module (in this folder) whose main(argv) runs it.
PROFILES = {
    "decode": {"kernels": "decode_kernels"},
    "tree_kernels": {"sampling": "sampling_kernels"},
    "speculative": {"phases": "phases", "ops": "op_counts", "host": "host", "prefill": "prefill"},
}


def profile_help(benchmark: str) -> str:
    """The ``--profile`` option's help text for ``benchmark``."""
    kinds = ", ".join(PROFILES[benchmark])
    return (f"instead of the benchmark, run one of its profiles ({kinds}); the options after it are the "
            f"profile's own (--profile KIND --help lists them)")


def run_profile(benchmark: str, argv: list[str]) -> int | None:
    """If ``argv`` asks for ``--profile KIND``, run that profile of ``benchmark`` on the other options and
    return its exit code; None when ``argv`` asks for no profile (the benchmark runs)."""
    if "--profile" not in argv:
        return None
    at = argv.index("--profile")
    kinds = PROFILES[benchmark]
    kind = argv[at + 1] if at + 1 < len(argv) else None
    if kind not in kinds:
        print(f"{benchmark}.py: --profile takes one of {', '.join(kinds)} (got {kind!r})", file=sys.stderr)
        raise SystemExit(2)
    module = importlib.import_module(f"profiling.{kinds[kind]}")
    return module.main(argv[:at] + argv[at + 2:])
