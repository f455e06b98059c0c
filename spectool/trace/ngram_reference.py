"""Pure-Python reference of spectool.native.NgramCorpus: the trie tests' oracle and `spectool check --replay`'s.

It implements the documented semantics (spectool/native/__init__.py) the slow, obvious
way: a dict-of-dicts trie whose nodes remember the clock value of their last stamp
(creation or count), every n-gram looked up from the root, eviction by scanning every
leaf for the oldest stamp, no suffix or match cache,
and external corpora kept as plain token lists whose n-gram counts are found by
scanning them. Puts apply at once (there is no worker thread).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False)
class Node:
    token: int
    parent: Node | None
    count: int = 0
    stamp: int = 0
    children: dict[int, Node] = field(default_factory=dict)


class ReferenceCorpus:
    """Same constructor and methods as NgramCorpus, returning the same arrays."""

    def __init__(self, max_trie_depth=18, min_bfs_breadth=1, max_bfs_breadth=10, num_draft_tokens=12,
                 match="bfs", capacity=10_000_000):
        self.depth = max_trie_depth
        self.min_b = min_bfs_breadth
        self.max_b = max_bfs_breadth
        self.n = num_draft_tokens
        self.match = match
        self.capacity = capacity
        self.external: dict[str, list[list[int]]] = {}
        self.reset()

    # ----- trie -----
    def reset(self):
        self.root = Node(-1, None)
        self.nodes = 0
        self.evictions = 0
        self.clock = 0
        self.done: dict[int, int] = {}

    def _all_nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _evict(self):
        leaf = min((x for x in self._all_nodes() if not x.children), key=lambda x: x.stamp)
        del leaf.parent.children[leaf.token]
        self.nodes -= 1
        self.evictions += 1

    def _stamp(self, node):
        self.clock += 1
        node.stamp = self.clock

    def _child(self, node, token):
        """(node's child for token, whether it was created: count 0, not stamped)."""
        child = node.children.get(token)
        if child is not None:
            return child, False
        child = node.children[token] = Node(token, node)
        self.nodes += 1
        return child, True

    def _insert(self, w, first_new):
        for j in range(first_new, len(w)):
            for n in range(min(self.depth, j + 1), 0, -1):  # longest n-gram first
                node = self.root
                for t in w[j - n + 1:j]:  # the prefix; a missing node did occur: count 1
                    node, created = self._child(node, t)
                    if created:
                        node.count = 1
                        self._stamp(node)
                child, _ = self._child(node, w[j])
                child.count += 1
                self._stamp(child)
            while self.nodes > self.capacity:
                self._evict()

    def batch_put(self, windows, req_ids=None, total_lens=None):
        for i, w in enumerate(windows):
            w = [int(t) for t in w]
            first_new = 0
            if req_ids is not None:
                done = self.done.get(req_ids[i], 0)
                total = total_lens[i]
                start = total - len(w)
                first_new = len(w) if total <= done else max(done, start) - start
                self.done[req_ids[i]] = max(done, total)
            self._insert(w, first_new)

    def synchronize(self):
        pass

    def erase_match_state(self, req_ids):
        for r in req_ids:
            self.done.pop(r, None)

    # ----- external corpora -----
    def add_external_corpus(self, corpus_id, token_chunks, max_tokens):
        chunks, left = [], max_tokens
        for c in token_chunks:
            if left <= 0:
                break
            c = [int(t) for t in c][:left]
            left -= len(c)
            if c:
                chunks.append(c)
        self.external[corpus_id] = chunks

    def remove_external_corpus(self, corpus_id):
        del self.external[corpus_id]

    # ----- drafting -----
    def breadth_for(self, m):
        span = self.depth - 2
        if span <= 0:
            return self.max_b
        m = min(max(m, 1), self.depth - 1)
        return self.max_b - (self.max_b - self.min_b) * (m - 1) // span

    def _trie_children(self, node):
        kids = sorted(node.children.values(), key=lambda c: -c.stamp)
        return [(c, c.token, c.count) for c in kids]

    @staticmethod
    def _corpus_children(chunks, path):
        """Continuations of the token tuple `path` in the chunks: [(path+t, t, count)]."""
        counts: dict[int, int] = {}
        k = len(path)
        for c in chunks:
            for s in range(len(c) - k):
                if tuple(c[s:s + k]) == path:
                    counts[c[s + k]] = counts.get(c[s + k], 0) + 1
        order = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return [(path + (t,), t, n) for t, n in order]

    def _pass(self, children, start, breadth, tree):
        """One expansion from `start` grafted into tree = (tokens, parents, scores)."""
        tokens, parents, scores = tree

        def find(parent, token):
            for i in range(1, len(tokens)):
                if parents[i] == parent and tokens[i] == token:
                    return i
            return -1

        def add(token, parent, score):
            tokens.append(token)
            parents.append(parent)
            scores.append(np.float32(score))
            return len(tokens) - 1

        if self.match == "bfs":
            queue = [(start, 0)]
            while queue and len(tokens) < self.n:
                node, at = queue.pop(0)
                for rank, (child, token, _) in enumerate(children(node)[:breadth]):
                    idx = find(at, token)
                    if idx < 0:
                        if len(tokens) >= self.n:
                            return
                        if parents.count(at) >= breadth:  # this node is as wide as the pass allows
                            continue
                        idx = add(token, at, 1.0 / (rank + 1))
                    queue.append((child, idx))
        else:
            heap, seq = [], 0
            for child, token, count in (kids := children(start)):
                total = sum(k[2] for k in kids)
                heapq.heappush(heap, (-(1.0 * count / total), seq, child, token, 0))
                seq += 1
            while heap and len(tokens) < self.n:
                neg, _, node, token, at = heapq.heappop(heap)
                prob = -neg
                idx = find(at, token)
                if idx < 0:
                    idx = add(token, at, prob)
                kids = children(node)
                total = sum(k[2] for k in kids)
                for child, tok, count in kids:
                    heapq.heappush(heap, (-(prob * count / total), seq, child, tok, idx))
                    seq += 1

    def _tree(self, tail):
        tokens, parents, scores = [tail[-1]], [-1], [np.float32(1.0)]
        tree = (tokens, parents, scores)
        first = None  # (match_len, breadth) of the first pass
        k_max = min(len(tail), self.depth - 1)
        for m in range(k_max, 0, -1):
            if len(tokens) >= self.n:
                break
            node = self.root
            for t in tail[len(tail) - m:]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is None or not node.children:
                continue
            self._pass(self._trie_children, node, self.breadth_for(m), tree)
            first = first or (m, self.breadth_for(m))
        for chunks in self.external.values():
            for m in range(k_max, 0, -1):
                if len(tokens) >= self.n:
                    break
                path = tuple(tail[len(tail) - m:])
                if not self._corpus_children(chunks, path):
                    continue
                self._pass(lambda p, ch=chunks: self._corpus_children(ch, p), path, self.breadth_for(m), tree)
                first = first or (m, self.breadth_for(m))
        match_len, breadth = first or (0, 0)
        if self.match == "prob":
            fan = [parents.count(i) for i in range(len(tokens))]
            breadth = max(fan[:len(tokens)]) if len(tokens) > 1 else 0
        return tokens, parents, scores, match_len, breadth

    def batch_get(self, req_ids, tails, total_lens):
        bs, n = len(tails), self.n
        out_tokens = np.zeros((bs, n), np.int32)
        out_parents = np.zeros((bs, n), np.int32)
        out_scores = np.zeros((bs, n), np.float32)
        valid = np.zeros((bs, n), bool)
        mask = np.zeros((bs, n, n), bool)
        match_len = np.zeros(bs, np.int32)
        breadth = np.zeros(bs, np.int32)
        for b, tail in enumerate(tails):
            tokens, parents, scores, match_len[b], breadth[b] = self._tree([int(t) for t in tail])
            k = len(tokens)
            out_tokens[b, :k], out_parents[b, :k], out_scores[b, :k] = tokens, parents, scores
            valid[b, :k] = True
            for i in range(n):
                j = i
                while j >= 0:
                    mask[b, i, j] = True
                    j = out_parents[b, j] if j > 0 else -1
        return out_tokens, out_parents, mask, valid, out_scores, match_len, breadth
