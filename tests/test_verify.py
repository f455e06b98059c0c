"""Tree verification: greedy against a brute-force oracle, sampling against a node-by-node
replay of its coins and, statistically, against the exact target distribution; commit_kv
against a cache rebuilt from scratch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_tree import random_parents

from spectool.draft.tree import DraftTree
from spectool.verify import commit_kv, target_probs, verify_greedy, verify_sampling


def random_batch(bs: int, n: int, vocab: int, seed: int, pad_max: int = 2):
    """Random trees with small-vocabulary tokens (so duplicates and matches are common)."""
    g = torch.Generator().manual_seed(seed)
    parents, valid = random_parents(bs, n, g, pad_max=pad_max)
    tokens = torch.randint(0, vocab, (bs, n), generator=g)
    seq_lens = torch.randint(0, 100, (bs,), generator=g)
    tree = DraftTree.from_parents(tokens, parents, torch.rand(bs, n, generator=g), seq_lens, valid)
    return tree, g


def greedy_oracle(tokens, parents, valid, argmax):
    """Longest root path whose every node's token is the argmax at its parent (ties: the path
    ending at the lowest node index); status by walking the children of the path in order."""
    n = len(tokens)
    best = 0
    depth = [0] * n
    agree = [True] * n
    for j in range(1, n):
        p = parents[j]
        depth[j] = depth[p] + 1
        agree[j] = valid[j] and agree[p] and tokens[j] == argmax[p]
        if agree[j] and depth[j] > depth[best]:
            best = j
    path = [best]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    path.reverse()
    status = [0] * n
    for d, x in enumerate(path):
        status[x] = 1
        taken = path[d + 1] if d + 1 < len(path) else n
        for j in range(x + 1, n):
            if parents[j] == x and valid[j] and j < taken:
                status[j] = 2
    return path, status, argmax[best]


def test_greedy_matches_brute_force_oracle():
    for seed, (bs, n, vocab) in enumerate([(300, 8, 3), (300, 16, 2), (100, 33, 4), (50, 1, 5)]):
        tree, g = random_batch(bs, n, vocab, seed)
        logits = torch.randn(bs, n, vocab, generator=g)
        res = verify_greedy(tree, logits)
        argmax = logits.argmax(-1)
        assert res.accept_path.shape == (bs, tree.max_depth + 1)
        assert res.status.dtype == torch.int8 and res.coins.isnan().all()
        for b in range(bs):
            path, status, bonus = greedy_oracle(tree.tokens[b].tolist(), tree.parents[b].tolist(),
                                                tree.valid[b].tolist(), argmax[b].tolist())
            want = path + [-1] * (tree.max_depth + 1 - len(path))
            assert res.accept_path[b].tolist() == want
            assert res.accept_length[b].item() == len(path) - 1
            assert res.status[b].tolist() == status
            assert res.bonus[b].item() == bonus


def sampling_replay(tokens, parents, valid, probs, coins):
    """Node-by-node sequential version of the sampling rule, in float64, driven by the coins
    the verifier recorded. Returns (path, bonus)."""
    x, path = 0, [0]
    while True:
        u = float(coins[x])
        seen, cum, taken = set(), 0.0, None
        for j in range(x + 1, len(tokens)):
            if parents[j] != x or not valid[j] or tokens[j] in seen:
                continue
            seen.add(tokens[j])
            cum += float(probs[x][tokens[j]])
            if u < cum:
                taken = j
                break
        if taken is None:
            residual = np.array(probs[x], dtype=np.float64)
            residual[list(seen)] = 0.0
            cdf = np.cumsum(residual)
            return path, int(np.searchsorted(cdf, u - cum, side="right"))
        x = taken
        path.append(x)


def test_sampling_replays_its_coins_and_statuses_are_consistent():
    for seed, (bs, n, vocab) in enumerate([(400, 8, 3), (200, 16, 4), (100, 24, 6)]):
        tree, g = random_batch(bs, n, vocab, seed)
        logits = torch.randn(bs, n, vocab, generator=g) * 2
        res = verify_sampling(tree, logits, generator=torch.Generator().manual_seed(seed))
        probs = res.target_probs.double().tolist()
        mismatches = 0
        for b in range(bs):
            path, bonus = sampling_replay(tree.tokens[b].tolist(), tree.parents[b].tolist(),
                                          tree.valid[b].tolist(), probs[b], res.coins[b].tolist())
            got = [x for x in res.accept_path[b].tolist() if x >= 0]
            mismatches += got != path or res.bonus[b].item() != bonus
            # Coins exactly on the accepted nodes; statuses as the greedy oracle defines them.
            accepted = set(got)
            assert [not math.isnan(c) for c in res.coins[b].tolist()] == [i in accepted for i in range(n)]
            tokens = tree.tokens[b].tolist()
            fake_argmax = [tokens[got[d + 1]] if d + 1 < len(got) else -1 for d in range(len(got))]
            argmax = [-1] * n
            for d, x in enumerate(got):
                argmax[x] = fake_argmax[d]
            _, status, _ = greedy_oracle(tokens, tree.parents[b].tolist(), tree.valid[b].tolist(), argmax)
            # Greedy with "argmax = the token taken" agrees on status except for duplicate tokens
            # before the taken child, which sampling skips (first occurrence) but still rejects.
            assert [s == 1 for s in res.status[b].tolist()] == [s == 1 for s in status]
        # float32 vs float64 interval edges may differ on a rare coin; none expected here.
        assert mismatches <= 1


# --- lossless, statistically ---------------------------------------------------------------

VOCAB = 12
N_NODES = 8
TRIALS = 200_000
ALPHA = 1e-4  # per setting: with the fixed seeds below, a correct verifier fails w.p. <= 1e-4


def exact_probs(table: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Independent float64 version of the sampling distribution, row by row."""
    out = np.zeros_like(table)
    for r, row in enumerate(table):
        x = row / temperature
        if 0 < top_k < len(x):
            x = np.where(x < np.sort(x)[-top_k], -np.inf, x)
        p = np.exp(x - x.max())
        p /= p.sum()
        if top_p < 1:
            order = np.argsort(-p, kind="stable")
            kept, mass = [], 0.0
            for t in order:
                if mass >= top_p:
                    break
                kept.append(t)
                mass += p[t]
            q = np.zeros_like(p)
            q[kept] = p[kept]
            p = q / q.sum()
        out[r] = p
    return out


