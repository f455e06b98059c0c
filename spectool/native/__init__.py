"""The native (C++) n-gram corpus behind N-gram drafting.

``NgramCorpus`` keeps a trie of every n-gram (up to ``max_trie_depth`` tokens) put into
it, shared by all requests, and builds one draft tree per request from the longest
suffix of the request's tail found in the trie.

Semantics that callers rely on (tests/ngram_reference.py is the executable version):

- ``batch_put`` counts, for every new token of a window, each n-gram that ends in it.
  Without request ids every token of every window is new (re-putting a window counts
  it again). With ``req_ids`` and ``total_lens`` (the request's length including the
  window, which is its last ``len(window)`` tokens), only tokens past the ones already
  put for that request are new, so counts are true n-gram counts and the cost grows
  with the new tokens. A window whose total length is not past the last one put for
  its request counts nothing (call ``erase_match_state`` before reusing an id).
  Puts run on a worker thread in submission order (a put of a few windows, at most 64
  tokens, with none pending runs on the caller's thread instead, as a hand-off would
  cost more); ``synchronize`` waits for them.
  For each new position, n-grams are counted longest first; a missing prefix of one
  (evicted, or before the window's first new token and never put) is recreated with
  count 1. Every node created or counted takes the next value of a global clock.
  Counts are 32-bit and stop at ``2**32 - 1`` (the reference's do not; no test or
  realistic stream gets there).
- Recency: siblings are ordered by that clock, newest first, i.e. by when the n-gram
  last occurred.
- Capacity (trie nodes, the root excluded): after each new position, while the trie
  is over capacity, the leaf with the oldest clock value is evicted (only leaves, so
  no node is left dangling).
- Match: the longest suffix of the tail, at most ``max_trie_depth - 1`` tokens, whose
  trie node has children. ``match_len`` reports it (0: no match, the tree is the root
  and padding).
- ``bfs``: breadth-first from the matched node, keeping the ``breadth`` most recent
  children of each node, where breadth falls linearly (integer division) from
  ``max_bfs_breadth`` for a 1-token match to ``min_bfs_breadth`` for a
  ``max_trie_depth - 1``-token one. Score = 1 / (rank among siblings + 1).
  ``breadth`` reports the breadth of the first (longest) match.
- ``prob``: best-first by path probability, the product along the path of each node's
  count share among its siblings; ties go to the candidate found first (the more
  recent sibling). Score = that probability. ``breadth`` reports the largest number of
  children of any node in the tree.
- Both stop at N-1 drafted nodes. If the longest match yields fewer, each shorter
  suffix with children is expanded the same way and its paths are grafted into the
  tree (a path already present is reused and keeps its score), then each external
  corpus, in the order added, the same way.
- External corpora (suffix automata over token chunks; no match spans two chunks):
  children are ordered by occurrence count, then token id (they have no recency); the
  tree below an external match is limited only by the token budget.
- Output nodes are in topological order; node 0 is the tail's last token; padding nodes
  (``valid`` False, token 0, score 0) hang off the root at the end.
- Each request id keeps the trie nodes of the suffixes of what was put for it, so a
  put costs about ``max_trie_depth`` lookups per new token, and ``batch_get`` starts
  its match from them when the tail continues what was put (by at most two tokens);
  otherwise it looks the suffixes up from the root. The result never depends on that
  state.
  ``erase_match_state`` drops it (and the put progress) for ids; unknown ids are a
  no-op. ``reset`` empties the trie and all request state; external corpora stay.

Token ids must be ints in ``[0, 2**31 - 1]``: Python lists/tuples of ints, or contiguous
int32/int64 numpy arrays (a 2-D array counts as one row per request). Anything else
raises ``ValueError`` naming the argument and row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

try:
    from spectool import _native
except ImportError as e:  # a source tree nobody built
    raise ImportError("spectool's native extension (spectool._native) is not built: install the package with "
                      "`pip install .` (or `pip install -e .` to work on it in place)") from e


class NgramDraft(NamedTuple):
    """Draft trees of one batch (numpy arrays; bs = requests, N = num_draft_tokens)."""

    tokens: np.ndarray     # [bs, N] int32, node 0 = last token of the tail
    parents: np.ndarray    # [bs, N] int32, -1 for the root
    mask: np.ndarray       # [bs, N, N] bool, mask[b, q, k] = k is q or an ancestor of q
    valid: np.ndarray      # [bs, N] bool, False for padding nodes
    scores: np.ndarray     # [bs, N] float32 (prob: path probability; bfs: 1 / (sibling rank + 1))
    match_len: np.ndarray  # [bs] int32, matched suffix length (0 = no match)
    breadth: np.ndarray    # [bs] int32, bfs: breadth used; prob: widest fan-out in the tree


class NgramCorpus:
    """A trie of n-grams shared by all requests, drafting trees by suffix match.

    Args:
        max_trie_depth: longest n-gram stored (>= 1); matches use at most depth-1 tokens.
        min_bfs_breadth: children kept per node for the longest match (``bfs``).
        max_bfs_breadth: children kept per node for a 1-token match (``bfs``).
        num_draft_tokens: N, tree nodes per request including the root (>= 2).
        match: ``"bfs"`` (recency) or ``"prob"`` (frequency, best-first).
        capacity: trie nodes before LRU eviction of leaves (>= max_trie_depth).
    """

    def __init__(self, max_trie_depth: int = 18, min_bfs_breadth: int = 1, max_bfs_breadth: int = 10,
                 num_draft_tokens: int = 12, match: str = "bfs", capacity: int = 10_000_000) -> None:
        for name, value in (("max_trie_depth", max_trie_depth), ("min_bfs_breadth", min_bfs_breadth),
                            ("max_bfs_breadth", max_bfs_breadth), ("num_draft_tokens", num_draft_tokens),
                            ("capacity", capacity)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise ValueError(f"{name} must be an int, got {type(value).__name__}")
        if not isinstance(match, str):
            raise ValueError(f"match must be 'bfs' or 'prob', got {match!r}")
        self._c = _native.NgramCorpus(int(max_trie_depth), int(min_bfs_breadth), int(max_bfs_breadth),
                                      int(num_draft_tokens), match, int(capacity))
        self.max_trie_depth = int(max_trie_depth)
        self.min_bfs_breadth = int(min_bfs_breadth)
        self.max_bfs_breadth = int(max_bfs_breadth)
        self.num_draft_tokens = int(num_draft_tokens)
        self.match = match
        self.capacity = int(capacity)

    def batch_put(self, windows: Sequence | np.ndarray, req_ids: Sequence[int] | None = None,
                  total_lens: Sequence[int] | None = None) -> None:
        """Queues ``windows`` for insertion on the worker thread (the data is copied first);
        at most 64 tokens with no put pending are inserted before returning."""
        self._c.batch_put(windows, req_ids, total_lens)

    def synchronize(self) -> None:
        """Waits until every queued put has been applied."""
        self._c.synchronize()

    def batch_get(self, req_ids: Sequence[int] | None, tails: Sequence | np.ndarray,
                  total_lens: Sequence[int] | None, out: NgramDraft | None = None) -> NgramDraft:
        """Builds one draft tree per tail (queued puts may or may not be visible yet).

        With ``out`` (an ``NgramDraft`` of C-contiguous, writeable arrays of exactly the
        result's dtypes and shapes, e.g. views of a pinned staging buffer) the trees are
        written there and ``out`` is returned: no allocation and no copy.
        """
        return NgramDraft(*self._c.batch_get(req_ids, tails, total_lens, None if out is None else tuple(out)))

    def replay_greedy(self, request_ids: Sequence[int], knowns: Sequence, prompt_lens: Sequence[int],
                      ends: Sequence[int], max_batch_size: int, keep_trees: bool = True) -> dict[str, np.ndarray]:
        """Replays a recorded greedy workload through this (fresh) corpus, all in C++: the engine's
        batch schedule over ``max_batch_size`` slots, the N-gram drafter's puts and gets, and the
        greedy verifier with each request's known tokens (``knowns[i]``: prompt + output + any
        verified past it) standing in for the target; request i finishes at length ``ends[i]``.

        Returns numpy arrays: per row (iteration x running request) ``iteration``, ``request_id``,
        ``seq_len``, ``accept_length``, ``censored``, ``match_len``; per iteration ``batch_size`` and
        ``num_nodes``; with ``keep_trees``, row r's tree as ``tree_tokens`` / ``tree_parents`` /
        ``tree_valid`` [``tree_offsets[r]``: ``tree_offsets[r + 1]``].
        """
        return self._c.replay_greedy(request_ids, knowns, prompt_lens, ends, int(max_batch_size), bool(keep_trees))

    def erase_match_state(self, req_ids: Sequence[int]) -> None:
        """Forgets the match state and put progress of ``req_ids``; unknown ids are ignored."""
        self._c.erase_match_state(req_ids)

    def reset(self) -> None:
        """Empties the trie and all request state (after pending puts); keeps external corpora."""
        self._c.reset()

    def add_external_corpus(self, corpus_id: str, token_chunks: Sequence | np.ndarray,
                            max_tokens: int = 1_000_000) -> None:
        """Adds a read-only corpus (e.g. a tokenized file) to draft from, keeping its first
        ``max_tokens`` tokens. Chunks are separate documents: no match spans two."""
        if not isinstance(corpus_id, str):
            raise ValueError(f"corpus_id must be a str, got {type(corpus_id).__name__}")
        self._c.add_external_corpus(corpus_id, token_chunks, int(max_tokens))

    def remove_external_corpus(self, corpus_id: str) -> None:
        """Removes an external corpus; raises ValueError if there is none by that id."""
        if not self._c.remove_external_corpus(corpus_id):
            raise ValueError(f"no external corpus {corpus_id!r}")

    def list_external_corpora(self) -> list[dict]:
        """``[{"corpus_id": ..., "tokens": ...}]`` in the order they were added (= merge order)."""
        return [{"corpus_id": cid, "tokens": n} for cid, n in self._c.list_external_corpora()]

    def stats(self) -> dict:
        """nodes, capacity, evictions, puts (windows applied), gets (trees built),
        external_corpora, external_tokens, bytes_per_node (trie memory / nodes)."""
        return self._c.stats()


__all__ = ["NgramCorpus", "NgramDraft"]
