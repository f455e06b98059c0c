"""``spectool record``: decode prompts with one draft method and save the trace (spectool's draft options
or SGLang's ``--speculative-*`` flags)."""

from __future__ import annotations

import sys

from spectool.cli.args import add_draft_arguments, add_run_arguments, build_engine, fail, parser
from spectool.cli.launch import launch, launched


def main(argv: list[str]) -> int:
    p = parser("record", "Decode prompts with one draft method and record every draft tree, mask and acceptance "
                         "decision to a trace file (see `spectool summary`, `check`, `report`).")
    add_run_arguments(p)
    add_draft_arguments(p)
    p.add_argument("--out", required=True, help="trace file to write (.sptrace)")
    keep = p.add_argument_group("what to record (options combine; default: every record)")
    keep.add_argument("--record-every", type=int, default=1, metavar="K", help="every K-th iteration")
    keep.add_argument("--record-requests", metavar="IDS", help="only these request ids, e.g. 0,3,5")
    keep.add_argument("--record-where", metavar="COND", help='only records matching, e.g. "accept_length == 0"')
    keep.add_argument("--record-slowest", type=float, metavar="P", help="only the slowest fraction P of iterations")
    args, unknown = p.parse_known_args(argv)
    if unknown:
        speculative = [a for a in unknown if a.startswith("--speculative-")]
        if speculative:
            from spectool.deploy import parse_sglang_flags

            try:
                parse_sglang_flags(speculative)  # names the flag and why it cannot be honoured
            except ValueError as e:
                return fail("record", e)
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.tp > 1 and not launched():  # one process per rank, this command in each
        return launch([sys.executable, "-m", "spectool", "record", *argv], args.tp)
    from spectool.prompts import load_prompts
    from spectool.trace.select import Record

    try:
        prompts = load_prompts(args.prompts, args.kind)[: args.num_prompts]
        requests = None if args.record_requests is None else [int(r) for r in args.record_requests.split(",")]
        # Straight to the file, batch by batch: memory stays bounded, and a run killed midway leaves the
        # records up to its last complete batch.
        record = Record(every=args.record_every, requests=requests, where=args.record_where,
                        slowest=args.record_slowest, path=args.out)
        engine = build_engine(args, prompts)
        result = engine.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 top_k=args.top_k, top_p=args.top_p, seed=args.seed, record=record, progress=True)
    except (ValueError, OSError) as e:  # bad options or files (BadInput is a ValueError); an unreachable hub id
        return fail("record", e)
    if result.trace is None:  # a rank other than 0 of a split target: rank 0 records
        return 0
    print(f"{len(prompts)} requests, mean accept length {result.stats.mean_accept_length:.2f}, "
          f"{result.stats.tokens_per_s:.1f} tok/s; trace written to {args.out}")
    return 0