def adversarial_trees(roots: torch.Tensor, probs: torch.Tensor, g: torch.Generator) -> DraftTree:
    """One random tree per trial: random shape and padding; per trial, tokens drawn one of four
    ways: uniform, the target's least likely token at the parent, its most likely, or copies of
    the parent's first child (duplicates)."""
    bs, n = roots.shape[0], N_NODES
    parents, valid = random_parents(bs, n, g, pad_max=2)
    kind = torch.randint(0, 4, (bs,), generator=g)
    tokens = torch.randint(0, VOCAB, (bs, n), generator=g)
    tokens[:, 0] = roots
    rows = torch.arange(bs)
    for i in range(1, n):
        parent_tok = tokens[rows, parents[:, i]]
        least = probs[parent_tok].argmin(-1)
        most = probs[parent_tok].argmax(-1)
        first_child = (parents == parents[:, i:i + 1]).float().argmax(-1)
        tokens[:, i] = torch.where(kind == 1, least, tokens[:, i])
        tokens[:, i] = torch.where(kind == 2, most, tokens[:, i])
        tokens[:, i] = torch.where(kind == 3, tokens[rows, first_child], tokens[:, i])
    return DraftTree.from_parents(tokens, parents, torch.zeros(bs, n), torch.zeros(bs, dtype=torch.long),
                                  valid, check=False)


def emitted_tokens(tree: DraftTree, res) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    first = torch.where(res.accept_length >= 1,
                        tree.tokens.gather(1, res.accept_path[:, 1:2].clamp(min=0))[:, 0], res.bonus)
    second = torch.where(res.accept_length >= 2,
                         tree.tokens.gather(1, res.accept_path[:, 2:3].clamp(min=0))[:, 0], res.bonus)
    return first, second, res.accept_length


