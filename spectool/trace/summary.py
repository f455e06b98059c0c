"""`spectool summary TRACE`: accept length, per-depth acceptance, tokens/s and phase times."""

from __future__ import annotations

from spectool.trace.reader import Trace


def summary_table(trace: Trace):
    """A rich Table of `trace.summary()` (formulas in spectool.trace.stats)."""
    from rich.table import Table

    s = trace.summary()
    draft = trace.run_info.get("draft", {})
    method = draft.get("method") or trace.run_info.get("method", "?")
    table = Table(title=f"spectool trace: {method}, {s['records']} records, {s['iterations']} iterations")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("tokens gained by verification", str(s["tokens"]))
    table.add_row("mean accept length", f"{s['mean_accept_length']:.3f}")
    table.add_row("tokens per record (accept + bonus)", f"{s['mean_accept_length'] + 1:.3f}")
    tps = s["tokens_per_s"]
    table.add_row("tokens/s (decode)", "not recorded" if tps is None else f"{tps:,.1f}")
    hist = s["accept_length_histogram"]
    total = sum(hist) or 1
    for a, count in enumerate(hist):
        table.add_row(f"accept length {a}", f"{count} ({100 * count / total:.1f} %)")
    for d, rate in enumerate(s["accept_rate_by_depth"], start=1):
        table.add_row(f"acceptance at depth {d}", f"{100 * rate:.1f} %")
    for phase, us in s["phase_us"].items():
        table.add_row(f"{phase.removesuffix('_us')} (µs / iteration)", f"{us:,.1f}")
    if trace.truncated:
        table.caption = "the file ends in an incomplete batch (the run was cut short)"
    return table
