"""``spectool demo``: the bundled model, both draft families, a summary table, traces and reports."""

from __future__ import annotations

import json
from pathlib import Path

from spectool.cli.args import POSITIVE, add_device_argument, fail, parser, resolve_device
from spectool.config import Eagle3Config, EagleConfig, MultiLayerEagleConfig, NgramConfig

# --quick: the same run, short (one prompt per workload, a few tokens): a smoke test of an install.
QUICK = {"num_prompts": 1, "max_new_tokens": 16}
# Why speculative rows can be slower than plain on a CPU: the demo target is so small (5 layers of width 256)
# that drafting a tree costs about what the target's own step does.
CPU_NOTE = "On a CPU drafting costs about as much as this tiny target: it rarely pays here."


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
    p = parser("demo", "Decode the bundled demo prompts (completion and editing) with plain decoding, N-gram, "
                       "EAGLE and multi-layer EAGLE drafting; print a summary table and write each run's trace, "
                       "an HTML report of it and summary.json to --out.")
    p.add_argument("--out", default="spectool-demo", help="folder for traces, reports and summary.json")
    p.add_argument("--num-prompts", type=POSITIVE, default=4, help="prompts per workload")
    p.add_argument("--max-new-tokens", type=POSITIVE, default=64, help="tokens generated per prompt")
    p.add_argument("--quick", action="store_true",
                   help=f"a short run ({QUICK['num_prompts']} prompt per workload, {QUICK['max_new_tokens']} "
                        "tokens), e.g. to check an install")
    add_device_argument(p)
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_new_tokens = QUICK["num_prompts"], QUICK["max_new_tokens"]
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return fail("demo", f"--out {out} is a file, not a folder")

    import torch
    from rich.console import Console

    import spectool as st
    from spectool.demo import demo_model
    from spectool.prompts import load_prompts
    from spectool.trace.report import write_report

    device = resolve_device(args.device)
    root = demo_model()
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    target = st.load(root / "target", device=device, dtype=dtype)
    workloads = {kind: load_prompts(root / "prompts.jsonl", kind)[: args.num_prompts]
                 for kind in ("completion", "editing")}
    console = Console()
    console.print(f"spectool demo on {device} ({torch.get_num_threads()} threads)" if device == "cpu"
                  else f"spectool demo on {device}")
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
            summary.append({"method": name, "workload": kind, "device": device,
                            "mean_accept_length": None if config is None else stats.mean_accept_length,
                            "tokens_per_s": stats.tokens_per_s,
                            "speedup": stats.tokens_per_s / base if base else 0.0, "trace": str(trace_path)})
            console.print(f"[dim]{name:>17} / {kind:<10} done[/dim]")
    console.print(demo_table(summary, device))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if device == "cpu" and any(r["speedup"] < 1 for r in summary if r["method"] != "plain"):
        console.print(CPU_NOTE)
    console.print(f"traces, HTML reports and summary.json: {out.resolve()}")
    return 0


def demo_table(rows: list[dict], device: str):
    """The demo's summary as a rich Table that fits an 80-column terminal."""
    from rich.table import Table

    table = Table(title="spectool demo: plain decoding against drafting")
    table.add_column("method", no_wrap=True)
    table.add_column("workload", no_wrap=True)
    table.add_column("accept length", justify="right")
    table.add_column("tok/s", justify="right")
    table.add_column(f"speedup on {device}", justify="right")
    for r in rows:
        accept = "-" if r["mean_accept_length"] is None else f"{r['mean_accept_length']:.2f}"
        table.add_row(r["method"], r["workload"], accept, f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x")
    return table
