"""`spectool check TRACE [--replay MODEL_DIR]`: is a trace internally consistent?

Checks, for every (iteration, request) record in trace order:
- shapes: every per-node array has num_nodes entries, the packed mask N*N bits;
- the tree: parents[0] = -1 and 0 <= parents[i] < i; depth = parent's depth + 1;
- mask = ancestors of parents (plus the diagonal);
- positions and retrieve_* = the rule of `reconstruct_indices_from_tree_mask` (recomputed in numpy) applied to the
  recorded mask and seq_len (retrieve_index relative to the row's first entry,
  since a row does not know its batch position);
- the decision: accept_path starts at the root and walks parent -> child through
  valid nodes marked accepted, accept_length = len(accept_path) - 1; when greedy
  (temperature 0) each accepted token equals the target argmax at its parent, no
  child of the last node matches its argmax, and the bonus is that argmax;
- continuity per request: the root token is the previous bonus (or the prefill
  token), seq_len grows by accept_length + 1;
- outputs: requests.output_tokens[0] is the prefill token (no iteration covers it);
  the rest is the concatenation over iterations of accepted tokens + bonus, cut at
  most inside the last iteration (stop token / max_new_tokens).
With ``--replay MODEL_DIR`` the target is re-run greedily on every prompt and must
reproduce the recorded outputs.

Exit 0 when consistent, 1 naming the first fault (iteration, request, node), 2 when
the file cannot be read (one line, no traceback).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from spectool.trace.parts import check_in_parts
from spectool.trace.reader import Trace
from spectool.trace.schema import ACCEPTED, NOT_VISITED, REJECTED

_NODE_FIELDS = ("tokens", "parents", "positions", "retrieve_index", "retrieve_next_token",
                "retrieve_next_sibling", "status", "target_argmax")
_OPTIONAL_NODE_FIELDS = ("depth", "scores", "valid", "target_argmax_prob")


@dataclass(frozen=True, order=True)
class Fault:
    """The first inconsistency found; (row, stage) orders faults: trace order, then the
    order of the checks (0 shapes, 1 tree, 2 mask, 3 indices, 4 decision, 5 continuity,
    6 outputs, 7 replay)."""

    row: int
    stage: int
    iteration: int
    request_id: int
    node: int | None
    message: str

    def __str__(self) -> str:
        where = f"iteration {self.iteration}, request {self.request_id}"
        if self.iteration < 0:
            where = f"request {self.request_id}"
        if self.node is not None:
            where += f", node {self.node}"
        return f"{where}: {self.message}"


def _sorted_steps(steps: pa.Table) -> pa.Table:
    return steps.sort_by([("iteration", "ascending"), ("request_id", "ascending")])


class _Checker:
    def __init__(self, trace: Trace):
        self.trace = trace
        self.steps = _sorted_steps(trace.steps)
        self.rows = self.steps.to_pylist()
        self.best: Fault | None = None
        self.groups: dict[int, list[int]] = {}  # N -> rows whose tree can be checked as arrays

    def fault(self, row: int, stage: int, message: str, node: int | None = None,
              request: int | None = None) -> None:
        """Keep the fault if it comes first; ``request`` names a per-request fault (no iteration)."""
        if request is None:
            f = Fault(row, stage, self.rows[row]["iteration"], self.rows[row]["request_id"], node, message)
        else:
            f = Fault(row, stage, -1, request, node, message)
        if self.best is None or f < self.best:
            self.best = f

    def run(self) -> Fault | None:
        for k, row in enumerate(self.rows):
            if self.best is not None and self.best.row < k:
                break
            self.check_row(k, row)
        for n, rows in self.groups.items():
            self.check_masks(n, rows)
        self.check_requests()
        return self.best

    # -- one record --------------------------------------------------------------

    def check_row(self, k: int, row: dict) -> None:
        n = row["num_nodes"]
        if n is None or n < 1:
            return self.fault(k, 0, f"num_nodes is {n}")
        for name in _NODE_FIELDS + _OPTIONAL_NODE_FIELDS:
            value = row[name]
            if value is None:
                if name in _NODE_FIELDS:
                    return self.fault(k, 0, f"{name} is missing")
            elif len(value) != n:
                return self.fault(k, 0, f"{name} has {len(value)} entries, num_nodes is {n}")
        for name in ("mask_packed", "accept_path", "bonus_token", "seq_len"):
            if row[name] is None:
                return self.fault(k, 0, f"{name} is missing")
        if len(row["mask_packed"]) != (n * n + 7) // 8:
            return self.fault(k, 0, f"mask_packed has {len(row['mask_packed'])} bytes, N={n} needs "
                                    f"{(n * n + 7) // 8}")
        topk = row["target_topk_tokens"]
        if topk is not None and len(topk) % n:
            return self.fault(k, 0, f"target_topk_tokens has {len(topk)} entries, not a multiple of N={n}")

        parents = row["parents"]
        if parents[0] != -1:
            return self.fault(k, 1, f"the root's parent is {parents[0]}, not -1", 0)
        for i in range(1, n):
            if not 0 <= parents[i] < i:
                return self.fault(k, 1, f"parent {parents[i]} is not an earlier node (topological order)", i)
        depth = row["depth"]
        if depth is not None:
            for i in range(n):
                want = 0 if i == 0 else depth[parents[i]] + 1
                if depth[i] != want:
                    return self.fault(k, 1, f"depth is {depth[i]}, its parent's depth + 1 is {want}", i)
        self.groups.setdefault(n, []).append(k)
        self.check_decision(k, row, n)

    def check_decision(self, k: int, row: dict, n: int) -> None:
        tokens, parents, status, argmax = row["tokens"], row["parents"], row["status"], row["target_argmax"]
        valid = row["valid"] or [True] * n
        path = row["accept_path"]
        for i, s in enumerate(status):
            if s not in (NOT_VISITED, ACCEPTED, REJECTED):
                return self.fault(k, 4, f"status {s} is not 0/1/2", i)
        if not path or path[0] != 0:
            return self.fault(k, 4, f"accepted path {path} does not start at the root")
        if row["accept_length"] != len(path) - 1:
            return self.fault(k, 4, f"accept_length is {row['accept_length']} but the accepted path "
                                    f"has {len(path) - 1} drafted nodes")
        for prev, node in zip(path, path[1:]):
            if not 0 <= node < n or parents[node] != prev:
                return self.fault(k, 4, f"accepted path {path} is not a root path: node {node} "
                                        f"is not a child of node {prev}", node if 0 <= node < n else None)
            if not valid[node]:
                return self.fault(k, 4, "a padding node (valid=False) is on the accepted path", node)
            if status[node] != ACCEPTED:
                return self.fault(k, 4, f"node is on the accepted path but its status is {status[node]}",
                                  node)
        on_path = set(path)
        for i in range(1, n):
            if status[i] == ACCEPTED and i not in on_path:
                return self.fault(k, 4, "status says accepted but the node is not on the accepted path", i)
        if row["temperature"] not in (None, 0.0):
            return
        for prev, node in zip(path, path[1:]):
            if tokens[node] != argmax[prev]:
                return self.fault(k, 4, f"accepted token {tokens[node]} but the target argmax at its parent "
                                        f"{prev} is {argmax[prev]}", node)
        last = path[-1]
        for c in range(1, n):
            if parents[c] == last and valid[c] and tokens[c] == argmax[last]:
                return self.fault(k, 4, f"token {tokens[c]} equals the target argmax at node {last} "
                                        "but the path stopped before it", c)
        if row["bonus_token"] != argmax[last]:
            return self.fault(k, 4, f"bonus token {row['bonus_token']} is not the target argmax "
                                    f"{argmax[last]} at the last accepted node {last}", last)

    # -- masks and indices, one array pass per tree size ----------------------------

    def check_masks(self, n: int, rows: list[int]) -> None:
        packed = np.stack([np.frombuffer(self.rows[k]["mask_packed"], np.uint8) for k in rows])
        mask = np.unpackbits(packed, axis=1, count=n * n).astype(bool).reshape(len(rows), n, n)
        parents = np.array([self.rows[k]["parents"] for k in rows], dtype=np.int64)
        want = np.broadcast_to(np.eye(n, dtype=bool), mask.shape).copy()
        idx = np.arange(len(rows))
        for i in range(1, n):
            want[:, i, :] |= want[idx, parents[:, i], :]
        bad = np.argwhere(mask != want)
        if len(bad):
            r, q, c = (int(v) for v in bad[0])
            bit = int(mask[r, q, c])
            why = "is an ancestor" if want[r, q, c] else "is not an ancestor"
            self.fault(rows[r], 2, f"mask[{q}][{c}] is {bit} but node {c} {why} of node {q}", q)
            # Index checks below are meaningless for rows with a wrong mask; the fault above wins anyway.
        self.check_indices(n, rows, mask)

    def check_indices(self, n: int, rows: list[int], mask: np.ndarray) -> None:
        # The index kernel's contract (kernels/tree_indices.py) recomputed here in numpy, independently of
        # the engine's path (and without importing torch, so a check takes a moment, not the torch import).
        idx = np.arange(n)
        depth = mask.sum(-1) - 1
        seq_lens = np.array([self.rows[k]["seq_len"] for k in rows], dtype=np.int64)
        parent = np.where(mask & (idx[None, None, :] < idx[None, :, None]), idx, -1).max(-1)
        child = parent[:, None, :] == idx[None, :, None]  # [r, i, j]: j is a child of i
        sibling = ((parent[:, None, :] == parent[:, :, None]) & (parent[:, :, None] >= 0)
                   & (idx[None, None, :] > idx[None, :, None]))  # [r, i, j]: j is a later sibling of i
        first = [np.where(rel.any(-1), np.where(rel, idx, n).min(-1), -1) for rel in (child, sibling)]
        want = (seq_lens[:, None] + depth, np.broadcast_to(idx, depth.shape), *first)
        for name, kernel in zip(("positions", "retrieve_index", "retrieve_next_token",
                                 "retrieve_next_sibling"), want):
            recorded = np.array([self.rows[k][name] for k in rows], dtype=np.int64)
            if name == "retrieve_index":
                recorded = recorded - recorded[:, :1]  # relative to the row's first entry
            bad = np.argwhere(recorded != kernel)
            if len(bad):
                r, i = (int(v) for v in bad[0])
                self.fault(rows[r], 3, f"{name} is {recorded[r, i]}, the index kernel's rule gives {kernel[r, i]} "
                                       "from the recorded mask", i)

    # -- per request: continuity and outputs ---------------------------------------

    def check_requests(self) -> None:
        requests = {r["request_id"]: r for r in self.trace.requests.to_pylist()}
        gained: dict[int, list[tuple[int, list[int]]]] = {}  # request -> [(row, tokens gained)]
        state: dict[int, tuple[int, int]] = {}  # request -> (next seq_len, next root token)
        for k, row in enumerate(self.rows):
            if self.best is not None and self.best.row <= k:
                return
            rid = row["request_id"]
            if rid not in state and rid in requests:
                req = requests[rid]
                first = req["output_tokens"][0] if req["output_tokens"] else None
                state[rid] = (len(req["prompt_tokens"]), first)
            if rid in state:
                seq_len, root = state[rid]
                if row["seq_len"] != seq_len:
                    return self.fault(k, 5, f"seq_len is {row['seq_len']}, the request's history "
                                            f"gives {seq_len}")
                if root is not None and row["tokens"][0] != root:
                    return self.fault(k, 5, f"root token {row['tokens'][0]} is not the previous bonus "
                                            f"(or prefill) token {root}", 0)
            path = row["accept_path"]
            new = [row["tokens"][i] for i in path[1:]] + [row["bonus_token"]]
            state[rid] = (row["seq_len"] + len(path), row["bonus_token"])
            gained.setdefault(rid, []).append((k, new))
        for rid, req in sorted(requests.items()):
            self.check_output(rid, req, gained.get(rid, []))

    def check_output(self, rid: int, req: dict, gained: list[tuple[int, list[int]]]) -> None:
        out = req["output_tokens"][1:]
        pos = 0
        for idx, (k, new) in enumerate(gained):
            take = out[pos:pos + len(new)]
            j = next((j for j, (a, b) in enumerate(zip(take, new)) if a != b), None)
            if j is not None:
                return self.fault(k, 6, f"output token {pos + j + 1} is {take[j]} but this iteration "
                                        f"gained {new[j]}")
            if len(take) < len(new) and (idx != len(gained) - 1 or not take):
                return self.fault(k, 6, f"the output ends after {pos + len(take) + 1} tokens, inside or "
                                        "before this iteration, but it is not the request's last")
            pos += len(take)
        if pos < len(out):
            row = gained[-1][0] if gained else len(self.rows)
            self.fault(row, 6, f"output has {len(out) + 1} tokens but the prefill token and the "
                               f"iterations account for {pos + 1}", request=rid)


def check_trace(trace: Trace) -> Fault | None:
    """The first inconsistency of ``trace`` in trace order, or None when it is consistent.
    A large trace is checked in parts of whole requests (spectool/trace/parts.py), in bounded memory."""
    return check_in_parts(trace, lambda part: _Checker(part).run())


def replay(trace: Trace, model_dir: str, device: str | None = None) -> Fault | None:
    """Re-run the target greedily on every recorded prompt; the first output that differs."""
    import torch

    import spectool as st

    if any(t not in (None, 0.0) for t in trace.steps.column("temperature").to_pylist()):
        raise ValueError("--replay needs a greedy (temperature 0) trace")
    recorded_device = str(trace.run_info.get("device", "cpu"))
    if device is None:
        device = recorded_device if recorded_device.startswith("cpu") or torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, str(trace.run_info.get("model", {}).get("dtype", "float32")), torch.float32)
    target = st.load(model_dir, device=device, dtype=dtype)
    engine = st.Engine(target, draft=None)
    for req in trace.requests.to_pylist():
        out = req["output_tokens"]
        result = engine.generate([req["prompt_tokens"]], max_new_tokens=len(out), temperature=0.0,
                                 record=False)
        got = list(result.token_ids[0])
        if got != out:
            j = next((j for j, (a, b) in enumerate(zip(got, out)) if a != b), min(len(got), len(out)))
            want = got[j] if j < len(got) else "end of output"
            have = out[j] if j < len(out) else "end of output"
            return Fault(0, 7, -1, req["request_id"], None,
                         f"replayed greedy output differs at output token {j}: recorded {have}, "
                         f"the target gives {want}")
    return None
