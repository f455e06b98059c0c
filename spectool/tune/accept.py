"""Greedy acceptance against a known continuation: the verifier's rule without the target.

Greedy verification accepts the deepest root path whose every token is the target's argmax
at its parent. In a greedy trace the argmax after ``known[:L + d]`` is ``known[L + d]``
(the output is the same for every configuration), so the check needs no forward.
"""

from __future__ import annotations


def accept_against(tokens: list[int], parents: list[int], valid: list[bool], known: list[int], seq_len: int
            ) -> tuple[int, bool]:
    """(accept length, censored) of one tree against the known continuation after ``known[seq_len]``.

    The verifier's rule: the deepest node whose root path matches, ties to the lowest index.
    Censored: the path reached the end of what is known, so the bonus (or deeper matches) is unknown.
    """
    limit = len(known) - seq_len  # depths d < limit have a known token
    if limit <= 1:
        return 0, True
    if known[seq_len + 1] not in tokens:  # no node drafts the next token (most misses): one C-level scan
        return 0, False
    depth = [0] * len(tokens)
    ok = [False] * len(tokens)
    ok[0] = True
    best = 0
    for i in range(1, len(tokens)):
        if not valid[i]:
            continue
        p = parents[i]
        d = depth[p] + 1
        depth[i] = d
        if ok[p] and d < limit and tokens[i] == known[seq_len + d]:
            ok[i] = True
            if d > best:
                best = d
    return best, best + 1 >= limit


def accepted_path(tokens: list[int], parents: list[int], valid: list[bool], known: list[int], seq_len: int
                  ) -> list[int]:
    """Node indices of the accepted path, root first (the path ``accept_against`` measures)."""
    limit = len(known) - seq_len
    depth = [0] * len(tokens)
    ok = [False] * len(tokens)
    ok[0] = True
    best, node = 0, 0
    for i in range(1, len(tokens)):
        if not valid[i]:
            continue
        p = parents[i]
        depth[i] = depth[p] + 1
        if ok[p] and depth[i] < limit and tokens[i] == known[seq_len + depth[i]]:
            ok[i] = True
            if depth[i] > best:
                best, node = depth[i], i
    path = [node]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    return path[::-1]
