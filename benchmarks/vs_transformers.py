"""spectool against transformers' own speculative paths, on the same target and prompts.

Figure: docs/BENCHMARKS.md "Against transformers". Time: about 1 minute on an H200.

    python benchmarks/vs_transformers.py                       # H200: demo target, 3 prompts each, 96 tokens
    python benchmarks/vs_transformers.py --assistant DIR       # a trained small draft for assisted generation
    python benchmarks/vs_transformers.py --device cpu --quick  # smoke test

Greedy, batch 1, one prompt at a time, ``max_new_tokens`` = ``min_new_tokens`` (transformers)
or ``ignore_eos`` (spectool) so both produce the same number of tokens. Pairs:

* editing workload: transformers prompt-lookup decoding (``prompt_lookup_num_tokens=10``)
  against spectool N-gram (NgramConfig defaults; a fresh engine, so a fresh trie, per prompt);
* completion workload: transformers assisted generation (``assistant_model`` = the first
  ``--assistant-layers`` layers of the target, or ``--assistant DIR``) against spectool EAGLE
  (5 steps, top-k 4, 16 tokens).

tokens/s = generated tokens / wall time of the generate calls (prefill included, for
both sides). transformers' accept length = tokens per target forward - 1, counted with
a forward hook on the target (every assisted iteration is one target forward). The
plain transformers greedy rate is shown for context. Prints a table; writes
$OUT/vs_transformers.json (or --out DIR).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from speculative import (
    add_common_arguments,
    draft_config,
    fmt,
    load_target,
    measure,
    run_meta,
    seed_all,
    workload_prompts,
    write_json,
)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def hf_generate(model, prompts: list[list[int]], new_tokens: int, device: torch.device, **kwargs) -> dict:
    """Greedy ``generate`` per prompt; tokens/s over the wall time of all calls, target forwards counted."""
    calls = [0]
    hook = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    args = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                **kwargs)
    try:
        with torch.inference_mode():
            model.generate(torch.tensor([prompts[0]], device=device), **{**args, "max_new_tokens": 4,
                                                                         "min_new_tokens": 4})  # warm-up
            calls[0], tokens, seconds = 0, 0, 0.0
            for ids in prompts:
                x = torch.tensor([ids], device=device)
                sync(device)
                t0 = time.perf_counter()
                out = model.generate(x, **args)
                sync(device)
                seconds += time.perf_counter() - t0
                tokens += out.shape[1] - x.shape[1]
    finally:
        hook.remove()
    return {"tokens_per_s": tokens / seconds, "mean_accept_length": tokens / calls[0] - 1,
            "target_forwards": calls[0], "generated_tokens": tokens}


def spectool_generate(target, draft, prompts: list[list[int]], new_tokens: int, seed: int) -> dict:
    """One fresh engine per prompt (batch 1); the same wall-time tokens/s as ``hf_generate``."""
    runs = [measure(target, draft, [ids], new_tokens, len(ids) + new_tokens + 8, seed) for ids in prompts]
    tokens = sum(r["generated_tokens"] for r in runs)
    iterations = sum(r["iterations"] for r in runs)
    accept = sum(r["mean_accept_length"] * r["iterations"] for r in runs) / max(iterations, 1)
    return {"tokens_per_s": tokens / sum(r["wall_s"] for r in runs), "mean_accept_length": accept,
            "decode_tokens_per_s": sum(r["tokens_per_s"] for r in runs) / len(runs),
            "generated_tokens": tokens}


def load_hf(path: str, device: torch.device, **overrides):
    """transformers' model of a local HF directory, or None (with the reason printed) if it cannot."""
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging
    except ImportError:
        print("transformers is not installed: its columns are n/a")
        return None
    logging.set_verbosity_error()  # the truncated assistant's unused-weights report would flood the log
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **overrides).to(device).eval()
    except Exception as e:  # an incompatible transformers version: report it, keep the spectool side
        print(f"transformers could not load {path}: {e!r}")
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    p.add_argument("--num-prompts", type=int, default=3, help="prompts per workload")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens")
    p.add_argument("--assistant", help="HF directory of the assistant model (default: truncated target)")
    p.add_argument("--assistant-layers", type=int, default=2, help="layers kept when truncating the target")
    args = p.parse_args(argv)
    num_prompts, new_tokens, max_prompt = args.num_prompts, args.new_tokens, None
    if args.quick:
        num_prompts, new_tokens, max_prompt = 1, 3, 16
    device = torch.device(args.device)
    seed_all(args.seed)
    target = load_target(args.model, args.device)
    pairs = [  # (workload, spectool method, transformers path, its generate kwargs)
        ("editing", "ngram", "prompt lookup", {"prompt_lookup_num_tokens": args.lookup_tokens}),
        ("completion", "eagle", "assisted", None),
    ]
    prompts = {w: workload_prompts(target, args.prompts, w, num_prompts, max_prompt) for w, *_ in pairs}

    rows = []
    for workload, method, _, _ in pairs:
        seed_all(args.seed)
        ours = spectool_generate(target, draft_config(method, args.draft_dir), prompts[workload], new_tokens,
                                 args.seed)
        rows.append({"workload": workload, "spectool_method": method, "spectool": ours})
    del target
    gc.collect()

    hf = load_hf(args.model, device)
    assistant = None
    if hf is not None:
        assistant = (load_hf(args.assistant, device) if args.assistant
                     else load_hf(args.model, device, num_hidden_layers=args.assistant_layers))
    for row, (workload, _, hf_name, kwargs) in zip(rows, pairs):
        row["hf_method"] = hf_name
        row["hf"] = row["hf_plain"] = None
        if hf is None or (kwargs is None and assistant is None):
            continue
        kwargs = kwargs if kwargs is not None else {"assistant_model": assistant}
        try:
            row["hf"] = hf_generate(hf, prompts[workload], new_tokens, device, **kwargs)
            row["hf_plain"] = hf_generate(hf, prompts[workload], new_tokens, device)
        except Exception as e:  # a transformers version without the feature: report it as n/a
            print(f"transformers {hf_name} failed: {e!r}")
        if row["hf"]:
            row["ratio"] = row["spectool"]["tokens_per_s"] / row["hf"]["tokens_per_s"]

    print(f"\nvs_transformers.py — {run_meta(args)['gpu'] or args.device}; target {args.model}; batch 1, "
          f"greedy, {num_prompts} prompts x {new_tokens} tokens; tok/s = tokens / wall time of generate "
          "(prefill included)")
    print(f"{'workload':<10} {'spectool':<8} {'tok/s':>8} {'accept':>6} | {'transformers':<13} {'tok/s':>8} "
          f"{'accept':>6} {'plain':>7} | {'ratio':>6}")
    for r in rows:
        ours, theirs, plain = r["spectool"], r["hf"] or {}, r["hf_plain"] or {}
        print(f"{r['workload']:<10} {r['spectool_method']:<8} {ours['tokens_per_s']:>8.1f} "
              f"{ours['mean_accept_length']:>6.2f} | {r['hf_method']:<13} "
              f"{fmt(theirs.get('tokens_per_s')):>8} "
              f"{fmt(theirs.get('mean_accept_length'), '.2f'):>6} {fmt(plain.get('tokens_per_s')):>7} | "
              f"{fmt(r.get('ratio'), '.1f'):>5}x")
    assistant_desc = args.assistant or f"first {args.assistant_layers} layers of the target"
    write_json("vs_transformers.json", {"meta": {**run_meta(args), "model": args.model,
                                                 "assistant": assistant_desc, "new_tokens": new_tokens,
                                                 "num_prompts": num_prompts}, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
