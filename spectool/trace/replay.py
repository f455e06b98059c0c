"""`spectool check --replay MODEL_DIR`: re-run the target and the drafters from scratch.

The target is run as plain forwards (no cache, no commit, no verify kernel): causal over
each request's recorded prompt plus its committed tokens, and over the committed prefix
followed by each tree's nodes, every node attending to the prefix and its own ancestors
(a mask the checker builds from the recorded parents), so its view at every node of every
iteration is recomputed independently of the engine's verify path:
- greedy: the target's argmax at every valid node must equal the recorded one. Where it
  differs the report gives the top-2 logit margin there and the gap between the two tokens;
  a gap below the dtype's rounding at that magnitude is a near-tie (kernels that sum in
  another order may flip it), anything else is a fault;
- sampled: the target's probabilities of the drafted children are recomputed (temperature,
  top-k and top-p applied by the checker's own code) and every decision is re-derived from
  the recorded coins.
The drafters are replayed too: the N-gram corpus is the pure-Python reference fed with the
recorded streams (and the puts of earlier runs of the same engine), each tree compared with
the recorded one; multi-layer EAGLE layers are re-run on the recorded tokens and the target's
replayed hidden states, each draft compared; EAGLE's tree is grown again step by step (each
step's kept frontier and scores, then the best N-1 candidates against the recorded tree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from spectool.trace import reference as ref
from spectool.trace.check import Fault
from spectool.trace.ngram_reference import ReferenceCorpus
from spectool.trace.parts import holds_whole_requests
from spectool.trace.reader import Trace

REPLAY_STAGE = 9
SAMPLED_FLOOR = 1e-4  # relative tolerance on replayed probabilities, whatever the dtype


@dataclass(frozen=True)
class Divergence:
    """A node where the replayed target's argmax differs from the recorded one."""

    iteration: int
    request_id: int
    node: int
    recorded: int
    replayed: int
    gap: float        # replayed logit of its argmax minus that of the recorded token (>= 0)
    margin: float     # the replay's top-2 logit margin there
    near_tie: bool

    def __str__(self) -> str:
        kind = "near-tie" if self.near_tie else "bug"
        return (f"iteration {self.iteration}, request {self.request_id}, node {self.node}: recorded argmax "
                f"{self.recorded}, the replayed target gives {self.replayed} (logit gap {self.gap:.4g}, "
                f"top-2 margin {self.margin:.4g}): {kind}")


