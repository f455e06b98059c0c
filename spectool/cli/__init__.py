"""The ``spectool`` command: one module per subcommand in this package, each with ``main(argv) -> int``.

Exit codes, the same for every command: 0 ok, 1 a failed check, 2 bad input (options, files, traces).
"""

from __future__ import annotations

import sys
from importlib import import_module

# subcommand -> (module, function taking argv and returning an exit code, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("spectool.cli.demo", "main", "decode the bundled demo prompts with every draft method; "
             "summary table, traces and an HTML report"),
    "record": ("spectool.cli.record", "main", "decode prompts with one draft method and record a trace"),
    "summary": ("spectool.cli.summary", "main", "summarise a trace: accept length, per-depth rates, timings"),
    "check": ("spectool.cli.check", "main", "verify a trace's internal consistency (and optionally replay it)"),
    "report": ("spectool.cli.report", "main", "write one standalone HTML report of a trace"),
    "query": ("spectool.cli.query", "main", "run SQL (DuckDB) over a trace's records, requests and tree nodes"),
    "export-perfetto": ("spectool.cli.export_perfetto", "main", "export phase timings as Chrome/Perfetto trace JSON"),
    "train-target": ("spectool.cli.train_target", "main", "train a BPE tokenizer and a small target"),
    "train-draft": ("spectool.cli.train_draft", "main", "train EAGLE, EAGLE-3 or multi-layer EAGLE draft layers"),
    "bench": ("spectool.cli.bench", "main", "time plain vs speculative decoding on a model and prompts"),
    "tune": ("spectool.cli.tune", "main", "exact what-if of other draft settings over a greedy trace; "
             "ranked table, recommendation, SGLang and vLLM settings"),
    "audit": ("spectool.cli.audit", "main", "test that speculative decoding reproduces plain decoding (greedy: "
              "first divergence and its logit margin; sampled: chi-square on the first tokens)"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: spectool COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "`spectool COMMAND --help` shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``spectool`` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] not in COMMANDS:
        print(f"spectool: unknown command {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[argv[0]]
    try:
        return int(getattr(import_module(module), func)(argv[1:]) or 0)
    except SystemExit as e:  # argparse: 0 after --help, 2 for a bad option (it printed why)
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2


if __name__ == "__main__":
    sys.exit(main())
