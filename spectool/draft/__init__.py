"""Draft methods: each turns engine state into a DraftTree for the running batch.

A drafter sees the engine at these fixed points:

- ``on_admit(request_ids, prompts)`` (optional) before the target prefills new requests, for
  host work that can run meanwhile (the N-gram trie inserts the prompts on its worker thread);
- ``on_prefill(prefill)`` after each group of new requests the target prefilled (a ``Prefill``:
  the padded prompts, the first sampled tokens and the hidden states the drafter reads, on the
  device). A drafter whose ``host_accepted`` is False is called before the engine's host sync
  on the first tokens, so its prefill runs on the GPU right after the target's while the host
  reads them; one that learns on the host (the N-gram trie) is called after it, its
  ``histories`` then holding the first tokens;
- ``draft(batch, timer) -> (DraftTree | MaskTree, why)`` before the verify forward (``why``
  holds the per-row reasons the recorder stores: ngram match length and breadth, EAGLE
  per-step top-k; a MaskTree is completed inside the engine's verify step);
- ``on_verify(batch, tree, result, hidden, accepted, timer)`` after acceptance and KV
  commit (``accepted[b]`` = tokens gained by row b: accepted drafts then the bonus).
  A drafter whose ``host_accepted`` is False works from ``result`` on the device alone:
  the engine then calls it before its host sync with ``accepted=None``, so the GPU goes
  straight on from the verify to the draft-extend;
- ``release(request_ids)`` when requests finish (their slots are reused afterwards).

When no request finished in an iteration, the engine calls ``draft`` for the next one at
the end of this one (the batch and its host state already advanced), so the draft's GPU
work overlaps the engine's own host work; its phases are timed into the next iteration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """The running requests of one iteration, in slot order.

    ``seq_lens`` and ``roots`` describe the state *before* the iteration: tokens in
    the cache and the last verified token (not yet cached). ``histories`` hold each
    request's prompt plus output so far (root included) as Python lists.

    The engine reuses one Batch while the running requests stay the same and advances
    its tensors and lists in place after ``on_verify``: read them during a call, never
    keep or modify them.
    """

    request_ids: list[int]
    slots: torch.Tensor  # [B] int64, device
    seq_lens: torch.Tensor  # [B] int64, device
    roots: torch.Tensor  # [B] int64, device
    histories: list[list[int]]
    seq_lens_host: list[int]

    @property
    def size(self) -> int:
        return len(self.request_ids)


@dataclass
class Prefill:
    """One prefill group's forward as the drafters read it, right-padded to the group's length t.

    ``tokens`` [G, t] the prompts (0 past each), ``first`` [G] each request's first token (sampled
    from the prefill's logits, on the device), ``lens`` the prompt lengths and ``last`` [G] each
    one's last index on the device (a host list made a device tensor here would wait for the
    target's prefill to finish, since a copy from pageable memory syncs the stream), ``hidden`` [G, t, H]
    what the drafter reads of the target (its hidden states, before the final norm; past a prompt
    the padding's), None when it reads none; ``graphed``: whether the target ran the group in a
    prefill graph (a drafter's own prefill of the same shape can too). ``histories`` are the
    requests' own lists: the prompt, and the first token once the engine has read it on the host.
    ``last_group``: no other group of these admitted requests follows this one. ``hidden`` is a
    prefill graph's output, rewritten by its next replay: a drafter on the device reads it in the
    call. A drafter that learns on the host (``host_accepted``) is called once every group is
    launched and the first tokens are read, with the histories complete.
    """

    request_ids: list[int]
    slots: torch.Tensor  # [G] int64, device
    tokens: torch.Tensor  # [G, t] int64, device
    first: torch.Tensor  # [G] int64, device
    lens: list[int]
    last: torch.Tensor  # [G] int64, device
    hidden: torch.Tensor | None
    graphed: bool
    histories: list[list[int]]
    last_group: bool = True

    def with_first(self) -> torch.Tensor:
        """[G, t + 1]: each prompt followed by its first token, then zeros (on the device: no host sync)."""
        out = torch.nn.functional.pad(self.tokens, (0, 1))
        return out.scatter_(1, self.last[:, None] + 1, self.first[:, None].to(out.dtype))


def accepted_inputs(tree_tokens: torch.Tensor, accept_path: torch.Tensor, accept_length: torch.Tensor,
                    bonus: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a draft layer is extended over after a verify, on the device (graph safe).

    Returns ``(tokens [B, N], hidden [B, W, H])``: the tokens each row gained, i.e. the
    accepted drafts in depth order then the bonus at index accept_length (entries after
    it are junk), and the target's hidden states along each accepted path (root first;
    junk past it). ``accept_path`` is [B, W], -1 padded, from the verify result.
    """
    n = tree_tokens.shape[1]
    path = accept_path.clamp(min=0)
    tokens = torch.nn.functional.pad(tree_tokens.gather(1, path[:, 1:]), (0, n - path.shape[1] + 1))
    tokens.scatter_(1, accept_length[:, None], bonus[:, None])
    return tokens, hidden.gather(1, path[..., None].expand(-1, -1, hidden.shape[-1]))


# What one more prefill forward costs beyond its padded tokens, in padded tokens: groups are split
# only where that saves more padding than this (on the 32-layer 113M target a forward's fixed
# launches and tails cost about as much as 500 tokens of its work).
PREFILL_FORWARD_TOKENS = 512


def prefill_groups(lengths: list[int], budget: int,
                   cost: Callable[[int, int], int | None] | None = None) -> list[list[int]]:
    """Indices of prompts in prefill groups, one forward each, that pad the fewest tokens in all.

    ``cost(count, longest)`` is the padded tokens of a group of ``count`` prompts, the longest
    ``longest`` tokens, or None where no forward takes it (default ``count * longest``, None past
    ``budget``; a prompt no group takes is a group of its own); each group adds
    ``PREFILL_FORWARD_TOKENS``. Prompts are grouped in order of length, so short ones are not padded
    to a long one's length, and the cuts are chosen by dynamic programming over group sizes of
    powers of two or all that are left: the least cost where a group costs the same at every count
    up to a power of two (a graph's batch buckets), close to it elsewhere. Each group lists its
    indices in their given order, and the groups come in the order of their first index.
    """
    cost = cost or (lambda count, longest: count * longest if count * longest <= budget else None)
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0] + [None] * n  # best[j]: the least cost of the j shortest prompts
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]
        sizes, size = [], 1
        while size < j:
            sizes.append(size)
            size *= 2
        sizes.append(j)
        for count in sizes:
            tokens = cost(count, longest)
            if tokens is None:  # no larger group is taken either
                if count > 1:
                    break
                tokens = longest
            total = best[j - count] + tokens + PREFILL_FORWARD_TOKENS
            if best[j] is None or total < best[j]:
                best[j], cut[j] = total, j - count
    groups = []
    j = n
    while j:
        groups.append(sorted(order[cut[j]:j]))
        j = cut[j]
    return sorted(groups)


def make_drafter(config, engine):
    """The drafter for a draft config (None for plain decoding)."""
    if config is None:
        return None
    if config.method == "ngram":
        from spectool.draft.ngram import NgramDrafter

        return NgramDrafter(config, engine)
    if config.method == "eagle":
        from spectool.draft.eagle import EagleDrafter

        return EagleDrafter(config, engine)
    if config.method == "multi_layer_eagle":
        from spectool.draft.multi_layer_eagle import MultiLayerEagleDrafter

        return MultiLayerEagleDrafter(config, engine)
    if config.method == "eagle3":
        from spectool.draft.eagle3 import Eagle3Drafter

        return Eagle3Drafter(config, engine)
    if config.method == "draft_model":
        from spectool.draft.draft_model import DraftModelDrafter

        return DraftModelDrafter(config, engine)
    raise ValueError(f"unknown draft method {config.method!r}")
