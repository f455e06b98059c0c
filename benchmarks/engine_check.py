"""Graph vs eager, and speculative vs plain, on the bundled demo model (a quick GPU sanity run).

    python benchmarks/engine_check.py --device cuda

Prints, per method and graphs on/off: mean accept length, how many outputs equal plain
eager greedy decoding, tokens/s, and the graph counters.
"""

from __future__ import annotations

import argparse

import torch

import spectool as st
from spectool.cli.demo import demo_configs
from spectool.prompts import load_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    a = p.parse_args()
    root = st.demo_model()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    target = st.load(root / "target", device=a.device, dtype=dtype)
    prompts = [t[:600] for t in load_prompts(root / "prompts.jsonl")[: a.prompts]]
    kw = dict(max_new_tokens=a.max_new_tokens, record=False, ignore_eos=True)
    base = st.Engine(target, None, max_batch_size=a.batch_size, max_seq_len=2048, cuda_graphs=False)
    base = base.generate(prompts, **kw).token_ids
    print(f"{'method':<18} {'graphs':>6} {'accept':>7} {'same':>5} {'tok/s':>8}  graph stats")
    for name, config in demo_configs(root).items():
        for graphs in (False, True):
            engine = st.Engine(target, config, max_batch_size=a.batch_size, max_seq_len=2048, cuda_graphs=graphs)
            engine.generate(prompts[:1], max_new_tokens=8, record=False)
            r = engine.generate(prompts, **kw)
            same = sum(x == y for x, y in zip(r.token_ids, base))
            print(f"{name:<18} {graphs!s:>6} {r.stats.mean_accept_length:>7.2f} {same:>2}/{len(base):<2} "
                  f"{r.stats.tokens_per_s:>8.1f}  {engine.graph_stats()}")


if __name__ == "__main__":
    main()