def chi_square_pvalue(counts: np.ndarray, expected: np.ndarray) -> float:
    # Pool cells expected below 5 into one so the chi-square approximation holds.
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
        assert counts[small].sum() == 0, "a token with zero target probability was emitted"
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 6, 0.85)])
def test_sampling_is_lossless_on_first_two_tokens(temperature, top_k, top_p):
    rng = np.random.default_rng(1234)
    table = rng.normal(0, 1.5, (VOCAB, VOCAB))  # logits of the next token given the last one
    exact = exact_probs(table, temperature, top_k, top_p)
    root = 3
    want = exact[root][:, None] * exact  # P(t1, t2) = p(t1 | root) p(t2 | t1)

    g = torch.Generator().manual_seed(99)
    coins = torch.Generator().manual_seed(7)
    logits_table = torch.tensor(table, dtype=torch.float32)
    probs_table = torch.tensor(exact, dtype=torch.float32)
    tree = adversarial_trees(torch.full((TRIALS,), root), probs_table, g)
    res = verify_sampling(tree, logits_table[tree.tokens], temperature, top_k, top_p, coins)
    first, second, length = emitted_tokens(tree, res)
    # When only the bonus was emitted, the second token comes from the next iteration.
    tree2 = adversarial_trees(first, probs_table, g)
    res2 = verify_sampling(tree2, logits_table[tree2.tokens], temperature, top_k, top_p, coins)
    second = torch.where(length >= 1, second, emitted_tokens(tree2, res2)[0])

    counts = np.bincount((first * VOCAB + second).numpy(), minlength=VOCAB * VOCAB).astype(np.float64)
    assert chi_square_pvalue(counts, want.ravel() * TRIALS) > ALPHA
    # The drafts were accepted often enough that the tree part of the rule was exercised.
    assert (length >= 2).float().mean() > 0.01 and (length == 0).float().mean() > 0.05


def test_lossless_check_catches_a_biased_verifier():
    """The same statistic rejects a verifier that always takes the first drafted child when
    it is the argmax (a plausible bug), so the test above can fail."""
    rng = np.random.default_rng(5)
    table = rng.normal(0, 1.5, (VOCAB, VOCAB))
    exact = exact_probs(table, 1.0, 0, 1.0)
    g = torch.Generator().manual_seed(1)
    tree = adversarial_trees(torch.full((TRIALS,), 3), torch.tensor(exact, dtype=torch.float32), g)
    res = verify_sampling(tree, torch.tensor(table, dtype=torch.float32)[tree.tokens], generator=g)
    first = emitted_tokens(tree, res)[0]
    greedy_first = verify_greedy(tree, torch.tensor(table, dtype=torch.float32)[tree.tokens])
    biased = torch.where(greedy_first.accept_length >= 1, torch.tensor(int(exact[3].argmax())), first)
    counts = np.bincount(biased.numpy(), minlength=VOCAB).astype(np.float64)
    assert chi_square_pvalue(counts, exact[3] * TRIALS) < ALPHA


def test_target_probs_matches_oracle_and_rejects_bad_settings():
    rng = np.random.default_rng(0)
    table = rng.normal(0, 2, (20, 9))
    settings = [(1.0, 0, 1.0), (0.5, 3, 1.0), (2.0, 0, 0.6), (1.3, 4, 0.7), (1.0, 1, 1.0)]
    for temperature, top_k, top_p in settings:
        got = target_probs(torch.tensor(table), temperature, top_k, top_p)
        np.testing.assert_allclose(got.numpy(), exact_probs(table, temperature, top_k, top_p), atol=1e-6)
    for bad in [dict(temperature=0.0), dict(temperature=math.nan), dict(top_k=-1), dict(top_p=0.0),
                dict(top_p=1.5), dict(top_k=2.5)]:
        with pytest.raises(ValueError):
            target_probs(torch.tensor(table), **bad)


def test_verify_rejects_mismatched_logits():
    tree, _ = random_batch(2, 4, 5, 0)
    with pytest.raises(ValueError, match=r"\[B, N, V\]"):
        verify_greedy(tree, torch.zeros(2, 5, 5))
    with pytest.raises(ValueError, match="floating"):
        verify_sampling(tree, torch.zeros(2, 4, 5, dtype=torch.long))


# --- commit_kv -----------------------------------------------------------------------------


def toy_kv(tokens: torch.Tensor, positions: torch.Tensor, layers: int, heads: int, dim: int):
    """K/V of a toy model whose entries depend only on (layer, token, position): [L, T, H, D]."""
    base = tokens[None, :, None, None] * 1000.0 + positions[None, :, None, None]
    lh = torch.arange(layers)[:, None, None, None] * 10 + torch.arange(heads)[None, None, :, None]
    d = torch.arange(dim)[None, None, None, :]
    return torch.sin(base * 0.001 + lh * 0.1 + d), torch.cos(base * 0.002 + lh * 0.3 - d)


