"""Exact EAGLE and multi-layer EAGLE what-if from one teacher-forced target forward.

In a greedy run every configuration decodes the same tokens, and a draft layer's cache
entry at a committed index depends only on the committed token and the target's hidden
state there. So one target forward over a request's known tokens (prompt + output) gives
every hidden state the engine would have fed its draft layers, and a draft at any
``seq_len`` L is a function of L alone: the drafter's own draft computation over the
teacher-forced draft cache truncated at L. The replay runs the drafters' own steps
(``EagleDrafter._run`` / ``_top_children`` / ``_draft_step`` and
``MultiLayerEagleDrafter._layer_step``) on a one-slot host that stands in for the engine,
restores the few cache entries a draft overwrites, and memoizes drafts by L, so a sweep
pays once per distinct L:

- EAGLE: the tree of S steps is the candidate prefix of the tree of S_max steps (each
  step depends only on earlier ones), so one draft with S_max steps per (top-k, L)
  serves every num_steps and num_draft_tokens; the EAGLE-2 selection
  (``eagle_tree_from_candidates``) then picks that configuration's N nodes.
- multi-layer EAGLE: layer k drafts from the drafts of layers < k, so one chain of
  S_max drafts per L serves every num_steps.

Equal to the engine's accept lengths in float32 (the test runs both); in bf16 the
teacher-forced and the engine's incremental forwards round differently, so a near-tie
between two draft tokens can go either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from spectool.config import EagleConfig, MultiLayerEagleConfig
from spectool.tune.accept import accept_against
from spectool.tune.workload import RequestWork, TuneError


class DrafterHost:
    """The engine attributes a drafter reads, for one slot and no CUDA graphs."""

    def __init__(self, target, seq_capacity: int) -> None:
        self.target = target
        self.model = target.model
        self.config = target.config
        self.device = torch.device(target.device)
        self.on_cuda = self.device.type == "cuda"
        self.max_batch_size = 1
        self.num_slots = 1
        self.cache_len = seq_capacity
        self.graph_buckets = (1,)
        self.cuda_graphs = False


@torch.no_grad()
def target_hidden(target, known: torch.Tensor) -> torch.Tensor:
    """The target's hidden states [T, H] (before its final norm) over ``known`` [T], teacher-forced."""
    from spectool.model.kv_cache import KVCache

    t = known.shape[0]
    dev = known.device
    cache = KVCache.for_model(target.config, 1, t, target.dtype, dev)
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    hidden = target.model(known[None], torch.arange(t, device=dev)[None], cache=cache, slots=zero, starts=zero,
                          tree_mask=None, kv_len=t)
    return hidden[0]


def check_checkpoint(path, kind: str) -> Path:
    """The checkpoint directory of a draft config, or a one-line TuneError."""
    if path is None or not Path(path).is_dir():
        raise TuneError(f"the {kind} draft checkpoint {path} is not a directory: give the path it was recorded with")
    return Path(path)


def _flat(tensor: torch.Tensor) -> list[int]:
    return tensor[0].tolist()


class EagleDrafts:
    """Memoized EAGLE drafts of one request for one top-k, at up to ``max_steps`` steps."""

    def __init__(self, target, path, topk: int, max_steps: int, capacity: int) -> None:
        from spectool.draft.eagle import EagleDrafter

        self.topk, self.max_steps = topk, max_steps
        total = 1 + topk + (max_steps - 1) * topk * topk
        cfg = EagleConfig(path, num_steps=max_steps, topk=topk, num_draft_tokens=total)
        self.drafter = EagleDrafter(cfg, DrafterHost(target, capacity))
        self.drafter.allocate()
        self.device = self.drafter.device
        self._memo: dict[int, tuple[torch.Tensor, ...]] = {}

    @torch.no_grad()
    def load(self, known: torch.Tensor, hidden: torch.Tensor) -> None:
        """Teacher-force the draft layer over the request: index i sees (known[i + 1], hidden[i])."""
        d = self.drafter
        t = known.shape[0]
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        positions = torch.arange(1, t, device=self.device)[None]
        feature, normed = d._run(known[None, 1:], hidden[None, :t - 1], positions, zero, zero, None, t - 1)
        self.features = feature[0]
        self.root_p, self.root_i = d._top_children(normed[0])
        self.known = known
        self._pristine = (d.cache.k.clone(), d.cache.v.clone())
        self._memo.clear()

    @torch.no_grad()
    def candidates(self, seq_len: int) -> tuple[torch.Tensor, ...]:
        """(tokens, scores, parents) [1, C] of every candidate of the S_max-step draft at ``seq_len``,
        in the drafter's flat order (root first)."""
        got = self._memo.get(seq_len)
        if got is not None:
            return got
        d, L = self.drafter, seq_len
        slot = torch.zeros(1, dtype=torch.long, device=self.device)
        d.feature[0] = self.features[L - 1]
        d.root_p[0], d.root_i[0] = self.root_p[L - 1], self.root_i[L - 1]
        d._kv_len = L
        out = d._draft_step(slot, torch.tensor([L], device=self.device), self.known[L:L + 1])
        # With N = every candidate the selection keeps them all, sorted back to flat order.
        tree_tokens, tree_parents, _depth, tree_scores = out[0], out[1], out[2], out[3]
        got = (tree_tokens.clone(), tree_scores.clone(), tree_parents.clone())
        fed = (self.max_steps - 1) * self.topk
        if fed:  # the fed frontier overwrote the teacher-forced entries from index L on
            k0, v0 = self._pristine
            d.cache.k[..., L:L + fed, :] = k0[..., L:L + fed, :]
            d.cache.v[..., L:L + fed, :] = v0[..., L:L + fed, :]
        self._memo[L] = got
        return got


