"""Which iterations a different configuration would have gained or lost, and where.

``iteration_gains(a, b)`` lines two runs of the same greedy requests up by output position
(both decode the same tokens): for every iteration of ``b`` it gives the tokens it gained and
how many iterations ``a`` spent on the same tokens. A Prediction or a recorded Trace can
stand on either side, so "recorded against predicted" and "predicted against predicted"
read the same way.
"""

from __future__ import annotations

import numpy as np


def _rows(run) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(request_id, iteration, seq_len, accept_length) of a Prediction or a Trace."""
    if hasattr(run, "steps"):
        s = run.steps
        cols = [np.asarray(s.column(c).to_pylist(), dtype=np.int64)
                for c in ("request_id", "iteration", "seq_len", "accept_length")]
        return tuple(cols)
    return run.request_id, run.iteration, run.seq_len, run.accept_length


def iteration_gains(a, b):
    """Per iteration of ``b``: request, iteration, seq_len, b's accept length and tokens gained;
    ``iterations_a``, the iterations of ``a`` that overlap the same output tokens, and ``saved`` =
    that minus 1 (> 0: b did in one iteration what took a several); where ``a`` also starts an
    iteration at that seq_len, ``tokens_a`` (what it gained there) and ``delta`` = tokens -
    tokens_a (> 0 gained, < 0 lost). Returns a pandas DataFrame."""
    import pandas as pd

    ra, _, la, aa = _rows(a)
    rb, ib, lb, ab = _rows(b)
    out = []
    for rid in np.unique(rb):
        order = np.argsort(la[ra == rid])
        starts_a = la[ra == rid][order]
        tokens_at = dict(zip(starts_a.tolist(), (aa[ra == rid][order] + 1).tolist()))
        sel = np.flatnonzero(rb == rid)
        for k in sel[np.argsort(lb[sel])]:
            lo, hi = lb[k], lb[k] + ab[k] + 1  # b's iteration starts at seq_len lo and ends at hi
            covering = int(np.searchsorted(starts_a, hi, side="left") - np.searchsorted(starts_a, lo, side="right"))
            # a's iteration that was running at lo (it started at or before lo) also covers tokens here
            n_a = covering + 1
            same = tokens_at.get(int(lo))
            out.append({"request_id": int(rid), "iteration": int(ib[k]), "seq_len": int(lo),
                        "accept_length": int(ab[k]), "tokens": int(ab[k]) + 1, "iterations_a": n_a,
                        "saved": n_a - 1, "tokens_a": same,
                        "delta": None if same is None else int(ab[k]) + 1 - same})
    return pd.DataFrame(out)