def test_commit_kv_equals_cache_rebuilt_from_scratch():
    layers, heads, dim, max_batch, max_seq = 2, 3, 4, 5, 64
    tree, g = random_batch(4, 10, 3, seed=4, pad_max=2)
    logits = torch.randn(4, 10, 3, generator=g)
    res = verify_sampling(tree, logits, generator=g)
    slots = torch.tensor([3, 0, 4, 1])
    seq_lens = tree.seq_lens.clamp(max=max_seq - 10)
    prefix = torch.randint(0, 3, (max_batch, max_seq), generator=g)

    def cache_with(rows):  # rows: {slot: (tokens, positions)} written at cache indices 0..T-1
        k = torch.zeros(layers, max_batch, heads, max_seq, dim)
        v = torch.zeros_like(k)
        for slot, (toks, pos) in rows.items():
            kk, vv = toy_kv(toks, pos, layers, heads, dim)
            k[:, slot, :, : len(toks)] = kk.transpose(1, 2)
            v[:, slot, :, : len(toks)] = vv.transpose(1, 2)
        return k, v

    # The verify forward wrote the prefix and then the N tree nodes at their positions.
    written, rebuilt = {}, {}
    for b, slot in enumerate(slots.tolist()):
        s = int(seq_lens[b])
        pre_tok, pre_pos = prefix[slot, :s], torch.arange(s)
        written[slot] = (torch.cat([pre_tok, tree.tokens[b]]), torch.cat([pre_pos, s + tree.depth[b]]))
        path = res.accept_path[b, : int(res.accept_length[b]) + 1]
        rebuilt[slot] = (torch.cat([pre_tok, tree.tokens[b, path]]), torch.arange(s + len(path)))
    k, v = cache_with(written)
    commit_kv(k, v, slots, seq_lens, res.accept_path, res.accept_length)
    k_ref, v_ref = cache_with(rebuilt)
    for b, slot in enumerate(slots.tolist()):
        live = int(seq_lens[b]) + int(res.accept_length[b]) + 1
        torch.testing.assert_close(k[:, slot, :, :live], k_ref[:, slot, :, :live], rtol=0, atol=0)
        torch.testing.assert_close(v[:, slot, :, :live], v_ref[:, slot, :, :live], rtol=0, atol=0)
    assert int(res.accept_length.max()) >= 2  # some rows really moved entries
    with pytest.raises(ValueError, match="max_seq_len"):
        commit_kv(k[0], v[0], slots, seq_lens, res.accept_path, res.accept_length)


def test_a_graph_padding_row_leaves_the_real_rows_decision_unchanged():
    """A CUDA graph pads a batch to its bucket with all-zero rows (mask, tokens, valid); sampling
    and greedy verify must run over such a row and decide the real row as they do alone."""
    from spectool.draft.tree import MaskTree

    n, vocab = 4, 16
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    real = (torch.tensor([[3, 5, 6, 7]]), mask[None], torch.ones(1, n, dtype=torch.bool), torch.tensor([5]))
    padded = (torch.cat([real[0], torch.zeros(1, n, dtype=torch.long)]),
              torch.cat([real[1], torch.zeros(1, n, n, dtype=torch.bool)]),
              torch.cat([real[2], torch.zeros(1, n, dtype=torch.bool)]), torch.tensor([5, 0]))
    gen = torch.Generator().manual_seed(0)
    logits, coins = torch.randn(2, n, vocab, generator=gen), torch.rand(2, n, generator=gen)
    for tokens, m, valid, lens in (real, padded):
        tree = MaskTree(tokens, torch.zeros(tokens.shape), m, valid, lens, max_depth=n - 1).build()
        b = tokens.shape[0]
        sampled = verify_sampling(tree, logits[:b], 0.8, coins=coins[:b])
        greedy = verify_greedy(tree, logits[:b])
        if b == 1:
            want = (sampled.accept_path[0], sampled.bonus[0], greedy.accept_path[0], greedy.bonus[0])
    got = (sampled.accept_path[0], sampled.bonus[0], greedy.accept_path[0], greedy.bonus[0])
    assert all(torch.equal(g, w) for g, w in zip(got, want))
