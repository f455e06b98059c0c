"""Synthetic but valid traces, recorded through the real Recorder.

A tiny deterministic "target" (next-token distribution = a pseudo-random function
of the last two tokens over a small Python-ish vocabulary) is decoded with
speculative decoding by a tiny engine simulation: requests of different lengths,
more requests than batch slots, ngram-like BFS trees (with padding nodes),
EAGLE-like top-k trees (best N-1 by path score) or multi-layer chains, greedy or
sampled verification. Every field is computed from its definition in docs/INTERNALS.md, so
the result is an oracle for the checker and a realistic input for the views.

    trace = make_trace("eagle", num_requests=3, batch_size=2)
    trace = make_trace("ngram", path=tmp_path / "run.sptrace")
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from spectool.trace.reader import Trace
from spectool.trace.recorder import Recorder

VOCAB = ["<pad>", "<eos>", "def", "return", "self", "if", "else", "for", "in", "range", "(", ")", ":",
         ",", ".", "=", "+", "-", "*", "[", "]", "x", "y", "i", "n", "0", "1", "2", "len", "print",
         "import", "from", "None", "True", "False", "while", "and", "or", "not", "is", "class",
         "lambda", "yield", "with", "as", "try", "except", "pass"]
METHODS = ("ngram", "eagle", "multi_layer_eagle")
TOPK = 5  # target top-k recorded per node


def tiny_tokenizer_json() -> str:
    """A word-level tokenizer over VOCAB, as the JSON string a trace stores."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok.to_str()


def target_probs(context: list[int]) -> np.ndarray:
    """The toy target's next-token distribution given the tokens so far."""
    key = zlib.crc32(np.asarray(context[-2:], dtype=np.int64).tobytes())
    logits = np.random.default_rng(key).normal(0.0, 2.0, len(VOCAB))
    logits[0] = -1e9  # never <pad>
    p = np.exp(logits - logits.max())
    return p / p.sum()


