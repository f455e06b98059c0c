"""Draft methods: each turns engine state into a DraftTree for the running batch.

A drafter sees the engine at four fixed points:

- ``on_prefill(batch, hiddens)`` after the target prefilled new requests (``hiddens[b]``:
  the prompt's hidden states [L, H], before the final norm);
- ``draft(batch, timer) -> (DraftTree, why)`` before the verify forward (``why`` holds the
  per-row reasons the recorder stores: ngram match length and breadth, EAGLE
  per-step top-k);
- ``on_verify(batch, tree, result, hidden, accepted, timer)`` after acceptance and KV
  commit (``accepted[b]`` = tokens gained by row b: accepted drafts then the bonus);
- ``release(batch)`` when requests finish (slots are reused afterwards).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """The running requests of one iteration, in slot order.

    ``seq_lens`` and ``roots`` describe the state *before* the iteration: tokens in
    the cache and the last verified token (not yet cached). ``histories`` hold each
    request's prompt plus output so far (root included) as Python lists.
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


def gained_tokens(tree, result) -> torch.Tensor:
    """[B, N] tokens each row gained this iteration on the device: the accepted drafts
    in depth order, then the bonus at index accept_length; entries after it are junk."""
    path = result.accept_path  # [B, W], root first
    n = tree.tokens.shape[1]
    drafted = tree.tokens.gather(1, path[:, 1:].clamp(min=0))  # [B, W-1]
    drafted = torch.nn.functional.pad(drafted, (0, n - drafted.shape[1]))
    j = torch.arange(n, device=drafted.device)
    return torch.where(j == result.accept_length[:, None], result.bonus[:, None], drafted)


def path_hidden(hidden: torch.Tensor, result) -> torch.Tensor:
    """[B, W, H] target hidden states along each accepted path (root first; junk past it)."""
    path = result.accept_path.clamp(min=0)
    return hidden.gather(1, path[..., None].expand(-1, -1, hidden.shape[-1]))


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
    raise ValueError(f"unknown draft method {config.method!r}")
