"""EAGLE-2 drafting: one draft layer reused for ``num_steps`` steps, a dynamic top-k tree.

Alignment (docs/INTERNALS.md): at draft-cache index i the layer consumes
(emb(x[i+1]), h[i]) at position i+1 and predicts x[i+2]. After every verify the
layer is *extended* over the newly accepted tokens with the target's hidden
states, which leaves per slot the feature and the top-k children of the root.
``draft()`` then grows the tree: each step feeds the current frontier (the best
``topk`` nodes by path score) with its parents' output features standing in for
the target hidden state, and expands every frontier node into ``topk`` children.
Frontier nodes of earlier steps are fed again with each step (a tree mask keeps
each node to its own ancestors), so every step is one fixed-shape forward.
"""

from __future__ import annotations

import torch

from spectool.config import EagleConfig
from spectool.draft import Batch, gained_tokens, path_hidden
from spectool.draft.tree import DraftTree, build_eagle_tree
from spectool.graphs import GraphRunner

# DraftTree tensors the graphed draft step returns (max_depth is num_steps).
_TREE_FIELDS = ("tokens", "parents", "depth", "scores", "valid", "mask", "positions", "retrieve_index",
                "retrieve_next_token", "retrieve_next_sibling", "seq_lens")


class EagleDrafter:
    """Drafts an EAGLE-2 tree from one draft layer with its own KV cache."""

    def __init__(self, config: EagleConfig, engine) -> None:
        from spectool.model.draft_layer import load_draft

        self.config = config
        self.engine = engine
        self.device = engine.device
        self.checkpoint = load_draft(config.path, engine.target)
        if self.checkpoint.kind != "eagle" and self.checkpoint.num_layers < 1:
            raise ValueError(f"{config.path} holds no draft layer")
        vocab = engine.config.vocab_size
        if config.topk > vocab:
            raise ValueError(f"topk={config.topk} is larger than the vocabulary ({vocab})")
        self.layer = self.checkpoint.layers[0]
        self.num_draft_tokens = config.num_draft_tokens

    def allocate(self) -> None:
        e = self.engine
        # The draft cache holds the committed prefix plus the fed frontier nodes of one draft.
        room = self.config.num_steps * self.config.topk
        self.cache = self.checkpoint.make_cache(0, e.num_slots, e.cache_len + room)
        hidden = e.config.hidden_size
        dtype = e.target.dtype
        self.feature = torch.zeros(e.num_slots, hidden, dtype=dtype, device=self.device)
        self.root_p = torch.zeros(e.num_slots, self.config.topk, device=self.device)
        self.root_i = torch.zeros(e.num_slots, self.config.topk, dtype=torch.long, device=self.device)
        self._kv_len: int | None = None
        scratch = {"slots": e.max_batch_size}
        self._extend_runner = GraphRunner(self._extend_step, e.graph_buckets, e.cuda_graphs, scratch)
        self._draft_runner = GraphRunner(self._draft_step, e.graph_buckets, e.cuda_graphs, scratch)
        self.graph_runners = [self._extend_runner, self._draft_runner]

    # ------------------------------------------------------------ extend

    def _run(self, tokens, hidden, positions, slots, starts, tree_mask, kv_len):
        """Draft layer forward: (feature, normed). kv_len None reads lengths on the device."""
        emb = self.engine.model.embed_tokens(tokens)
        return self.layer(emb, hidden, positions, self.cache, slots, starts, tree_mask, kv_len)

    def _probs(self, normed: torch.Tensor) -> torch.Tensor:
        """Next-token probabilities through the target's lm_head (only where they are needed:
        at a large vocabulary the head costs more than the draft layer)."""
        return torch.softmax(self.engine.model.lm_head(normed).float(), dim=-1)

    def _extend_step(self, slots, starts, tokens, hidden, last):
        """Feed (tokens[b], hidden[b]) at draft-cache index starts[b]; keep the feature and the
        root's top-k children from position ``last[b]`` (later entries are padding)."""
        t = tokens.shape[1]
        positions = starts[:, None] + 1 + torch.arange(t, device=self.device)
        kv_len = None if self._kv_len is None else self._kv_len + t
        feature, normed = self._run(tokens, hidden, positions, slots, starts, None, kv_len)
        rows = torch.arange(tokens.shape[0], device=self.device)
        self.feature[slots] = feature[rows, last]
        p, i = self._probs(normed[rows, last]).topk(self.config.topk, dim=-1)
        self.root_p[slots], self.root_i[slots] = p, i
        return p

    def on_prefill(self, batch: Batch, hiddens: list[torch.Tensor]) -> None:
        for b in range(batch.size):
            hist = batch.histories[b]
            n = len(hist) - 1  # prompt length; hist[-1] is the first sampled token (the root)
            tokens = torch.tensor([hist[1:]], dtype=torch.long, device=self.device)
            zero = torch.zeros(1, dtype=torch.long, device=self.device)
            self._kv_len = 0
            self._extend_step(batch.slots[b:b + 1], zero, tokens, hiddens[b][None, :n], zero + n - 1)

    def on_verify(self, batch: Batch, tree: DraftTree, result, hidden: torch.Tensor,
                  accepted: list[list[int]], timer) -> None:
        with timer("draft"):
            self._kv_len = None if self.engine.on_cuda else max(batch.seq_lens_host)
            # The accepted path is N wide from the greedy verify step but max_depth + 1 wide from
            # verify_sampling: cut the gained tokens to it so tokens and hidden states line up.
            width = result.accept_path.shape[1]
            self._extend_runner(batch.size, slots=batch.slots, starts=batch.seq_lens,
                                tokens=gained_tokens(tree, result)[:, :width], hidden=path_hidden(hidden, result),
                                last=result.accept_length)

    def release(self, batch: Batch) -> None:
        """Slots are overwritten by the next prefill; nothing to free."""

    # ------------------------------------------------------------ draft

    def draft(self, batch: Batch, timer) -> tuple[DraftTree, dict]:
        self._kv_len = None if self.engine.on_cuda else max(batch.seq_lens_host)
        out = self._draft_runner(batch.size, slots=batch.slots, seq_lens=batch.seq_lens, roots=batch.roots)
        tree = DraftTree(**dict(zip(_TREE_FIELDS, out[:-2])), max_depth=self.config.num_steps)
        return tree, {"step_topk_tokens": out[-2], "step_topk_probs": out[-1]}

    def _draft_step(self, slots, seq_lens, roots):
        """Grow the tree (all steps) and return its tensors plus the per-step top-k."""
        k, steps = self.config.topk, self.config.num_steps
        b = slots.shape[0]
        dev = self.device
        scores = self.root_p[slots]  # [B, K] path scores of step-0 candidates
        tokens = self.root_i[slots]
        step_tokens, step_scores, step_parents = [tokens], [scores], [torch.full_like(tokens, -1)]
        frontier_tok, frontier_score = tokens, scores
        frontier_hidden = self.feature[slots][:, None].expand(-1, k, -1)
        frontier_depth = 1
        fed_tok = torch.empty(b, 0, dtype=torch.long, device=dev)
        fed_hidden = self.feature.new_empty(b, 0, self.feature.shape[-1])
        fed_pos = torch.empty(b, 0, dtype=torch.long, device=dev)
        fed_mask = torch.zeros(b, 0, 0, dtype=torch.bool, device=dev)
        frontier_parent_fed = torch.full((b, k), -1, dtype=torch.long, device=dev)
        frontier_index = torch.arange(k, device=dev).expand(b, -1)  # into the latest step's candidates
        chosen_tok, chosen_p = [tokens], [scores]
        for _ in range(1, steps):
            # Append the frontier to the fed nodes; each sees its fed ancestors and itself.
            n_fed = fed_tok.shape[1]
            parent_rows = torch.zeros(b, k, n_fed + k, dtype=torch.bool, device=dev)
            if n_fed:
                has_parent = frontier_parent_fed >= 0
                rows = fed_mask.gather(1, frontier_parent_fed.clamp(min=0)[..., None].expand(-1, -1, n_fed))
                parent_rows[..., :n_fed] = rows & has_parent[..., None]
            parent_rows[:, :, n_fed:] = torch.eye(k, dtype=torch.bool, device=dev)  # each sees itself
            fed_mask = torch.cat([torch.nn.functional.pad(fed_mask, (0, k)), parent_rows], dim=1)
            fed_tok = torch.cat([fed_tok, frontier_tok], 1)
            fed_hidden = torch.cat([fed_hidden, frontier_hidden], 1)
            fed_pos = torch.cat([fed_pos, seq_lens[:, None] + frontier_depth + fed_tok.new_zeros(b, k)], 1)
            kv_len = None if self._kv_len is None else self._kv_len + fed_tok.shape[1]
            feature, normed = self._run(fed_tok, fed_hidden, fed_pos, slots, seq_lens, fed_mask, kv_len)
            feat, logp = feature[:, -k:], self._probs(normed[:, -k:])
            p, i = logp.topk(k, dim=-1)  # [B, K(frontier), K(children)]
            cand_score = (frontier_score[..., None] * p).reshape(b, k * k)
            cand_tok = i.reshape(b, k * k)
            cand_parent = torch.arange(k, device=dev).repeat_interleave(k).expand(b, -1)
            step_tokens.append(cand_tok)
            step_scores.append(cand_score)
            step_parents.append(frontier_index.gather(1, cand_parent))  # index into the previous step
            best = torch.nan_to_num(cand_score, nan=-1.0).topk(k, dim=-1).indices
            frontier_index = best
            frontier_tok = cand_tok.gather(1, best)
            frontier_score = cand_score.gather(1, best)
            parent_of_best = best // k
            frontier_hidden = feat.gather(1, parent_of_best[..., None].expand(-1, -1, feat.shape[-1]))
            frontier_parent_fed = n_fed + parent_of_best
            frontier_depth += 1
            chosen_tok.append(frontier_tok)
            chosen_p.append(frontier_score)
        tree = build_eagle_tree(roots, step_tokens, step_scores, step_parents, self.num_draft_tokens, seq_lens)
        return (*(getattr(tree, name) for name in _TREE_FIELDS), torch.stack(chosen_tok, 1),
                torch.stack(chosen_p, 1))

