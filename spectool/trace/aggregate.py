"""Whole-trace series for plots and pickers, small whatever the trace's size.

`iteration_aggregates(trace, max_points)` takes the few scalar columns it needs
(iteration, request_id, accept_length, iteration_us: `Trace.scalars`, which a lazily
loaded trace reads with its index at open), reduces them to one value per iteration,
then downsamples: consecutive iterations are grouped into at
most ``max_points`` equal-width buckets, and each bucket keeps its mean, min and max
(so a plot of the means with a min-max band shows every outlier a full plot would).
A view that needs one iteration's tree reads it with `Trace.iteration`; a request's
rows with `Trace.request_steps`.
"""

from __future__ import annotations

import numpy as np


def _bucket(values: np.ndarray, edges: np.ndarray) -> dict[str, list]:
    starts = edges[:-1]
    counts = np.diff(edges)
    sums = np.add.reduceat(values, starts) if len(values) else np.zeros(0)
    return {"mean": (sums / np.maximum(counts, 1)).tolist(),
            "min": (np.minimum.reduceat(values, starts) if len(values) else np.zeros(0)).tolist(),
            "max": (np.maximum.reduceat(values, starts) if len(values) else np.zeros(0)).tolist()}


def iteration_aggregates(trace, max_points: int = 2000) -> dict:
    """Downsampled per-iteration series and per-request totals of ``trace``.

    Returns a dict:
    - ``iteration``: the first iteration of each bucket; ``bucket_size``: iterations per bucket;
    - ``accept_length``: mean accept length over the bucket's records, as {mean, min, max} of the
      per-iteration means; ``batch``: records per iteration {mean, min, max};
    - ``iteration_us``: {mean, min, max} over the bucket's iterations (empty when not recorded);
    - ``histogram``: records per accept length over the whole trace;
    - ``requests``: per request id ascending: ``id``, ``records``, ``mean_accept_length``,
      ``first_iteration``, ``last_iteration`` (what a searchable request picker lists).
    """
    if max_points < 1:
        raise ValueError(f"max_points must be >= 1, got {max_points}")
    cols = trace.scalars()
    its, reqs, times = cols["iteration"], cols["request_id"], cols["iteration_us"]
    acc = np.maximum(cols["accept_length"], 0).astype(np.float64)

    uniq, first, inverse = np.unique(its, return_index=True, return_inverse=True)
    per_it_n = np.bincount(inverse, minlength=len(uniq)).astype(np.float64)
    per_it_acc = np.bincount(inverse, weights=acc, minlength=len(uniq)) / np.maximum(per_it_n, 1)
    per_it_us = times[first] if len(times) else np.zeros(0)
    size = max(1, -(-len(uniq) // max_points))
    edges = np.r_[np.arange(0, len(uniq), size), len(uniq)].astype(np.int64)
    out = {"iteration": uniq[edges[:-1]].tolist() if len(uniq) else [], "bucket_size": size,
           "accept_length": _bucket(per_it_acc, edges), "batch": _bucket(per_it_n, edges),
           "iteration_us": _bucket(per_it_us, edges) if len(uniq) and not np.isnan(per_it_us).all() else
           {"mean": [], "min": [], "max": []},
           "histogram": np.bincount(acc.astype(np.int64)).tolist() if len(acc) else []}

    ids, rinv = np.unique(reqs, return_inverse=True)
    counts = np.bincount(rinv, minlength=len(ids))
    first_it = np.full(len(ids), np.iinfo(np.int64).max)
    last_it = np.full(len(ids), -1)
    np.minimum.at(first_it, rinv, its)
    np.maximum.at(last_it, rinv, its)
    out["requests"] = {"id": ids.tolist(), "records": counts.tolist(),
                       "mean_accept_length": (np.bincount(rinv, weights=acc, minlength=len(ids))
                                              / np.maximum(counts, 1)).tolist(),
                       "first_iteration": first_it.tolist(), "last_iteration": last_it.tolist()}
    return out
