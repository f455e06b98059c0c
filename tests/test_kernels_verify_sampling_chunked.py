"""The chunk-parallel sampling verify (spectool/kernels/verify_sampling_chunked.py) against the torch
reference ``verify_sampling``, under TRITON_INTERPRET=1 (unless this process started with it, the
file re-runs itself in a child pytest that does).

For the same coins both make the same decision: statuses, accept paths and lengths, bonus tokens
and the target argmax are equal, the children's probabilities and the bonus CDF agree to float32
rounding, and the distribution the rows describe keeps exactly the reference's tokens with its
probabilities. Small launch shapes make several chunks per row, so every cross-chunk step (the cut
searches, a tie spread over chunks, the chunk that holds the coin) runs. Cases: bs 1 and larger, up
to 64 nodes, temperature alone and with top-k / top-p, ties at either cut, rows where everything but
one token is masked, coins next to 1 and trees whose children hold all the mass. The statistical
lossless test with the kernel runs on the GPU (tests/gpu/test_verify_sampling_gpu.py).
"""

from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch
from sampling_checks import assert_decides_as, check_residual_ends
from test_verify import random_batch

from spectool.draft.tree import DraftTree
from spectool.engine import Engine, _led_by
from spectool.kernels import verify_sampling_chunked as chunked
from spectool.kernels.verify_sampling_chunked import LaunchConfig, cut_rounds
from spectool.verify import target_probs_at, verify_sampling, verify_sampling_chunked

# Three chunks of a 1,200-token row in groups of 256, 16 probes (8 cut rounds); one chunk with 64
# probes (6 rounds).
VOCAB = 1200
SMALL = LaunchConfig(chunk=512, sub=256, probes=16, warps=4)
WIDE = LaunchConfig(chunk=2048, sub=2048, probes=64, warps=4)
# 10 groups: at least k of them, so the k-th largest group maximum bounds the top-k cut.
TINY = LaunchConfig(chunk=128, sub=128, probes=16, warps=4)
# Groups of 16 (75 in a row), so the bound from the group maxima leaves a few candidates: FINE sorts
# them, SEARCHED searches both cuts among them, and with a buffer of 8 (FEW) they do not fit and
# every cut is searched over the whole row.
FINE = LaunchConfig(chunk=512, sub=16, probes=16, warps=4, candidates=128)
SEARCHED = dataclasses.replace(FINE, sorted=0)
FEW = dataclasses.replace(FINE, candidates=8)
# FEW with top-p alone's whole-row rounds at 16 warps, 512 values a round.
FEW_P16 = dataclasses.replace(FEW, p_warps=16)
# The copy into the buffer reads 4 groups a round, so the candidates are gathered over many rounds.
ROUNDS = dataclasses.replace(FINE, gather=64)
# Chunks of 64 (19 in a row): top-k 12's bound sorts only the groups at or above the 12th largest
# chunk maximum; WHOLE_SORT sorts every group maximum.
CHUNK_MAXIMA = dataclasses.replace(FINE, chunk=64)
WHOLE_SORT = dataclasses.replace(FINE, prefilter=0)
# FINE with each group's second value kept: the groups under the bound's second value give their
# maximum alone, and only the others are read.
SECOND = dataclasses.replace(FINE, second=True)
# The decision made by the last row program of each request and the bonus by its last residual program.
FUSED, FUSED_WIDE = (dataclasses.replace(c, fused=True) for c in (SMALL, WIDE))
# Top-k's cut searches (SEARCHED, and FEW over the whole row) read 32 values a round, not 256.
SEARCHED_SHORT, FEW_SHORT = (dataclasses.replace(c, cut_tile=32) for c in (SEARCHED, FEW))


def test_kernels_in_an_interpreter_subprocess(triton_interpreter_child):
    triton_interpreter_child()


def test_cut_rounds_narrow_every_float_key_to_one():
    for probes in (1, 16, 64, 256):
        size = 2**32
        for _ in range(cut_rounds(probes)):
            size = math.ceil(size / (probes + 1))
        assert size == 1
        assert math.ceil(2**32 / (probes + 1) ** (cut_rounds(probes) - 1)) > 1


