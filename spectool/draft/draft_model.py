"""Drafting with a standalone draft model: a small Llama-family model with the target's tokenizer.

It keeps its own KV cache and runs the EAGLE-2 tree search of ``EagleDrafter`` (a chain when
topk is 1) on its own forward, reading no target hidden state. Its cache runs one index ahead
of the target's: index i holds token x[i] at position i, the root included, so after a verify
it is extended over the tokens the row gained (accepted drafts, then the bonus, the new root)
and a draft's frontier nodes go right after the root. What an extend writes past the accepted
path (padding of the fixed-width graph step) lies beyond anything later read before it is
rewritten: that is the rollback to the accepted path.
"""

from __future__ import annotations

import torch

from spectool.draft import Prefill
from spectool.draft.eagle import EagleDrafter
from spectool.kernels.topk import row_topk
from spectool.model.llama import positions_at


class DraftModelDrafter(EagleDrafter):
    """Drafts a chain or an EAGLE-2 tree from a standalone draft model."""

    reads_hidden = False  # its own tokens stand in for the target's hidden states

    def _load(self) -> int:
        from spectool.model.loader import load

        e = self.engine
        self.draft_target = load(self.config.path, device=e.device, dtype=e.target.dtype)
        check_same_vocabulary(e.target, self.draft_target)
        self.model = self.draft_target.model
        return self.draft_target.config.vocab_size

    def _make_cache(self, num_slots: int, length: int):
        from spectool.model.kv_cache import KVCache

        # One index more: the root sits in the draft's cache.
        return KVCache.for_model(self.draft_target.config, num_slots, length + 1, self.draft_target.dtype, self.device)

    @property
    def feature_size(self) -> int:
        return self.draft_target.config.hidden_size

    def _run(self, tokens, hidden, positions, slots, starts, tree_mask, kv_len, at=None):
        """The draft model's forward, written one cache index past ``starts`` (the module docstring);
        its hidden states stand in for both the feature and the normed output ([B, 1, H] at ``at``)."""
        out = self.model(tokens, positions, self.cache, slots, starts + 1, tree_mask,
                         None if kv_len is None else kv_len + 1)
        if at is not None:
            out = positions_at(out, at)
        return out, out

    def _top_children(self, normed: torch.Tensor, out=None) -> tuple[torch.Tensor, torch.Tensor]:
        return row_topk(self.model.logits(normed), self.config.topk, softmax=True, out=out)

    def on_prefill(self, prefill: Prefill) -> None:
        histories = prefill.with_first()  # the prompt, then the first sampled token (the root)
        for b, n in enumerate(prefill.lens):
            tokens = histories[b:b + 1, :n + 1]
            start = torch.full((1,), -1, dtype=torch.long, device=self.device)  # -1: index 0 holds x[0]
            self._kv_len = 0
            # A draft model reads no hidden state: the tokens stand in for it, unread.
            self._extend_step(prefill.slots[b:b + 1], start, tokens, tokens, start + n + 1)


def check_same_vocabulary(target, draft) -> None:
    """Refuse a draft model whose token ids do not mean what the target's do, naming the first
    token that differs (or the vocabulary sizes)."""
    where = f"draft model {draft.name}"
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"{where} does not fit the target: its vocabulary (lm_head.weight, vocab_size) has "
                         f"{draft.config.vocab_size} tokens, the target's {target.config.vocab_size}")
    if (target.tokenizer is None) != (draft.tokenizer is None):
        which = "the target" if target.tokenizer is None else "the draft model"
        raise ValueError(f"cannot check that {where} shares the target's tokenizer: {which} has no tokenizer.json")
    if target.tokenizer is None:
        return
    ours, theirs = (dict((i, t) for t, i in tok.get_vocab(with_added_tokens=True).items())
                    for tok in (target.tokenizer, draft.tokenizer))
    if ours == theirs:
        return
    for i in range(max(len(ours), len(theirs), max(ours, default=-1) + 1, max(theirs, default=-1) + 1)):
        if ours.get(i) != theirs.get(i):
            raise ValueError(f"{where} has a different tokenizer from the target's: token id {i} is "
                             f"{ours.get(i)!r} for the target and {theirs.get(i)!r} for the draft")
