"""``spectool audit``: plain against speculative decoding on the same prompts, measured.

Greedy (``--temperature 0``, the default): the first divergence per request with its logit
margin, a near-tie or a bug. Sampled: chi-square tests of the first tokens' distributions.
Exit 0 when they agree (near-ties only), 1 naming each failure, 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys

from spectool.cli.args import add_draft_arguments, add_run_arguments, build_engine
from spectool.prompts import load_prompts


def main(argv: list[str]) -> int:
    """Command line: exit 0 agree, 1 a divergence that is not a near-tie or a failed test, 2 bad input."""
    p = argparse.ArgumentParser(prog="spectool audit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p)
    add_draft_arguments(p)
    p.add_argument("--samples", type=int, default=400, help="sampled runs per prompt and engine (sampled audit)")
    p.add_argument("--positions", type=int, default=2,
                   help="output positions tested after the prefill token (sampled audit)")
    p.add_argument("--alpha", type=float, default=1e-3,
                   help="false-alarm rate of the whole sampled audit (Bonferroni over its tests)")
    args = p.parse_args(argv)
    import spectool as st
    from spectool.trace.audit import greedy_audit, sampled_audit

    if args.samples < 2 or args.positions < 1 or not 0 < args.alpha < 1:
        print("spectool audit: --samples >= 2, --positions >= 1 and 0 < --alpha < 1", file=sys.stderr)
        return 2
    try:
        prompts = load_prompts(args.prompts, args.kind)[: args.num_prompts]
        spec = build_engine(args)
        plain = st.Engine(spec.target, draft=None, max_batch_size=args.batch_size, max_seq_len=args.max_seq_len)
    except (ValueError, OSError) as e:
        print(f"spectool audit: {e}", file=sys.stderr)
        return 2
    if args.temperature == 0:
        report = greedy_audit(plain, spec, prompts, args.max_new_tokens)
        for d in report.greedy:
            print(f"divergence {d}")
        print(f"{len(prompts)} prompts: {len(prompts) - len(report.greedy)} identical, "
              f"{sum(d.near_tie for d in report.greedy)} near-ties, {len(report.failures)} bugs")
    else:
        report = sampled_audit(plain, spec, prompts, args.samples, args.positions, args.temperature,
                               args.top_k, args.top_p, args.seed, args.alpha)
        for t in report.failures:
            print(f"FAULT distributions differ: {t}")
        print(f"{len(report.tests)} chi-square tests at p < {report.threshold:.3g} each (false-alarm rate "
              f"{args.alpha:g} in all): {len(report.failures)} failed")
    return 1 if report.failures else 0
