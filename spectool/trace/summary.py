"""`spectool summary TRACE`: accept length, per-depth acceptance, tokens/s and phase times."""

from __future__ import annotations

from spectool.trace.reader import Trace


def emitted_tokens(trace: Trace) -> int | None:
    """Output tokens the iterations emitted (each request's output less its prefill token), None when the trace
    has no request rows (a file cut short before its end)."""
    if trace.requests.num_rows == 0:
        return None
    return sum(max(len(out) - 1, 0) for out in trace.requests.column("output_tokens").to_pylist() if out)


def summary_table(trace: Trace):
    """A rich Table of `trace.summary()` (formulas in spectool.trace.stats)."""
    from rich.table import Table

    s = trace.summary()
    method = trace.method
    label = "plain decoding" if method == "none" else method
    table = Table(title=f"spectool trace: {label}, {s['records']} records, {s['iterations']} iterations")
    table.add_column("metric")
    table.add_column("value", justify="right")
    if s["selection"]:
        table.add_row("records kept (of the run)", f"{100 * s['kept_fraction']:.1f} % ({s['selection']})")
    emitted = emitted_tokens(trace)
    table.add_row("tokens verified (accepted + bonus)", str(s["tokens"]))
    if emitted is not None:
        table.add_row("tokens emitted (output less prefill)", str(emitted))
    tps = s["tokens_per_s"]
    table.add_row("verified tokens/s (decode)", "not recorded" if tps is None else f"{tps:,.1f}")
    if method != "none":  # plain decoding drafts nothing: its accept length is no result
        table.add_row("mean accept length", f"{s['mean_accept_length']:.3f}")
        table.add_row("tokens per record (accept + bonus)", f"{s['mean_accept_length'] + 1:.3f}")
        hist = s["accept_length_histogram"]
        total = sum(hist) or 1
        for a, count in enumerate(hist):
            table.add_row(f"accept length {a}", f"{count} ({100 * count / total:.1f} %)")
        for d, rate in enumerate(s["accept_rate_by_depth"], start=1):
            table.add_row(f"acceptance at depth {d}", f"{100 * rate:.1f} %")
    for phase, us in s["phase_us"].items():
        if us > 0:  # a phase this method does not have (or this device does not time) records 0
            table.add_row(f"{phase.removesuffix('_us')} (µs / iteration)", f"{us:,.1f}")
    from spectool.trace.suspicious import suspicious_numbers

    for warning in suspicious_numbers(trace):
        table.add_row("[bold red]warning[/]", warning)
    notes = []
    if emitted is not None and emitted < s["tokens"]:
        notes.append(f"{s['tokens'] - emitted} verified tokens past max_new_tokens or a stop token were dropped")
    if trace.truncated:
        notes.append(f"the file ends inside a batch or holds a damaged one ({trace.damage}): its complete records"
                     if trace.damage else "the file ends inside a batch (the run was cut short): its complete records")
    if s["selection"]:
        notes.append(f"computed over the {100 * s['kept_fraction']:.1f} % of records the trace keeps, "
                     "not the whole run")
    table.caption = "; ".join(notes) or None
    return table