def greedy_continuation(prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding of the toy target (the losslessness oracle)."""
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(int(np.argmax(target_probs(ctx))))
    return ctx[len(prompt):]


def ancestors_mask(parents: np.ndarray) -> np.ndarray:
    """mask[q, k] = node k is q itself or an ancestor of q."""
    n = len(parents)
    mask = np.eye(n, dtype=bool)
    for q in range(n):
        k = parents[q]
        while k >= 0:
            mask[q, k] = True
            k = parents[k]
    return mask


def tree_indices(parents: np.ndarray, seq_len: int, row: int) -> dict[str, np.ndarray]:
    """depth, positions and retrieve_* of one tree from their definitions (docs/INTERNALS.md)."""
    n = len(parents)
    depth = np.zeros(n, np.int64)
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    next_token = np.full(n, -1, np.int64)
    next_sibling = np.full(n, -1, np.int64)
    for i in range(1, n):
        p = parents[i]
        if next_token[p] < 0:
            next_token[p] = i
        later = [j for j in range(i + 1, n) if parents[j] == p]
        next_sibling[i] = later[0] if later else -1
    return {"depth": depth, "positions": seq_len + depth, "retrieve_index": row * n + np.arange(n),
            "retrieve_next_token": next_token, "retrieve_next_sibling": next_sibling}


def _path_context(ctx: list[int], tokens: np.ndarray, parents: np.ndarray, node: int) -> list[int]:
    path = []
    while node > 0:
        path.append(int(tokens[node]))
        node = int(parents[node])
    return ctx + path[::-1]


def _ngram_tree(ctx, n, rng):
    """BFS-like tree: breadth shrinking with depth, the true continuation often first; padded."""
    tokens, parents, scores = [ctx[-1]], [-1], [1.0]
    breadth = int(rng.integers(1, 4))
    frontier = [0]
    while frontier and len(tokens) < n:
        nxt = []
        for node in frontier:
            context = _path_context(ctx, np.array(tokens), np.array(parents), node)
            truth = int(np.argmax(target_probs(context)))
            choices = [truth] if rng.random() < 0.7 else []
            choices += [int(t) for t in rng.choice(np.arange(2, len(VOCAB)), breadth + 1, replace=False)]
            for rank, tok in enumerate(dict.fromkeys(choices)):
                if rank >= breadth or len(tokens) >= n:
                    break
                tokens.append(tok)
                parents.append(node)
                scores.append(1.0 / (rank + 1))
                nxt.append(len(tokens) - 1)
        frontier = nxt
        breadth = max(1, breadth - 1)
        if rng.random() < 0.25:  # a short match: the rest is padding
            break
    valid = [True] * len(tokens) + [False] * (n - len(tokens))
    pad = n - len(tokens)
    return (np.array(tokens + [0] * pad), np.array(parents + [0] * pad), np.array(scores + [0.0] * pad),
            np.array(valid), {"ngram_match_len": int(rng.integers(1, 6)), "ngram_breadth": breadth})


def _draft_probs(context, rng):
    """A draft model's guess: the target's distribution blurred with noise."""
    p = 0.6 * target_probs(context) + 0.4 * rng.dirichlet(np.ones(len(VOCAB)))
    return p / p.sum()


def _eagle_tree(ctx, n, rng, topk=3):
    """EAGLE-2: expand the top-k frontier per step, keep the best N-1 nodes by path score."""
    steps = max(3, n // topk)
    cand = [(1.0, 0, -1, ctx[-1])]  # (path score, step, parent candidate index, token)
    frontier = [0]
    step_tokens, step_probs = [], []
    for s in range(steps):
        new = []
        for f in frontier:
            path = [f]
            while cand[path[-1]][2] >= 0:
                path.append(cand[path[-1]][2])
            context = ctx + [cand[i][3] for i in path[::-1][1:]]
            p = _draft_probs(context, rng)
            for tok in np.argsort(-p)[:topk]:
                cand.append((cand[f][0] * float(p[tok]), s + 1, f, int(tok)))
                new.append(len(cand) - 1)
        frontier = sorted(new, key=lambda c: -cand[c][0])[:topk]
        step_tokens.append([cand[c][3] for c in frontier])
        step_probs.append([cand[c][0] for c in frontier])
    # Best N-1 by score; a parent always scores at least its child, so ancestors come along.
    best = sorted(range(1, len(cand)), key=lambda c: (-cand[c][0], c))[: n - 1]
    keep = [0] + sorted(best, key=lambda c: (cand[c][1], c))  # topological: by step
    where = {c: i for i, c in enumerate(keep)}
    tokens = np.array([cand[c][3] for c in keep])
    parents = np.array([-1] + [where[cand[c][2]] for c in keep[1:]])
    scores = np.array([cand[c][0] for c in keep])
    return tokens, parents, scores, np.ones(n, bool), {
        "step_topk_tokens": np.array(step_tokens), "step_topk_probs": np.array(step_probs)}


def _chain_tree(ctx, n, rng):
    """Multi-layer EAGLE: a chain root, d1..dK, each layer's own top-1 and its probability."""
    tokens, scores = [ctx[-1]], [1.0]
    for _ in range(n - 1):
        p = _draft_probs(ctx + tokens[1:], rng)
        tokens.append(int(np.argmax(p)))
        scores.append(float(p.max()))
    return np.array(tokens), np.arange(-1, n - 1), np.array(scores), np.ones(n, bool), {}


def _verify(ctx, tokens, parents, valid, temperature, rng):
    """Greedy (or sampled) tree verification -> target view and decision."""
    n = len(tokens)
    probs = np.stack([target_probs(_path_context(ctx, tokens, parents, i)) for i in range(n)])
    argmax = probs.argmax(1)
    status = np.zeros(n, np.int8)
    status[0] = 1
    coins = np.full(n, np.nan, np.float32) if temperature > 0 else None
    path, node = [0], 0
    while True:
        children = [c for c in range(n) if parents[c] == node and valid[c]]
        pick = None
        if temperature > 0:
            coins[node] = u = rng.random()
            cum = np.cumsum([probs[node, tokens[c]] for c in children]) if children else []
            hit = np.nonzero(u < np.asarray(cum))[0]
            pick = children[hit[0]] if len(hit) else None
        else:
            pick = next((c for c in children if tokens[c] == argmax[node]), None)
        for c in children:  # rejected: the children before the one taken (all of them when none is)
            status[c] = 1 if c == pick else (2 if pick is None or c < pick else 0)
        if pick is None:
            break
        path.append(pick)
        node = pick
    bonus = int(argmax[node]) if temperature == 0 else int(rng.choice(len(VOCAB), p=probs[node]))
    top = np.argsort(-probs, axis=1)[:, :TOPK]
    return {"target_argmax": argmax, "target_argmax_prob": probs.max(1),
            "target_topk_tokens": top, "target_topk_probs": np.take_along_axis(probs, top, 1),
            "status": status, "accept_path": np.array(path), "bonus_token": bonus, "coins": coins}


def run_info_for(method: str, num_draft_tokens: int, temperature: float) -> dict:
    return {"method": method, "model": {"name": "toy-target", "hash": "0" * 16},
            "draft": {"method": method, "num_draft_tokens": num_draft_tokens},
            "device": "cpu", "temperature": temperature, "synthetic": True}


def record_synthetic(recorder: Recorder, method: str = "ngram", num_requests: int = 3, batch_size: int = 2,
                     max_new_tokens: int = 24, num_draft_tokens: int = 8, temperature: float = 0.0,
                     seed: int = 0, max_iterations: int | None = None) -> None:
    """Decode ``num_requests`` toy prompts speculatively, recording every iteration."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}")
    rng = np.random.default_rng(seed)
    n = num_draft_tokens
    width = n + 3 if method == "eagle" else n  # eagle rows arrive padded to a wider batch N
    waiting = []
    for r in range(num_requests):
        prompt = [int(t) for t in rng.integers(2, len(VOCAB), int(rng.integers(4, 12)))]
        waiting.append({"id": r, "prompt": prompt, "max_new": int(rng.integers(max_new_tokens // 2,
                                                                                   max_new_tokens + 1))})
    active: list[dict] = []
    iteration = 0
    while waiting or active:
        while waiting and len(active) < batch_size:  # admit: prefill gives the first token
            req = waiting.pop(0)
            req["out"] = [int(np.argmax(target_probs(req["prompt"])))]
            req["seq_len"] = len(req["prompt"])
            active.append(req)
        if max_iterations is not None and iteration >= max_iterations:
            return
        rows = []
        for b, req in enumerate(active):
            ctx = req["prompt"] + req["out"]
            build = {"ngram": _ngram_tree, "eagle": _eagle_tree, "multi_layer_eagle": _chain_tree}[method]
            tokens, parents, scores, valid, why = build(ctx, n, rng)
            row = {"tokens": tokens, "parents": parents, "scores": scores, "valid": valid,
                   "mask": ancestors_mask(parents), **tree_indices(parents, req["seq_len"], b), **why}
            row.update(_verify(ctx, tokens, parents, valid, temperature, rng))
            rows.append(row)
        fields = _stack(rows, width, n)
        fields.update(iteration=iteration, request_id=np.array([r["id"] for r in active]), method=method,
                      seq_len=np.array([r["seq_len"] for r in active]), num_nodes=n, temperature=temperature)
        phases = {"draft_us": 300.0, "index_us": 20.0, "verify_us": 900.0, "commit_us": 40.0}
        if method == "ngram":
            phases.update(trie_get_us=60.0, trie_put_us=30.0)
        for name, mean in phases.items():
            fields[name] = float(rng.gamma(8.0, mean / 8.0))
        fields["iteration_us"] = sum(fields[p] for p in phases) + 50.0
        recorder.record_batch(fields)
        iteration += 1
        for req, row in zip(list(active), rows):
            path = row["accept_path"]
            req["out"] += [int(row["tokens"][i]) for i in path[1:]] + [row["bonus_token"]]
            req["seq_len"] += len(path)
            if len(req["out"]) >= req["max_new"]:
                req["out"] = req["out"][: req["max_new"]]
                recorder.record_request(req["id"], req["prompt"], req["out"], "length",
                                        " ".join(VOCAB[t] for t in req["prompt"]))
                active.remove(req)


def _stack(rows: list[dict], width: int, n: int) -> dict:
    """Per-row arrays -> batch arrays [B, width, ...], padded past n (as an engine pads)."""
    out = {}
    for name in rows[0]:
        values = [r[name] for r in rows]
        if name == "mask":
            arr = np.zeros((len(rows), width, width), bool)
            arr[:, :n, :n] = values
        elif name == "accept_path":
            arr = np.full((len(rows), n), -1, np.int64)
            for b, v in enumerate(values):
                arr[b, : len(v)] = v
        elif name == "coins" and values[0] is None:
            continue
        elif np.ndim(values[0]) == 0 or name.startswith("step_topk"):
            arr = np.array(values)
        else:
            first = np.asarray(values[0])
            arr = np.full((len(rows), width, *first.shape[1:]), 7, first.dtype)  # junk beyond n
            arr[:, :n] = values
        out[name] = arr
    return out


def make_trace(method: str = "ngram", path: str | Path | None = None, flush_every: int = 64,
               **kwargs) -> Trace:
    """Record a synthetic run and return its Trace (written to ``path`` when given)."""
    n = kwargs.get("num_draft_tokens", 8)
    rec = Recorder(path, run_info_for(method, n, kwargs.get("temperature", 0.0)),
                   tiny_tokenizer_json(), flush_every=flush_every)
    with rec:
        record_synthetic(rec, method, **kwargs)
    return rec.close()


def as_stored(table):
    """``table`` with the columns a trace file keeps in float16 rounded to float16, as a reader sees them."""
    import pyarrow as pa

    from spectool.trace.schema import DISK_TYPES

    for name, typ in DISK_TYPES.items():
        if name in table.column_names and pa.types.is_list(typ) and typ.value_type == pa.float16():
            i = table.schema.get_field_index(name)
            wide = table.schema.field(i)
            table = table.set_column(i, wide, table.column(i).cast(typ).cast(wide.type))
    return table
