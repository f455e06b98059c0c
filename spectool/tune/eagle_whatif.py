"""Exact EAGLE and multi-layer EAGLE what-if from one teacher-forced target forward.

In a greedy run every configuration decodes the same tokens, and a draft layer's cache
entry at a committed index depends only on the committed token and the target's hidden
state there. So one target forward over a request's known tokens (prompt + output) gives
every hidden state the engine would have fed its draft layers, and a draft at any
``seq_len`` L is a function of L alone: the drafter's own draft computation over the
teacher-forced draft cache truncated at L. The replay runs the drafters' own steps
(``EagleDrafter._run`` / ``_top_children`` / ``_draft_candidates`` and
``MultiLayerEagleDrafter._layer_step``) on a host that stands in for the engine, with one
slot per (request, configuration) *lane* holding that request's teacher-forced state; each
round drafts every unfinished lane at its own L in one batch, then puts back the few cache
entries a draft overwrote:

- EAGLE: the tree of S steps is the candidate prefix of the tree of S_max steps (each
  step depends only on earlier ones), so one draft per (request, L) serves every num_steps
  and num_draft_tokens of that top-k; the EAGLE-2 selection (``eagle_tree_from_candidates``)
  then picks each configuration's N nodes.
- multi-layer EAGLE: layer k drafts from the drafts of layers < k, so one chain serves
  every num_steps.

An EAGLE draft runs only as many steps as the longest configuration standing at its
(request, L) needs (on the CPU its row leaves the round's batch after its last step, and each
step feeds only the newest frontier: ``FrontierEagleDrafter``), and is run again, longer, if a
longer configuration reaches that L later.

Equal to the engine's accept lengths in float32 (the test runs both). In bf16 with the
default kernels the teacher-forced forward (one prefill over the whole request) and the
engine's (prefill, then verifies of N-node trees at its batch size) pick different GEMM and
attention reductions, so hidden states, draft caches and draft scores differ in their last
bits, and a near-tie between two draft tokens can go either way (within 2 % of the mean
accept length on the H200, over the requests the engine decodes again: another tree shape can
also flip the target's own argmax and change the text itself). A trace recorded with
``Engine(deterministic=True)`` is replayed with the same batch-invariant kernels (target and
draft layers): every forward computes a token's bits as the engine did, so the replay is exact
in any dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch

from spectool.config import EagleConfig, MultiLayerEagleConfig
from spectool.draft.eagle import EagleDrafter
from spectool.tune.accept import accept_against
from spectool.tune.workload import RequestWork, TuneError


class DrafterHost:
    """The engine attributes a drafter reads: ``num_slots`` slots and no CUDA graphs."""

    def __init__(self, target, seq_capacity: int, num_slots: int = 1) -> None:
        self.target = target
        self.model = target.model
        self.config = target.config
        self.device = torch.device(target.device)
        self.on_cuda = self.device.type == "cuda"
        self.max_batch_size = num_slots
        self.num_slots = num_slots
        self.cache_len = seq_capacity
        self.graph_buckets = (1,)
        self.cuda_graphs = False


@torch.no_grad()
def target_hidden(target, known: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
    """The target's hidden states [T, H] (before its final norm) over ``known`` [T], teacher-forced
    (``deterministic``: with the batch-invariant kernels, the bits a deterministic engine fed its drafter)."""
    from spectool.model.kv_cache import KVCache

    t = known.shape[0]
    dev = known.device
    cache = KVCache.for_model(getattr(target.model, "local_config", target.config), 1, t, target.dtype, dev)
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    hidden = target.model(known[None], torch.arange(t, device=dev)[None], cache=cache, slots=zero, starts=zero,
                          tree_mask=None, kv_len=t, deterministic=deterministic)
    return hidden[0]


def check_checkpoint(path, kind: str) -> Path:
    """The checkpoint directory of a draft config, or a one-line TuneError."""
    if path is None or not Path(path).is_dir():
        raise TuneError(f"the {kind} draft checkpoint {path} is not a directory: give the path it was recorded with")
    return Path(path)


class _Lanes:
    """Slots of one drafter, one per (request, configuration) *lane*, each holding a copy of its
    request's teacher-forced draft state, so the lanes' drafts at different L run as one batch.

    Subclasses say how to teacher-force a request into a slot (``_force``), which state to copy
    and restore (``_state``), and how to draft a batch of lanes sorted by their steps (``_draft``).
    """

    def __init__(self, drafter, lane_requests: list[int]) -> None:
        self.drafter = drafter
        self.drafter.allocate()
        self.device = drafter.device
        self.lane_requests = lane_requests
        self.pristine: dict[int, list[torch.Tensor]] = {}

    @torch.no_grad()
    def load(self, request_id: int, known: torch.Tensor, hidden: torch.Tensor) -> None:
        """Teacher-force one request into its lanes' slots and keep a pristine copy of its state."""
        lanes = [i for i, r in enumerate(self.lane_requests) if r == request_id]
        if not lanes:
            return
        first = lanes[0]
        self._force(first, known, hidden)
        self.pristine[request_id] = [t[first].clone() for t in self._state()]
        for lane in lanes[1:]:
            for t in self._state():
                t[lane] = t[first]

    @torch.no_grad()
    def draft(self, lanes: list[int], seq_lens: list[int], steps: list[int]) -> list:
        """Each lane's draft of its own ``steps`` (<= max_steps) at its seq_len, as ``_draft`` gives
        it: one batch, whose rows leave it after their last step (most steps first)."""
        order = sorted(range(len(lanes)), key=lambda i: -steps[i])
        got = self._draft([lanes[i] for i in order], [seq_lens[i] for i in order], [steps[i] for i in order])
        out: list = [None] * len(lanes)
        for i, g in zip(order, got):
            out[i] = g
        return out

    def _restore(self, lanes: list[int], lo: list[int], hi: list[int]) -> None:
        """Put back the pristine state at sequence indices [lo, hi) of each lane (axis -2 of every
        state tensor but the token rows, whose sequence axis is their last)."""
        for lane, a, b in zip(lanes, lo, hi):
            saved = self.pristine[self.lane_requests[lane]]
            for t, p in zip(self._state(), saved):
                if t.dim() == 2:  # token ids [slots, seq]
                    t[lane, a:b] = p[a:b]
                else:
                    t[lane, ..., a:b, :] = p[..., a:b, :]


