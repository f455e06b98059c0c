"""Kernel by kernel, what repeated CUDA graph replays spend (torch.profiler's kernel events).

``graph_kernels(replay, steps)`` runs ``replay`` ``steps`` times, each followed by a host sync,
and reports from the kernels' own start and end times: per kernel (name shortened) its count and
µs per replay, and per replay the span from the first kernel's start to the last one's end, the
sum of kernel time and the idle time between kernels (what launches cost inside the graph).
Medians over the replays.
"""

from __future__ import annotations

import collections
import json
import os
import re
import tempfile

import torch


def short_name(name: str) -> str:
    """A readable kernel name: Triton kernels keep theirs, cuBLAS/ATen ones lose template noise."""
    name = re.sub(r"<.*", "", name.split("(")[0])
    return name[:60]


def graph_kernels(replay, steps: int) -> tuple[dict, list[dict]]:
    """``(summary, rows)`` of ``steps`` calls of ``replay`` (a CUDA graph's replay, already warm):
    summary has ``steps``, ``kernels_per_step``, ``span_us``, ``kernel_us`` and ``idle_us``; each row
    ``kernel``, ``per_step``, ``us_per_step`` and ``us_each``, the costliest first."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            replay()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if kernels and len(kernels) % steps == 0:  # every replay launches the same kernels
        each = len(kernels) // steps
        groups = [kernels[i:i + each] for i in range(0, len(kernels), each)]
    else:  # told apart by the host syncs: a gap much longer than any inside a graph
        groups, current = [], []
        for e in kernels:
            if current and e["ts"] - (current[-1]["ts"] + current[-1]["dur"]) > 50:
                groups.append(current)
                current = []
            current.append(e)
        groups.append(current)
        groups = groups[1:] if len(groups) > steps else groups  # a stray first group, if any
    per_kernel = collections.defaultdict(lambda: [0, 0.0])
    spans, busy = [], []
    for g in groups:
        spans.append(g[-1]["ts"] + g[-1]["dur"] - g[0]["ts"])
        busy.append(sum(e["dur"] for e in g))
        for e in g:
            per_kernel[short_name(e["name"])][0] += 1
            per_kernel[short_name(e["name"])][1] += e["dur"]
    n = len(groups)
    rows = sorted(({"kernel": k, "per_step": c / n, "us_per_step": t / n, "us_each": t / c}
                   for k, (c, t) in per_kernel.items()), key=lambda r: -r["us_per_step"])
    summary = {"steps": n, "kernels_per_step": len(kernels) / max(1, n),
               "span_us": sorted(spans)[n // 2], "kernel_us": sorted(busy)[n // 2]}
    summary["idle_us"] = summary["span_us"] - summary["kernel_us"]
    return summary, rows


def print_rows(rows: list[dict]) -> None:
    """The rows of :func:`graph_kernels` as a markdown table."""
    print("\n| kernel | per step | µs per step | µs each |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kernel']} | {r['per_step']:.0f} | {r['us_per_step']:.1f} | {r['us_each']:.2f} |")
