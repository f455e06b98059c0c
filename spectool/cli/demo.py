"""``spectool demo``: the bundled model, both draft families, a summary table, traces and reports."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from spectool.config import Eagle3Config, EagleConfig, MultiLayerEagleConfig, NgramConfig
from spectool.demo import demo_model
from spectool.prompts import load_prompts


def demo_configs(root: Path) -> dict:
    """The draft settings the demo runs, by name (None = plain decoding, the baseline)."""
    return {
        "plain": None,
        "ngram": NgramConfig(num_draft_tokens=12),
        "eagle": EagleConfig(root / "eagle", num_steps=5, topk=4, num_draft_tokens=16),
        "multi_layer_eagle": MultiLayerEagleConfig(root / "multi_layer_eagle", num_steps=4),
        # EAGLE's tree settings, so the two accept lengths compare (when the bundle has the layer).
        **({"eagle3": Eagle3Config(root / "eagle3", num_steps=5, topk=4, num_draft_tokens=16)}
           if (root / "eagle3").is_dir() else {}),
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="spectool demo", description=__doc__)
    p.add_argument("--out", default="spectool-demo", help="folder for traces, reports and summary.json")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts per workload")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        print("spectool demo: --num-prompts and --max-new-tokens must be >= 1", file=sys.stderr)
        return 2

    from rich.console import Console
    from rich.table import Table

    import spectool as st
    from spectool.trace.report import write_report

    root = demo_model()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    target = st.load(root / "target", device=args.device, dtype=dtype)
    workloads = {kind: load_prompts(root / "prompts.jsonl", kind)[: args.num_prompts]
                 for kind in ("completion", "editing")}
    console = Console()
    table = Table(title=f"spectool demo on {args.device} ({target.name})")
    for col in ("method", "workload", "accept length", "tok/s", "speedup", "trace"):
        table.add_column(col, justify="left" if col in ("method", "workload", "trace") else "right")
    summary = []
    for name, config in demo_configs(root).items():
        engine = st.Engine(target, draft=config, max_batch_size=4, max_seq_len=2048)
        for kind, prompts in workloads.items():
            engine.generate(prompts[:1], max_new_tokens=8, record=False)  # warm-up
            result = engine.generate(prompts, max_new_tokens=args.max_new_tokens, record=True)
            trace_path = out / f"{name}_{kind}.sptrace"
            result.trace.save(trace_path)
            if config is not None:
                write_report(result.trace, out / f"{name}_{kind}.html")
            stats = result.stats
            base = next((s["tokens_per_s"] for s in summary if s["method"] == "plain" and s["workload"] == kind),
                        stats.tokens_per_s)
            row = {"method": name, "workload": kind, "mean_accept_length": stats.mean_accept_length,
                   "tokens_per_s": stats.tokens_per_s, "speedup": stats.tokens_per_s / base if base else 0.0,
                   "trace": str(trace_path)}
            summary.append(row)
            table.add_row(name, kind, f"{row['mean_accept_length']:.2f}", f"{row['tokens_per_s']:.1f}",
                          f"{row['speedup']:.2f}x", trace_path.name)
            console.print(f"[dim]{name:>18} / {kind:<10} done[/dim]")
    console.print(table)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(f"traces, HTML reports and summary.json are in {out.resolve()}")
    return 0
