"""Multi-layer EAGLE: K independent draft layers, layer k drafts the token k+1 ahead.

Alignment (docs/INTERNALS.md): layer k at its cache index i consumes
(emb(x[i+k+1]), h[i]) at position i+k+1 and predicts x[i+k+2]. After prefill and
after every verify each layer is extended over its window: the newly committed
indices, plus the last k indices it had fed with drafted tokens (those inputs are
known for certain now). Beyond the root, layer k's input tokens are the drafts of
layers 0..k-1 at the last index, so the layers run in order and the chain
root, d1, ..., dK is complete when the extend ends: ``draft()`` only assembles it.
A chained checkpoint's layer k > 0 reads layer k-1's feature at index i in place of h[i];
layer k-1 has written it by then (same window indices, or kept from the last extend, whose
inputs at those indices were all committed).

Everything stays on the device: per slot, the committed tokens (then the drafts)
and the target's hidden states by index. After a verify each layer runs one
fixed-shape step (window N + k, where N-1 is the most a verify can accept). The K steps
and the next iteration's chain tree are captured together as one CUDA graph per batch
bucket: a graph launch costs the host more than a draft layer costs the GPU at small
batches, so one launch per layer would leave the GPU waiting.
"""

from __future__ import annotations

import functools

import torch

from spectool.config import MultiLayerEagleConfig
from spectool.draft import Batch, Prefill, accepted_inputs
from spectool.draft.tree import DraftTree, chain_tree
from spectool.graphs import GraphRunner
from spectool.model.llama import positions_at


