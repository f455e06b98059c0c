"""EAGLE-3 drafting: the EAGLE-2 tree search of ``EagleDrafter`` over an EAGLE-3 draft.

What differs from EAGLE (spectool/model/eagle3.py): the target's forward hands the drafter the
outputs of three of its layers (the engine asks for ``aux_layers``), which ``fc`` projects to
the root's hidden input, while later steps read the draft's own feature as EAGLE's do; and the
children come from the draft's own head over its reduced vocabulary, mapped to target ids by
``d2t`` before they enter the tree (so trees, per-step top-k and the trace hold target ids).
"""

from __future__ import annotations

import torch

from spectool.draft.eagle import EagleDrafter
from spectool.kernels.topk import row_topk


class Eagle3Drafter(EagleDrafter):
    """Drafts an EAGLE-2 tree from an EAGLE-3 checkpoint."""

    def _load(self) -> int:
        from spectool.model.eagle3 import load_eagle3

        draft = load_eagle3(self.config.path, self.engine.target)
        self.layer, self.aux_layers = draft.layer, draft.aux_layers
        return self.layer.draft_vocab_size

    def _make_cache(self, num_slots: int, length: int):
        return self.layer.make_cache(num_slots, length)

    def _root_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer.project(hidden)

    def _top_children(self, normed: torch.Tensor, out=None) -> tuple[torch.Tensor, torch.Tensor]:
        p, draft_ids = row_topk(self.layer.logits(normed), self.config.topk, softmax=True, out=out)
        # In place, so a caller's ``out`` receives target ids too.
        return p, draft_ids.add_(self.layer.d2t[draft_ids])
