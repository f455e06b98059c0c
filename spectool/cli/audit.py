"""``spectool audit``: plain against speculative decoding on the same prompts, measured."""

from __future__ import annotations

from spectool.cli.args import POSITIVE, add_draft_arguments, add_run_arguments, build_engine, fail, number, parser


def main(argv: list[str]) -> int:
    """Command line: exit 0 agree, 1 a divergence that is not a near-tie or a failed test, 2 bad input."""
    p = parser("audit", "Test that speculative decoding reproduces plain decoding on the same prompts. Greedy "
                        "(--temperature 0): the first divergence of each request, with the two tokens' logit gap "
                        "and the top-2 margin there, classified as a near-tie (below the dtype's rounding at that "
                        "magnitude) or a bug. Sampled: each prompt is decoded --samples times by both and the "
                        "distributions of the first --positions tokens after the prefill token are compared with "
                        "chi-square tests. Exits 0 when they agree, 1 naming each bug or failed test, 2 on bad "
                        "input.")
    add_run_arguments(p)
    add_draft_arguments(p)
    p.add_argument("--samples", type=number(int, 2), default=400, help="sampled runs per prompt and engine")
    p.add_argument("--positions", type=POSITIVE, default=2, help="output positions tested after the prefill token")
    p.add_argument("--alpha", type=number(float, 0, 1, low_open=True), default=1e-3,
                   help="false-alarm rate of the whole sampled audit (split over its tests)")
    args = p.parse_args(argv)
    import spectool as st
    from spectool.prompts import load_prompts
    from spectool.trace.audit import greedy_audit, sampled_audit

    try:
        prompts = load_prompts(args.prompts, args.kind)[: args.num_prompts]
        spec = build_engine(args, prompts)
        plain = st.Engine(spec.target, draft=None, max_batch_size=args.batch_size, max_seq_len=args.max_seq_len)
    except (ValueError, OSError) as e:  # bad options or files (BadInput is a ValueError); an unreachable hub id
        return fail("audit", e)
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
