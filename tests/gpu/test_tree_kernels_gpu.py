"""The tree-index kernel and the verifiers on CUDA against their CPU results."""

from __future__ import annotations

import pytest
import torch

from spectool.draft.tree import DraftTree, build_eagle_tree, parents_to_mask
from spectool.kernels import reconstruct_indices_from_tree_mask
from spectool.kernels.tree_indices import reconstruct_indices_torch
from spectool.verify import commit_kv, verify_greedy, verify_greedy_torch, verify_sampling

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def random_trees(bs: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    idx = torch.arange(n)
    parents = (torch.rand(bs, n, generator=g) * idx).long()
    chain = (torch.rand(bs, n, generator=g) < 0.5) & (torch.rand(bs, 1, generator=g) < 0.5)
    parents = torch.where(chain, idx - 1, parents)
    parents[:, 0] = -1
    return parents, g


@pytest.mark.parametrize("bs", [1, 3, 64, 256])
@pytest.mark.parametrize("n", [1, 2, 8, 16, 33, 64])
def test_index_kernel_on_cuda_matches_reference(bs, n):
    parents, g = random_trees(bs, n, seed=bs * 100 + n)
    mask = parents_to_mask(parents)
    seq_lens = torch.randint(0, 10**6, (bs,), generator=g)
    want = reconstruct_indices_torch(mask, seq_lens)
    got = reconstruct_indices_from_tree_mask(mask.cuda(), seq_lens.cuda())
    for w, t in zip(want, got):
        assert t.is_cuda and torch.equal(w, t.cpu())
    # parents -> mask -> indices on the GPU equals indices built straight from parents.
    tree = DraftTree.from_parents(torch.zeros(bs, n, dtype=torch.long).cuda(), parents.cuda(),
                                  torch.zeros(bs, n).cuda(), seq_lens.cuda())
    assert torch.equal(tree.mask.cpu(), mask)
    assert torch.equal(tree.retrieve_next_sibling.cpu(), want[3])


def test_verify_on_cuda_matches_cpu():
    bs, n, vocab = 64, 16, 50
    parents, g = random_trees(bs, n, seed=5)
    tokens = torch.randint(0, 4, (bs, n), generator=g)
    logits = torch.randn(bs, n, vocab, generator=g)
    logits[..., :4] += 3  # make drafts matter
    tree = DraftTree.from_parents(tokens, parents, torch.zeros(bs, n), torch.arange(bs))
    tree_gpu = DraftTree.from_parents(tokens.cuda(), parents.cuda(), torch.zeros(bs, n).cuda(),
                                      torch.arange(bs).cuda())
    cpu, gpu = verify_greedy(tree, logits), verify_greedy(tree_gpu, logits.cuda())
    for name in ("status", "accept_path", "accept_length", "bonus"):
        assert torch.equal(getattr(cpu, name), getattr(gpu, name).cpu()), name
    res = verify_sampling(tree_gpu, logits.cuda(), 0.8, 20, 0.9, torch.Generator("cuda").manual_seed(0))
    assert torch.equal(res.accept_length, (res.status == 1).sum(-1) - 1)
    k = torch.randn(2, bs, 2, 64, 8, device="cuda")
    v = torch.randn_like(k)
    k_before = k.clone()
    slots = torch.arange(bs, device="cuda")
    seq_lens = torch.zeros(bs, dtype=torch.long, device="cuda")
    commit_kv(k, v, slots, seq_lens, res.accept_path, res.accept_length)
    for b in range(bs):
        path = res.accept_path[b, : int(res.accept_length[b]) + 1]
        assert torch.equal(k[:, b, :, : len(path)], k_before[:, b, :, path])


@pytest.mark.parametrize("bs,n", [(1, 16), (64, 16), (3, 64)])
def test_greedy_verify_kernels_at_llama3_vocab_match_the_torch_reference(bs, n):
    """The Triton greedy verify (two launches, replayed from a CUDA graph) against the torch
    reference, at V = 128256 with tied maxima spread over several argmax chunks."""
    vocab = 128256
    parents, g = random_trees(bs, n, seed=bs + n)
    logits = torch.randn(bs, n, vocab, generator=g).round().cuda()
    logits[..., 100000] = logits.amax(-1)  # a tie in a later chunk: the lower id must win
    # Half the nodes carry the target's argmax at their parent, so paths are accepted.
    at_parent = logits.argmax(-1).cpu().gather(1, parents.clamp(min=0))
    tokens = torch.where(torch.rand(bs, n, generator=g) < 0.5, at_parent, torch.randint(0, 3, (bs, n), generator=g))
    tokens[:, 1] = at_parent[:, 1]  # node 1 is always a child of the root: every row accepts something
    tree = DraftTree.from_parents(tokens.cuda(), parents.cuda(), torch.zeros(bs, n).cuda(), torch.arange(bs).cuda())
    want = verify_greedy_torch(tree, logits)
    static = logits.clone()
    graph = torch.cuda.CUDAGraph()
    verify_greedy(tree, static)  # compile outside the capture
    with torch.cuda.graph(graph):
        out = verify_greedy(tree, static)
    graph.replay()
    for name in ("status", "accept_path", "accept_length", "bonus", "target_argmax"):
        assert torch.equal(getattr(want, name), getattr(out, name)), name
    assert (want.accept_length > 0).all()


def test_eagle_tree_on_cuda_matches_cpu():
    g = torch.Generator().manual_seed(0)
    steps = [torch.rand(8, 4, generator=g)] + [torch.rand(8, 16, generator=g) for _ in range(3)]
    toks = [torch.randint(0, 100, s.shape, generator=g) for s in steps]
    pars = [None] + [torch.randint(0, s.shape[1], (8, 16), generator=g) for s in steps[:-1]]
    cpu = build_eagle_tree(torch.arange(8), toks, steps, pars, 16, torch.arange(8))
    gpu = build_eagle_tree(torch.arange(8).cuda(), [t.cuda() for t in toks], [s.cuda() for s in steps],
                           [None] + [p.cuda() for p in pars[1:]], 16, torch.arange(8).cuda())
    assert torch.equal(cpu.tokens, gpu.tokens.cpu()) and torch.equal(cpu.parents, gpu.parents.cpu())
