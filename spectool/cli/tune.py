"""``spectool tune``: exact what-if of other draft settings over a recorded greedy trace.

    spectool tune run.sptrace --profile demo-cpu --batch-size 4 \\
        --grid num_draft_tokens=4,8,16 --grid max_bfs_breadth=1,4,8

Prints the ranked table, the recommended configuration, and the same configuration as
SGLang launch flags and a vLLM speculative_config.
"""

from __future__ import annotations

import argparse
import json
import sys

from spectool.cli.args import BadInput, fail, open_trace, parser


def _grid_item(text: str) -> tuple[str, list]:
    name, sep, values = text.partition("=")
    if not sep or not values.strip():
        raise argparse.ArgumentTypeError(f"--grid takes NAME=V1,V2,... got {text!r}")
    out = []
    for v in values.split(","):
        v = v.strip()
        out.append(int(v) if v.lstrip("-").isdigit() else v)
    return name.strip().replace("-", "_"), out


def main(argv: list[str]) -> int:
    p = parser("tune", "Predict, exactly and without running the target's verify, the accept length every "
                       "other draft setting would have had on a recorded greedy trace, and with a cost profile "
                       "its tokens/s; print them ranked, the recommended setting, and the same setting as "
                       "SGLang launch flags and a vLLM speculative_config. Example: spectool tune run.sptrace "
                       "--profile demo-cpu --grid num_draft_tokens=4,8,16 --grid max_bfs_breadth=1,4")
    p.add_argument("trace", help="a greedy .sptrace file")
    p.add_argument("--profile", help="cost profile JSON (or a shipped name) for predicted tokens/s")
    p.add_argument("--batch-size", type=int, help="max_batch_size to predict for (default: the recorded one)")
    p.add_argument("--method", choices=["ngram", "eagle", "multi_layer_eagle"],
                   help="draft method to tune (default: the trace's)")
    p.add_argument("--grid", action="append", type=_grid_item, default=[],
                   help="a setting and its values, NAME=V1,V2 (repeatable); default: a grid per method")
    p.add_argument("--draft-path", help="draft checkpoint (eagle methods; default: the recorded one)")
    p.add_argument("--model", help="target directory (eagle methods; default: the recorded one)")
    p.add_argument("--max-new-tokens", type=int, help="tune over only this many output tokens per request")
    p.add_argument("--top", type=int, default=10, help="rows of the table to print")
    p.add_argument("--allow-other-model", action="store_true", help="accept a profile measured for another model")
    p.add_argument("--json", help="also write the table and the recommendation to this file")
    args = p.parse_args(argv)

    try:
        trace = open_trace("tune", args.trace)
    except BadInput as e:
        return fail("tune", e)
    from spectool.tune.recommend import tune
    from spectool.tune.workload import TuneError

    try:
        import spectool as st

        method = args.method or (trace.run_info.get("draft") or {}).get("method")
        target = None
        if method in ("eagle", "multi_layer_eagle"):
            import torch

            model = args.model or (trace.run_info.get("model") or {}).get("name")
            if not model:
                raise TuneError("the trace names no model: pass --model")
            target = st.load(model, device="cpu", dtype=torch.float32)
        result = tune(trace, grid=dict(args.grid) or None, profile=args.profile, batch_size=args.batch_size,
                      method=args.method, max_new_tokens=args.max_new_tokens, target=target,
                      draft_path=args.draft_path, allow_other_model=args.allow_other_model,
                      progress=sys.stderr.isatty())
    except (TuneError, ValueError, OSError) as e:
        return fail("tune", e)
    print(result.report(top=args.top))
    if args.json:
        out = {"table": json.loads(result.frame.to_json(orient="records")), "recommended": result.best.to_dict(),
               "sglang_flags": result.sglang_flags(), "vllm_speculative_config": result.vllm_config()}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0