class MultiLayerEagleDrafter:
    """Drafts a top-1 chain of ``num_steps`` tokens from the first ``num_steps`` layers."""

    host_accepted = False  # on_verify reads only device tensors

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
        n = self.num_draft_tokens
        self.caches = [self.checkpoint.make_cache(k, e.num_slots, e.cache_len + n) for k in range(self.steps)]
        # Per slot: committed tokens, the root, then the drafts (read by later layers), and the
        # target's hidden state at every committed index (layer k re-reads the last k of them).
        # Every index a step reads or writes stays inside: a running request's length is below
        # max_seq_len, a verify adds at most n and layer k's window reaches n + 2k past it.
        self.tokens = torch.zeros(e.num_slots, e.cache_len + 2 * n + 1, dtype=torch.long, device=self.device)
        self.hidden = torch.zeros(e.num_slots, e.cache_len + 2 * n, e.config.hidden_size, dtype=e.target.dtype,
                                  device=self.device)
        # Chained layers: layer k's feature by index, read by layer k+1 (the last layer's is not read).
        self.features = (torch.zeros(self.steps - 1, *self.hidden.shape, dtype=self.hidden.dtype, device=self.device)
                         if self.checkpoint.chained else None)
        self.chain = torch.zeros(e.num_slots, self.steps, dtype=torch.long, device=self.device)
        # Chain scores with the root's 1.0 in front, so draft() reads them in one op.
        self.chain_p = torch.ones(e.num_slots, 1 + self.steps, device=self.device)
        self._arange = torch.arange(n + self.steps, device=self.device)  # window offsets of every step
        # Per layer k: how far its window starts before the old length (k), and where its draft goes
        # past the new last index (k + 2): every layer's indices come from one op each per extend.
        self._layer_back = torch.arange(self.steps, device=self.device)
        self._draft_ahead = self._layer_back + 2
        self._kv_len: int | None = None
        self._next: tuple[Batch, tuple] | None = None  # the batch on_verify drafted for, and its tree
        self._extend_runner = GraphRunner(self._extend_step, e.graph_buckets, e.cuda_graphs,
                                          {"slots": e.max_batch_size})
        # The prompts' extend, per (batch bucket, padded length) as the target's prefill; a padded
        # row's length is 1, so its last index is 0.
        self._prefill_runner = GraphRunner(self._prefill_step, e.graph_buckets, e.cuda_graphs,
                                           {"slots": e.max_batch_size, "lens": 1})
        self.graph_runners = [self._extend_runner, self._prefill_runner]

    def _layer_step(self, k: int, slots, start, last, draft_at, window: int | None = None,
                    kv_len: int | None = None):
        """Extend layer k over draft-cache indices [start, start + last] (start = old length - k,
        at least 0; start + last = new length - 1); write its draft d_{k+1} to token index
        ``draft_at`` (read by the later layers) and return ``(draft, its probability)``.

        ``window`` is the padded length (default N + k, the most a verify can need);
        rows with a shorter window compute junk past it, beyond anything valid.
        ``kv_len`` (CPU only) bounds the cache read; default ``self._kv_len``.
        """
        t = self.num_draft_tokens + k if window is None else window
        offsets = self._arange[:t] if t <= self._arange.shape[0] else torch.arange(t, device=self.device)
        index = start[:, None] + offsets  # draft-cache indices
        positions = index + (k + 1)  # also the indices of the input tokens
        rows = slots[:, None]
        hidden = self.hidden if k == 0 or self.features is None else self.features[k - 1]
        _, draft, p = self._run_layer(k, slots, self.tokens[rows, positions], hidden[rows, index], positions, start,
                                      last, draft_at, self._kv_len if kv_len is None else kv_len, index)
        return draft, p

    def _run_layer(self, k: int, slots, tokens, hidden, positions, start, last, draft_at, kv_len, index):
        """Layer k on its inputs ``tokens`` [B, t] and ``hidden`` [B, t, H] at ``positions``, its cache
        written from ``start``: stores its feature at draft-cache ``index`` (chained checkpoints) and
        its draft (taken at window offset ``last``) at token index ``draft_at``. Returns
        ``(feature, draft, its probability)``, the feature [B, 1, H] at ``last`` alone where no later
        layer reads it."""
        model = self.engine.model
        # A layer whose feature no later layer reads is wanted at ``last`` alone (last >= 0, padded
        # graph rows included: their inputs are 0); its other positions only write their keys and values.
        read_on = self.features is not None and k < self.steps - 1
        feature, normed = self.checkpoint.layers[k](model.embed_tokens(tokens), hidden, positions, self.caches[k],
                                                    slots, start, None, kv_len, at=None if read_on else last)
        if read_on:
            self.features[k][slots[:, None], index] = feature
            normed = positions_at(normed, last)
        out = normed[:, 0]
        # Softmax and argmax in one launch on CUDA. NaN logits (a broken layer) count as -inf, so
        # the chain's scores stay valid; the target's verify rejects such drafts anyway.
        p, draft = (t[:, 0] for t in model.head_topk(out, 1))
        self.tokens[slots, draft_at] = draft
        return feature, draft, p

    def _extend_step(self, slots, old_lens, tree_tokens, path, length, bonus, hidden):
        """After a verify: store the gained tokens and the path's hidden states, run every layer
        in order (each drafts from the drafts before it), and return the next iteration's chain
        tree (root = the bonus token) as a tuple of its tensors (``DraftTree.tensors``)."""
        n = self.num_draft_tokens
        tokens, path_hidden = accepted_inputs(tree_tokens, path, length, bonus, hidden)
        rows = slots[:, None]
        index = old_lens[:, None] + self._arange[:n]
        self.tokens[rows, index + 1] = tokens
        self.hidden[rows, index] = path_hidden[:, :n]
        new_last = old_lens + length
        starts = (old_lens[:, None] - self._layer_back).clamp(min=0)  # [B, steps]
        lasts = new_last[:, None] - starts
        draft_at = new_last[:, None] + self._draft_ahead
        drafts, probs = zip(*(self._layer_step(k, slots, starts[:, k], lasts[:, k], draft_at[:, k])
                              for k in range(self.steps)))
        self.chain[slots] = torch.stack(drafts, 1)
        self.chain_p[slots, 1:] = torch.stack(probs, 1)
        return self._chain(slots, bonus, new_last + 1).tensors()

    def _chain(self, slots, roots, seq_lens) -> DraftTree:
        tokens = torch.cat([roots[:, None], self.chain[slots]], dim=1)
        return chain_tree(tokens, self.chain_p[slots], seq_lens)

    def on_prefill(self, prefill: Prefill) -> None:
        # The target's group as it is, each layer one step over it (one per prompt and layer cost a
        # draft prefill several times the target's host time). A short row's padding lands past its
        # prompt (zeros in the token and hidden tables, junk in the layer caches and features), and
        # the first extend after a verify rewrites those indices before any layer reads them; its
        # drafts are written after the padding, where later layers read them.
        step = (functools.partial(self._prefill_runner, len(prefill.lens)) if prefill.graphed
                else self._prefill_step)
        step(slots=prefill.slots, tokens=prefill.with_first(), hidden=prefill.hidden, lens=prefill.last + 1)

    def _prefill_step(self, slots, tokens, hidden, lens):
        """Every layer's extend over right-padded prompts: ``tokens`` [B, T + 1] the histories (the
        prompt and its first token), ``hidden`` [B, T, H] the target's hidden states (past a prompt,
        the padding's), ``lens`` [B] the prompt lengths. Returns the chain's drafts [B, steps].

        Every window starts at index 0, so the layers read their inputs as they are made (the
        prompt's tokens, the target's states, the layer before's feature) instead of gathering them
        from the tables by index: a prefill is launch-bound, and each gather is a launch."""
        b, t = hidden.shape[:2]
        self.tokens[slots, :t + 1] = tokens
        live = torch.arange(t, device=hidden.device) < lens[:, None]
        hidden = hidden.masked_fill(~live[..., None], 0)  # the padding's states left out
        self.hidden[slots, :t] = hidden
        index = torch.arange(t + self.steps, device=hidden.device).expand(b, -1)
        zero = torch.zeros_like(lens)
        last = lens - 1
        draft_at = last[:, None] + self._draft_ahead  # layer k's draft goes to index lens + k + 1
        drafts, probs = [], []
        for k in range(self.steps):
            # Layer 0's input tokens are the prompt's, past its first; a later layer's reach into the
            # drafts the layers before it wrote.
            inputs = tokens[:, 1:] if k == 0 else self.tokens[slots, k + 1:k + 1 + t]
            # Every start is 0, so no query sees past t: on CUDA reading just t keys makes the attention
            # plainly causal (ops.cached_attention's flash path); the CPU keeps the width it always read.
            kv_len = t if self.engine.on_cuda else t + k + 1
            feature, draft, p = self._run_layer(k, slots, inputs, hidden, index[:, k + 1:k + 1 + t], zero, last,
                                                draft_at[:, k], kv_len, index[:, :t])
            if self.features is not None:
                hidden = feature
            drafts.append(draft)
            probs.append(p)
        self.chain[slots] = torch.stack(drafts, 1)
        self.chain_p[slots, 1:] = torch.stack(probs, 1)
        return self.chain[slots]

    def on_verify(self, batch: Batch, tree: DraftTree, result, hidden: torch.Tensor,
                  accepted: list[list[int]] | None, timer) -> None:
        with timer("draft"):
            self._kv_len = None if self.engine.on_cuda else max(batch.seq_lens_host) + self.num_draft_tokens
            out = self._extend_runner(
                batch.size, slots=batch.slots, old_lens=batch.seq_lens, tree_tokens=tree.tokens,
                path=result.accept_path, length=result.accept_length, bonus=result.bonus, hidden=hidden)
            self._next = (batch, out)

    def release(self, request_ids: list[int]) -> None:
        """Slots are overwritten by the next prefill; nothing to free."""
        self._next = None

    def draft(self, batch: Batch, timer) -> tuple[DraftTree, dict]:
        if self._next is not None and self._next[0] is batch:  # made by the extend graph
            return DraftTree.from_tensors(self._next[1], max_depth=self.steps), {}
        with timer("index"):  # after a prefill, or the batch changed since the extend
            tree = self._chain(batch.slots, batch.roots, batch.seq_lens)
        return tree, {}
