"""Cost profiles for ``spectool tune``, measured on this device (run on the H200 to ship them).

Figure: docs/BENCHMARKS.md "What-if tuner". Time: 3 to 7 minutes on an H200 (every draft grid point
is the engine running that configuration, its graphs captured for each batch size).

    python benchmarks/tune_profiles.py --out spectool/tune/profiles          # H200: demo + 8B shape
    python benchmarks/tune_profiles.py --device cpu --quick --out /tmp/p     # smoke test

Writes two profiles (``spectool.tune.cost_profile`` describes the JSON):

* ``demo-<device>.json``: the bundled demo target with its EAGLE and multi-layer EAGLE draft
  layers and the N-gram drafter (what ``spectool bench --calibrate`` measures);
* ``llama3-8b-shape-<device>.json``: the Llama-3-8B shape with random bf16 weights (no
  download): the verify step per (batch, N), the engine's host overhead and the N-gram
  drafter. It carries the shape, not a weight hash: tune with ``allow_other_model=True``
  (``spectool tune --allow-other-model``) for a real 8B checkpoint.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from decode import random_target
from speculative import default_device

import spectool as st
from spectool.tune.calibrate import calibrate


def _tag(device: str) -> str:
    if not device.startswith("cuda"):
        return "cpu"
    name = torch.cuda.get_device_name(torch.device(device)).lower()
    return "h200" if "h200" in name else name.replace("nvidia ", "").replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=default_device())
    p.add_argument("--out", required=True, help="directory for the profile JSON files")
    p.add_argument("--quick", action="store_true", help="tiny grids and shape (CPU smoke test)")
    p.add_argument("--repeats", type=int, default=20, help="timed verify calls / engine iterations per grid point")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = _tag(args.device)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    quick = dict(batch_sizes=(1, 2), num_nodes=(1, 4), topks=(1, 2), eagle_steps=(1, 2), repeats=2, context=32)
    full = dict(batch_sizes=(1, 2, 4, 8, 16), num_nodes=(1, 2, 4, 5, 8, 12, 16, 24, 32, 48, 64),
                topks=(1, 2, 4, 8), eagle_steps=(1, 2, 3, 4, 6, 8), repeats=args.repeats, context=256)
    grid = quick if args.quick else full

    demo = st.demo_model()
    t0 = time.perf_counter()
    target = st.load(demo / "target", device=args.device, dtype=dtype)
    profile = calibrate(target, eagle_path=demo / "eagle", multi_layer_path=demo / "multi_layer_eagle", **grid)
    profile.data["eagle_path_name"] = "demo eagle"
    profile.save(out / f"demo-{tag}.json")
    print(f"demo-{tag}.json: {time.perf_counter() - t0:.0f} s")

    t0 = time.perf_counter()
    shape = "tiny" if args.quick else "8B"
    big = random_target(shape, "cuda" if args.device.startswith("cuda") else "cpu", 4096)
    profile = calibrate(big, **grid)
    profile.data["model"]["hash"] = None  # random weights: the profile stands for the shape
    name = f"llama3-8b-shape-{tag}.json" if not args.quick else f"tiny-shape-{tag}.json"
    profile.save(out / name)
    print(f"{name}: {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