class FrontierEagleDrafter(EagleDrafter):
    """The engine's EAGLE drafter with each step feeding only the newest frontier: the earlier
    frontiers' keys and values are in the draft cache from the steps that fed them (the same
    values: a node's forward depends only on itself, its ancestors and the prefix), and a tree
    mask over every fed node keeps each new one to its ancestors. The same candidates for about
    a third of the draft layer's rows at five steps; on the CPU in float32 the same bits
    (tests/test_tune_oracle.py compares with the engine's runs).

    ``rows_at_step[s]`` (when set): only the first that many rows of the batch draft step s + 1;
    the others have stopped (their later candidates are zeros, read by no configuration).
    """

    rows_at_step: list[int] | None = None

    def _feed(self, tokens, hidden, positions, tree_mask, slots, seq_lens):
        k, n = self.config.topk, tokens.shape[1]
        kv_len = None if self._kv_len is None else self._kv_len + n
        b = self._rows = tokens.shape[0] if self.rows_at_step is None else self.rows_at_step[n // k]
        feature, normed = self._run(tokens[:b, -k:], hidden[:b, -k:], positions[:b, -k:], slots[:b],
                                    seq_lens[:b] + (n - k), tree_mask[:b, -k:], kv_len)
        if b < tokens.shape[0]:
            pad = (0, 0, 0, 0, 0, tokens.shape[0] - b)
            feature, normed = torch.nn.functional.pad(feature, pad), torch.nn.functional.pad(normed, pad)
        return feature, normed

    def _top_children(self, normed, out=None):
        if out is None or self.rows_at_step is None or self._rows == normed.shape[0]:
            return super()._top_children(normed, out)
        b = self._rows
        p, i = super()._top_children(normed[:b])
        for o, got in zip(out, (p, i)):
            o[:b] = got
            o[b:] = 0
        return out


class EagleLanes(_Lanes):
    """EAGLE drafts at up to ``max_steps`` steps with one top-k, for many lanes at once."""

    def __init__(self, target, path, topk: int, max_steps: int, capacity: int, lane_requests: list[int]) -> None:
        self.topk, self.max_steps = topk, max_steps
        total = 1 + topk + (max_steps - 1) * topk * topk
        cfg = EagleConfig(path, num_steps=max_steps, topk=topk, num_draft_tokens=total)
        host = DrafterHost(target, capacity, num_slots=len(lane_requests))
        # On CUDA the engine's own steps: its fused attention kernels (the batch-invariant ones of a
        # deterministic trace included) take a mask over the new tokens only.
        drafter = EagleDrafter if host.on_cuda else FrontierEagleDrafter
        super().__init__(drafter(cfg, host), lane_requests)
        self.features: dict[int, tuple[torch.Tensor, ...]] = {}
        self.known: dict[int, torch.Tensor] = {}

    def _state(self) -> list[torch.Tensor]:
        c = self.drafter.cache
        return [c.k[0], c.v[0]]  # [slots, heads, seq, dim]

    def _force(self, lane: int, known: torch.Tensor, hidden: torch.Tensor) -> None:
        """Index i of the draft cache sees (known[i + 1], hidden[i]), as the engine's extends feed it."""
        d = self.drafter
        t = known.shape[0]
        slot = torch.tensor([lane], device=self.device)
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        positions = torch.arange(1, t, device=self.device)[None]
        feature, normed = d._run(known[None, 1:], hidden[None, :t - 1], positions, slot, zero, None, t - 1)
        rid = self.lane_requests[lane]
        self.features[rid] = (feature[0], *d._top_children(normed[0]))
        self.known[rid] = known

    def _draft(self, lanes: list[int], seq_lens: list[int], steps: list[int]) -> list[tuple[torch.Tensor, ...]]:
        """Per lane (sorted by steps, most first), (tokens, scores, parents) of every candidate of
        its draft in the drafter's flat order (root first): the first 1 + k + (steps - 1) k^2 are
        its ``steps``-step draft's, the rest read by no configuration (zeros on the CPU, where the
        row left the batch; on CUDA every row runs the batch's most steps)."""
        d = self.drafter
        rids = [self.lane_requests[i] for i in lanes]
        slots = torch.tensor(lanes, device=self.device)
        for lane, rid, L in zip(lanes, rids, seq_lens):
            feature, root_p, root_i = self.features[rid]
            d.feature[lane], d.root_p[lane], d.root_i[lane] = feature[L - 1], root_p[L - 1], root_i[L - 1]
        roots = torch.stack([self.known[rid][L] for rid, L in zip(rids, seq_lens)])
        d._kv_len = max(seq_lens)
        if isinstance(d, FrontierEagleDrafter):
            d.rows_at_step = [sum(s > step for s in steps) for step in range(steps[0])]
        tok, score, par = d._draft_candidates(slots, torch.tensor(seq_lens, device=self.device), roots, steps[0])[:3]
        got = list(zip(tok, score, par))
        if steps[0] > 1:  # the fed frontiers overwrote teacher-forced entries from index L on
            self._restore(lanes, seq_lens, [L + (steps[0] - 1) * self.topk for L in seq_lens])
        return got


class MultiLayerLanes(_Lanes):
    """Multi-layer EAGLE chains of up to ``max_steps`` layers, for many lanes at once."""

    def __init__(self, target, path, max_steps: int, capacity: int, lane_requests: list[int]) -> None:
        from spectool.draft.multi_layer_eagle import MultiLayerEagleDrafter

        self.max_steps = max_steps
        host = DrafterHost(target, capacity, num_slots=len(lane_requests))
        super().__init__(MultiLayerEagleDrafter(MultiLayerEagleConfig(path, num_steps=max_steps), host),
                         lane_requests)

    def _state(self) -> list[torch.Tensor]:
        d = self.drafter
        state = [d.tokens, d.hidden] + [t for c in d.caches for t in (c.k[0], c.v[0])]
        if d.features is not None:
            state += list(d.features)
        return state

    def _force(self, lane: int, known: torch.Tensor, hidden: torch.Tensor) -> None:
        """Layer k at index i sees known[i + k + 1]; entries whose input would lie past the known
        tokens are junk, and every draft recomputes the ones it reads."""
        d = self.drafter
        t = known.shape[0]
        d.tokens[lane] = 0
        d.tokens[lane, :t] = known
        d.hidden[lane, :t] = hidden
        slot = torch.tensor([lane], device=self.device)
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        scratch = zero + d.tokens.shape[1] - 1
        for k in range(self.max_steps):
            d._layer_step(k, slot, zero, zero + t - 2, scratch, window=t - 1, kv_len=t - 1)
        d.tokens[lane, -1] = 0

    def _draft(self, lanes: list[int], seq_lens: list[int], steps: list[int]) -> list[list[int]]:
        """Per lane (sorted by steps, most first), the drafts d_1 .. d_steps of its chain at its
        seq_len (root = known[seq_len]), then zeros up to the most steps of the batch."""
        d, s = self.drafter, steps[0]
        slots = torch.tensor(lanes, device=self.device)
        lens = torch.tensor(seq_lens, device=self.device)
        top = max(seq_lens)
        drafts = torch.zeros(len(lanes), s, dtype=torch.long, device=self.device)
        for k in range(s):
            b = sum(n > k for n in steps)  # the rows whose chains reach layer k
            start = (lens[:b] - 1 - k).clamp(min=0)
            drafts[:b, k], _ = d._layer_step(k, slots[:b], start, lens[:b] - 1 - start, lens[:b] + k + 1,
                                             window=k + 1, kv_len=top + k + 1)
        self._restore(lanes, [max(L - 2 - s, 0) for L in seq_lens], [L + s + 2 for L in seq_lens])
        return drafts.tolist()


def sweep_lanes(lanes: _Lanes, works: list[RequestWork], configs: list, lane_of: list[tuple[int, int]],
                accept_rows, on_tokens=None) -> dict[tuple[int, int], list[tuple[int, int, bool]]]:
    """Walk every lane (request, config) from its prompt length, one batched draft per round.

    ``lane_of[i]`` = (index into works, index into configs) of lane i. A draft depends only on
    (request, L), and its first S steps are the S-step draft, so each round drafts only the
    (request, L) no lane drafted before with as many steps as a configuration standing there needs
    (in the slot of one lane standing there, with the most steps those configurations need: a
    position only short configurations reach costs only their steps), and a configuration's accept
    length at (request, L) is worked out once.
    ``accept_rows(config, request_ids, seq_lens, drafts)`` gives (accept length, censored, tree) per
    row. ``on_tokens(n)``, if given, hears after each round how many output tokens the lanes
    advanced (a progress bar). Returns each lane's iterations as (seq_len, accept length, censored, tree) rows, keyed by
    (request id, config index).
    """
    seq = [works[w].prompt_len for w, _ in lane_of]
    rid_of = [works[w].request_id for w, _ in lane_of]
    rows: dict[tuple[int, int], list] = {(works[w].request_id, c): [] for w, c in lane_of}
    drafts: dict[tuple[int, int], object] = {}
    drafted: dict[tuple[int, int], int] = {}  # steps of the draft kept at (request, L)
    accepts: dict[tuple[int, int, int], tuple[int, bool, tuple]] = {}
    active = [i for i, (w, _) in enumerate(lane_of) if seq[i] + 1 < works[w].end]
    while active:
        before = [seq[i] + 1 for i in active]
        todo: dict[tuple[int, int], tuple[int, int]] = {}  # (request, L) -> (lane, steps)
        for i in active:
            key = (rid_of[i], seq[i])
            steps = configs[lane_of[i][1]].num_steps
            if steps > max(drafted.get(key, 0), todo.get(key, (0, 0))[1]):
                todo[key] = (todo.get(key, (i, 0))[0], steps)
        if todo:
            keys = list(todo)
            steps = [todo[k][1] for k in keys]
            for key, got, s in zip(keys, lanes.draft([todo[k][0] for k in keys], [k[1] for k in keys], steps), steps):
                drafts[key], drafted[key] = got, s
        by_config: dict[int, list[tuple[int, int]]] = {}
        for i in active:
            c = lane_of[i][1]
            if (c, rid_of[i], seq[i]) not in accepts:
                by_config.setdefault(c, [])
                if (rid_of[i], seq[i]) not in by_config[c]:
                    by_config[c].append((rid_of[i], seq[i]))
        for c, keys in by_config.items():
            results = accept_rows(configs[c], [k[0] for k in keys], [k[1] for k in keys], [drafts[k] for k in keys])
            for key, res in zip(keys, results):
                accepts[(c, *key)] = res
        for i in active:
            a, cut, tree = accepts[(lane_of[i][1], rid_of[i], seq[i])]
            rows[(rid_of[i], lane_of[i][1])].append((seq[i], a, cut, tree))
            seq[i] += a + 1
        if on_tokens is not None:
            on_tokens(sum(min(seq[i] + 1, works[lane_of[i][0]].end) - L for i, L in zip(active, before)))
        active = [i for i in active if seq[i] + 1 < works[lane_of[i][0]].end]
    return rows


def eagle_accepts(known: dict[int, list[int]]):
    """accept_rows for EAGLE: each configuration's EAGLE-2 selection over the S_max candidates."""
    from spectool.draft.tree import eagle_select

    def accept_rows(config: EagleConfig, rids, seq_lens, drafts):
        k, s = config.topk, config.num_steps
        nc = 1 + k + (s - 1) * k * k
        tok, score, par = (torch.stack([d[f][:nc] for d in drafts]) for f in range(3))
        tokens, parents, _, valid = (t.tolist() for t in eagle_select(tok, score, par, config.num_draft_tokens))
        return [(*accept_against(tokens[b], parents[b], valid[b], known[rid], L), (tokens[b], parents[b], valid[b]))
                for b, (rid, L) in enumerate(zip(rids, seq_lens))]

    return accept_rows


def multi_layer_accepts(known: dict[int, list[int]]):
    """accept_rows for multi-layer EAGLE: the chain's first num_steps drafts."""

    def accept_rows(config: MultiLayerEagleConfig, rids, seq_lens, drafts):
        s = config.num_steps
        parents, valid = list(range(-1, s)), [True] * (s + 1)
        out = []
        for rid, L, chain in zip(rids, seq_lens, drafts):
            tokens = [known[rid][L], *chain[:s]]
            out.append((*accept_against(tokens, parents, valid, known[rid], L), (tokens, parents, valid)))
        return out

    return accept_rows
