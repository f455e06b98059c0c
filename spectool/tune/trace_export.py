"""A prediction as a Trace: the rows the engine would have recorded for that configuration.

Each row holds the predicted tree (tokens, parents, validity, mask, positions, retrieve
arrays), the verifier's decision against the recorded output (status, accepted path, accept
length, bonus token), the target's argmax where the recorded output says it (nodes whose
path is the output; -1 elsewhere) with no probabilities, and no timings (nothing was run). The requests are the
recorded ones, their outputs cut to what the prediction decoded.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from spectool.trace.schema import NOT_VISITED, REQUEST_SCHEMA, STEP_SCHEMA
from spectool.tune.accept import accepted_path

ACCEPTED, REJECTED = 1, 2


def _tree_arrays(parents: list[int]) -> tuple[list[int], np.ndarray, list[int], list[int]]:
    """(depth, ancestor mask [N, N], first child, next sibling) of a tree in topological order."""
    n = len(parents)
    depth = [0] * n
    mask = np.eye(n, dtype=bool)
    first = [-1] * n
    sibling = [-1] * n
    last_child = [-1] * n
    for i in range(1, n):
        p = parents[i]
        depth[i] = depth[p] + 1
        mask[i] |= mask[p]
        if first[p] < 0:
            first[p] = i
        else:
            sibling[last_child[p]] = i
        last_child[p] = i
    return depth, mask, first, sibling


def _known_argmax(tokens, parents, valid, depth, known: list[int], seq_len: int) -> list[int]:
    """The target's argmax at each node whose root path is the recorded output (the next recorded
    token), -1 where the trace cannot say (the node's path left the output)."""
    out = [-1] * len(tokens)
    on_output = [False] * len(tokens)
    on_output[0] = True
    for i in range(len(tokens)):
        if i and valid[i] and on_output[parents[i]]:
            on_output[i] = seq_len + depth[i] < len(known) and tokens[i] == known[seq_len + depth[i]]
        nxt = seq_len + depth[i] + 1
        if on_output[i] and nxt < len(known):
            out[i] = known[nxt]
    return out


def _status(parents: list[int], valid: list[bool], path: list[int]) -> list[int]:
    """The verifier's node status: the path accepted; children of accepted nodes before the child
    taken (all of them when none was) rejected; the rest not visited."""
    on_path = set(path)
    taken = {path[k]: path[k + 1] for k in range(len(path) - 1)}
    status = [NOT_VISITED] * len(parents)
    for i in range(len(parents)):
        if i in on_path:
            status[i] = ACCEPTED
        elif valid[i] and parents[i] in on_path and i < taken.get(parents[i], len(parents)):
            status[i] = REJECTED
    return status


def prediction_trace(pred, trace):
    """The Trace of a Prediction made from ``trace`` (see the module docstring)."""
    from spectool.trace.reader import Trace

    if pred.trees is None:
        raise ValueError("this prediction kept no trees")
    workload = pred.extra.get("workload")
    known = {r.request_id: r.known.tolist() for r in workload.requests}
    num_output = {r.request_id: r.num_output for r in workload.requests}
    rows = []
    row_in_batch: dict[int, int] = {}
    for k in range(pred.accept_length.size):
        it, rid, seq_len = int(pred.iteration[k]), int(pred.request_id[k]), int(pred.seq_len[k])
        b = row_in_batch[it] = row_in_batch.get(it, -1) + 1
        tokens, parents, valid = pred.trees[k]
        n = len(tokens)
        depth, mask, first, sibling = _tree_arrays(parents)
        path = accepted_path(tokens, parents, valid, known[rid], seq_len)
        a = int(pred.accept_length[k])
        argmax = _known_argmax(tokens, parents, valid, depth, known[rid], seq_len)
        bonus_at = seq_len + a + 1
        rows.append({
            "iteration": it, "request_id": rid, "method": pred.method, "seq_len": seq_len, "num_nodes": n,
            "tokens": list(tokens), "parents": list(parents), "depth": depth, "scores": [0.0] * n,
            "valid": list(valid), "mask_packed": np.packbits(mask.reshape(-1)).tobytes(),
            "positions": [seq_len + d for d in depth], "retrieve_index": [b * n + i for i in range(n)],
            "retrieve_next_token": first, "retrieve_next_sibling": sibling,
            "status": _status(parents, valid, path), "accept_path": path, "accept_length": a,
            "bonus_token": known[rid][bonus_at] if bonus_at < len(known[rid]) else None,
            "target_argmax": argmax, "target_argmax_prob": [float("nan")] * n,
            "target_topk_tokens": argmax, "target_topk_probs": [float("nan")] * n,
            "temperature": 0.0, "ngram_match_len": None, "ngram_breadth": None,
        })
    steps = pa.Table.from_pylist(rows, schema=STEP_SCHEMA)
    requests = []
    for r in trace.requests.to_pylist():
        rid = int(r["request_id"])
        if rid in num_output:
            requests.append({**r, "output_tokens": list(r["output_tokens"])[:num_output[rid]]})
    info = dict(trace.run_info or {})
    info["draft"] = pred.config.to_dict() if pred.config is not None else {"method": "none"}
    info["predicted"] = {"from_start_time": (trace.run_info or {}).get("start_time"), "exact": pred.exact}
    return Trace(steps, pa.Table.from_pylist(requests, schema=REQUEST_SCHEMA), info, trace.tokenizer_json)