@dataclass
class ReplayReport:
    """What the replay found: the first fault (None when consistent), every divergence, notes."""

    fault: Fault | None = None
    divergences: list[Divergence] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def sampling_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """softmax(logits / temperature) cut to the top_k most likely (ties at the k-th kept), then to
    the smallest most-likely set whose mass reaches top_p, renormalised (float64, one row)."""
    x = logits.astype(np.float64) / temperature
    if 0 < top_k < x.shape[-1]:
        kth = np.sort(x)[-top_k]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        keep = np.zeros_like(p, dtype=bool)
        keep[order[before < top_p]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


class _Target:
    """Plain causal forwards of the target (and draft layers) on one device."""

    def __init__(self, model_dir: str, device: str, dtype):
        import spectool as st

        self.torch = __import__("torch")
        self.target = st.load(model_dir, device=device, dtype=dtype)
        self.device = device

    def forward(self, seqs: list[list[int]], positions: list[list[int]] | None = None, mask=None) -> tuple:
        """(hidden [B, T, H] before the final norm, float32 logits [B, T, V]) of right-padded seqs:
        causal, or with ``mask`` [B, T, T] (row q sees column k) and explicit ``positions``."""
        torch = self.torch
        t = max(map(len, seqs))
        tokens = torch.tensor([s + [0] * (t - len(s)) for s in seqs], dtype=torch.long, device=self.device)
        if positions is None:
            pos = torch.arange(t, device=self.device).expand(len(seqs), -1)
        else:
            pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        if mask is not None:
            mask = mask.to(self.device)
        with torch.no_grad():
            hidden = self.target.model(tokens, pos, tree_mask=mask)
            return hidden, self.target.model.logits(hidden).float()


def _streams(trace: Trace, rows: list[dict]) -> dict[int, list[int]]:
    """Per request: prompt, prefill token, then every iteration's gained tokens (the cache's content)."""
    out = {}
    for req in trace.requests.to_pylist():
        out[req["request_id"]] = list(req["prompt_tokens"]) + list(req["output_tokens"][:1])
    for row in rows:
        if row["request_id"] in out:
            out[row["request_id"]] += [row["tokens"][i] for i in row["accept_path"][1:]] + [row["bonus_token"]]
    return out


def replay(trace: Trace, model_dir: str, device: str | None = None, progress: bool = False) -> ReplayReport:
    """Re-run the target and the drafters on ``trace``; the earliest fault and every divergence."""
    import torch

    from spectool.trace.check import _sorted_steps

    info = trace.run_info
    if device is None:
        recorded = str(info.get("device", "cpu"))
        device = recorded if recorded.startswith("cpu") or torch.cuda.is_available() else "cpu"
    dtype_name = str(info.get("model", {}).get("dtype", "float32"))
    target = _Target(model_dir, device, getattr(torch, dtype_name, torch.float32))
    if not holds_whole_requests(info):
        return ReplayReport(notes=["not replayed: the trace keeps only some iterations of its requests"])
    rows = _sorted_steps(trace.steps).to_pylist()
    streams = _streams(trace, rows)
    report = ReplayReport()
    faults: list[Fault] = []
    engine = info.get("engine", {})
    sampling = (float(engine.get("temperature", 0.0)), int(engine.get("top_k", 0)), float(engine.get("top_p", 1.0)))

    def fault(k: int, node: int | None, message: str) -> None:
        faults.append(Fault(k, REPLAY_STAGE, rows[k]["iteration"], rows[k]["request_id"], node, message))

    by_request: dict[int, list[int]] = {}
    for k, row in enumerate(rows):
        if row["request_id"] in streams:
            by_request.setdefault(row["request_id"], []).append(k)
    missing = sorted({row["request_id"] for row in rows} - set(streams))
    if missing:  # a file cut short before these requests finished: no prompt to replay from
        report.notes.append(f"requests {missing} have no request row (the run was cut short): not replayed")
    hiddens: dict[int, object] = {}
    bar = _bar(progress, len(rows))
    for rid, ks in by_request.items():
        stream = streams[rid]
        hidden, logits = target.forward([stream])
        hiddens[rid] = hidden[0]
        logits = logits[0].cpu().numpy()
        for k in ks:
            row = rows[k]
            greedy = row["temperature"] in (None, 0.0)
            view = _node_logits(target, stream, row, logits, every_node=greedy)
            if greedy:
                _compare_argmax(row, view, dtype_name, report, lambda node, msg, k=k: fault(k, node, msg))
            else:  # a sampled decision depends on the distributions at the visited nodes alone
                _replay_sampled(row, view, sampling, dtype_name, report, lambda node, msg, k=k: fault(k, node, msg))
            bar.update(1)
    bar.close()
    method = info.get("draft", {}).get("method", "none")
    if method == "ngram" and missing:
        report.notes.append("N-gram replay skipped: the corpus saw requests the trace lost")
    elif method == "ngram":
        _replay_ngram(trace, info, rows, streams, report, fault)
    elif method in ("multi_layer_eagle", "eagle"):
        _replay_eagle(target, info, rows, streams, hiddens, report, fault, method)
    report.fault = min(faults) if faults else None
    return report


def _node_logits(target: _Target, stream: list[int], row: dict, logits: np.ndarray,
                 every_node: bool = True) -> dict[int, np.ndarray]:
    """Replayed logits at every valid node (or the accepted path's alone): path nodes from the
    request's stream forward, the rest from one forward over the committed prefix and the tree."""
    n, base = row["num_nodes"], row["seq_len"]
    parents, tokens = row["parents"], row["tokens"]
    valid = row["valid"] or [True] * n
    view = {node: logits[base + j] for j, node in enumerate(row["accept_path"])}
    rest = [i for i in range(n) if valid[i] and i not in view]
    if not rest or not every_node:
        return view
    # One forward over the committed prefix then the tree's valid nodes, each node attending to
    # the prefix and its own ancestors (the mask built here from the parents, SDPA's plain path).
    nodes = [i for i in range(n) if valid[i]]
    col = {node: base + j for j, node in enumerate(nodes)}
    depth = ref.depths(parents)
    t = base + len(nodes)
    torch = target.torch
    mask = torch.ones(t, t, dtype=torch.bool).tril_()
    mask[base:, base:] = False
    for node in nodes:
        for a in ref.ancestors(parents, node):
            mask[col[node], col[a]] = True
    tokens_in = stream[:base] + [tokens[i] for i in nodes]
    positions = list(range(base)) + [base + depth[i] for i in nodes]
    out = target.forward([tokens_in], positions=[positions], mask=mask[None])[1][0].cpu().numpy()
    for node in rest:
        view[node] = out[col[node]]
    return view


def _compare_argmax(row: dict, view: dict, dtype: str, report: ReplayReport, fault) -> None:
    recorded = row["target_argmax"]
    for node in sorted(view):
        logits = view[node]
        got = int(np.argmax(logits))
        want = int(recorded[node])
        if got == want:
            continue
        top2 = np.sort(logits)[-2:]
        gap = float(logits[got] - logits[want])
        d = Divergence(row["iteration"], row["request_id"], node, want, got, gap, float(top2[1] - top2[0]),
                       ref.is_near_tie(gap, float(logits[got]), dtype))
        report.divergences.append(d)
        if not d.near_tie:
            fault(node, f"recorded target argmax {want}, the replayed target gives {got} (logit gap {gap:.4g} "
                        f"is more than {dtype} rounding at {abs(float(logits[got])):.3g}: not a near-tie)")
        return


def _replay_sampled(row: dict, view: dict, sampling: tuple, dtype: str, report: ReplayReport, fault) -> None:
    temperature, top_k, top_p = row["temperature"], sampling[1], sampling[2]
    n, tokens, parents = row["num_nodes"], row["tokens"], row["parents"]
    valid = row["valid"] or [True] * n
    probs, slack = {}, {}
    for node in row["accept_path"]:
        probs[node] = sampling_probs(view[node], temperature, top_k, top_p)
        # A logit moved by the dtype's rounding moves a probability by this factor, either way; float32
        # kernels that sum in another order differ by more than a few ulps of the logit: 1e-4 at least.
        shift = ref.NEAR_TIE_ULPS * ref.ulp(float(np.abs(view[node]).max()), dtype) / temperature
        slack[node] = max(math.expm1(2 * shift), SAMPLED_FLOOR)
    child = [math.nan] * n
    recorded = row["child_probs"] or [None] * n
    for c in range(1, n):
        if valid[c] and parents[c] in probs:
            child[c] = float(probs[parents[c]][tokens[c]])
            if recorded[c] is not None and abs(recorded[c] - child[c]) > slack[parents[c]] * max(child[c], 1e-3):
                return fault(c, f"recorded p(token | parent) {recorded[c]:.6g}, the replayed target gives "
                                f"{child[c]:.6g}")
    coins = row["coins"]
    if not coins or len(coins) != n:
        return
    want = ref.sampled_decision(tokens, parents, valid, coins, [0.0 if math.isnan(p) else p for p in child])
    path = row["accept_path"]
    if want.path != path:
        level = next(j for j, (a, b) in enumerate(zip(want.path + [None], path + [None])) if a != b)
        x = path[level - 1]
        bounds = np.cumsum([p for _, p in ref.sampled_children(tokens, parents, valid, x, child)])
        edge = float(np.min(np.abs(bounds - coins[x]))) if len(bounds) else math.inf
        if edge > slack[x]:
            node = path[level] if level < len(path) else x
            return fault(node, f"accepted path {path}; the coins and the replayed target give {want.path}")
        report.notes.append(f"iteration {row['iteration']}, request {row['request_id']}, node {x}: the coin "
                            f"{coins[x]:.6f} lies within {dtype} rounding of a child's interval edge (near-tie)")
        return
    last = path[-1]
    residual = probs[last].copy()
    for c, _ in ref.sampled_children(tokens, parents, valid, last, child):
        residual[tokens[c]] = 0.0
    cdf = np.cumsum(residual)
    if cdf[-1] <= 0:
        return
    bonus = min(int(np.searchsorted(cdf, want.residual_u, side="right")), len(cdf) - 1)
    if bonus != row["bonus_token"]:
        lo = cdf[bonus] - residual[bonus]
        edge = min(abs(want.residual_u - lo), abs(cdf[bonus] - want.residual_u))
        if edge > slack[last]:
            fault(last, f"bonus token {row['bonus_token']}; the residual of the replayed target at "
                        f"{want.residual_u:.6f} gives {bonus}")


# -- drafters ------------------------------------------------------------------------

def _replay_ngram(trace: Trace, info: dict, rows: list[dict], streams: dict, report: ReplayReport, fault) -> None:
    cfg = info.get("draft", {})
    if cfg.get("external_corpus"):
        report.notes.append("N-gram replay skipped: the corpus held an external corpus the trace does not carry")
        return
    prior = info.get("ngram_prior_puts", [])
    if prior is None:
        report.notes.append("N-gram replay skipped: earlier runs put more into the corpus than a trace keeps")
        return
    corpus = ReferenceCorpus(**{k: cfg[k] for k in ("max_trie_depth", "min_bfs_breadth", "max_bfs_breadth",
                                                    "num_draft_tokens", "match", "capacity") if k in cfg})
    depth = corpus.depth

    def put(kind: str, ids: list[int], windows: list[list[int]], lens: list[int]) -> None:
        if kind == "admit":  # a new request under this id: whatever its id held before is gone
            corpus.erase_match_state(ids)
        corpus.batch_put(windows, req_ids=ids, total_lens=lens)

    for kind, ids, windows, lens in prior:
        put(kind, ids, windows, lens)
    # Trace order is recording order (batch order within an iteration), which the puts followed.
    order = trace.steps.select(["iteration", "request_id"]).to_pylist()
    position = {(r["iteration"], r["request_id"]): k for k, r in enumerate(rows)}
    requests = {r["request_id"]: r for r in trace.requests.to_pylist()}
    history = {rid: list(r["prompt_tokens"]) + list(r["output_tokens"][:1]) for rid, r in requests.items()}
    first_iteration: dict[int, int] = {}
    for r in order:
        first_iteration.setdefault(r["request_id"], r["iteration"])
    never = sorted(set(requests) - set(first_iteration))  # finished at prefill: put, never drafted
    by_iteration: dict[int, list[int]] = {}
    for r in order:
        by_iteration.setdefault(r["iteration"], []).append(position[(r["iteration"], r["request_id"])])
    for it in sorted(by_iteration):
        admitted = sorted(rid for rid, first in first_iteration.items() if first == it)
        admitted += [rid for rid in never if admitted and rid < admitted[-1]]
        never = [rid for rid in never if rid not in admitted]
        if admitted:  # the prompts when admitted, then each history's window with the prefill token
            prompts = [list(requests[r]["prompt_tokens"]) for r in admitted]
            put("admit", admitted, prompts, [len(p) for p in prompts])
            put("prefill", admitted, [history[r][-depth:] for r in admitted], [len(history[r]) for r in admitted])
        ks = by_iteration[it]
        ids = [rows[k]["request_id"] for k in ks]
        got = corpus.batch_get(ids, [history[r][-depth:] for r in ids], [len(history[r]) for r in ids])
        for b, k in enumerate(ks):
            message = _compare_ngram_tree(rows[k], [g[b] for g in got])
            if message:
                return fault(k, *message)
        windows, lens = [], []
        for k in ks:
            row = rows[k]
            gained = [row["tokens"][i] for i in row["accept_path"][1:]] + [row["bonus_token"]]
            h = history[row["request_id"]]
            windows.append(h[-depth:] + gained)
            lens.append(len(h) + len(gained))
            h += gained
        put("verify", ids, windows, lens)


def _compare_ngram_tree(row: dict, got: list) -> tuple[int | None, str] | None:
    tokens, parents, _, valid, scores, match_len, breadth = got
    n = int(valid.sum())
    rec_valid = row["valid"] or [True] * row["num_nodes"]
    rec_n = sum(rec_valid)
    for i in range(1, max(n, rec_n)):
        want = (int(tokens[i]), int(parents[i])) if i < n else None
        have = (row["tokens"][i], row["parents"][i]) if i < rec_n else None
        if want != have:
            return i, (f"the trie drafted (token, parent) {have}; the reference corpus fed with the recorded "
                       f"streams drafts {want}")
    if rec_n > 1 and (row["ngram_match_len"], row["ngram_breadth"]) != (int(match_len), int(breadth)):
        return None, (f"matched suffix length and breadth ({row['ngram_match_len']}, {row['ngram_breadth']}); "
                      f"the reference gives ({int(match_len)}, {int(breadth)})")
    return None


def _replay_eagle(target: _Target, info: dict, rows: list[dict], streams: dict, hiddens: dict,
                  report: ReplayReport, fault, method: str) -> None:
    import torch

    from spectool.model.draft_layer import load_draft

    path = info.get("draft", {}).get("path")
    if not path:
        report.notes.append("draft replay skipped: the trace does not name the draft checkpoint")
        return
    try:
        draft = load_draft(path, target.target)
    except (OSError, ValueError) as e:
        report.notes.append(f"draft replay skipped: cannot load {path} ({e})")
        return
    model = target.target.model
    dtype = str(info.get("model", {}).get("dtype", "float32"))
    tol = 1e-3 if dtype == "float32" else 0.1  # bf16: the layers read hidden states of another kernel
    dev = target.device
    for k, row in enumerate(rows):
        if row["request_id"] not in hiddens:
            continue
        stream, h = streams[row["request_id"]], hiddens[row["request_id"]]
        base = row["seq_len"]  # the root is stream[base]; the layers read h[0 .. base-1]
        steps = len(draft.layers) if method == "eagle" else row["num_nodes"] - 1
        seq = stream[:base + 1] + list(row["tokens"][1:])
        feature = None
        for layer in range(1 if method == "eagle" else steps):
            ids = torch.tensor([seq[layer + 1:layer + 1 + base]], device=dev)
            positions = torch.arange(layer + 1, layer + 1 + base, device=dev)[None]
            inputs = h[None, :base] if feature is None or not draft.chained else feature
            with torch.no_grad():
                feature, normed = draft.layers[layer](model.embed_tokens(ids), inputs, positions)
                p = torch.softmax(model.lm_head(normed[0, -1]).float(), -1).cpu().numpy()
            if method == "eagle":
                message = _eagle_tree(draft.layers[0], model, row, seq, h, feature[0, -1], p, tol, dev)
                if message:
                    return fault(k, *message)
                continue
            node = layer + 1
            want, have = int(np.argmax(p)), row["tokens"][node]
            if want != have and abs(p[want] - p[have]) > tol:
                return fault(k, node, f"draft layer {layer} drafted {have}; re-run on the recorded tokens it "
                                      f"drafts {want} (p {p[want]:.4g} against {p[have]:.4g})")
            if row["scores"] is not None and abs(row["scores"][node] - p[have]) > tol:
                return fault(k, node, f"draft layer {layer} scored its draft {row['scores'][node]:.4g}; the "
                                      f"replay gives {p[have]:.4g}")


def _eagle_tree(layer, model, row: dict, seq: list[int], h, root_feature, root_p: np.ndarray, tol: float,
                dev) -> tuple[int | None, str] | None:
    """Grow the EAGLE-2 tree again (the worked example of docs/INTERNALS.md, at the draft layer): each step
    feeds the frontier so far after the committed prefix, every node seeing the prefix and its
    own ancestors, expands the newest frontier into top-k children each with path-score
    products and keeps the best k; the tree is the best N-1 candidates. Each step's frontier
    is compared with the recorded per-step top-k, then the tree's root paths with the recorded
    tree's. A difference within ``tol`` of a score is a near-tie: the record is not judged."""
    import torch

    shape = row["step_topk_shape"] or []
    if len(shape) != 2:
        return None
    steps, kk = shape
    rec_tok = [row["step_topk_tokens"][s * kk:(s + 1) * kk] for s in range(steps)]
    rec_p = [row["step_topk_probs"][s * kk:(s + 1) * kk] for s in range(steps)]
    base = row["seq_len"]
    top = np.argsort(-root_p, kind="stable")[:kk]
    # fed node: (token, path of tokens, score, fed index of its parent or -1, depth)
    frontier = [(int(t), (int(t),), float(root_p[t]), -1, 1) for t in top]
    candidates = [(c[1], c[2]) for c in frontier]
    fed: list[tuple] = []
    features: list = []
    for s in range(steps):
        got_tok, got_p = [c[0] for c in frontier], [c[2] for c in frontier]
        if got_tok != rec_tok[s]:
            if max(abs(a - b) for a, b in zip(sorted(got_p), sorted(rec_p[s]))) <= tol:
                return None
            return None, (f"EAGLE step {s} kept tokens {rec_tok[s]}; the replayed draft layer keeps {got_tok}")
        if any(abs(a - b) > tol for a, b in zip(got_p, rec_p[s])):
            return None, (f"EAGLE step {s} scored its frontier {[round(x, 4) for x in rec_p[s]]}; the replay gives "
                          f"{[round(x, 4) for x in got_p]}")
        if s == steps - 1:
            break
        first = len(fed)
        fed += frontier
        t = base + len(fed)
        mask = torch.ones(t, t, dtype=torch.bool, device=dev).tril_()
        mask[base:, base:] = False
        for i in range(len(fed)):
            j = i
            while j >= 0:
                mask[base + i, base + j] = True
                j = fed[j][3]
        hidden_in = [root_feature if node[3] < 0 else features[node[3]] for node in fed]
        ids = torch.tensor([seq[1:base + 1] + [node[0] for node in fed]], device=dev)
        pos = torch.tensor([list(range(1, base + 1)) + [base + node[4] for node in fed]], device=dev)
        hid = torch.cat([h[:base], torch.stack(hidden_in)])[None]
        with torch.no_grad():
            out_feature, normed = layer(model.embed_tokens(ids), hid, pos, tree_mask=mask[None])
            probs = torch.softmax(model.lm_head(normed[0, base + first:]).float(), -1).cpu().numpy()
        features = [out_feature[0, base + i] for i in range(len(fed))]
        expanded = []
        for i, node in enumerate(frontier):
            for tok in np.argsort(-probs[i], kind="stable")[:kk]:
                expanded.append((int(tok), node[1] + (int(tok),), node[2] * float(probs[i][tok]), first + i,
                                 node[4] + 1))
        candidates += [(c[1], c[2]) for c in expanded]
        order = sorted(range(len(expanded)), key=lambda i: -expanded[i][2])
        frontier = [expanded[i] for i in order[:kk]]
    keep = row["num_nodes"] - 1
    ranked = sorted(candidates, key=lambda c: -c[1])
    want = {c[0] for c in ranked[:keep]}
    cutoff = ranked[keep - 1][1] if keep <= len(ranked) else 0.0
    near = {c[0] for c in ranked if abs(c[1] - cutoff) <= tol}
    parents, tokens = row["parents"], row["tokens"]
    for i in range(1, row["num_nodes"]):
        path = tuple(tokens[a] for a in ref.ancestors(parents, i)[::-1][1:])
        if path not in want and path not in near:
            return i, (f"node {i}'s path {list(path)} is not among the best {keep} candidates of the replayed "
                       "EAGLE-2 tree")
    return None


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(enabled: bool, total: int):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="record", desc="replaying")
