"""`spectool check TRACE [--replay MODEL_DIR]`: re-derive every recorded decision.

Every field the engine computed is recomputed by the checker's own reference
(spectool/trace/reference.py, which shares no function with the engine's path) and
compared, for every (iteration, request) record in trace order:
- shapes: every per-node array has num_nodes entries, the packed mask N*N bits;
- the tree: parents[0] = -1 and 0 <= parents[i] < i; depth = parent's depth + 1;
- mask = ancestors of parents (plus the diagonal);
- positions and retrieve_* from the parents and seq_len (retrieve_index relative to the
  row's first entry, since a row does not know its batch position);
- the decision: the status of every node, the accepted path, accept length and bonus,
  re-derived from the tree and the target's argmax (greedy) or from the recorded coins
  and the target's probabilities of the drafted children (sampled: the bonus must lie in
  the residual interval its coin falls into);
- the KV commit: the cache rows it copied, seq_len + accepted node -> seq_len + j;
- the drafter: the corpus had been given every token of the request (ngram);
- continuity per request: the root token is the previous bonus (or the prefill
  token), seq_len grows by accept_length + 1;
- outputs: requests.output_tokens[0] is the prefill token (no iteration covers it);
  the rest is the concatenation over iterations of accepted tokens + bonus, cut at
  most inside the last iteration (stop token / max_new_tokens).
Fields a trace lacks (older traces) are not checked. ``replay`` (spectool/trace/replay.py)
re-runs the target and the drafters from scratch.

Exit 0 when consistent, 1 naming the first fault (iteration, request, node), 2 when
the file cannot be read (one line, no traceback).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from spectool.trace import reference as ref
from spectool.trace.parts import check_in_parts
from spectool.trace.reader import Trace
from spectool.trace.schema import ACCEPTED, NOT_VISITED, REJECTED

# Sampled decisions: the recorded coins and probabilities are float32, the reference sums in float64.
SAMPLING_TOLERANCE = 1e-5

_NODE_FIELDS = ("tokens", "parents", "positions", "retrieve_index", "retrieve_next_token",
                "retrieve_next_sibling", "status", "target_argmax")
_OPTIONAL_NODE_FIELDS = ("depth", "scores", "valid", "target_argmax_prob", "child_probs")


@dataclass(frozen=True, order=True)
class Fault:
    """The first inconsistency found; (row, stage) orders faults: trace order, then the
    order of the checks (0 shapes, 1 tree, 2 mask, 3 indices, 4 decision, 5 commit,
    6 drafter, 7 continuity, 8 outputs, 9 replay)."""

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
        self.check_indices(k, row)
        self.check_decision(k, row, n)
        self.check_commit(k, row)
        self.check_drafter(k, row)

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
        if row["temperature"] in (None, 0.0):
            want = ref.greedy_decision(tokens, parents, valid, argmax)
            what = "the target argmax"
        elif row["child_probs"] is not None and row["coins"] is not None and len(row["coins"]) == n:
            want = ref.sampled_decision(tokens, parents, valid, row["coins"], row["child_probs"])
            what = "the coins and the target's child probabilities"
            if not self.check_coins(k, row, want):
                return
        else:  # a sampled trace without child probabilities: the path's structure was checked above
            return
        if want.path != path:
            node = next((b for a, b in zip(want.path + [None], path + [None]) if a != b), None)
            node = node if node is not None else path[-1]
            return self.fault(k, 4, f"accepted path is {path}; {what} give {want.path}", node)
        for i in range(n):
            if want.status[i] != status[i]:
                return self.fault(k, 4, f"status is {status[i]}; {what} give {want.status[i]}", i)
        if want.bonus is not None and row["bonus_token"] != want.bonus:
            return self.fault(k, 4, f"bonus token {row['bonus_token']} is not the target argmax "
                                    f"{want.bonus} at the last accepted node {path[-1]}", path[-1])
        if want.bonus is None:
            self.check_bonus_draw(k, row, want)

    def check_coins(self, k: int, row: dict, want: ref.SampledDecision) -> bool:
        """A coin on every node of the path (in [0, 1)) and on no other node."""
        coins, on_path = row["coins"], set(row["accept_path"])
        for i, u in enumerate(coins):
            has = u is not None and not math.isnan(u)
            if i in on_path and not (has and 0.0 <= u < 1.0):
                self.fault(k, 4, f"node is visited but its coin is {u}", i)
                return False
            if i not in on_path and has:
                self.fault(k, 4, f"node is not visited but has a coin ({u})", i)
                return False
        return True

    def check_bonus_draw(self, k: int, row: dict, want: ref.SampledDecision) -> None:
        """The bonus is the residual's inverse CDF at the last coin minus the children's mass."""
        cdf = row["bonus_cdf"]
        if cdf is None or len(cdf) != 2:
            return
        lo, p = cdf
        last, u = row["accept_path"][-1], want.residual_u
        kids = ref.sampled_children(row["tokens"], row["parents"], row["valid"] or [True] * row["num_nodes"],
                                    last, row["child_probs"])
        if any(row["tokens"][c] == row["bonus_token"] for c, _ in kids):
            return self.fault(k, 4, f"bonus token {row['bonus_token']} is a drafted child of the last accepted "
                                    f"node, which sampling removes from the residual", last)
        if p == 0.0:  # the children held all the mass: nothing left to draw from but rounding
            if abs(sum(q for _, q in kids) - 1.0) > 1e-3:
                self.fault(k, 4, "the bonus token has residual probability 0 although the children leave "
                                 f"{1 - sum(q for _, q in kids):.4g} of the mass", last)
            return
        if not lo - SAMPLING_TOLERANCE <= u < lo + p + SAMPLING_TOLERANCE:
            self.fault(k, 4, f"the residual draw is at {u:.6f}, but the bonus token {row['bonus_token']} "
                             f"holds [{lo:.6f}, {lo + p:.6f}) of the residual", last)

    def check_commit(self, k: int, row: dict) -> None:
        src, dst = row["commit_src"], row["commit_dst"]
        if src is None or dst is None:
            return
        base, path = row["seq_len"], row["accept_path"]
        want_src, want_dst = [base + i for i in path], [base + j for j in range(len(path))]
        for j in range(max(len(src), len(dst), len(path))):
            got = (src[j] if j < len(src) else None, dst[j] if j < len(dst) else None)
            want = (want_src[j] if j < len(path) else None, want_dst[j] if j < len(path) else None)
            if got != want:
                node = path[j] if j < len(path) else None
                return self.fault(k, 5, f"the KV commit copied cache row {got[0]} to {got[1]}; the accepted "
                                        f"path needs {want[0]} -> {want[1]}", node)

    def check_drafter(self, k: int, row: dict) -> None:
        put = row["ngram_put_len"]
        if put is not None and put >= 0 and put != row["seq_len"] + 1:
            self.fault(k, 6, f"the corpus had been given {put} tokens of the request when it drafted; "
                             f"the request had {row['seq_len'] + 1}")

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

    def check_indices(self, k: int, row: dict) -> None:
        want = ref.tree_indices(row["parents"], row["seq_len"])
        for name, expected in want.items():
            got = list(row[name])
            if name == "retrieve_index":
                got = [g - got[0] for g in got]
            for i, (g, e) in enumerate(zip(got, expected)):
                if g != e:
                    return self.fault(k, 3, f"{name} is {g}; the parents and seq_len give {e}", i)

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
                    return self.fault(k, 7, f"seq_len is {row['seq_len']}, the request's history "
                                            f"gives {seq_len}")
                if root is not None and row["tokens"][0] != root:
                    return self.fault(k, 7, f"root token {row['tokens'][0]} is not the previous bonus "
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
                return self.fault(k, 8, f"output token {pos + j + 1} is {take[j]} but this iteration "
                                        f"gained {new[j]}")
            if len(take) < len(new) and (idx != len(gained) - 1 or not take):
                return self.fault(k, 8, f"the output ends after {pos + len(take) + 1} tokens, inside or "
                                        "before this iteration, but it is not the request's last")
            pos += len(take)
        if pos < len(out):
            row = gained[-1][0] if gained else len(self.rows)
            self.fault(row, 8, f"output has {len(out) + 1} tokens but the prefill token and the "
                               f"iterations account for {pos + 1}", request=rid)


def check_trace(trace: Trace) -> Fault | None:
    """The first inconsistency of ``trace`` in trace order, or None when it is consistent.
    A large trace is checked in parts of whole requests (spectool/trace/parts.py), in bounded memory."""
    return check_in_parts(trace, lambda part: _Checker(part).run())