class MultiLayerDrafts:
    """Memoized multi-layer EAGLE chains of one request, up to ``max_steps`` layers."""

    def __init__(self, target, path, max_steps: int, capacity: int) -> None:
        from spectool.draft.multi_layer_eagle import MultiLayerEagleDrafter

        self.max_steps = max_steps
        self.drafter = MultiLayerEagleDrafter(MultiLayerEagleConfig(path, num_steps=max_steps),
                                              DrafterHost(target, capacity))
        self.drafter.allocate()
        self.device = self.drafter.device
        self._memo: dict[int, list[int]] = {}

    @torch.no_grad()
    def load(self, known: torch.Tensor, hidden: torch.Tensor) -> None:
        """Teacher-force every layer over the request (layer k at index i sees known[i + k + 1]);
        entries whose input would be past the known tokens are recomputed by each draft."""
        d = self.drafter
        t = known.shape[0]
        d.tokens.zero_()
        d.tokens[0, :t] = known
        d.hidden[0, :t] = hidden
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        scratch = zero + d.tokens.shape[1] - 1
        for k in range(self.max_steps):
            d._layer_step(k, zero, zero, zero + t - 2, scratch, window=t - 1, kv_len=t - 1)
        d.tokens[0, -1] = 0
        self._pristine = (d.tokens.clone(), None if d.features is None else d.features.clone(),
                          [(c.k.clone(), c.v.clone()) for c in d.caches])
        self._memo.clear()

    @torch.no_grad()
    def chain(self, seq_len: int) -> list[int]:
        """The drafts d_1 .. d_{S_max} of the draft at ``seq_len`` (root = known[seq_len])."""
        got = self._memo.get(seq_len)
        if got is not None:
            return got
        d, L, s = self.drafter, seq_len, self.max_steps
        slot = torch.zeros(1, dtype=torch.long, device=self.device)
        drafts = []
        for k in range(s):
            start = max(L - 1 - k, 0)
            draft, _ = d._layer_step(k, slot, slot + start, slot + L - 1 - start, slot + L + k + 1,
                                     window=L - start, kv_len=L + k + 1)
            drafts.append(int(draft[0]))
        tokens, features, caches = self._pristine
        lo = max(L - 1 - s, 0)
        d.tokens[0, L + 1:L + s + 1] = tokens[0, L + 1:L + s + 1]
        if features is not None:
            d.features[:, 0, lo:L] = features[:, 0, lo:L]
        for c, (k0, v0) in zip(d.caches, caches):
            c.k[..., lo:L, :] = k0[..., lo:L, :]
            c.v[..., lo:L, :] = v0[..., lo:L, :]
        self._memo[L] = drafts
        return drafts


@dataclass
class RequestAccepts:
    """One request's predicted iterations under one configuration: (seq_len, accept, censored) each."""

    rows: list[tuple[int, int, bool]]


def walk(work: RequestWork, accept_at) -> RequestAccepts:
    """The iterations one request runs: from the prompt length, each gains accept + 1 tokens."""
    rows = []
    L = work.prompt_len
    while L + 1 < work.end:
        a, cut = accept_at(L)
        rows.append((L, a, cut))
        L += a + 1
    return RequestAccepts(rows)


def eagle_accept_at(drafts: EagleDrafts, config: EagleConfig, known: list[int]):
    """accept(L) -> (accept length, censored) of ``config``'s tree at seq_len L."""
    from spectool.draft.tree import eagle_tree_from_candidates

    k, s = config.topk, config.num_steps
    nc = 1 + k + (s - 1) * k * k

    def accept_at(L: int) -> tuple[int, bool]:
        tok, score, par = drafts.candidates(L)
        tree = eagle_tree_from_candidates(tok[:, :nc], score[:, :nc], par[:, :nc], config.num_draft_tokens,
                                          torch.tensor([L], device=tok.device), max_depth=s)
        return accept_against(_flat(tree.tokens), _flat(tree.parents), _flat(tree.valid), known, L)

    return accept_at


def multi_layer_accept_at(drafts: MultiLayerDrafts, config: MultiLayerEagleConfig, known: list[int]):
    """accept(L) -> (accept length, censored) of ``config``'s chain at seq_len L."""
    s = config.num_steps
    parents = list(range(-1, s))
    valid = [True] * (s + 1)

    def accept_at(L: int) -> tuple[int, bool]:
        return accept_against([known[L], *drafts.chain(L)[:s]], parents, valid, known, L)

    return accept_at