def assert_same_decision(tree: DraftTree, logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                         coins: torch.Tensor, config: LaunchConfig = SMALL) -> None:
    want = verify_sampling(tree, logits, temperature, top_k, top_p, coins=coins)
    temps = torch.full((logits.shape[0],), temperature)
    got = verify_sampling_chunked(tree, logits, temps, top_k, top_p, coins, config)
    assert_decides_as(got, want)
    ids = torch.arange(logits.shape[-1]).expand(logits.shape).contiguous()
    probs = target_probs_at(logits, temps, got.target_rows, ids)
    assert torch.equal(probs > 0, want.target_probs > 0)
    torch.testing.assert_close(probs, want.target_probs, rtol=1e-5, atol=1e-7)


def lifted(tree: DraftTree, logits: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """The drafted tokens among the likely ones, so the cuts decide some of them."""
    bs, n, _ = logits.shape
    out = logits.clone()
    out.scatter_(2, tree.tokens[:, None, :].expand(bs, n, n), 2.5 + torch.rand(bs, n, n, generator=g))
    return out


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("bs, n, temperature", [(1, 16, 0.7), (5, 9, 1.3), (2, 64, 1.0)])
def test_chunked_equals_reference_with_temperature(bs, n, temperature):
    tree, g = random_batch(bs, n, VOCAB, bs + n)
    logits = lifted(tree, torch.randn(bs, n, VOCAB, generator=g) * 2, g)
    assert_same_decision(tree, logits, temperature, 0, 1.0, torch.rand(bs, n, generator=g))


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("bs, n, top_k, top_p, config", [(1, 5, 50, 1.0, SMALL), (1, 5, 0, 0.9, SMALL),
                                                         (2, 8, 50, 0.9, WIDE), (3, 4, 7, 0.6, WIDE),
                                                         (1, 2, 6, 1.0, TINY)])
def test_chunked_equals_reference_with_top_k_and_top_p(bs, n, top_k, top_p, config):
    vocab = VOCAB
    tree, g = random_batch(bs, n, 40, top_k)
    logits = lifted(tree, torch.randn(bs, n, vocab, generator=g) * 2, g)
    assert_same_decision(tree, logits, 0.8, top_k, top_p, torch.rand(bs, n, generator=g), config)


def blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """[rows, ceil(V / size), size]: each row of ``x`` in blocks of ``size`` (the last padded with -inf)."""
    return torch.nn.functional.pad(x, (0, -x.shape[1] % size), value=-math.inf).view(x.shape[0], -1, size)


def block_maxima(x: torch.Tensor, size: int) -> torch.Tensor:
    """[rows, ceil(V / size)]: the maximum of each ``size`` entries of each row of ``x``."""
    return blocks(x, size).amax(-1)


def group_bound(x: torch.Tensor, top_k: int, top_p: float, sub: int) -> torch.Tensor:
    """Each row's bound from its group maxima of ``sub`` entries (the kernel's ``_bound``), [rows]:
    -inf where the maxima never reach the mass (every group is then live)."""
    gmax = block_maxima(x, sub).sort(-1, descending=True).values
    if top_k:
        return gmax[:, top_k - 1]
    mass = torch.exp(gmax - x.max(-1, keepdim=True).values).cumsum(-1)
    total = torch.exp(x - x.max(-1, keepdim=True).values).sum(-1, keepdim=True)
    at = (mass < top_p * total * 1.001).sum(-1, keepdim=True)
    padded = torch.nn.functional.pad(gmax, (0, 1), value=-math.inf)
    return padded.gather(1, at)[:, 0]


def candidates_over_the_bound(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                              sub: int) -> torch.Tensor:
    """The values at or above each row's bound from its group maxima (the kernel's candidates)."""
    x = logits.float().flatten(0, 1) / temperature
    return (x >= group_bound(x, top_k, top_p, sub)[:, None]).sum(-1)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("config", [FINE, SEARCHED, FEW, FEW_P16], ids=["sorted", "searched", "whole-row",
                                                                      "whole-row-16-warps"])
@pytest.mark.parametrize("top_k, top_p", [(50, 1.0), (0, 0.9), (20, 0.8), (12, 0.5)])
def test_chunked_cuts_from_the_candidates_and_from_the_whole_row(config, top_k, top_p):
    bs, n = 3, 6
    tree, g = random_batch(bs, n, 40, top_k)
    logits = lifted(tree, torch.randn(bs, n, VOCAB, generator=g) * 4, g)
    # The case takes the path it names: every row's candidates fit FINE's buffer (and are sorted
    # there), none fit FEW's; at top-k 50 some rows sort in FINE's small block and some in its full one.
    counts = candidates_over_the_bound(logits, 0.8, top_k, top_p, config.sub)
    assert 8 < counts.max() <= FINE.candidates < VOCAB
    if top_k == 50:
        assert counts.min() <= FINE.small_sorted < counts.max()
    assert_same_decision(tree, logits, 0.8, top_k, top_p, torch.rand(bs, n, generator=g), config)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("config", [SEARCHED_SHORT, FEW_SHORT], ids=["searched", "whole-row"])
@pytest.mark.parametrize("top_k, top_p", [(50, 1.0), (50, 0.5)])
def test_top_k_cuts_searched_in_short_rounds(config, top_k, top_p):
    # The search's tile is its own launch parameter where top-k bounds the candidates: several
    # tiles cover FINE's candidates (up to 128) and the whole 1,200-token row.
    bs, n = 3, 6
    tree, g = random_batch(bs, n, 40, top_k)
    logits = lifted(tree, torch.randn(bs, n, VOCAB, generator=g) * 4, g)
    assert candidates_over_the_bound(logits, 0.8, top_k, top_p, config.sub).max() > config.cut_tile
    assert_same_decision(tree, logits, 0.8, top_k, top_p, torch.rand(bs, n, generator=g), config)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("config, top_p", [(CHUNK_MAXIMA, 1.0), (CHUNK_MAXIMA, 0.5), (WHOLE_SORT, 0.5), (ROUNDS, 0.5)],
                         ids=["chunk-maxima", "chunk-maxima-top-p", "every-group", "rounds"])
def test_top_k_bound_from_the_groups_over_the_kth_chunk_maximum(config, top_p):
    bs, n, top_k = 3, 6, 12
    tree, g = random_batch(bs, n, 40, top_k)
    logits = lifted(tree, torch.randn(bs, n, VOCAB, generator=g) * 4, g)
    # With chunks of 64, fewer groups than all reach the 12th largest chunk maximum: CHUNK_MAXIMA
    # sorts only those, WHOLE_SORT all of them; ROUNDS (3 chunks, fewer than k) sorts them all too.
    x = logits.flatten(0, 1) / 0.8
    pre = block_maxima(x, CHUNK_MAXIMA.chunk).sort(-1, descending=True).values[:, top_k - 1]
    group_max = block_maxima(x, CHUNK_MAXIMA.sub)
    assert ((group_max >= pre[:, None]).sum(-1) < group_max.shape[1]).all()
    assert_same_decision(tree, logits, 0.8, top_k, top_p, torch.rand(bs, n, generator=g), config)


# Sorted: groups of 16 leave the tie's 10 candidates (sorted in the small block) and the integer rows'
# 200 or so (sorted in a block of 256); searched and whole-row search both cuts.
@pytest.mark.triton_interpreter
@pytest.mark.parametrize("shape", [dict(candidates=2048, sorted=256, sub=16), dict(candidates=2048, sorted=0),
                                   dict(candidates=8, sorted=0)], ids=["sorted", "searched", "whole-row"])
def test_chunked_ties_at_both_cuts(shape):
    small_config, wide, tiny = (dataclasses.replace(c, **shape) for c in (SMALL, WIDE, TINY))

    def decide(tree, logits, top_k, top_p, coins, config):
        if config.sorted:  # the case takes the path it names
            assert candidates_over_the_bound(logits, 1.0, top_k, top_p, config.sub).max() <= config.sorted
        assert_same_decision(tree, logits, 1.0, top_k, top_p, coins, config)

    bs, n, vocab = 2, 4, VOCAB
    tree, g = random_batch(bs, n, vocab, 5)
    # Ten tokens share the top value, spread over the three chunks, and the drafted ones are among
    # them: top-k 4 keeps the whole tie; top-p 0.35 keeps the first four ids of it (each holds about
    # a tenth of the mass, so the cut falls mid-tie, away from a rounding boundary).
    logits = torch.randn(bs, n, vocab, generator=g) - 8
    tie = torch.stack([torch.randperm(vocab, generator=g)[:10] for _ in range(bs * n)]).view(bs, n, 10)
    tie[:, :, :n] = tree.tokens[:, None, :]
    logits.scatter_(2, tie, 3.0)
    coins = torch.rand(bs, n, generator=g)
    decide(tree, logits, 4, 1.0, coins, wide)
    decide(tree, logits, 0, 0.35, coins, small_config)
    decide(tree, logits, 4, 0.35, coins, wide)
    # Integer logits: ties everywhere, at the k-th value included.
    coarse = torch.randint(0, 6, (bs, n, vocab), generator=g).float()
    decide(tree, coarse, 30, 1.0, coins, wide)
    small, g = random_batch(1, 2, vocab, 6)
    decide(small, coarse[:1, :2], 6, 1.0, coins[:1, :2], tiny)


def copied_ranges(monkeypatch) -> list[torch.Tensor]:
    """What each launch of the spread copy's kernel leaves in ``Gathered`` (per row, the values it
    copied, or -1 where the cut kernel is to narrow and copy the range itself): a row that should take
    the copy but falls back decides the same, only slower, so the tests ask which path it took."""
    kernel = chunked._spread_gather_kernel
    real, seen = kernel.run, []

    def run(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append({**dict(zip(kernel.arg_names, args)), **kwargs}["Gathered"].clone())
        return out

    monkeypatch.setattr(kernel, "run", run)
    return seen


def every_row_copied(copied: list[torch.Tensor], config: LaunchConfig, at_least: int | torch.Tensor = 1) -> bool:
    """Whether every launch of the spread copy copied every row's range: at least ``at_least`` values
    (per row, or one bound for all), and no more than its buffer holds."""
    return all(((c >= at_least) & (c <= config.candidates)).all() for c in copied)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("spread, gather", [(0, False), (1, False), (3, False), (1, True), (3, True)],
                         ids=["in-the-cut-kernel", "one-spread-round", "three-spread-rounds",
                              "one-spread-round-and-copy", "three-spread-rounds-and-copy"])
def test_top_p_over_a_flat_row_searches_a_copy_of_the_narrowed_range(spread, gather, monkeypatch):
    # Spread: the first rounds run as launches of (row, chunk) programs (one round narrows these rows
    # enough; a later round finds them narrowed and carries the state); with the copy, (row, chunk)
    # programs then copy the range, each after the chunks before it.
    bs, n, vocab = 2, 4, VOCAB
    tree, g = random_batch(bs, n, vocab, 12)
    coins = torch.rand(bs, n, generator=g)
    # Integer logits 0..5: top-p 0.9 cuts inside the tie at 3 (about 200 tokens) and keeps its first
    # ids. Its candidates (every value at or above the bound from the group maxima) overflow a
    # buffer of 256, but the first search rounds over the row narrow the range to the tie, which
    # fits: the rest of the search, the kept mass and the last kept id of the tie come from its copy.
    coarse = torch.randint(0, 6, (bs, n, vocab), generator=g).float()
    config = dataclasses.replace(FINE, candidates=256, sorted=0, spread_rounds=spread, spread_gather=gather)
    counts = candidates_over_the_bound(coarse, 1.0, 0, 0.9, config.sub)
    assert (counts > config.candidates).all() and ((coarse == 3).sum(-1) <= config.candidates).all()
    copied = copied_ranges(monkeypatch)
    assert_same_decision(tree, coarse, 1.0, 0, 0.9, coins, config)
    # With the copy every row's range fits after the spread rounds and is copied: the tie at 3 and
    # perhaps a few values at its ends.
    assert len(copied) == gather
    assert every_row_copied(copied, config, at_least=(coarse == 3).sum(-1).flatten())


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("spread, gather", [(0, False), (3, False), (1, True), (3, True)],
                         ids=["in-the-cut-kernel", "three-spread-rounds", "one-spread-round-then-the-cut-kernel",
                              "three-spread-rounds-and-copy"])
def test_top_p_over_flat_normal_rows_narrowed_in_rounds(spread, gather, monkeypatch):
    # The sampling benchmark's rows (random normal x 2 at temperature 0.8) at 1,200 tokens: top-p 0.9
    # keeps about 130 of each, and with a buffer of 16 the search takes several rounds over the row
    # before the range still open fits it, spread over (row, chunk) programs (5 a row, whose partials
    # are summed) or in the cut kernel. After one spread round the range does not fit yet, and the cut
    # kernel narrows and copies it as without the spread copy; after three it fits and is copied.
    bs, n = 2, 4
    tree, g = random_batch(bs, n, VOCAB, 13)
    logits = torch.randn(bs, n, VOCAB, generator=g) * 2
    config = dataclasses.replace(FINE, candidates=16, sorted=0, spread_rounds=spread, spread_chunk=256,
                                 spread_gather=gather)
    assert (candidates_over_the_bound(logits, 0.8, 0, 0.9, config.sub) > config.candidates).all()
    copied = copied_ranges(monkeypatch)
    assert_same_decision(tree, logits, 0.8, 0, 0.9, torch.rand(bs, n, generator=g), config)
    assert len(copied) == gather
    if gather:
        assert every_row_copied(copied, config) if spread == 3 else (copied[0] == -1).all()


def adjacent_floats(bs: int, n: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """Rows of ``vocab`` float32 values one ulp apart from 1.0, each row shuffled: every float key in
    their range is a value's, so each end of a top-p search's range falls on a value."""
    row = torch.full((vocab,), 1.0)
    for i in range(1, vocab):
        row[i] = torch.nextafter(row[i - 1], torch.tensor(2.0))
    return torch.stack([row[torch.randperm(vocab, generator=g)] for _ in range(bs * n)]).view(bs, n, vocab)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("spread", [0, 5, 6], ids=["in-the-cut-kernel", "five-spread-rounds-and-copy",
                                                   "six-spread-rounds-and-copy"])
def test_top_p_over_adjacent_floats_copies_both_ends_of_the_range(spread, monkeypatch):
    # The range still open ends on values, which the copy must hold: after five spread rounds the last
    # one moved the ends, after six the last found the range narrowed and counted the values at its
    # ends. A chunk's count off by one leaves an entry unwritten, which the poisoned buffers show (conftest).
    bs, n = 2, 4
    tree, g = random_batch(bs, n, VOCAB, 21)
    config = dataclasses.replace(FINE, candidates=16, sorted=0, spread_rounds=spread, spread_gather=spread > 0)
    copied = copied_ranges(monkeypatch)
    assert_same_decision(tree, adjacent_floats(bs, n, VOCAB, g), 1.0, 0, 0.5, torch.rand(bs, n, generator=g), config)
    assert len(copied) == (spread > 0) and every_row_copied(copied, config)


def logits_dividing_to_one_value(temperature: float) -> tuple[float, float]:
    """Two adjacent float32 logits (the smaller first) that divide by ``temperature`` to one value."""
    a = torch.linspace(14, 15, 4000)
    b = torch.nextafter(a, torch.tensor(math.inf))
    pair = ((a / temperature) == (b / temperature)).nonzero()[0, 0]
    return a[pair].item(), b[pair].item()


@pytest.mark.triton_interpreter
def test_chunked_argmax_where_two_logits_round_to_one_value():
    # At temperature 0.7 adjacent float32 logits often divide to the same value: the reference's
    # argmax is then the first of the two, here the smaller logit, at the lower id (both in one chunk).
    temperature = 0.7
    bs, n = 2, 3
    tree, g = random_batch(bs, n, 40, 9)
    logits = torch.randn(bs, n, VOCAB, generator=g) * 2
    logits[..., 60], logits[..., 100] = logits_dividing_to_one_value(temperature)
    assert_same_decision(tree, logits, temperature, 0, 1.0, torch.rand(bs, n, generator=g))
    assert_same_decision(tree, logits, temperature, 5, 1.0, torch.rand(bs, n, generator=g), TINY)
    got = verify_sampling_chunked(tree, logits, torch.full((bs,), temperature), 0, 1.0,
                                  torch.rand(bs, n, generator=g), SMALL)
    assert (got.target_argmax == 60).all()


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("config", [SMALL, SECOND], ids=["groups-of-256", "groups-of-16"])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (6, 0.8)])
def test_first_argmax_equals_the_reference(config, top_k, top_p):
    # Rows as they come (the maximum alone in its group), the maximum twice in one group, twice in
    # two groups of a chunk (ids 70 and 300 of the first), and the pair of logits that divide to one
    # value (ids 60 and 100: one group of 256, two of 16): the first argmax is the reference's.
    temperature = 0.7
    bs, n = 4, 3
    tree, g = random_batch(bs, n, 40, 11)
    logits = torch.randn(bs, n, VOCAB, generator=g) * 2
    logits[1, :, 80] = logits[1, :, 90] = 20.0
    logits[2, :, 300] = logits[2, :, 70] = 20.0
    logits[3, :, 60], logits[3, :, 100] = logits_dividing_to_one_value(temperature)
    assert_same_decision(tree, logits, temperature, top_k, top_p, torch.rand(bs, n, generator=g), config)
    got = verify_sampling_chunked(tree, logits, torch.full((bs,), temperature), top_k, top_p,
                                  torch.rand(bs, n, generator=g), config)
    assert got.target_argmax[1:].tolist() == [[80] * n, [70] * n, [60] * n]


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("top_k, top_p", [(50, 1.0), (20, 0.8), (0, 0.9)])
def test_second_values_leave_single_candidate_groups_unread(top_k, top_p):
    bs, n = 3, 6
    tree, g = random_batch(bs, n, 40, top_k + 1)
    logits = lifted(tree, torch.randn(bs, n, VOCAB, generator=g) * 4, g)
    # The path is taken: live groups holding one candidate (their maximum) and some holding more.
    x = logits.flatten(0, 1) / 0.8
    top, second = blocks(x, SECOND.sub).topk(2, dim=-1).values.unbind(-1)
    bound = group_bound(x, top_k, top_p, SECOND.sub)[:, None]
    live = top >= bound
    assert (live & (second < bound)).any() and (live & (second >= bound)).any()
    assert_same_decision(tree, logits, 0.8, top_k, top_p, torch.rand(bs, n, generator=g), SECOND)


@pytest.mark.triton_interpreter
def test_second_values_with_ties_at_the_cut():
    bs, n, vocab = 2, 4, VOCAB
    tree, g = random_batch(bs, n, vocab, 11)
    coins = torch.rand(bs, n, generator=g)
    # Ten tokens share the top value, each alone in its group of 16: top-p 0.35 keeps the first four
    # ids of the tie, and its last kept one is a group's maximum that the copy did not read.
    logits = torch.randn(bs, n, vocab, generator=g) - 8
    groups = torch.stack([torch.randperm(vocab // SECOND.sub, generator=g)[:10] for _ in range(bs * n)])
    tie = (groups * SECOND.sub + torch.randint(0, SECOND.sub, groups.shape, generator=g)).view(bs, n, 10)
    logits.scatter_(2, tie, 3.0)
    assert_same_decision(tree, logits, 1.0, 0, 0.35, coins, SECOND)
    assert_same_decision(tree, logits, 1.0, 4, 0.35, coins, SECOND)
    # Two of the tie in one group: that group is read, the others are not.
    logits[..., tie[0, 0, 0] ^ 1] = 3.0
    assert_same_decision(tree, logits, 1.0, 0, 0.35, coins, SECOND)
    # Integer logits: more candidates than the sorted cuts take, so they are copied again in id order
    # (and here overflow the buffer, so the whole row is searched).
    coarse = torch.randint(0, 6, (bs, n, vocab), generator=g).float()
    assert_same_decision(tree, coarse, 1.0, 30, 0.9, coins, SECOND)


@pytest.mark.triton_interpreter
def test_chunked_rows_with_one_token_left():
    bs, n, vocab = 2, 4, VOCAB
    tree, g = random_batch(bs, n, 6, 8)
    coins = torch.rand(bs, n, generator=g)
    # Every logit but one is -inf (whole chunks of them), or top-k 1 / a tiny top-p leaves one token.
    masked = torch.full((bs, n, vocab), -math.inf)
    masked.scatter_(2, torch.randint(0, 6, (bs, n, 1), generator=g), 1.0)
    assert_same_decision(tree, masked, 1.0, 0, 1.0, coins)
    logits = torch.randn(bs, n, vocab, generator=g)
    logits[..., :6] += 3
    assert_same_decision(tree, logits, 1.0, 1, 1.0, coins, WIDE)
    assert_same_decision(tree, logits, 1.0, 0, 1e-4, coins, WIDE)


@pytest.mark.triton_interpreter
def test_chunked_at_the_ends_of_the_residual():
    check_residual_ends(assert_same_decision, bs=4, n=6, vocab=VOCAB, token=700,
                        decide_peaked=lambda *args: assert_same_decision(*args, WIDE))


def test_chunked_rejects_an_unknown_launch_config():
    tree, g = random_batch(1, 3, 10, 0)
    with pytest.raises(ValueError, match="unknown launch config"):
        verify_sampling_chunked(tree, torch.randn(1, 3, 10), 1.0, 0, 1.0, torch.rand(1, 3), "fastest")


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("bs, n, top_k, top_p, config", [(1, 16, 0, 1.0, FUSED), (5, 9, 50, 0.9, FUSED),
                                                         (3, 4, 7, 0.6, FUSED_WIDE), (2, 64, 0, 0.9, FUSED_WIDE)])
def test_decision_and_bonus_by_the_last_program_equal_the_reference(bs, n, top_k, top_p, config):
    tree, g = random_batch(bs, n, 40, bs + n)
    logits = lifted(tree, torch.randn(bs, n, VOCAB, generator=g) * 2, g)
    assert_same_decision(tree, logits, 0.8, top_k, top_p, torch.rand(bs, n, generator=g), config)
    check_residual_ends(lambda *args: assert_same_decision(*args, FUSED), bs=bs, n=min(n, 6), vocab=VOCAB,
                        token=700, decide_peaked=lambda *args: assert_same_decision(*args, FUSED_WIDE))


@pytest.mark.triton_interpreter
def test_chunked_trace_row_holds_what_the_torch_verify_records():
    tree, g = random_batch(2, 4, 300, 3)
    logits = torch.randn(2, 4, 300, generator=g) * 2
    coins = torch.rand(2, 4, generator=g)
    temps = torch.full((2,), 0.9)
    want = verify_sampling(tree, logits, temps, 20, 0.8, coins=coins)
    got = verify_sampling_chunked(tree, logits, temps, 20, 0.8, coins, WIDE)
    engine = types.SimpleNamespace(record_topk=5)  # all the packing reads of the engine
    assert (Engine._pack_sampling_record(engine, tree, want).layout
            == Engine._pack_sampling_record(engine, tree, got, None, logits, temps).layout)
    # The recorded top-k: the same tokens (argmax first), the same probabilities.
    top_want = _led_by(want.target_probs.topk(5, dim=-1).indices, want.target_argmax)
    top_got = _led_by(logits.topk(5, dim=-1).indices, got.target_argmax)
    assert torch.equal(top_got, top_want)
    torch.testing.assert_close(target_probs_at(logits, temps, got.target_rows, top_got),
                               want.target_probs.gather(-1, top_want), rtol=1e-5, atol=1e-7)
