"""How long the command line makes a user wait: `spectool COMMAND --help`, `spectool check` on a small
trace (no --replay) and `spectool demo` with the default environment, each in a fresh interpreter.

Figure: docs/BENCHMARKS.md "Command line". Time: about 1 minute on the CPU.

    python benchmarks/cli_latency.py [--quick] [--out DIR]

Goals on a 2-core CPU: --help <= 1 s, check <= 3 s, demo <= 60 s. The machine's load is printed with
the figures, since on a shared machine every process waits for a core.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spectool.cli import COMMANDS


def timed(args: list[str], env: dict) -> float:
    """Wall seconds of ``python -m spectool ARGS`` in a fresh interpreter (it must exit 0)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "spectool", *args], check=True, env=env, capture_output=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="demo --quick instead of the full demo")
    p.add_argument("--out", default=".", help="folder for cli_latency.json")
    p.add_argument("--device", default="cpu", help="device of the demo")
    args = p.parse_args(argv)
    # The default environment: no thread count chosen by hand.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    rows = {f"{name} --help": timed([name, "--help"], env) for name in COMMANDS}
    with tempfile.TemporaryDirectory() as tmp:
        demo = ["demo", "--device", args.device, "--out", tmp, *(["--quick"] if args.quick else [])]
        rows["demo" + (" --quick" if args.quick else "")] = timed(demo, env)
        rows["check (no --replay)"] = timed(["check", str(Path(tmp) / "ngram_completion.sptrace")], env)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    for name, seconds in rows.items():
        print(f"{name:<28} {seconds:7.2f} s")
    print(f"load average {load} on {os.cpu_count()} CPUs")
    out = Path(args.out) / "cli_latency.json"
    out.write_text(json.dumps({"seconds": rows, "load_average": load, "cpus": os.cpu_count()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
