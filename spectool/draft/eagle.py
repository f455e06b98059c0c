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

import functools

import torch

from spectool.draft import Batch, Prefill, accepted_inputs
from spectool.draft.tree import DraftTree, eagle_tree_from_candidates
from spectool.graphs import GraphRunner
from spectool.kernels.topk import row_topk


class EagleDrafter:
    """Drafts an EAGLE-2 tree from one draft layer with its own KV cache.

    The tree search is the same for every one-layer draft; what a draft method changes is in
    the methods marked "per method" (the EAGLE-3 and draft-model drafters override them): how
    the draft is loaded, how big its cache and feature are, one forward, and the children it
    proposes from that forward's output.
    """

    host_accepted = False  # on_verify reads only device tensors

    def __init__(self, config, engine) -> None:
        self.config = config
        self.engine = engine
        self.device = engine.device
        self.num_draft_tokens = config.num_draft_tokens
        vocab = self._load()
        if config.topk > vocab:
            raise ValueError(f"topk={config.topk} is larger than the draft's vocabulary ({vocab})")

    # ------------------------------------------------------------ per method

    def _load(self) -> int:
        """Load the draft; returns the size of the vocabulary its children are drafted from."""
        from spectool.model.draft_layer import load_draft

        self.checkpoint = load_draft(self.config.path, self.engine.target)
        if self.checkpoint.kind != "eagle" and self.checkpoint.num_layers < 1:
            raise ValueError(f"{self.config.path} holds no draft layer")
        self.layer = self.checkpoint.layers[0]
        return self.engine.config.vocab_size

    def _make_cache(self, num_slots: int, length: int):
        """The draft's KV cache for ``length`` draft-cache indices per slot."""
        return self.checkpoint.make_cache(0, num_slots, length)

    @property
    def feature_size(self) -> int:
        """Width of the feature a draft step hands its children."""
        return self.engine.config.hidden_size

    def _root_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's hidden input at the root from what the target's forward gave the drafter."""
        return hidden

    def _run(self, tokens, hidden, positions, slots, starts, tree_mask, kv_len, at=None):
        """Draft layer forward: (feature, normed), [B, 1, H] at each row's position ``at`` where
        given (the other positions only write the cache). kv_len None reads lengths on the device."""
        emb = self.engine.model.embed_tokens(tokens)
        return self.layer(emb, hidden, positions, self.cache, slots, starts, tree_mask, kv_len, at=at)

    def _top_children(self, normed: torch.Tensor, out=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``topk`` most probable next tokens and their probabilities, through the target's
        lm_head (only where they are needed: at a large vocabulary the head costs more than the
        draft layer); softmax and top-k are one launch on CUDA (kernels/topk.py)."""
        return self.engine.model.head_topk(normed, self.config.topk, out=out)

    # ------------------------------------------------------------ buffers

    def allocate(self) -> None:
        e = self.engine
        # The draft cache holds the committed prefix plus the fed frontier nodes of one draft.
        room = self.config.num_steps * self.config.topk
        self.cache = self._make_cache(e.num_slots, e.cache_len + room)
        dtype = e.target.dtype
        self.feature = torch.zeros(e.num_slots, self.feature_size, dtype=dtype, device=self.device)
        self.root_p = torch.zeros(e.num_slots, self.config.topk, device=self.device)
        self.root_i = torch.zeros(e.num_slots, self.config.topk, dtype=torch.long, device=self.device)
        self._kv_len: int | None = None
        self._make_draft_constants()
        scratch = {"slots": e.max_batch_size}
        # After a verify one graph extends the layer and drafts the next tree: a graph launch costs
        # the host about as much as the draft costs the GPU at small batches. The draft graph alone
        # serves the first iteration after a prefill or a change of the batch.
        self._extend_runner = GraphRunner(self._extend_and_draft_step, e.graph_buckets, e.cuda_graphs, scratch)
        self._draft_runner = GraphRunner(self._draft_step, e.graph_buckets, e.cuda_graphs, scratch)
        # The prompts' extend, per (batch bucket, padded length) as the target's prefill.
        self._prefill_runner = GraphRunner(self._extend_step, e.graph_buckets, e.cuda_graphs, scratch)
        self.graph_runners = [self._extend_runner, self._draft_runner, self._prefill_runner]
        self._next: tuple[Batch, tuple] | None = None  # the batch on_verify drafted for, and the draft

    def _make_draft_constants(self) -> None:
        """What the draft step needs that depends only on (num_steps, topk): building it inside
        the graph would cost a kernel per tensor per draft."""
        k, steps, dev = self.config.topk, self.config.num_steps, self.device
        fed = (steps - 1) * k  # frontier nodes fed to the layer: those of every step but the last
        self._fed_depth = 1 + torch.arange(fed, device=dev) // k
        self._fed_eye = torch.eye(fed, dtype=torch.bool, device=dev)
        # Which node of the frontier fed last is the parent of each of a step's k*k candidates.
        self._parent_in_frontier = torch.arange(k * k, device=dev) // k
        # Flat candidate parents (root first, see eagle_tree_from_candidates): the root's top-k hang
        # off the root and step 1's candidates off the root's top-k in order; later steps are filled in.
        self._num_candidates = 1 + k + (steps - 1) * k * k
        self._flat_parents = torch.zeros(self._num_candidates, dtype=torch.long, device=dev)
        self._flat_parents[0] = -1
        if steps > 1:
            self._flat_parents[1 + k:1 + k + k * k] = 1 + torch.arange(k * k, device=dev) // k

    # ------------------------------------------------------------ extend

    def _extend_step(self, slots, starts, tokens, hidden, last):
        """Feed (tokens[b], hidden[b]) at draft-cache index starts[b]; keep the feature and the
        root's top-k children from position ``last[b]`` (later entries are padding)."""
        t = tokens.shape[1]
        positions = starts[:, None] + torch.arange(1, t + 1, device=self.device)
        kv_len = None if self._kv_len is None else self._kv_len + t
        feature, normed = self._run(tokens, self._root_hidden(hidden), positions, slots, starts, None, kv_len,
                                    at=last)
        self.feature[slots] = feature[:, 0]
        p, i = self._top_children(normed[:, 0])
        self.root_p[slots], self.root_i[slots] = p, i
        return p

    def _verify_extend_step(self, slots, starts, tree_tokens, path, length, bonus, hidden):
        """The extend after a verify, from its results: one graph with the gathering of its inputs."""
        tokens, path_hidden = accepted_inputs(tree_tokens, path, length, bonus, hidden)
        # The accepted path is N wide from the greedy verify step but max_depth + 1 wide from
        # verify_sampling: cut the gained tokens to it so tokens and hidden states line up.
        return self._extend_step(slots, starts, tokens[:, :path.shape[1]], path_hidden, length)

    def _extend_and_draft_step(self, slots, starts, tree_tokens, path, length, bonus, hidden):
        """The extend after a verify, then the next iteration's draft (root = the bonus token)."""
        self._verify_extend_step(slots, starts, tree_tokens, path, length, bonus, hidden)
        if self._kv_len is not None:  # CPU: a verify adds at most N tokens to the longest row
            self._kv_len += self.num_draft_tokens
        return self._draft_step(slots, starts + length + 1, bonus)

    def on_prefill(self, prefill: Prefill) -> None:
        # The target's group as it is, one extend: a token with the hidden state before it, so the
        # prompt from its second token then the first sampled one. Padding writes past a prompt's
        # end in the draft cache, where the first extend after a verify writes before anything reads.
        tokens = prefill.with_first()[:, 1:]
        self._kv_len = 0
        step = functools.partial(self._prefill_runner, len(prefill.lens)) if prefill.graphed else self._extend_step
        step(slots=prefill.slots, starts=torch.zeros_like(prefill.last), tokens=tokens, hidden=prefill.hidden,
             last=prefill.last)

    def on_verify(self, batch: Batch, tree: DraftTree, result, hidden: torch.Tensor,
                  accepted: list[list[int]] | None, timer) -> None:
        with timer("draft"):
            self._kv_len = None if self.engine.on_cuda else max(batch.seq_lens_host)
            out = self._extend_runner(batch.size, slots=batch.slots, starts=batch.seq_lens, tree_tokens=tree.tokens,
                                      path=result.accept_path, length=result.accept_length, bonus=result.bonus,
                                      hidden=hidden)
            self._next = (batch, out)

    def release(self, request_ids: list[int]) -> None:
        """Slots are overwritten by the next prefill; nothing to free."""
        self._next = None

    # ------------------------------------------------------------ draft

    def draft(self, batch: Batch, timer) -> tuple[DraftTree, dict]:
        if self._next is not None and self._next[0] is batch:  # drafted by the extend graph
            out = self._next[1]
        else:
            self._kv_len = None if self.engine.on_cuda else max(batch.seq_lens_host)
            out = self._draft_runner(batch.size, slots=batch.slots, seq_lens=batch.seq_lens, roots=batch.roots)
        tree = DraftTree.from_tensors(out[:-2], max_depth=self.config.num_steps)
        return tree, {"step_topk_tokens": out[-2], "step_topk_probs": out[-1]}

    def _draft_step(self, slots, seq_lens, roots):
        """Grow the tree (all steps) and return its tensors plus the per-step top-k."""
        cand_tok, cand_score, cand_parent, chosen_tok, chosen_p = self._draft_candidates(slots, seq_lens, roots)
        tree = eagle_tree_from_candidates(cand_tok, cand_score, cand_parent, self.num_draft_tokens, seq_lens,
                                          max_depth=self.config.num_steps)
        return (*tree.tensors(), chosen_tok, chosen_p)

    def _feed(self, tokens, hidden, positions, tree_mask, slots, seq_lens):
        """One draft step's forward over the fed nodes [B, n] (the frontiers of every step so far, at
        draft-cache index seq_lens on, ``tree_mask`` [B, n, n] keeping each to its ancestors): the
        (feature, normed) [B, k, H] of the last ``topk``, the newest frontier. Every earlier frontier
        is fed again, so a step is one forward of fixed shape (a CUDA graph) with a self-contained mask."""
        k = self.config.topk
        kv_len = None if self._kv_len is None else self._kv_len + tokens.shape[1]
        feature, normed = self._run(tokens, hidden, positions, slots, seq_lens, tree_mask, kv_len)
        return feature[:, -k:], normed[:, -k:]

    def _draft_candidates(self, slots, seq_lens, roots, num_steps: int | None = None):
        """Every step's candidates, flat and root first (tokens, scores, parents [B, 1 + C], see
        eagle_tree_from_candidates), and the per-step chosen frontier (tokens, probabilities [B, S, k]).
        ``num_steps`` (at most the config's) stops early: each step depends only on earlier ones, so
        the result is the first steps of the config's draft.

        Every step's results go straight into buffers sized for the whole draft (the fed
        frontier, its mask, the flat candidate list) instead of being concatenated step by
        step: at batch 1 on the GPU each small op is a kernel launch that costs more than
        its work.
        """
        k, steps = self.config.topk, num_steps or self.config.num_steps
        b, dev = slots.shape[0], self.device
        kk, fed = k * k, (steps - 1) * k
        num_candidates = 1 + k + (steps - 1) * kk
        # Frontier per step (step 0: the root's top-k); steps 0..S-2 are the fed nodes, in order.
        chosen_tok = torch.empty(b, steps, k, dtype=torch.long, device=dev)
        chosen_p = torch.empty(b, steps, k, device=dev)
        fed_tok = chosen_tok.view(b, steps * k)
        fed_hidden = self.feature.new_empty(b, fed, self.feature.shape[-1])
        fed_mask = self._fed_eye[:fed, :fed].expand(b, -1, -1).clone()  # a fed node sees its fed ancestors and itself
        fed_pos = seq_lens[:, None] + self._fed_depth[:fed]
        # All candidates, the root first (see eagle_tree_from_candidates).
        cand_tok = torch.empty(b, num_candidates, dtype=torch.long, device=dev)
        cand_score = torch.empty(b, num_candidates, device=dev)
        cand_parent = self._flat_parents[:num_candidates].expand(b, -1).clone()
        cand_tok[:, 0] = roots
        torch.index_select(self.root_i, 0, slots, out=chosen_tok[:, 0])
        torch.index_select(self.root_p, 0, slots, out=chosen_p[:, 0])
        cand_tok[:, 1:1 + k] = chosen_tok[:, 0]
        cand_score[:, 1:1 + k] = chosen_p[:, 0]
        if fed:
            fed_hidden[:, :k] = self.feature[slots][:, None]
        block = 1 + k  # flat index of this step's candidates
        for s in range(1, steps):
            n = s * k  # the frontiers of steps 0 .. s-1 (each node sees only its ancestors)
            feature, normed = self._feed(fed_tok[:, :n], fed_hidden[:, :n], fed_pos[:, :n], fed_mask[:, :n, :n],
                                         slots, seq_lens)
            tok, score = cand_tok[:, block:block + kk], cand_score[:, block:block + kk]
            p = torch.empty(b, k, k, device=dev)
            self._top_children(normed, out=(p, tok.view(b, k, k)))
            torch.mul(chosen_p[:, s - 1, :, None], p, out=score.view(b, k, k))  # path scores
            best = row_topk(score, k)[1]
            torch.gather(tok, 1, best, out=chosen_tok[:, s])
            torch.gather(score, 1, best, out=chosen_p[:, s])
            if s < steps - 1:  # the next step expands this frontier: its nodes' flat index, hidden, mask rows
                nxt = block + kk
                torch.add(best[:, :, None].expand(-1, -1, k), block, out=cand_parent[:, nxt:nxt + kk].view(b, k, k))
                parent = self._parent_in_frontier[best]  # each frontier node's parent in step s-1's frontier
                torch.gather(feature, 1, parent[..., None].expand(-1, -1, feature.shape[-1]),
                             out=fed_hidden[:, n:n + k])
                fed_mask[:, n:n + k].bitwise_or_(fed_mask[:, n - k:n].gather(1, parent[..., None].expand(-1, -1, fed)))
            block += kk
        return cand_tok, cand_score, cand_parent, chosen_tok, chosen_p
