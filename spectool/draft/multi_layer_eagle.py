"""Multi-layer EAGLE: K independent draft layers, layer k drafts the token k+1 ahead.

Alignment (docs/INTERNALS.md): layer k at its cache index i consumes
(emb(x[i+k+1]), h[i]) at position i+k+1 and predicts x[i+k+2]. After prefill and
after every verify each layer is extended over its window: the newly committed
indices, plus the last k indices it had fed with drafted tokens (those inputs are
known for certain now). Beyond the root, layer k's input tokens are the drafts of
layers 0..k-1 at the last index, so the layers run in order and the chain
root, d1, ..., dK is complete when the extend ends: ``draft()`` only assembles it.
"""

from __future__ import annotations

import torch

from spectool.config import MultiLayerEagleConfig
from spectool.draft import Batch
from spectool.draft.tree import DraftTree


class MultiLayerEagleDrafter:
    """Drafts a top-1 chain of ``num_steps`` tokens from the first ``num_steps`` layers."""

    def __init__(self, config: MultiLayerEagleConfig, engine) -> None:
        from spectool.model.draft_layer import load_draft

        self.config = config
        self.engine = engine
        self.device = engine.device
        self.checkpoint = load_draft(config.path, engine.target)
        if config.num_steps > self.checkpoint.num_layers:
            raise ValueError(f"num_steps={config.num_steps} but {config.path} holds "
                             f"{self.checkpoint.num_layers} draft layer(s)")
        self.steps = config.num_steps
        self.num_draft_tokens = config.num_steps + 1

    def allocate(self) -> None:
        e = self.engine
        self.caches = [self.checkpoint.make_cache(k, e.num_slots, e.cache_len) for k in range(self.steps)]
        # Target hidden states of every committed index: layer k re-reads the last k of them.
        self.hidden = torch.zeros(e.num_slots, e.cache_len, e.config.hidden_size, dtype=e.target.dtype,
                                  device=self.device)
        self.chain = torch.zeros(e.num_slots, self.steps, dtype=torch.long, device=self.device)
        self.chain_p = torch.zeros(e.num_slots, self.steps, device=self.device)

    def _extend(self, slots: torch.Tensor, histories: list[list[int]], old_lens: list[int]) -> None:
        """Run every layer over its window, given the committed history (root last) per row.

        ``old_lens[b]`` is the committed length before the new tokens; the new committed
        length is ``len(histories[b]) - 1`` (the root is not in the cache yet).
        """
        dev = self.device
        model = self.engine.model
        drafts = [[] for _ in histories]  # d1.. per row, filled layer by layer
        for k in range(self.steps):
            starts, rows_tok, rows_pos = [], [], []
            for b, hist in enumerate(histories):
                new_len = len(hist) - 1
                start = max(old_lens[b] - k, 0)
                ext = hist + drafts[b]
                starts.append(start)
                rows_tok.append([ext[i + k + 1] for i in range(start, new_len)])
                rows_pos.append([i + k + 1 for i in range(start, new_len)])
            lengths = [len(r) for r in rows_tok]
            t = max(lengths)
            tokens = torch.tensor([r + [0] * (t - len(r)) for r in rows_tok], dtype=torch.long, device=dev)
            positions = torch.tensor([r + [r[-1]] * (t - len(r)) for r in rows_pos], dtype=torch.long,
                                     device=dev)
            start_t = torch.tensor(starts, dtype=torch.long, device=dev)
            index = (start_t[:, None] + torch.arange(t, device=dev)).clamp(max=self.hidden.shape[1] - 1)
            hidden = self.hidden[slots[:, None], index]
            emb = model.embed_tokens(tokens)
            _, normed = self.checkpoint.layers[k](emb, hidden, positions, self.caches[k], slots, start_t, None,
                                             max(starts) + t)
            last = torch.tensor(lengths, device=dev) - 1
            rows = torch.arange(len(histories), device=dev)
            probs = torch.softmax(model.lm_head(normed[rows, last]).float(), dim=-1)
            p, tok = probs.max(dim=-1)
            self.chain[slots, k], self.chain_p[slots, k] = tok, p
            for b, d in enumerate(tok.tolist()):
                drafts[b].append(d)

    def on_prefill(self, batch: Batch, hiddens: list[torch.Tensor]) -> None:
        for b, h in enumerate(hiddens):
            self.hidden[batch.slots[b], : h.shape[0]] = h
        self._extend(batch.slots, batch.histories, [0] * batch.size)

    def on_verify(self, batch: Batch, tree: DraftTree, result, hidden: torch.Tensor,
                  accepted: list[list[int]], timer) -> None:
        with timer("draft"):
            t = result.accept_path.shape[1]
            path = result.accept_path.clamp(min=0)
            h = hidden.gather(1, path[..., None].expand(-1, -1, hidden.shape[-1]))
            index = (batch.seq_lens[:, None] + torch.arange(t, device=self.device)).clamp(
                max=self.hidden.shape[1] - 1)
            # Rows past a request's accept length write garbage beyond its committed length:
            # those indices are rewritten before any layer reads them.
            self.hidden[batch.slots[:, None], index] = h
            histories = [h_ + a for h_, a in zip(batch.histories, accepted)]
            self._extend(batch.slots, histories, batch.seq_lens_host)

    def release(self, batch: Batch) -> None:
        """Slots are overwritten by the next prefill; nothing to free."""

    def draft(self, batch: Batch, timer) -> tuple[DraftTree, dict]:
        b, s = batch.size, self.steps
        tokens = torch.cat([batch.roots[:, None], self.chain[batch.slots]], dim=1)
        parents = torch.arange(-1, s, device=self.device).expand(b, -1)
        scores = torch.cat([torch.ones(b, 1, device=self.device), self.chain_p[batch.slots]], dim=1)
        with timer("index"):
            tree = DraftTree.from_parents(tokens, parents, scores, batch.seq_lens)
        return tree, {}
